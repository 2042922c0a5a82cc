"""Pure derivations: a target's window -> per-engine derived values, None when unknown.

Nothing here does I/O or reads a clock; tests feed recorded scrapes. A value that
cannot be computed honestly (no denominator in the window, stale input, an
unidentifiable fit) is None, which the collector renders as an absent series.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from exporter.model.derive.backends import BackendDerived, backend_derived
from exporter.model.derive.balance import (
    DELIVERED_KEYS,
    TTFT_FIT_KEYS,
    DeliveredSaving,
    OffloadBalance,
    decode_step_seconds,
    delivered_saving,
    offload_balance,
    request_cost,
)
from exporter.model.derive.balance import KEYS as BALANCE_KEYS
from exporter.model.derive.fits import (
    OffloadFit,
    PrefillFit,
    offload_fit,
    prefill_fit,
    total_scale,
)
from exporter.vllm_cmdline import LaunchConfig
from exporter.vllm_metrics import EngineKey, EngineSample, TargetSample
from exporter.window import TargetWindow

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class CostBefore:
    """An engine's TTFT fit with offload off, and the KV bytes per token of the model it was
    measured on: a restart that serves another model under the same name does not get it."""

    fit: PrefillFit
    kv_bytes_per_token: float | None
    requests_per_second: float | None = None  # of the window the fit was measured over
    machine: str | None = None  # DeriveSettings.machine when it was measured
    scale: float = 1.0  # EngineDerived.ttft_fit_scale when it was measured


@dataclass(frozen=True, slots=True)
class DeriveSettings:
    stale_after: float  # seconds after which the last scrape no longer counts as current
    kv_bytes_per_token: float | None = None  # operator override for the target
    assumed_load_bandwidth: float | None = None  # bytes/s, for engines without offload
    link_bandwidth: float | None = None  # bytes/s, theoretical host link (from NVML)
    link_efficiency: float = 0.56  # achieved/theoretical for vLLM's block copies (H200: 31/55)
    # What a load from a CPU tier costs a request beyond its copy, at least, as a share of
    # the engine's mean prefill time per request: vLLM loads asynchronously and schedules the
    # request at a step after it sees the copy done, so the request waits out part of a step
    # of other work, and steps are longer on larger models. On the H200 matrix (vLLM 0.26,
    # docs/whatif.md) queue time minus copy time per load was 0.16-0.26 of the prefill time
    # per request with offload on: 5.7 ms (0.6B), 7.4-10.7 ms (8B), 20-26 ms (32B). A load
    # that leaves a step it would have shared waits out the rest of it (whatif.view.
    # step_sharing).
    load_wait_share: float = 0.2
    min_fit_points: int = 4
    launch: LaunchConfig | None = None  # the target's vLLM command line, when readable
    # Which machine the engine runs on (NVML's GPU UUIDs): a fit from before offload is
    # compared only on the machine it was measured on. The same sequence ran 24-28 % slower
    # on one H200 VM than on another (docs/gpu-acceptance.md, drift), more than most savings.
    machine: str | None = None
    # The least a computed token costs, seconds: the model's weight bytes per GPU over the
    # GPU's dense peak (compute.computed_token_floor); None where either is unknown.
    computed_token_floor: float | None = None


@dataclass(frozen=True, slots=True)
class EngineDerived:
    key: EngineKey
    fresh: bool
    offload_enabled: bool
    offload_buffer_bytes: float | None
    gpu_capacity_tokens: float | None
    block_size: int | None
    kv_usage: float | None
    gpu_prefix_hit_ratio: float | None
    offload_hit_ratio: float | None
    offload_lookup_hit_ratio: float | None
    load_bandwidth: float | None
    store_bandwidth: float | None
    reuse_ratio: float | None
    kv_bytes_per_token: float | None
    kv_bytes_per_token_method: str | None
    prefill_fit: PrefillFit | None
    offload_fit: OffloadFit | None
    recompute_tokens_per_second: float | None
    recompute_negligible: bool
    prefill_average_tokens_per_second: float | None
    transfer_tokens_per_second: float | None
    transfer_estimated: bool
    transfer_speedup: float | None
    transfer_speedup_lower: float | None
    window: Mapping[str, float]  # window sums of the counters, for the advisor
    totals: Mapping[str, float]  # reset-safe running totals
    backend: BackendDerived | None = None  # connector/spec/tiers and per-backend values
    balance: OffloadBalance | None = None  # offload on: the window's TTFT saved minus stores
    ttft_fit: PrefillFit | None = None  # offload off: summed TTFT on requests, computed tokens
    # The window's summed TTFT over what ttft_fit predicts for the window's own requests and
    # tokens (fits.total_scale).
    ttft_fit_scale: float | None = None
    # Offload on, with the engine's TTFT fit from before it was enabled: what enabling saved.
    delivered: DeliveredSaving | None = None
    load_wait_share: float = 0.0  # of a prefill, per load beyond its copy (DeriveSettings)
    # Bytes vLLM stored to the CPU tier since the engine started (its own counter, not the
    # window's): a restart empties the tier and the counter alike.
    offload_stored_bytes: float | None = None
    computed_token_floor: float | None = None  # seconds (DeriveSettings)
    # Tokens the GPU computed over the window, in GPU KV caches' worth (gpu_cache_turnover);
    # None where vLLM says neither the cache's size nor how many prompt tokens it computed.
    gpu_cache_turnover: float | None = None
    # Whether the engine serves with CUDA graphs (LaunchConfig.cuda_graphs); None where its
    # command line is unknown.
    cuda_graphs: bool | None = None
    # The engine's step time while requests decode (balance.decode_step_seconds); None
    # where the window decoded too little to say.
    decode_step_seconds: float | None = None
    # Offload on, where `delivered` is: the TTFT the tier adds to every request and its
    # standard error (balance.request_cost).
    request_cost: tuple[float, float] | None = None

    @property
    def tier_filling(self) -> bool:
        """The CPU tier has stored less than its size since the engine started, so it has
        never been full: every prefix it stored is still there, and as it fills, more of the
        traffic finds its prefix in it. Its hits, and what they save, are still growing."""
        return (
            self.offload_buffer_bytes is not None
            and self.offload_stored_bytes is not None
            and self.offload_stored_bytes < self.offload_buffer_bytes
        )


def _ratio(sums: tuple[float, ...] | None) -> float | None:
    if sums is None:
        return None
    num, den = sums
    if den <= 0:
        return None
    return min(max(num / den, 0.0), 1.0)


def _rate(sums: tuple[float, ...] | None) -> float | None:
    if sums is None:
        return None
    num, den = sums
    if den <= 0 or num < 0:
        return None
    return num / den


def _float(text: str | None) -> float | None:
    if text is None or text in ("None", ""):
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def offload_settings(
    cache_config: Mapping[str, str] | None, es: EngineSample
) -> tuple[bool, float | None]:
    """Is offload on for this engine, and how big is its CPU buffer in bytes."""
    if es.offload_config is not None:
        size = _float(es.offload_config.get("cpu_kv_cache_size_bytes"))
        return True, size
    size_gib = _float((cache_config or {}).get("kv_offloading_size"))
    backend = (cache_config or {}).get("kv_offloading_backend", "native")
    if size_gib is not None and size_gib > 0:
        # lmcache owns its own capacity; the flag's size is not propagated to it.
        return True, size_gib * GIB if backend != "lmcache" else None
    offload_series = ("load_bytes", "store_bytes", "stored_chunks")
    # Backends without vLLM's offload series: SimpleCPUOffloadConnector, LMCache.
    backend_series = ("simple_save", "simple_load_blocks", "lmc_hit_tokens", "lmc_requested_tokens")
    return any(k in es.counters for k in offload_series) or any(
        k.split(":", 1)[0] in backend_series for k in es.counters
    ), None


def kv_bytes_per_token(
    cache_config: Mapping[str, str] | None,
    es: EngineSample,
    totals: Mapping[str, float],
    override: float | None,
) -> tuple[float | None, str | None]:
    """KV bytes per token, from the most exact source available, and which one it was."""
    if override:
        return override, "configured"
    cc = cache_config or {}
    block = _float(cc.get("block_size"))
    oc = es.offload_config
    if oc is not None:
        size = _float(oc.get("cpu_kv_cache_size_bytes"))
        chunks = _float(oc.get("cpu_num_chunks"))
        per_chunk = _float(oc.get("cpu_blocks_per_chunk"))
        if size and chunks and per_chunk and block:
            return size / (chunks * per_chunk * block), "offload_config"
    loaded = totals.get("load_bytes")
    loaded_tokens = totals.get("prompt_by_source:external_kv_transfer")
    if loaded and loaded_tokens:
        # Every external-transfer prompt token arrived in a load: exact on every recorded
        # H200 run, tiering and ARC included.
        return loaded / loaded_tokens, "offload_loads"
    stored = totals.get("store_bytes")
    chunks_stored = totals.get("stored_chunks")
    if stored and chunks_stored and block and not totals.get("alloc_failures"):
        # The allocation histogram is observed before an allocation can fail (and counts
        # secondary-tier chunks with tiering), so it only counts stored chunks without
        # failures. blocks_per_chunk is 1 unless configured, and then offload_config exists.
        return stored / (chunks_stored * block), "offload_stores"
    mem = _float(cc.get("kv_cache_memory_bytes"))
    tokens = _float(cc.get("kv_cache_size_tokens"))
    if mem and tokens and cc.get("num_gpu_blocks_override", "None") == "None":
        # An upper bound: the pool is the requested memory rounded down to whole blocks.
        return mem / tokens, "cache_config"
    return None, None


WINDOW_KEYS = (
    "prompt_tokens",
    "prompt_by_source:local_compute",
    "prompt_by_source:local_cache_hit",
    "prompt_by_source:external_kv_transfer",
    "prefix_queries",
    "prefix_hits",
    "ext_queries",
    "ext_hits",
    "load_bytes",
    "load_seconds",
    "load_ops",
    "store_bytes",
    "store_seconds",
    "store_ops",
    "alloc_failures",
    "stores_skipped",
    "prefill_seconds",
    "prefill_requests",
    "computed_tokens",
    "ttft_seconds",
    "ttft_requests",
    "preemptions",
    "itl_seconds",
    "itl_gaps",
)


def _comparable(before: CostBefore | None, bpt: float | None, machine: str | None) -> bool:
    """The fit from before describes this engine: the same model (KV bytes per token) and,
    where both are known, the same machine."""
    if before is None or before.kv_bytes_per_token != bpt:
        return False
    return before.machine is None or machine is None or before.machine == machine


def derive_engine(
    win: TargetWindow,
    ek: EngineKey,
    now: float,
    settings: DeriveSettings,
    before: CostBefore | None = None,
) -> EngineDerived | None:
    """`before`: the engine's TTFT fit from a time its offload was off (offload_fit, and
    what enabling delivered against it), used while the engine's KV bytes per token and
    machine are those it was measured on."""
    latest: TargetSample | None = win.latest
    if latest is None or ek not in latest.engines:
        return None
    es = latest.engines[ek]
    fresh = now - latest.ts <= settings.stale_after
    cc = latest.cache_config.get(ek.engine)
    enabled, buffer_bytes = offload_settings(cc, es)
    totals = win.totals.get(ek, {})
    bpt, bpt_method = kv_bytes_per_token(cc, es, totals, settings.kv_bytes_per_token)

    def sums(*keys: str) -> tuple[float, ...] | None:
        return win.sums(ek, keys) if fresh else None

    window: dict[str, float] = {}
    for key in WINDOW_KEYS:
        s = win.sums(ek, (key,))
        if s is not None:
            window[key] = s[0]

    load_bw = _rate(sums("load_bytes", "load_seconds"))
    # LMCache reports tokens and seconds of its retrieves, not bytes: its retrieve speed is
    # the transfer rate where vLLM's own load counters are absent.
    lmc_retrieve = _rate(sums("lmc_hit_tokens", "lmc_retrieve_seconds"))
    store_bw = _rate(sums("store_bytes", "store_seconds"))
    fit = (
        prefill_fit(
            win.points(ek, ("prefill_requests", "computed_tokens", "prefill_seconds")),
            settings.min_fit_points,
        )
        if fresh
        else None
    )
    recompute = 1.0 / fit.seconds_per_token if fit and fit.seconds_per_token > 0 else None
    comparable = before if _comparable(before, bpt, settings.machine) else None
    ofit = (
        offload_fit(
            win.points(
                ek,
                (
                    "ttft_requests",
                    "prompt_by_source:local_compute",
                    "prompt_by_source:external_kv_transfer",
                    "ttft_seconds",
                ),
            ),
            settings.min_fit_points + 2,
            comparable.fit if comparable is not None else None,
            settings.computed_token_floor,
        )
        if fresh and enabled
        else None
    )
    delivered = (
        delivered_saving(
            comparable.fit,
            comparable.requests_per_second,
            comparable.scale,
            dict(zip(DELIVERED_KEYS, got, strict=True)) if (got := sums(*DELIVERED_KEYS)) else None,
            win.covered_seconds(),
        )
        if fresh and enabled and comparable is not None
        else None
    )
    # Offload off: what a computed token adds to the summed TTFT of all requests, not only to
    # its own prefill (on a busy engine it delays the requests queued behind it too): the
    # what-if's saving is stated in summed TTFT, the unit of the truth it is checked against.
    tfit = (
        prefill_fit(
            win.points(ek, TTFT_FIT_KEYS),
            settings.min_fit_points,
        )
        if fresh and not enabled
        else None
    )
    tfit_scale = total_scale(tfit, sums(*TTFT_FIT_KEYS)) if tfit is not None else None
    average = _rate(sums("computed_tokens", "prefill_seconds"))
    bal_sums = sums(*BALANCE_KEYS) if ofit is not None else None
    bal = offload_balance(
        ofit,
        dict(zip(BALANCE_KEYS, bal_sums, strict=True)) if bal_sums else None,
        settings.computed_token_floor,
        window,
    )

    transfer: float | None = None
    estimated = False
    if load_bw is None and lmc_retrieve is not None:
        transfer = lmc_retrieve  # measured in tokens/s: needs no bytes per token
    elif bpt:
        if load_bw is not None:
            transfer = load_bw / bpt
        elif settings.assumed_load_bandwidth:
            transfer, estimated = settings.assumed_load_bandwidth / bpt, True
        elif settings.link_bandwidth:
            transfer = settings.link_bandwidth * settings.link_efficiency / bpt
            estimated = True
    speedup: float | None = None
    speedup_lower: float | None = None
    # "Free at the margin" needs more than a slope at or below zero: even the upper end of the
    # slope's interval must cost less than a reload, or six near-collinear intervals with a
    # wide, negative slope would read as "recompute is free".
    upper = fit.upper if fit is not None else None
    negligible = bool(
        fit is not None
        and fit.seconds_per_token <= 0
        and transfer is not None
        and upper is not None
        and upper * transfer < 1.0
    )
    if transfer is not None and recompute:
        speedup = transfer / recompute
    elif negligible:
        speedup = 0.0  # recompute costs nothing measurable per token: no reload can win
    if transfer is not None and fit is not None and fit.stderr is not None:
        # Enabling offload needs the speedup's lower bound to clear the margin: a handful of
        # near-collinear intervals can give any slope, and a false "enable" costs memory.
        speedup_lower = transfer * max(fit.seconds_per_token - 2 * fit.stderr, 0.0)

    capacity = _float((cc or {}).get("kv_cache_size_tokens"))
    return EngineDerived(
        key=ek,
        fresh=fresh,
        offload_enabled=enabled,
        offload_buffer_bytes=buffer_bytes,
        gpu_capacity_tokens=capacity,
        block_size=int(b) if (b := _float((cc or {}).get("block_size"))) else None,
        kv_usage=es.gauges.get("kv_usage") if fresh else None,
        gpu_prefix_hit_ratio=_ratio(sums("prefix_hits", "prefix_queries")),
        offload_hit_ratio=_ratio(sums("prompt_by_source:external_kv_transfer", "prompt_tokens"))
        if enabled
        else None,
        offload_lookup_hit_ratio=(
            _ratio(sums("ext_hits", "ext_queries"))
            if "ext_queries" in es.counters
            else _ratio(sums("lmc_hit_tokens", "lmc_requested_tokens"))
        )
        if enabled
        else None,
        load_bandwidth=load_bw,
        store_bandwidth=store_bw,
        reuse_ratio=_rate(sums("load_bytes", "store_bytes")) if enabled else None,
        kv_bytes_per_token=bpt,
        kv_bytes_per_token_method=bpt_method,
        prefill_fit=fit,
        offload_fit=ofit,
        recompute_tokens_per_second=recompute,
        recompute_negligible=negligible,
        prefill_average_tokens_per_second=average,
        transfer_tokens_per_second=transfer,
        transfer_estimated=estimated,
        transfer_speedup=speedup,
        transfer_speedup_lower=speedup_lower,
        load_wait_share=settings.load_wait_share,
        offload_stored_bytes=es.counters.get("store_bytes") if enabled else None,
        computed_token_floor=settings.computed_token_floor,
        cuda_graphs=settings.launch.cuda_graphs if settings.launch is not None else None,
        decode_step_seconds=decode_step_seconds(window),
        gpu_cache_turnover=gpu_cache_turnover(window, capacity) if fresh else None,
        window=window,
        totals=dict(totals),
        backend=backend_derived(
            win,
            ek,
            es,
            cc,
            settings.launch,
            fresh=fresh,
            kv_bytes_per_token=bpt,
            recompute_tokens_per_second=recompute,
            recompute_negligible=negligible,
        ),
        balance=bal,
        ttft_fit=tfit,
        ttft_fit_scale=tfit_scale,
        delivered=delivered,
        request_cost=(
            request_cost(ofit, comparable.fit)
            if delivered is not None and comparable is not None
            else None
        ),
    )


def gpu_cache_turnover(window: Mapping[str, float], capacity_tokens: float | None) -> float | None:
    """Prompt tokens the GPU computed over the window over the tokens its KV cache holds.

    Every block a prefill computes enters the prefix cache, and a block leaves it only when
    a new one needs its place: above 1 the window computed more than the cache holds, so
    cached prefixes were evicted whatever the usage gauge read (it counts only the running
    requests' blocks, 0 between requests). Computed is vLLM's local-compute prompt tokens
    (0.26+: loaded ones are not computed), or prompt tokens less prefix-cache hits."""
    if not capacity_tokens or capacity_tokens <= 0:
        return None
    computed = window.get("prompt_by_source:local_compute")
    if computed is None:
        prompt, hits = window.get("prompt_tokens"), window.get("prefix_hits")
        if prompt is None or hits is None:
            return None
        computed = max(prompt - hits, 0.0)
    return computed / capacity_tokens


def derive_target(
    win: TargetWindow,
    now: float,
    settings: DeriveSettings,
    before: Mapping[EngineKey, CostBefore] | None = None,
) -> list[EngineDerived]:
    out = []
    for ek in win.engines():
        d = derive_engine(win, ek, now, settings, (before or {}).get(ek))
        if d is not None:
            out.append(d)
    return out
