"""Recording and alerting rules, generated so thresholds and metric names come from the code.

`rules()` returns the Prometheus rule file as a dict; scripts/gen.py writes it to
alerts/rules.yml and the Kubernetes PrometheusRule. Thresholds are exporter/thresholds.py's,
the same numbers the advisor and the dashboards use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from exporter.model.advisor.types import Action
from exporter.thresholds import DEFAULT, Thresholds

BY = "job, instance, model_name, engine"
RUNBOOK = "https://github.com/kv-offload-exporter/kv-offload-exporter/blob/main/docs/runbooks.md"


def _rate(metric: str, window: str = "5m", by: str = BY, selector: str = "") -> str:
    return f"sum by ({by}) (rate({metric}{selector}[{window}]))"


def _either(new: str, old: str, old_selector: str, by: str = BY) -> str:
    """New series, else the older generation's: `or` takes one per label set, never both.

    vLLM 0.26 exposes kv_offload_load_bytes_total and the deprecated
    kv_offload_total_bytes_total{transfer_type=...} with the same values.
    """
    return f"({_rate(new, by=by)} or {_rate(old, by=by, selector=old_selector)})"


LOAD_BYTES = _either(
    "vllm:kv_offload_load_bytes_total",
    "vllm:kv_offload_total_bytes_total",
    '{transfer_type="CPU_to_GPU"}',
)
STORE_BYTES = _either(
    "vllm:kv_offload_store_bytes_total",
    "vllm:kv_offload_total_bytes_total",
    '{transfer_type="GPU_to_CPU"}',
)
LOAD_TIME = _either(
    "vllm:kv_offload_load_time_total",
    "vllm:kv_offload_total_time_total",
    '{transfer_type="CPU_to_GPU"}',
)
STORE_TIME = _either(
    "vllm:kv_offload_store_time_total",
    "vllm:kv_offload_total_time_total",
    '{transfer_type="GPU_to_CPU"}',
)


def recording_rules() -> list[dict[str, str]]:
    prefix_hits = (
        f"({_rate('vllm:prefix_cache_hits_total')} or {_rate('vllm:gpu_prefix_cache_hits_total')})"
    )
    prefix_queries = (
        f"({_rate('vllm:prefix_cache_queries_total')} or "
        f"{_rate('vllm:gpu_prefix_cache_queries_total')})"
    )
    external = _rate(
        "vllm:prompt_tokens_by_source_total", selector='{source="external_kv_transfer"}'
    )
    prompt = _rate("vllm:prompt_tokens_total")
    model_prompt = _rate("vllm:prompt_tokens_total", by="model_name")
    model_external = _rate(
        "vllm:prompt_tokens_by_source_total",
        by="model_name",
        selector='{source="external_kv_transfer"}',
    )
    return [
        {
            "record": "kvoffload:gpu_prefix_hit_ratio:rate5m",
            "expr": f"{prefix_hits} / ({prefix_queries} > 0)",
        },
        {"record": "kvoffload:offload_hit_ratio:rate5m", "expr": f"{external} / ({prompt} > 0)"},
        {
            "record": "kvoffload:offload_lookup_hit_ratio:rate5m",
            "expr": f"{_rate('vllm:external_prefix_cache_hits_total')} / "
            f"({_rate('vllm:external_prefix_cache_queries_total')} > 0)",
        },
        {"record": "kvoffload:offload_load_bytes:rate5m", "expr": LOAD_BYTES},
        {"record": "kvoffload:offload_store_bytes:rate5m", "expr": STORE_BYTES},
        {
            "record": "kvoffload:offload_load_bandwidth_bytes_per_second:rate5m",
            "expr": f"{LOAD_BYTES} / ({LOAD_TIME} > 0)",
        },
        {
            "record": "kvoffload:offload_store_bandwidth_bytes_per_second:rate5m",
            "expr": f"{STORE_BYTES} / ({STORE_TIME} > 0)",
        },
        {
            "record": "kvoffload:offload_reuse_ratio:rate5m",
            "expr": f"{LOAD_BYTES} / ({STORE_BYTES} > 0)",
        },
        {
            "record": "kvoffload:kv_cache_usage_ratio:max5m",
            "expr": f"max by ({BY}) (max_over_time(vllm:kv_cache_usage_perc[5m]) or "
            "max_over_time(vllm:gpu_cache_usage_perc[5m]))",
        },
        {"record": "kvoffload:preemptions:rate5m", "expr": _rate("vllm:num_preemptions_total")},
        {
            "record": "kvoffload:prefill_average_tokens_per_second:rate5m",
            "expr": f"{_rate('vllm:request_prefill_kv_computed_tokens_sum')} / "
            f"({_rate('vllm:request_prefill_time_seconds_sum')} > 0)",
        },
        {
            "record": "kvoffload:ttft_seconds:p90_5m",
            "expr": f"histogram_quantile(0.9, sum by ({BY}, le) "
            "(rate(vllm:time_to_first_token_seconds_bucket[5m])))",
        },
        {
            "record": "model_name:kvoffload_offload_hit_ratio:rate5m",
            "expr": f"{model_external} / ({model_prompt} > 0)",
        },
        {
            "record": "model_name:kvoffload_gpu_prefix_hit_ratio:rate5m",
            "expr": f"({_rate('vllm:prefix_cache_hits_total', by='model_name')}) / "
            f"({_rate('vllm:prefix_cache_queries_total', by='model_name')} > 0)",
        },
        *backend_recording_rules(),
    ]


TIER = f"{BY}, tier"
DROPPED = '{outcome=~"dropped_.*"}'
LMCACHE = "job, instance, served_model_name"


def backend_recording_rules() -> list[dict[str, str]]:
    """The backends' ratios over raw series (docs/backends.md), as the exporter derives them."""
    queries = _rate("vllm:kv_offload_tiering_chunk_queries_total", by=TIER)
    # vLLM creates a tier's hit counter at its first hit: no series means 0 hits.
    hits = (
        f"({_rate('vllm:kv_offload_tiering_chunk_hits_total', by=TIER)} or "
        f"sum by ({TIER}) (0 * rate(vllm:kv_offload_tiering_chunk_queries_total[5m])))"
    )
    outcomes = "vllm:simple_kv_offload_save_outcomes_total"
    return [
        {"record": "kvoffload:tier_hit_ratio:rate5m", "expr": f"{hits} / ({queries} > 0)"},
        {
            "record": "kvoffload:tier_read_bandwidth_bytes_per_second:rate5m",
            "expr": f"{_rate('vllm:kv_offload_tiering_read_bytes_total', by=TIER)} / "
            f"({_rate('vllm:kv_offload_tiering_read_time_total', by=TIER)} > 0)",
        },
        {
            "record": "kvoffload:tier_write_bandwidth_bytes_per_second:rate5m",
            "expr": f"{_rate('vllm:kv_offload_tiering_write_bytes_total', by=TIER)} / "
            f"({_rate('vllm:kv_offload_tiering_write_time_total', by=TIER)} > 0)",
        },
        {
            "record": "kvoffload:simple_offload_dropped_ratio:rate5m",
            "expr": f"({_rate(outcomes, selector=DROPPED)} or "
            f"sum by ({BY}) (0 * rate({outcomes}[5m]))) / ({_rate(outcomes)} > 0)",
        },
        {
            "record": "kvoffload:nixl_transfer_bandwidth_bytes_per_second:rate5m",
            "expr": f"{_rate('vllm:nixl_bytes_transferred_sum')} / "
            f"({_rate('vllm:nixl_xfer_time_seconds_sum')} > 0)",
        },
        {
            "record": "kvoffload:lmcache_hit_ratio:rate5m",
            "expr": f"{_rate('lmcache:num_hit_tokens_total', by=LMCACHE)} / "
            f"({_rate('lmcache:num_requested_tokens_total', by=LMCACHE)} > 0)",
        },
        {
            "record": "kvoffload:lmcache_retrieve_tokens_per_second:rate5m",
            "expr": f"{_rate('lmcache:num_hit_tokens_total', by=LMCACHE)} / "
            f"({_rate('lmcache:time_to_retrieve_sum', by=LMCACHE)} > 0)",
        },
    ]


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str  # critical pages, warning opens a ticket, info is advice
    summary: str
    description: str

    def rule(self, for_scale: float) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": scale_duration(self.for_, for_scale),
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook_url": f"{RUNBOOK}#{self.name.lower()}",
            },
        }


def scale_duration(text: str, factor: float) -> str:
    """'30m' scaled by factor, as whole seconds; only the end-to-end test scales."""
    if factor == 1.0:
        return text
    m = re.fullmatch(r"(\d+)([smh])", text)
    assert m, text
    seconds = int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]
    return f"{max(1, round(seconds * factor))}s"


ENGINE = "{{ $labels.target }} {{ $labels.model_name }} engine {{ $labels.engine }}"


def _recommended() -> str:
    """Template that looks the recommended size up at notification time."""
    q = (
        "printf \"kvoffload_advice_recommended_buffer_bytes{target='%s',model_name='%s',"
        "engine='%s'}\" $labels.target $labels.model_name $labels.engine"
    )
    return "{{ with " + q + " | query }}{{ . | first | value | humanize1024 }}B{{ end }}"


def alerts(th: Thresholds = DEFAULT) -> list[Alert]:
    def advice(action: Action) -> str:
        return f'kvoffload_advice{{action="{action.value}"}} == 1'

    return [
        Alert(
            "OffloadRecommended",
            advice(Action.ENABLE_OFFLOAD),
            "30m",
            "info",
            f"Enable CPU KV offload on {ENGINE}",
            "Evicted prefixes are being recomputed and the what-if replay says a CPU tier "
            f"would serve them faster than recompute. Recommended --kv-offloading-size: "
            f"{_recommended()}. `kv-offload-exporter advise` or /advice has the numbers.",
        ),
        Alert(
            "OffloadNotPayingOff",
            advice(Action.DISABLE_OFFLOAD),
            "30m",
            "warning",
            f"CPU KV offload is not paying off on {ENGINE}",
            "Offload is on but reloads do not beat recomputation, or offloaded prefixes are "
            "not reused: it costs PCIe bandwidth and pinned memory for no TTFT gain. See "
            "/advice for the measured numbers; consider removing --kv-offloading-size.",
        ),
        Alert(
            "OffloadBufferTooSmall",
            advice(Action.GROW_BUFFER),
            "30m",
            "info",
            f"CPU KV offload buffer too small on {ENGINE}",
            "The what-if replay of live traffic shows a materially higher offload hit ratio "
            f"with a larger buffer that fits the memory headroom: {_recommended()}.",
        ),
        Alert(
            "OffloadStoresWithoutReuse",
            f"kvoffload_offload_reuse_ratio < {th.reuse_ratio_low:g} and on (target, "
            "model_name, engine) rate(kvoffload_offload_store_bytes_total[10m]) > 1e6",
            "30m",
            "warning",
            f"Offloaded KV is almost never read back on {ENGINE}",
            "Loaded bytes are {{ $value | humanizePercentage }} of stored bytes over the "
            "window: the offload tier is written to but not read from. Raise "
            "store_threshold or disable offload.",
        ),
        Alert(
            "PinnedMemoryNearLimit",
            "kvoffload_container_memory_usage_bytes / kvoffload_container_memory_limit_bytes "
            f"> {th.memory_usage_high:g} and on (target) kvoffload_offload_pool_bytes > 0",
            "5m",
            "critical",
            "vLLM container of {{ $labels.target }} near its memory limit with a pinned "
            "offload pool",
            "Memory use is {{ $value | humanizePercentage }} of the container limit and "
            "the pinned offload pool cannot be swapped or reclaimed: the engine is at risk "
            "of an OOM kill. Reduce --kv-offloading-size or raise the limit.",
        ),
        Alert(
            "PCIeSaturated",
            "max by (instance, gpu, uuid) ("
            "rate(kvoffload_gpu_pcie_tx_bytes_total[5m]) "
            "/ kvoffload_gpu_pcie_link_bandwidth_bytes_per_second "
            "or rate(kvoffload_gpu_pcie_rx_bytes_total[5m]) "
            f"/ kvoffload_gpu_pcie_link_bandwidth_bytes_per_second) > "
            f"{th.pcie_utilization_high:g}",
            "10m",
            "warning",
            "PCIe link of GPU {{ $labels.gpu }} on {{ $labels.instance }} is saturated",
            "PCIe traffic is {{ $value | humanizePercentage }} of the link's theoretical "
            "bandwidth: KV offload stores and loads compete with everything else on the "
            "link. Check reuse and store_threshold.",
        ),
        Alert(
            "KVCacheSaturated",
            f"max_over_time(kvoffload_kv_cache_usage_ratio[5m]) > {th.kv_usage_high:g} "
            "and on (target, model_name, engine) kvoffload_gpu_prefix_hit_ratio < 0.3",
            "15m",
            "warning",
            f"GPU KV cache saturated with a low prefix hit ratio on {ENGINE}",
            "GPU KV usage stays above the high-water mark while few prompt tokens hit the "
            "prefix cache: prefixes are evicted before reuse. See whether offload is "
            "recommended (OffloadRecommended, /advice).",
        ),
        Alert(
            "ExporterTargetDown",
            "kvoffload_target_up == 0",
            "5m",
            "warning",
            "kv-offload-exporter cannot scrape vLLM target {{ $labels.target }}",
            "The last scrapes of vLLM's /metrics failed (see "
            "kvoffload_target_scrape_failures_total by reason); offload metrics and advice "
            "for this target are absent until it recovers.",
        ),
        Alert(
            "CollectorDown",
            "kvoffload_collector_up == 0 and on (instance, collector) "
            "sum by (instance, collector) (increase(kvoffload_collector_errors_total[10m])) > 0",
            "10m",
            "warning",
            "kv-offload-exporter collector {{ $labels.collector }} on {{ $labels.instance }} "
            "is failing",
            "The collector is down with errors (a source that is simply absent, such as NVML "
            "without a GPU, does not fire this). The exporter's / page shows the last error.",
        ),
        *backend_alerts(th),
        Alert(
            "KVEventGaps",
            "increase(kvoffload_kv_events_lost_total[15m]) > 0",
            "0m",
            "warning",
            "KV cache events from {{ $labels.target }} were lost",
            "Sequence gaps in vLLM's KV event stream could not be recovered through the "
            "replay endpoint: resident-block counts and the what-if are missing events. "
            "Configure replay_endpoint or raise the publisher's hwm/buffer_steps.",
        ),
    ]


# Backend alerts (docs/backends.md); each series exists only while its backend is in use.
SIMPLE_DROPPED_HIGH = 0.5  # half of the classified stores dropped: the CPU pool is too small


def backend_alerts(th: Thresholds = DEFAULT) -> list[Alert]:
    return [
        Alert(
            "SecondaryTierNotEarningKeep",
            f'kvoffload_tier_hit_ratio{{tier!="0:primary"}} < {th.offload_hit_ratio_material:g} '
            "and on (target, model_name, engine, tier) "
            "rate(kvoffload_tier_write_bytes_total[10m]) > 1e6",
            "30m",
            "warning",
            "Secondary KV tier {{ $labels.tier }} is written to but almost never hit on " + ENGINE,
            "Only {{ $value | humanizePercentage }} of the chunk lookups that reach tier "
            "{{ $labels.tier }} hit, while more than 1 MB/s is cascaded into it: the tier costs "
            "storage bandwidth and capacity without serving prompts. Check that its prefixes "
            "come back at all, or drop it from secondary_tiers.",
        ),
        Alert(
            "SimpleOffloadDroppingStores",
            f"kvoffload_simple_offload_dropped_ratio > {SIMPLE_DROPPED_HIGH:g}",
            "15m",
            "warning",
            f"SimpleCPUOffloadConnector drops most stores on {ENGINE}",
            "{{ $value | humanizePercentage }} of the store decisions dropped the block "
            "(dropped_cpu_full when the CPU pool is full): prefixes never reach the offload "
            "tier. Grow cpu_bytes_to_use / --kv-offloading-size or check the outcome split.",
        ),
        Alert(
            "NixlTransfersFailing",
            "increase(kvoffload_nixl_failed_transfers_total[10m]) > 0",
            "10m",
            "warning",
            f"NIXL KV transfers are failing on {ENGINE}",
            "{{ $value | humanize }} NIXL transfers (handshakes and notifications included) "
            "failed in the last 10 minutes: the affected requests recompute their prefill or "
            "fail. Check the prefill/decode link, UCX transports and the NIXL handshake.",
        ),
        Alert(
            "DisaggregationSlowerThanRecompute",
            "kvoffload_nixl_transfer_speedup_ratio < 1",
            "30m",
            "warning",
            f"Moving KV over NIXL is slower than recomputing it on {ENGINE}",
            'KV arrives from the prefill engine at {{ $value | printf "%.2f" }}x the speed this '
            "model recomputes it: disaggregated prefill is slower than one engine here. It "
            "pays only over a fast KV path (NVLink, RDMA); see kvoffload_nixl_link_info.",
        ),
    ]


def rules(th: Thresholds = DEFAULT, for_scale: float = 1.0) -> dict[str, Any]:
    return {
        "groups": [
            {"name": "kvoffload.vllm.recording", "rules": recording_rules()},
            {"name": "kvoffload.alerts", "rules": [a.rule(for_scale) for a in alerts(th)]},
        ]
    }
