"""Families of the derived values: ratios, rates, fits and re-exported offload counters."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from exporter.catalogue import Family
from exporter.model.derive.engines import EngineDerived

# (metric name, attribute of EngineDerived) for plain optional gauges.
_DERIVED_GAUGES: tuple[tuple[str, str], ...] = (
    ("kvoffload_offload_buffer_bytes", "offload_buffer_bytes"),
    ("kvoffload_gpu_kv_cache_capacity_tokens", "gpu_capacity_tokens"),
    ("kvoffload_kv_cache_usage_ratio", "kv_usage"),
    ("kvoffload_gpu_prefix_hit_ratio", "gpu_prefix_hit_ratio"),
    ("kvoffload_offload_hit_ratio", "offload_hit_ratio"),
    ("kvoffload_offload_lookup_hit_ratio", "offload_lookup_hit_ratio"),
    ("kvoffload_offload_load_bandwidth_bytes_per_second", "load_bandwidth"),
    ("kvoffload_offload_store_bandwidth_bytes_per_second", "store_bandwidth"),
    ("kvoffload_offload_reuse_ratio", "reuse_ratio"),
    ("kvoffload_kv_bytes_per_token", "kv_bytes_per_token"),
    ("kvoffload_recompute_tokens_per_second", "recompute_tokens_per_second"),
    ("kvoffload_prefill_average_tokens_per_second", "prefill_average_tokens_per_second"),
    ("kvoffload_transfer_tokens_per_second", "transfer_tokens_per_second"),
    ("kvoffload_transfer_speedup_ratio", "transfer_speedup"),
)

# (metric name, running-total key) for re-exported counters.
_DERIVED_COUNTERS: tuple[tuple[str, str], ...] = (
    ("kvoffload_offload_load_bytes_total", "load_bytes"),
    ("kvoffload_offload_store_bytes_total", "store_bytes"),
    ("kvoffload_offload_load_seconds_total", "load_seconds"),
    ("kvoffload_offload_store_seconds_total", "store_seconds"),
    ("kvoffload_offload_stores_skipped_total", "stores_skipped"),
)

PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def derived_families(
    per_target: Iterable[tuple[str, Sequence[EngineDerived]]],
    covered: Mapping[str, float] | None = None,
) -> list[Family]:
    enabled = Family("kvoffload_offload_enabled")
    gauges = {name: Family(name) for name, _ in _DERIVED_GAUGES}
    counters = {name: Family(name) for name, _ in _DERIVED_COUNTERS}
    prompt = Family("kvoffload_prompt_tokens_total")
    estimated = Family("kvoffload_transfer_rate_estimated")
    overhead = Family("kvoffload_prefill_request_overhead_seconds")
    fit_points = Family("kvoffload_prefill_fit_points")
    saving = Family("kvoffload_offload_saving_seconds_per_token")
    saved_rate = Family("kvoffload_offload_ttft_saved_seconds_per_second")
    delivered = Family("kvoffload_offload_delivered_ttft_saved_seconds_per_second")
    request_cost = Family("kvoffload_offload_request_ttft_cost_seconds")
    for target, engines in per_target:
        span = (covered or {}).get(target, 0.0)
        for d in engines:
            labels = [target, d.key.model_name, d.key.engine]
            enabled.add(labels, 1.0 if d.offload_enabled else 0.0)
            for name, attr in _DERIVED_GAUGES:
                value = getattr(d, attr)
                if value is not None:
                    gauges[name].add(labels, value)
            for name, key in _DERIVED_COUNTERS:
                if key in d.totals:
                    counters[name].add(labels, d.totals[key])
            for src in PROMPT_SOURCES:
                key = f"prompt_by_source:{src}"
                if key in d.totals:
                    prompt.add([*labels, src], d.totals[key])
            if d.transfer_tokens_per_second is not None:
                estimated.add(labels, 1.0 if d.transfer_estimated else 0.0)
            if d.prefill_fit is not None:
                overhead.add(labels, d.prefill_fit.overhead_seconds)
            fit_points.add(labels, d.prefill_fit.points if d.prefill_fit else 0)
            _offload_savings(d, labels, span, saving, saved_rate, delivered)
            if d.request_cost is not None:
                request_cost.add(labels, d.request_cost[0])
    return [
        enabled,
        *gauges.values(),
        *counters.values(),
        prompt,
        estimated,
        overhead,
        fit_points,
        saving,
        saved_rate,
        delivered,
        request_cost,
    ]


def _offload_savings(
    d: EngineDerived,
    labels: list[str],
    span: float,
    saving: Family,
    saved_rate: Family,
    delivered: Family,
) -> None:
    """The measured saving per loaded token, and the window's net TTFT seconds as a rate:
    the balance, and against the engine's TTFT before offload."""
    if d.offload_fit is not None:
        saving.add(labels, d.offload_fit.saving_seconds_per_token)
    if span <= 0:
        return
    if d.balance is not None:
        saved_rate.add(labels, d.balance.net_seconds / span)
    if d.delivered is not None:
        delivered.add(labels, d.delivered.net_seconds / span)
