from __future__ import annotations

import re

from exporter.vllm_metrics import EngineKey
from tests.conftest import CPU, H200
from tests.helpers import gpu_metrics, rename, sample_from, synth

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


# --- SERIES: the one table of vLLM names (QUANTITIES' and the dashboards') ---------------


def _fixture_texts() -> str:
    from pathlib import Path

    root = Path(__file__).resolve().parent / "fixtures"
    return "".join(
        p.read_text(encoding="utf-8", errors="replace")
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix in {".prom", ".txt"}
    )


def test_every_name_read_is_a_series_of_fitting_type():
    from exporter.vllm_metrics import QUANTITIES, SERIES, WANTED, family_of

    for q in QUANTITIES:
        for cand in q.candidates:
            fam = family_of(cand.name)
            assert fam is not None, f"{cand.name} ({q.key}) is not in SERIES"
            kind = SERIES[fam].type
            if fam == cand.name:
                assert kind == q.kind, (cand.name, kind, q.kind)
            else:  # a histogram's _sum or _count: a counter
                assert kind == "histogram" and q.kind == "counter", (cand.name, kind)
    assert all(family_of(n) is not None for n in WANTED)


def test_series_types_are_the_recorded_ones():
    import re

    from exporter.vllm_metrics import SERIES

    recorded = dict(re.findall(r"^# TYPE (\S+) (\S+)$", _fixture_texts(), re.M))
    checked = 0
    for name, series in SERIES.items():
        # prometheus_client declares a counter's TYPE without _total
        declared = recorded.get(name) or recorded.get(name.removesuffix("_total"))
        if declared is not None:
            assert declared == series.type, (name, declared, series.type)
            checked += 1
    assert checked > len(SERIES) // 2


def test_series_appear_in_the_fixtures_except_the_unrecorded():
    import re

    from exporter.vllm_metrics import SERIES

    texts = _fixture_texts()
    missing = {n for n in SERIES if not re.search(re.escape(n) + r"[ {_]", texts)}
    assert missing == {
        # older vLLM generations and vLLM 0.33+ only: no recorded run has them
        "vllm:gpu_cache_usage_perc",
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_hits",
        "vllm:kv_offload_config_info",
        # recorded compressed (tests/fixtures/gpu/small-thr2),
        # checked by tests/model/derive/test_backends.py
        "vllm:kv_offload_stores_skipped_total",
    }
    assert all(SERIES[n].condition for n in missing)


def test_dashboard_backend_series_appear_in_the_backend_fixtures() -> None:
    """The conditional vLLM series the dashboards query (exporter/vllm_metrics.py SERIES),
    found in the backend fixtures (tests/test_dashboards.py checks the dashboards themselves)."""
    from dashboards.build import vllm_series
    from exporter.vllm_metrics import SERIES

    conditional = {n for n in vllm_series() if SERIES[n].condition}
    assert conditional, "no conditional series: the selection is broken"

    texts = "".join(
        [synth(n, "after") for n in ("vllm-0.32-tiering", "vllm-0.32-simple")]
        + [gpu_metrics(c, "after", "W2") for c in ("small-tier", "small-thr2")]
    )
    for name in conditional:
        assert re.search(re.escape(name) + r"[ {_]", texts), name


def test_a_body_of_the_same_shape_reuses_the_plan_with_its_own_values():
    from exporter.expfmt import Sample
    from exporter.vllm_metrics import normalise

    def body(hits: float, running: float, engines: int = 2) -> list[Sample]:
        out = []
        for e in range(engines):
            labels = (("engine", str(e)), ("model_name", "m"))
            out.append(Sample("vllm:prefix_cache_hits_total", labels, hits + e))
            out.append(Sample("vllm:num_requests_running", labels, running))
        return out

    first = normalise(body(10.0, 1.0), 1.0)
    again = normalise(body(20.0, float("nan")), 2.0)  # same shape: the plan is reused
    e0, e1 = EngineKey("m", "0"), EngineKey("m", "1")
    assert first.engines[e1].counters == {"prefix_hits": 11.0}
    assert first.engines[e0].gauges == {"running": 1.0}
    assert again.engines[e1].counters == {"prefix_hits": 21.0} and again.ts == 2.0
    assert again.engines[e0].gauges == {} and len(again.invalid) == 2
    # Under the cap the preferred engines count: the plan is not reused across them.
    assert set(normalise(body(1.0, 1.0), 3.0, max_engines=1, prefer={e1}).engines) == {e1}
    assert set(normalise(body(1.0, 1.0), 3.0, max_engines=1, prefer={e0}).engines) == {e0}
    assert set(normalise(iter(body(1.0, 1.0, 3)), 3.0).engines) == {e0, e1, EngineKey("m", "2")}
