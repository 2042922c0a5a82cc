from __future__ import annotations

from exporter.vllm_metrics import EngineKey
from tests.conftest import CPU, H200
from tests.helpers import rename, sample_from

ENGINE_H200 = EngineKey("qwen3-dummy", "0")
ENGINE_CPU = EngineKey("tiny-llama", "0")


def test_normalise_offload_series_are_taken_once_not_added():
    s = sample_from(H200 / "b_offload" / "metrics_after.txt", 0)
    c = s.engines[ENGINE_H200].counters
    # vLLM 0.26 exposes kv_offload_load_bytes_total and the deprecated
    # kv_offload_total_bytes_total{transfer_type="CPU_to_GPU"} with the same value.
    assert c["load_bytes"] == 8.4410368e08
    assert c["store_bytes"] == 2.82591232e09
    assert c["load_seconds"] == 0.02484294377267361
    assert c["stored_chunks"] == 1540


def test_normalise_falls_back_to_deprecated_offload_series_before_first_transfer():
    # Before the first transfer only the deprecated series exist (new ones are lazy).
    s = sample_from(H200 / "b_offload" / "metrics_before.txt", 0)
    c = s.engines[ENGINE_H200].counters
    assert c["load_bytes"] == 0.0 and c["store_bytes"] == 0.0


def test_normalise_reads_current_generation_cpu_capture():
    s = sample_from(CPU / "metrics-after.prom", 0)
    e = s.engines[ENGINE_CPU]
    assert e.counters["prefix_queries"] == 40000
    assert e.counters["prefix_hits"] == 7680
    assert e.counters["prompt_by_source:local_compute"] == 32320
    assert e.counters["cached_by_source:device"] == 7680
    assert "load_bytes" not in e.counters
    assert s.cache_config["0"]["num_gpu_blocks"] == "20"
    assert s.process_start is not None


def test_normalise_reads_older_generation_names():
    text = rename(
        (CPU / "metrics-after.prom").read_text(),
        {
            "vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
            "vllm:prefix_cache_queries_total": "vllm:gpu_prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total": "vllm:gpu_prefix_cache_hits_total",
        },
    )
    e = sample_from(text, 0).engines[ENGINE_CPU]
    assert e.counters["prefix_queries"] == 40000 and e.counters["prefix_hits"] == 7680
    assert e.gauges["kv_usage"] == 0.0


def test_normalise_splits_data_parallel_engines_and_models():
    base = (CPU / "metrics-after.prom").read_text()
    dp1 = base.replace('engine="0"', 'engine="1"')
    other = base.replace('model_name="tiny-llama"', 'model_name="other"')
    keep = [
        line
        for line in (dp1 + other).splitlines()
        if "vllm:prefix_cache" in line and not line.startswith("#")
    ]
    s = sample_from(base + "\n".join(keep) + "\n", 0)
    assert set(s.engines) == {ENGINE_CPU, EngineKey("tiny-llama", "1"), EngineKey("other", "0")}


def test_normalise_drops_nan_and_negative_counters_and_reports_them():
    text = (
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} NaN\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} -3\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} +Inf\n'
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 5\n'
    )
    s = sample_from(text, 0)
    e = s.engines[EngineKey("m", "0")]
    assert e.counters == {"prompt_tokens": 5.0}
    assert e.gauges == {}
    assert len(s.invalid) == 3
