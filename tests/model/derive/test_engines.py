"""exporter/model/derive/engines.py: derive_engine on recorded vLLM expositions (H200 runs
of vLLM 0.26.0, a CPU capture of vLLM 0.32.0)."""

from __future__ import annotations

import pytest

from exporter.model.derive.engines import DeriveSettings, derive_engine, gpu_cache_turnover
from exporter.vllm_metrics import EngineKey
from tests.conftest import CPU, H200
from tests.helpers import sample_from, window_of

H200_EK = EngineKey("qwen3-dummy", "0")
CPU_EK = EngineKey("tiny-llama", "0")
FRESH = DeriveSettings(stale_after=10.0)


def h200(run: str):
    before = sample_from(H200 / run / "metrics_before.txt", 0.0)
    after = sample_from(H200 / run / "metrics_after.txt", 5.0)
    return before, after


def test_offload_run_ratios_equal_what_the_raw_counters_imply():
    before, after = h200("b_offload")
    d = derive_engine(window_of(before, after), H200_EK, 5.0, FRESH)
    assert d is not None and d.offload_enabled
    prev = before.engines[H200_EK].counters
    delta = {k: v - prev.get(k, 0.0) for k, v in after.engines[H200_EK].counters.items()}
    assert d.gpu_prefix_hit_ratio == pytest.approx(delta["prefix_hits"] / delta["prefix_queries"])
    assert d.offload_hit_ratio == pytest.approx(
        delta["prompt_by_source:external_kv_transfer"] / delta["prompt_tokens"]
    )
    assert d.offload_hit_ratio == pytest.approx(7360 / 40000)
    assert d.offload_lookup_hit_ratio == pytest.approx(7360 / 32080)
    assert d.reuse_ratio == pytest.approx(8.4410368e08 / 2.82591232e09)
    assert d.load_bandwidth == pytest.approx(8.4410368e08 / 0.02484294377267361)
    assert d.store_bandwidth == pytest.approx(2.82591232e09 / 0.08171545618772509)
    # 28 layers x 8 KV heads x 128 head_dim x K,V x bf16 = 114688 B per token.
    assert d.kv_bytes_per_token == pytest.approx(114688)
    assert d.kv_bytes_per_token_method == "offload_loads"
    assert d.offload_buffer_bytes == 0.5 * (1 << 30)
    assert d.transfer_tokens_per_second == pytest.approx(d.load_bandwidth / 114688)
    assert not d.transfer_estimated
    assert d.totals["load_bytes"] == 8.4410368e08
    # What vLLM stored since the engine started, its own counter: 2.8 GB into a 0.5 GiB tier.
    assert d.offload_stored_bytes == after.engines[H200_EK].counters["store_bytes"]
    assert d.offload_stored_bytes > d.offload_buffer_bytes and not d.tier_filling


def test_no_offload_run_has_no_offload_ratios_and_estimates_transfer_from_link():
    before, after = h200("a_nooffload")
    settings = DeriveSettings(stale_after=10.0, link_bandwidth=64e9)
    d = derive_engine(window_of(before, after), H200_EK, 5.0, settings)
    assert d is not None and not d.offload_enabled
    assert d.offload_hit_ratio is None and d.reuse_ratio is None and d.load_bandwidth is None
    assert d.offload_stored_bytes is None and not d.tier_filling
    assert d.kv_bytes_per_token == pytest.approx(268435456 / 2336)
    assert d.kv_bytes_per_token_method == "cache_config"
    assert d.transfer_estimated
    assert d.transfer_tokens_per_second == pytest.approx(64e9 * 0.56 / (268435456 / 2336))


def test_cpu_capture_hit_ratio_and_no_bytes_per_token_with_block_override():
    before = sample_from(CPU / "metrics-before.prom", 0.0)
    after = sample_from(CPU / "metrics-after.prom", 5.0)
    d = derive_engine(window_of(before, after), CPU_EK, 5.0, FRESH)
    assert d is not None
    assert d.gpu_prefix_hit_ratio == pytest.approx(7680 / 40000)
    # --num-gpu-blocks-override makes kv_cache_memory_bytes unrelated to the token count.
    assert d.kv_bytes_per_token is None
    assert d.transfer_speedup is None


def test_stale_window_exports_no_ratios_but_keeps_totals():
    before, after = h200("b_offload")
    d = derive_engine(window_of(before, after), H200_EK, 100.0, FRESH)
    assert d is not None and not d.fresh
    assert d.gpu_prefix_hit_ratio is None and d.kv_usage is None
    assert d.totals["prefix_hits"] == 7920


def test_ratio_without_denominator_is_absent():
    before, _ = h200("b_offload")
    later = sample_from(H200 / "b_offload" / "metrics_before.txt", 5.0)
    d = derive_engine(window_of(before, later), H200_EK, 5.0, FRESH)
    assert d is not None
    assert d.gpu_prefix_hit_ratio is None and d.offload_hit_ratio is None


def test_gpu_cache_turnover_is_the_window_computed_tokens_over_the_cache_size():
    before = sample_from(CPU / "metrics-before.prom", 0.0)
    after = sample_from(CPU / "metrics-after.prom", 5.0)
    d = derive_engine(window_of(before, after), CPU_EK, 5.0, FRESH)
    assert d is not None and d.gpu_capacity_tokens == 2560  # 20 blocks of 128 tokens
    prev = before.engines[CPU_EK].counters
    now = after.engines[CPU_EK].counters
    computed = now["prompt_by_source:local_compute"] - prev.get("prompt_by_source:local_compute", 0)
    assert computed > 2560
    assert d.gpu_cache_turnover == pytest.approx(computed / 2560)
    # Without the breakdown by source (vLLM before 0.11): prompt tokens less prefix hits.
    assert gpu_cache_turnover({"prompt_tokens": 9000.0, "prefix_hits": 1000.0}, 4000.0) == 2.0
    assert gpu_cache_turnover({"prompt_tokens": 9000.0}, 4000.0) is None
    assert gpu_cache_turnover({"prompt_by_source:local_compute": 10.0}, None) is None
    stale = derive_engine(window_of(before, after), CPU_EK, 100.0, FRESH)
    assert stale is not None and stale.gpu_cache_turnover is None
