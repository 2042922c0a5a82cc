"""What the exporter reads from vLLM's /metrics, as data, and the normalisation step.

Each canonical quantity lists the vLLM series that can supply it, newest generation
first. The first candidate present for an engine wins and the others are ignored:
vLLM 0.26 exposes the new `kv_offload_{load,store}_*` series and the deprecated
`kv_offload_total_*{transfer_type}` series side by side with equal values, and
adding them would double every offload number.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from exporter.expfmt import Labels, Sample


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    match: tuple[tuple[str, str], ...] = ()  # extra label values the sample must have


@dataclass(frozen=True, slots=True)
class Quantity:
    key: str
    kind: str  # "counter" | "gauge"
    candidates: tuple[Candidate, ...]
    by: str | None = None  # label whose values split the quantity (key becomes "key:value")


def _c(name: str, **match: str) -> Candidate:
    return Candidate(name, tuple(sorted(match.items())))


QUANTITIES: tuple[Quantity, ...] = (
    Quantity(
        "kv_usage", "gauge", (_c("vllm:kv_cache_usage_perc"), _c("vllm:gpu_cache_usage_perc"))
    ),
    Quantity("running", "gauge", (_c("vllm:num_requests_running"),)),
    Quantity("waiting", "gauge", (_c("vllm:num_requests_waiting"),)),
    Quantity("offload_cpu_usage", "gauge", (_c("vllm:kv_offload_cpu_cache_usage_perc"),)),
    Quantity(
        "prefix_queries",
        "counter",
        (
            _c("vllm:prefix_cache_queries_total"),
            _c("vllm:gpu_prefix_cache_queries_total"),
            _c("vllm:gpu_prefix_cache_queries"),
        ),
    ),
    Quantity(
        "prefix_hits",
        "counter",
        (
            _c("vllm:prefix_cache_hits_total"),
            _c("vllm:gpu_prefix_cache_hits_total"),
            _c("vllm:gpu_prefix_cache_hits"),
        ),
    ),
    Quantity("ext_queries", "counter", (_c("vllm:external_prefix_cache_queries_total"),)),
    Quantity("ext_hits", "counter", (_c("vllm:external_prefix_cache_hits_total"),)),
    Quantity("prompt_tokens", "counter", (_c("vllm:prompt_tokens_total"),)),
    Quantity(
        "prompt_by_source", "counter", (_c("vllm:prompt_tokens_by_source_total"),), by="source"
    ),
    Quantity(
        "cached_by_source",
        "counter",
        (_c("vllm:prompt_tokens_cached_by_source_total"),),
        by="source",
    ),
    Quantity(
        "load_bytes",
        "counter",
        (
            _c("vllm:kv_offload_load_bytes_total"),
            _c("vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU"),
        ),
    ),
    Quantity(
        "load_seconds",
        "counter",
        (
            _c("vllm:kv_offload_load_time_total"),
            _c("vllm:kv_offload_total_time_total", transfer_type="CPU_to_GPU"),
        ),
    ),
    Quantity(
        "load_ops",
        "counter",
        (
            _c("vllm:kv_offload_load_size_count"),
            _c("vllm:kv_offload_size_count", transfer_type="CPU_to_GPU"),
        ),
    ),
    Quantity(
        "store_bytes",
        "counter",
        (
            _c("vllm:kv_offload_store_bytes_total"),
            _c("vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU"),
        ),
    ),
    Quantity(
        "store_seconds",
        "counter",
        (
            _c("vllm:kv_offload_store_time_total"),
            _c("vllm:kv_offload_total_time_total", transfer_type="GPU_to_CPU"),
        ),
    ),
    Quantity(
        "store_ops",
        "counter",
        (
            _c("vllm:kv_offload_store_size_count"),
            _c("vllm:kv_offload_size_count", transfer_type="GPU_to_CPU"),
        ),
    ),
    Quantity("stored_chunks", "counter", (_c("vllm:kv_offload_cpu_allocation_size_sum"),)),
    Quantity("alloc_failures", "counter", (_c("vllm:kv_offload_allocation_failure_total"),)),
    Quantity("stores_skipped", "counter", (_c("vllm:kv_offload_stores_skipped_total"),)),
    Quantity("prefill_seconds", "counter", (_c("vllm:request_prefill_time_seconds_sum"),)),
    Quantity("prefill_requests", "counter", (_c("vllm:request_prefill_time_seconds_count"),)),
    Quantity("computed_tokens", "counter", (_c("vllm:request_prefill_kv_computed_tokens_sum"),)),
    Quantity(
        "computed_requests", "counter", (_c("vllm:request_prefill_kv_computed_tokens_count"),)
    ),
    # The gap between a request's output tokens: while requests decode, one engine step.
    Quantity("itl_seconds", "counter", (_c("vllm:inter_token_latency_seconds_sum"),)),
    Quantity("itl_gaps", "counter", (_c("vllm:inter_token_latency_seconds_count"),)),
    Quantity("ttft_seconds", "counter", (_c("vllm:time_to_first_token_seconds_sum"),)),
    Quantity("ttft_requests", "counter", (_c("vllm:time_to_first_token_seconds_count"),)),
    Quantity("preemptions", "counter", (_c("vllm:num_preemptions_total"),)),
    # --- KV transfer backends (docs/backends.md) ---------------------------------------
    # TieringOffloadingSpec per tier ("0:primary", "1:fs", ...): vLLM 0.32+; 0.26 exports
    # only the tier lookup-delay histograms, which the dashboards read directly.
    Quantity(
        "tier_read_bytes", "counter", (_c("vllm:kv_offload_tiering_read_bytes_total"),), by="tier"
    ),
    Quantity(
        "tier_read_seconds", "counter", (_c("vllm:kv_offload_tiering_read_time_total"),), by="tier"
    ),
    Quantity(
        "tier_write_bytes",
        "counter",
        (_c("vllm:kv_offload_tiering_write_bytes_total"),),
        by="tier",
    ),
    Quantity(
        "tier_write_seconds",
        "counter",
        (_c("vllm:kv_offload_tiering_write_time_total"),),
        by="tier",
    ),
    Quantity(
        "tier_chunk_queries",
        "counter",
        (_c("vllm:kv_offload_tiering_chunk_queries_total"),),
        by="tier",
    ),
    Quantity(
        "tier_chunk_hits", "counter", (_c("vllm:kv_offload_tiering_chunk_hits_total"),), by="tier"
    ),
    Quantity(
        "tier_promotion_failures",
        "counter",
        (_c("vllm:kv_offload_tiering_promotion_job_failures_total"),),
        by="tier",
    ),
    Quantity(
        "tier_cascade_failures",
        "counter",
        (_c("vllm:kv_offload_tiering_cascade_job_failures_total"),),
        by="tier",
    ),
    Quantity(
        "tier_bp_blocks_dropped",
        "counter",
        (_c("vllm:kv_offload_tiering_backpressure_blocks_dropped_total"),),
        by="tier",
    ),
    Quantity(
        "tier_promotion_alloc_failures",
        "counter",
        (_c("vllm:kv_offload_tiering_promotion_allocation_failures_total"),),
    ),
    # SimpleCPUOffloadConnector (VLLM_USE_SIMPLE_KV_OFFLOAD=1): vLLM 0.32+.
    Quantity(
        "simple_save", "counter", (_c("vllm:simple_kv_offload_save_outcomes_total"),), by="outcome"
    ),
    Quantity("simple_load_blocks", "counter", (_c("vllm:simple_kv_offload_load_blocks_total"),)),
    Quantity("simple_used_blocks", "gauge", (_c("vllm:simple_kv_offload_used_blocks"),)),
    Quantity(
        "simple_pending_store_blocks", "gauge", (_c("vllm:simple_kv_offload_pending_store_blocks"),)
    ),
    Quantity("simple_info", "gauge", (_c("vllm:simple_kv_offload_info"),), by="backend"),
    # LMCache (lmcache:*, labels model_name/worker_id/role/served_model_name): rewritten
    # onto (served model, engine "0") by exporter.model.derive.backends.lmcache_samples before this.
    Quantity("lmc_requested_tokens", "counter", (_c("lmcache:num_requested_tokens_total"),)),
    Quantity("lmc_hit_tokens", "counter", (_c("lmcache:num_hit_tokens_total"),)),
    Quantity("lmc_stored_tokens", "counter", (_c("lmcache:num_stored_tokens_total"),)),
    Quantity("lmc_lookup_tokens", "counter", (_c("lmcache:num_lookup_tokens_total"),)),
    Quantity("lmc_lookup_hits", "counter", (_c("lmcache:num_lookup_hits_total"),)),
    Quantity("lmc_retrieve_seconds", "counter", (_c("lmcache:time_to_retrieve_sum"),)),
    Quantity("lmc_retrieves", "counter", (_c("lmcache:time_to_retrieve_count"),)),
    Quantity("lmc_store_seconds", "counter", (_c("lmcache:time_to_store_sum"),)),
    Quantity("lmc_stores", "counter", (_c("lmcache:time_to_store_count"),)),
    Quantity("lmc_evicted_keys", "counter", (_c("lmcache:local_cpu_evict_keys_count_total"),)),
    Quantity("lmc_local_cache_bytes", "gauge", (_c("lmcache:local_cache_usage"),)),
    # NixlConnector (disaggregated prefill): transfer histograms and failure counters.
    Quantity("nixl_xfer_seconds", "counter", (_c("vllm:nixl_xfer_time_seconds_sum"),)),
    Quantity("nixl_transfers", "counter", (_c("vllm:nixl_xfer_time_seconds_count"),)),
    Quantity("nixl_post_seconds", "counter", (_c("vllm:nixl_post_time_seconds_sum"),)),
    Quantity("nixl_bytes", "counter", (_c("vllm:nixl_bytes_transferred_sum"),)),
    Quantity("nixl_failed", "counter", (_c("vllm:nixl_num_failed_transfers_total"),)),
    Quantity(
        "nixl_failed_notifications", "counter", (_c("vllm:nixl_num_failed_notifications_total"),)
    ),
    Quantity("nixl_expired", "counter", (_c("vllm:nixl_num_kv_expired_reqs_total"),)),
)

CACHE_CONFIG_INFO = "vllm:cache_config_info"
OFFLOAD_CONFIG_INFO = "vllm:kv_offload_config_info"
PROCESS_START = "process_start_time_seconds"
ENGINE_LABELS = ("model_name", "engine")
# Cardinality caps: a buggy or hostile endpoint must not grow the exporter's memory or
# output without bound. Engine label sets beyond the cap and split-label values beyond
# MAX_SPLIT_VALUES are dropped and counted (TargetSample.dropped_series).
DEFAULT_MAX_ENGINES = 64
MAX_SPLIT_VALUES = 16  # distinct values of a `by` label, per quantity and engine

WANTED: frozenset[str] = frozenset(
    {c.name for q in QUANTITIES for c in q.candidates}
    | {CACHE_CONFIG_INFO, OFFLOAD_CONFIG_INFO, PROCESS_START}
)
COUNTER_KEYS_PREFIXES: frozenset[str] = frozenset(q.key for q in QUANTITIES if q.kind == "counter")


@dataclass(frozen=True, slots=True)
class Series:
    """A metric family as vLLM (or a connector it loads) exposes it."""

    type: str  # "counter" | "gauge" | "histogram" (then the name is the base name)
    meaning: str
    # When vLLM registers it, where not in every run of tests/fixtures/vllm-0.26.0-h200
    # b_offload and vllm-0.32.0-cpu; empty: it is there.
    condition: str = ""


_OLD = "older vLLM, before the rename to the current series"
_THRESHOLD = "OffloadingConnector with store_threshold >= 2"
_TIERING = "TieringOffloadingSpec (per tier from vLLM 0.32)"
_SIMPLE = "SimpleCPUOffloadConnector (VLLM_USE_SIMPLE_KV_OFFLOAD=1), vLLM 0.32+"
_LMCACHE = "LMCache connector"
_NIXL = "NixlConnector (disaggregated prefill)"

# Every vLLM family the exporter knows: QUANTITIES' candidates and the info series above
# (tests/test_vllm_metrics.py checks each resolves here with a fitting type), and the series
# the dashboards query directly (dashboards/build.py accepts no other vLLM name). Names from
# the vLLM metric catalogue in the team notes (../shared/notes/vllm-metrics-and-kv-events.md,
# vLLM 0.33.0 sources) and the recorded expositions under tests/fixtures/.
SERIES: Mapping[str, Series] = MappingProxyType(
    {
        # core (PrometheusStatLogger), labels model_name, engine
        "vllm:num_requests_running": Series("gauge", "requests running"),
        "vllm:num_requests_waiting": Series("gauge", "requests waiting"),
        "vllm:kv_cache_usage_perc": Series("gauge", "GPU KV cache usage 0..1"),
        "vllm:gpu_cache_usage_perc": Series("gauge", "GPU KV cache usage 0..1", _OLD),
        "vllm:prefix_cache_queries_total": Series("counter", "GPU prefix cache lookups, tokens"),
        "vllm:prefix_cache_hits_total": Series("counter", "GPU prefix cache hits, tokens"),
        "vllm:gpu_prefix_cache_queries_total": Series("counter", "GPU prefix lookups", _OLD),
        "vllm:gpu_prefix_cache_queries": Series("counter", "GPU prefix lookups", _OLD),
        "vllm:gpu_prefix_cache_hits_total": Series("counter", "GPU prefix hits", _OLD),
        "vllm:gpu_prefix_cache_hits": Series("counter", "GPU prefix hits", _OLD),
        "vllm:external_prefix_cache_queries_total": Series(
            "counter", "KV connector lookups, tokens"
        ),
        "vllm:external_prefix_cache_hits_total": Series("counter", "KV connector hits, tokens"),
        "vllm:num_preemptions_total": Series("counter", "preemptions"),
        "vllm:prompt_tokens_total": Series("counter", "all prompt tokens"),
        "vllm:prompt_tokens_by_source_total": Series("counter", "prompt tokens by source"),
        "vllm:prompt_tokens_cached_total": Series("counter", "cached prompt tokens"),
        "vllm:prompt_tokens_cached_by_source_total": Series(
            "counter", "cached prompt tokens by source"
        ),
        "vllm:generation_tokens_total": Series("counter", "generated tokens"),
        "vllm:request_success_total": Series("counter", "finished requests by reason"),
        "vllm:time_to_first_token_seconds": Series("histogram", "TTFT"),
        "vllm:inter_token_latency_seconds": Series(
            "histogram", "gap between a request's output tokens"
        ),
        "vllm:e2e_request_latency_seconds": Series("histogram", "end-to-end latency"),
        "vllm:request_prefill_time_seconds": Series("histogram", "prefill time"),
        "vllm:request_prefill_kv_computed_tokens": Series(
            "histogram", "prompt tokens computed (not cached) per request"
        ),
        "vllm:request_queue_time_seconds": Series("histogram", "queue time"),
        CACHE_CONFIG_INFO: Series("gauge", "CacheConfig as labels, value 1"),
        OFFLOAD_CONFIG_INFO: Series("gauge", "offload config as labels, value 1", "vLLM 0.33+"),
        PROCESS_START: Series("gauge", "API server start, unix seconds"),
        # OffloadingConnector (vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py)
        "vllm:kv_offload_load_bytes_total": Series("counter", "bytes offload tier -> GPU"),
        "vllm:kv_offload_store_bytes_total": Series("counter", "bytes GPU -> offload tier"),
        "vllm:kv_offload_load_time_total": Series("counter", "summed GPU copy time of loads"),
        "vllm:kv_offload_store_time_total": Series("counter", "summed GPU copy time of stores"),
        "vllm:kv_offload_load_size": Series("histogram", "bytes per load operation"),
        "vllm:kv_offload_store_size": Series("histogram", "bytes per store operation"),
        # the deprecated generation beside them (vLLM 0.26), split by transfer_type
        "vllm:kv_offload_total_bytes_total": Series("counter", "bytes moved, by transfer_type"),
        "vllm:kv_offload_total_time_total": Series("counter", "copy time, by transfer_type"),
        "vllm:kv_offload_size": Series("histogram", "bytes per transfer, by transfer_type"),
        "vllm:kv_offload_cpu_allocation_size": Series("histogram", "CPU chunks per store"),
        "vllm:kv_offload_lookup_sync_delay_seconds": Series(
            "histogram", "time in one offload lookup"
        ),
        "vllm:kv_offload_allocation_failure_total": Series(
            "counter", "failed CPU store allocations"
        ),
        "vllm:kv_offload_stores_skipped_total": Series(
            "counter", "stores below store_threshold", _THRESHOLD
        ),
        "vllm:kv_offload_cpu_cache_usage_perc": Series("gauge", "CPU space pinned by transfers"),
        "vllm:kv_offload_cpu_cache_write_usage_perc": Series("gauge", "CPU space pinned by stores"),
        "vllm:kv_offload_cpu_cache_read_usage_perc": Series("gauge", "CPU space pinned by loads"),
        # KV transfer backends (docs/backends.md)
        "vllm:kv_offload_tiering_lookup_sync_delay_seconds": Series(
            "histogram", "time blocked in one tier lookup", _TIERING
        ),
        "vllm:kv_offload_tiering_read_bytes_total": Series("counter", "bytes read", _TIERING),
        "vllm:kv_offload_tiering_read_time_total": Series("counter", "read time", _TIERING),
        "vllm:kv_offload_tiering_write_bytes_total": Series("counter", "bytes written", _TIERING),
        "vllm:kv_offload_tiering_write_time_total": Series("counter", "write time", _TIERING),
        "vllm:kv_offload_tiering_chunk_queries_total": Series("counter", "chunk lookups", _TIERING),
        "vllm:kv_offload_tiering_chunk_hits_total": Series("counter", "chunk hits", _TIERING),
        "vllm:kv_offload_tiering_promotion_job_failures_total": Series(
            "counter", "failed promotions", _TIERING
        ),
        "vllm:kv_offload_tiering_cascade_job_failures_total": Series(
            "counter", "failed cascades", _TIERING
        ),
        "vllm:kv_offload_tiering_backpressure_blocks_dropped_total": Series(
            "counter", "blocks dropped by back-pressure", _TIERING
        ),
        "vllm:kv_offload_tiering_promotion_allocation_failures_total": Series(
            "counter", "promotion allocation failures", _TIERING
        ),
        "vllm:simple_kv_offload_save_outcomes_total": Series(
            "counter", "simple offload store decisions", _SIMPLE
        ),
        "vllm:simple_kv_offload_load_blocks_total": Series("counter", "blocks loaded", _SIMPLE),
        "vllm:simple_kv_offload_used_blocks": Series("gauge", "CPU blocks in use", _SIMPLE),
        "vllm:simple_kv_offload_pending_store_blocks": Series(
            "gauge", "blocks waiting to be stored", _SIMPLE
        ),
        "vllm:simple_kv_offload_info": Series("gauge", "backend as a label, value 1", _SIMPLE),
        "lmcache:num_requested_tokens_total": Series("counter", "tokens requested", _LMCACHE),
        "lmcache:num_hit_tokens_total": Series("counter", "tokens hit", _LMCACHE),
        "lmcache:num_stored_tokens_total": Series("counter", "tokens stored", _LMCACHE),
        "lmcache:num_lookup_tokens_total": Series("counter", "tokens looked up", _LMCACHE),
        "lmcache:num_lookup_hits_total": Series("counter", "lookup hits, tokens", _LMCACHE),
        "lmcache:time_to_retrieve": Series("histogram", "retrieve time", _LMCACHE),
        "lmcache:time_to_store": Series("histogram", "store time", _LMCACHE),
        "lmcache:local_cpu_evict_keys_count_total": Series("counter", "keys evicted", _LMCACHE),
        "lmcache:local_cache_usage": Series("gauge", "local cache bytes", _LMCACHE),
        "vllm:nixl_xfer_time_seconds": Series("histogram", "transfer time", _NIXL),
        "vllm:nixl_post_time_seconds": Series("histogram", "transfer post time", _NIXL),
        "vllm:nixl_bytes_transferred": Series("histogram", "bytes per transfer", _NIXL),
        "vllm:nixl_num_failed_transfers_total": Series("counter", "failed transfers", _NIXL),
        "vllm:nixl_num_failed_notifications_total": Series(
            "counter", "failed notifications", _NIXL
        ),
        "vllm:nixl_num_kv_expired_reqs_total": Series("counter", "expired KV requests", _NIXL),
    }
)

_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def family_of(sample_name: str) -> str | None:
    """The SERIES entry a sample name belongs to (histograms: _bucket/_sum/_count)."""
    if sample_name in SERIES:
        return sample_name
    for suffix in _HISTOGRAM_SUFFIXES:
        base = sample_name.removesuffix(suffix)
        if base != sample_name and base in SERIES and SERIES[base].type == "histogram":
            return base
    return None


class EngineKey(NamedTuple):
    """(model_name, engine): a tuple, because it is hashed on every window lookup."""

    model_name: str
    engine: str


@dataclass(frozen=True, slots=True)
class EngineSample:
    counters: Mapping[str, float]
    gauges: Mapping[str, float]
    offload_config: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class TargetSample:
    """One successful scrape, normalised. `ts` is the exporter's clock at scrape end."""

    ts: float
    engines: Mapping[EngineKey, EngineSample]
    cache_config: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # by engine
    process_start: float | None = None
    invalid: tuple[str, ...] = ()  # series dropped for NaN/Inf/negative counter values
    dropped_series: int = 0  # series dropped by the cardinality caps
    dropped_engines: int = 0  # engine label sets over max_engines


def is_counter_key(key: str) -> bool:
    return key.split(":", 1)[0] in COUNTER_KEYS_PREFIXES


def _kept_engines(
    by_name: Mapping[str, list[tuple[int, EngineKey | None]]],
    max_engines: int | None,
    prefer: Collection[EngineKey],
) -> tuple[set[EngineKey] | None, int]:
    """The engines to keep under the cap (None: all) and how many are dropped.

    Engines in `prefer` come first, then the rest in sorted order.
    """
    if max_engines is None:
        return None, 0
    present: set[EngineKey] = set()
    for q in QUANTITIES:
        for cand in q.candidates:
            for _, ek in by_name.get(cand.name, ()):
                if ek is not None:
                    present.add(ek)
    if len(present) <= max_engines:
        return None, 0
    known = sorted(present.intersection(prefer))
    rest = sorted(present.difference(prefer))
    kept = set((known + rest)[: max(max_engines, 0)])
    return kept, len(present) - len(kept)


# Sample indices by series name, each with its engine (None without model_name and engine).
_ByName = dict[str, list[tuple[int, EngineKey | None]]]


def _by_name(names: list[str], labels: list[Labels]) -> _ByName:
    """Sample indices by series name, each with its engine, worked out once: the cap and
    every quantity read it."""
    by_name: _ByName = {}
    known: dict[tuple[str | None, str | None], EngineKey | None] = {}
    for i, (name, labs) in enumerate(zip(names, labels, strict=True)):
        model = engine = None
        for k, v in labs:
            if k == "model_name":
                model = v if model is None else model
            elif k == "engine":
                engine = v if engine is None else engine
        pair = (model, engine)
        if pair not in known:
            known[pair] = None if model is None or engine is None else EngineKey(model, engine)
        by_name.setdefault(name, []).append((i, known[pair]))
    return by_name


def _label(labels: Labels, key: str) -> str | None:
    for k, v in labels:
        if k == key:
            return v
    return None


@dataclass(frozen=True, slots=True)
class _Plan:
    """What normalise() does with a body of a given shape (its series names and label sets,
    the cap and, when the cap bites, the preferred engines): everything but the values.
    Bodies of one target keep their shape from scrape to scrape, so the plan is reused."""

    names: list[str]
    labels: list[Labels]
    max_engines: int | None
    prefer: frozenset[EngineKey] | None  # None: the cap keeps every engine, prefer is moot
    steps: tuple[tuple[int, bool, EngineKey, str], ...]  # sample, is counter, engine, key
    dropped: int  # series dropped by the caps (quantities, cache and offload config)
    dropped_engines: int
    kept: set[EngineKey] | None
    cache_config: tuple[int, ...]  # indices of CACHE_CONFIG_INFO samples
    offload_config: tuple[tuple[int, EngineKey], ...]  # kept OFFLOAD_CONFIG_INFO samples
    process_start: tuple[int, ...]


def _offload_config(
    by_name: _ByName, kept: set[EngineKey] | None
) -> tuple[tuple[tuple[int, EngineKey], ...], int]:
    """The OFFLOAD_CONFIG_INFO samples of kept engines, and how many the cap dropped."""
    out: list[tuple[int, EngineKey]] = []
    dropped = 0
    for i, ek in by_name.get(OFFLOAD_CONFIG_INFO, ()):
        if ek is None:
            continue
        if kept is not None and ek not in kept:
            dropped += 1
            continue
        out.append((i, ek))
    return tuple(out), dropped


def _make_plan(
    names: list[str], labels: list[Labels], max_engines: int | None, prefer: Collection[EngineKey]
) -> _Plan:
    by_name = _by_name(names, labels)
    kept, dropped_engines = _kept_engines(by_name, max_engines, prefer)
    dropped = 0
    split_values: dict[tuple[EngineKey, str], set[str]] = {}
    steps: list[tuple[int, bool, EngineKey, str]] = []
    for q in QUANTITIES:
        is_counter = q.kind == "counter"
        won: set[EngineKey] = set()
        for cand in q.candidates:
            chosen: set[EngineKey] = set()
            for i, ek in by_name.get(cand.name, ()):
                if ek is None:
                    continue
                labs = labels[i]
                if cand.match and any(_label(labs, k) != v for k, v in cand.match):
                    continue
                if kept is not None and ek not in kept:
                    dropped += 1
                    continue
                if ek in won:
                    continue  # an earlier generation's series already supplies this engine
                key = q.key
                if q.by is not None:
                    part = _label(labs, q.by)
                    if part is None:
                        continue
                    parts = split_values.setdefault((ek, q.key), set())
                    if part not in parts and len(parts) >= MAX_SPLIT_VALUES:
                        dropped += 1
                        continue
                    parts.add(part)
                    key = f"{q.key}:{part}"
                chosen.add(ek)
                steps.append((i, is_counter, ek, key))
            won |= chosen
    offload, dropped_offload = _offload_config(by_name, kept)
    return _Plan(
        names=names,
        labels=labels,
        max_engines=max_engines,
        prefer=None if kept is None else frozenset(prefer),
        steps=tuple(steps),
        dropped=dropped + dropped_offload,
        dropped_engines=dropped_engines,
        kept=kept,
        cache_config=tuple(i for i, _ in by_name.get(CACHE_CONFIG_INFO, ())),
        offload_config=offload,
        process_start=tuple(i for i, _ in by_name.get(PROCESS_START, ())),
    )


# Plans by a cheap fingerprint of the body's shape (checked in full on use). Bounded:
# cleared when full, as a target whose series keep changing would otherwise grow it.
_PLANS: dict[tuple[object, ...], list[_Plan]] = {}
_PLANS_MAX = 64


def _plan(
    names: list[str], labels: list[Labels], max_engines: int | None, prefer: Collection[EngineKey]
) -> _Plan:
    n = len(names)
    fingerprint: tuple[object, ...] = (
        (n, max_engines, names[0], labels[0], names[-1], labels[-1]) if n else (0, max_engines)
    )
    candidates = _PLANS.get(fingerprint)
    if candidates is not None:
        for plan in candidates:
            # List equality compares item by item in C, and the parser hands out the same
            # label tuples for the same label blocks, so this is mostly identity checks.
            if (
                plan.names == names
                and plan.labels == labels
                and (plan.prefer is None or plan.prefer == frozenset(prefer))
            ):
                return plan
    plan = _make_plan(names, labels, max_engines, prefer)
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    bucket = _PLANS.setdefault(fingerprint, [])
    if len(bucket) >= 4:
        del bucket[0]
    bucket.append(plan)
    return plan


def normalise(
    samples: Iterable[Sample],
    ts: float,
    *,
    max_engines: int | None = None,
    prefer: Collection[EngineKey] = (),
) -> TargetSample:
    """Map raw vLLM samples onto canonical per-engine quantities.

    With `max_engines`, at most that many engine label sets are kept (those in `prefer`,
    the engines already being tracked, first; then in sorted order, so the choice is
    stable across scrapes); the series of the others are dropped and counted.

    Which sample becomes which engine's quantity depends only on the body's series and
    label sets (and the cap): that plan is worked out once per shape of body (`_plan`)
    and the values of each scrape are filled in along it.
    """
    seq = samples if isinstance(samples, list | tuple) else list(samples)
    names = [s.name for s in seq]
    labels = [s.labels for s in seq]
    plan = _plan(names, labels, max_engines, prefer)
    counters: dict[EngineKey, dict[str, float]] = {}
    gauges: dict[EngineKey, dict[str, float]] = {}
    invalid: list[str] = []
    isfinite = math.isfinite
    for i, is_counter, ek, key in plan.steps:
        value = seq[i].value
        if not isfinite(value) or (is_counter and value < 0):
            invalid.append(f"{names[i]}{dict(labels[i])}={value}")
            continue
        target = counters if is_counter else gauges
        values = target.get(ek)
        if values is None:
            values = target[ek] = {}
        values[key] = value
    keys = set(counters) | set(gauges)
    engine_labels = {ek.engine for ek in keys}
    dropped = plan.dropped
    cache_config: dict[str, dict[str, str]] = {}
    for i in plan.cache_config:
        labs = labels[i]
        engine = _label(labs, "engine") or "0"
        if plan.kept is not None and engine not in engine_labels:
            dropped += 1
            continue
        cache_config[engine] = dict(labs)
    offload_config = {ek: dict(labels[i]) for i, ek in plan.offload_config}
    process_start = None
    for i in plan.process_start:
        if isfinite(seq[i].value):
            process_start = seq[i].value
    engines = {
        ek: EngineSample(
            counters=counters.get(ek, {}),
            gauges=gauges.get(ek, {}),
            offload_config=offload_config.get(ek),
        )
        for ek in keys
    }
    return TargetSample(
        ts=ts,
        engines=engines,
        cache_config=cache_config,
        process_start=process_start,
        invalid=tuple(invalid),
        dropped_series=dropped,
        dropped_engines=plan.dropped_engines,
    )
