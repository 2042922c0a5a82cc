"""What the exporter reads from vLLM's /metrics, as data, and the normalisation step.

Each canonical quantity lists the vLLM series that can supply it, newest generation
first. The first candidate present for an engine wins and the others are ignored:
vLLM 0.26 exposes the new `kv_offload_{load,store}_*` series and the deprecated
`kv_offload_total_*{transfer_type}` series side by side with equal values, and
adding them would double every offload number.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from exporter.expfmt import Sample


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
    Quantity("ttft_seconds", "counter", (_c("vllm:time_to_first_token_seconds_sum"),)),
    Quantity("ttft_requests", "counter", (_c("vllm:time_to_first_token_seconds_count"),)),
    Quantity("preemptions", "counter", (_c("vllm:num_preemptions_total"),)),
)

CACHE_CONFIG_INFO = "vllm:cache_config_info"
OFFLOAD_CONFIG_INFO = "vllm:kv_offload_config_info"
PROCESS_START = "process_start_time_seconds"
ENGINE_LABELS = ("model_name", "engine")

WANTED: frozenset[str] = frozenset(
    {c.name for q in QUANTITIES for c in q.candidates}
    | {CACHE_CONFIG_INFO, OFFLOAD_CONFIG_INFO, PROCESS_START}
)
COUNTER_KEYS_PREFIXES: frozenset[str] = frozenset(q.key for q in QUANTITIES if q.kind == "counter")


@dataclass(frozen=True, slots=True, order=True)
class EngineKey:
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


def is_counter_key(key: str) -> bool:
    return key.split(":", 1)[0] in COUNTER_KEYS_PREFIXES


def normalise(samples: Iterable[Sample], ts: float) -> TargetSample:
    """Map raw vLLM samples onto canonical per-engine quantities."""
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)

    counters: dict[EngineKey, dict[str, float]] = {}
    gauges: dict[EngineKey, dict[str, float]] = {}
    invalid: list[str] = []
    for q in QUANTITIES:
        target = counters if q.kind == "counter" else gauges
        won: set[EngineKey] = set()
        for cand in q.candidates:
            chosen: set[EngineKey] = set()
            for s in by_name.get(cand.name, ()):
                if any(s.label(k) != v for k, v in cand.match):
                    continue
                model, engine = s.label("model_name"), s.label("engine")
                if model is None or engine is None:
                    continue
                ek = EngineKey(model, engine)
                if ek in won:
                    continue  # an earlier generation's series already supplies this engine
                key = q.key
                if q.by is not None:
                    part = s.label(q.by)
                    if part is None:
                        continue
                    key = f"{q.key}:{part}"
                chosen.add(ek)
                value = s.value
                if not math.isfinite(value) or (q.kind == "counter" and value < 0):
                    invalid.append(f"{s.name}{dict(s.labels)}={value}")
                    continue
                target.setdefault(ek, {})[key] = value
            won |= chosen
    cache_config: dict[str, dict[str, str]] = {}
    for s in by_name.get(CACHE_CONFIG_INFO, ()):
        engine = s.label("engine") or "0"
        cache_config[engine] = dict(s.labels)
    offload_config: dict[EngineKey, dict[str, str]] = {}
    for s in by_name.get(OFFLOAD_CONFIG_INFO, ()):
        model, engine = s.label("model_name"), s.label("engine")
        if model is not None and engine is not None:
            offload_config[EngineKey(model, engine)] = dict(s.labels)
    process_start = None
    for s in by_name.get(PROCESS_START, ()):
        if math.isfinite(s.value):
            process_start = s.value
    keys = set(counters) | set(gauges)
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
    )
