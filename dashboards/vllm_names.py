"""vLLM series the dashboards may query directly (the sidecar is scraped beside vLLM).

Names as exposed, from the vLLM metric catalogue in the team notes
(../shared/notes/vllm-metrics-and-kv-events.md §1.3 core metrics and §1.6
OffloadingConnector metrics, vLLM 0.33.0 sources; the offload series were also
recorded from vLLM 0.26.0 on an H200, tests/fixtures/vllm-0.26.0-h200/). Kept here,
not read from ../shared, because CI runs on a clean clone. tests/test_dashboards.py
checks every entry against the notes when they are present and against the recorded
expositions.

name -> (type, what it is)
"""

from __future__ import annotations

VLLM_METRICS: dict[str, tuple[str, str]] = {
    # core (PrometheusStatLogger), labels model_name, engine
    "vllm:num_requests_running": ("gauge", "requests running"),
    "vllm:num_requests_waiting": ("gauge", "requests waiting"),
    "vllm:kv_cache_usage_perc": ("gauge", "GPU KV cache usage 0..1"),
    "vllm:prefix_cache_queries_total": ("counter", "GPU prefix cache lookups, tokens"),
    "vllm:prefix_cache_hits_total": ("counter", "GPU prefix cache hits, tokens"),
    "vllm:external_prefix_cache_queries_total": ("counter", "KV connector lookups, tokens"),
    "vllm:external_prefix_cache_hits_total": ("counter", "KV connector hits, tokens"),
    "vllm:num_preemptions_total": ("counter", "preemptions"),
    "vllm:prompt_tokens_total": ("counter", "all prompt tokens"),
    "vllm:prompt_tokens_by_source_total": ("counter", "prompt tokens by source"),
    "vllm:prompt_tokens_cached_total": ("counter", "cached prompt tokens"),
    "vllm:generation_tokens_total": ("counter", "generated tokens"),
    "vllm:request_success_total": ("counter", "finished requests by reason"),
    "vllm:time_to_first_token_seconds": ("histogram", "TTFT"),
    "vllm:e2e_request_latency_seconds": ("histogram", "end-to-end latency"),
    "vllm:request_prefill_time_seconds": ("histogram", "prefill time"),
    "vllm:request_queue_time_seconds": ("histogram", "queue time"),
    "vllm:cache_config_info": ("gauge", "CacheConfig as labels, value 1"),
    # OffloadingConnector (vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py)
    "vllm:kv_offload_load_bytes_total": ("counter", "bytes offload tier -> GPU"),
    "vllm:kv_offload_store_bytes_total": ("counter", "bytes GPU -> offload tier"),
    "vllm:kv_offload_load_time_total": ("counter", "summed GPU copy time of loads"),
    "vllm:kv_offload_store_time_total": ("counter", "summed GPU copy time of stores"),
    "vllm:kv_offload_load_size": ("histogram", "bytes per load operation"),
    "vllm:kv_offload_store_size": ("histogram", "bytes per store operation"),
    "vllm:kv_offload_lookup_sync_delay_seconds": ("histogram", "time in one offload lookup"),
    "vllm:kv_offload_allocation_failure_total": ("counter", "failed CPU store allocations"),
    "vllm:kv_offload_stores_skipped_total": ("counter", "stores below store_threshold"),
    "vllm:kv_offload_cpu_cache_usage_perc": ("gauge", "CPU space pinned by transfers"),
    "vllm:kv_offload_cpu_cache_write_usage_perc": ("gauge", "CPU space pinned by stores"),
    "vllm:kv_offload_cpu_cache_read_usage_perc": ("gauge", "CPU space pinned by loads"),
    # KV transfer backends (docs/backends.md): TieringOffloadingSpec (lookup delay since
    # 0.26, per tier from 0.32) and SimpleCPUOffloadConnector (0.32+), from vLLM 0.32.0's
    # source (.venv-vllm); the tiering histogram was recorded from 0.26 on the H200.
    "vllm:kv_offload_tiering_lookup_sync_delay_seconds": (
        "histogram",
        "time blocked in one tier lookup",
    ),
    "vllm:simple_kv_offload_save_outcomes_total": ("counter", "simple offload store decisions"),
}

# Registered only under a condition no recorded run met (store_threshold >= 2).
CONDITIONAL = frozenset(
    {
        "vllm:kv_offload_stores_skipped_total",
        # registered only by their backend; recorded in tests/fixtures/gpu/small-tier and
        # synthesized in tests/fixtures/backends/ (test_backends.py checks them there)
        "vllm:kv_offload_tiering_lookup_sync_delay_seconds",
        "vllm:simple_kv_offload_save_outcomes_total",
    }
)

_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count")}


def family_of(sample_name: str) -> str | None:
    """The table entry a sample name belongs to (histograms: _bucket/_sum/_count)."""
    if sample_name in VLLM_METRICS:
        return sample_name
    for suffix in _SUFFIXES["histogram"]:
        base = sample_name.removesuffix(suffix)
        if base != sample_name and VLLM_METRICS.get(base, ("",))[0] == "histogram":
            return base
    return None
