"""KV transfer backends other than the plain CPU tier: tiering, simple offload, LMCache, NIXL.

vLLM moves KV out of GPU memory through one connector interface, and the questions are
the same for every backend (is it hitting, what does a transfer cost, does the link beat
recompute), so their series feed the same derived metrics where they mean the same
thing and get a few families of their own where they do not (docs/backends.md):

- TieringOffloadingSpec (vLLM 0.32+ exports per-tier counters, label `tier` =
  "0:primary", "1:fs", ...): per-tier chunk hit ratio, read (promotion) and write
  (cascade) bandwidth, bytes moved.
- SimpleCPUOffloadConnector (0.32+): share of offered stores that were stored / dropped.
- LMCache (`lmcache:*`, its own labels model_name/worker_id/role/served_model_name, no
  `engine`): `lmcache_samples` rewrites them onto the engine key vLLM uses, (served model
  name, engine "0"), before normalisation, so hit ratios, transfer speed and the advisor
  work unchanged; retrieve/store throughput in tokens/s.
- NixlConnector (disaggregated prefill): KV transfer bandwidth, the same in tokens/s
  against marginal recompute (`kvoffload_nixl_transfer_speedup_ratio`), failures, the
  link type where it can be known.

Everything here is pure: windows and launch configurations in, values or None out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from exporter.vllm_cmdline import LaunchConfig
from exporter.vllm_metrics import EngineKey, EngineSample
from exporter.window import TargetWindow

if TYPE_CHECKING:
    pass

NONE = "none"  # not applicable (no connector, a connector without a spec)
UNKNOWN = "unknown"  # applicable but not observable (no command line, no series)


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """Label values of kvoffload_offload_config_info, and where they came from."""

    connector: str
    spec: str
    eviction_policy: str
    store_threshold: str
    tiers: str
    source: str  # cmdline | metrics

    def labels(self) -> list[str]:
        return [self.connector, self.spec, self.eviction_policy, self.store_threshold, self.tiers]


def _heads(counters: Mapping[str, float]) -> set[str]:
    """Quantity names without their split label part (`tier_reads:cpu` -> `tier_reads`)."""
    return {k.partition(":")[0] for k in counters}


def _has(heads: set[str], *prefixes: str) -> bool:
    return not heads.isdisjoint(prefixes)


def _tier_values(keys: Iterable[str]) -> list[str]:
    tiers = {k.split(":", 1)[1] for k in keys if k.startswith("tier_") and ":" in k}
    return sorted(tiers)


def backend_config(
    launch: LaunchConfig | None,
    cache_config: Mapping[str, str] | None,
    es: EngineSample,
) -> BackendConfig:
    """The engine's KV connector, offloading spec, eviction policy, threshold and tiers.

    The command line decides where it is readable; otherwise the series the engine
    exports say what they can (the policy and the threshold never show in them).
    """
    counters = es.counters
    tier_keys = _tier_values(list(counters) + list(es.gauges))
    if launch is not None:
        connector = launch.connector or NONE
        offloading = connector == "OffloadingConnector"
        spec = launch.spec or NONE
        policy = launch.eviction_policy if offloading else NONE
        threshold = str(launch.threshold_active) if offloading else NONE
        tiers = launch.tiers_label or (",".join(tier_keys) if tier_keys else NONE)
        return BackendConfig(connector, spec, policy, threshold, tiers, "cmdline")
    cc = cache_config or {}
    size = cc.get("kv_offloading_size", "None")
    backend = cc.get("kv_offloading_backend", "native")
    heads = _heads(counters)
    offload_series = _has(heads, "load_bytes", "store_bytes", "stored_chunks")
    if _has(heads, "simple_save", "simple_load_blocks") or "simple_used_blocks" in es.gauges:
        connector = "SimpleCPUOffloadConnector"
    elif _has(heads, "lmc_hit_tokens", "lmc_requested_tokens", "lmc_stored_tokens"):
        connector = "LMCacheConnectorV1"
    elif size not in ("None", "") and backend == "lmcache":
        connector = "LMCacheMPConnector"
    elif offload_series or tier_keys or (size not in ("None", "") and backend == "native"):
        connector = "OffloadingConnector"
    elif _has(heads, "nixl_transfers", "nixl_bytes", "nixl_failed"):
        connector = "NixlConnector"
    else:
        connector = NONE
    spec = policy = threshold = NONE
    if connector == "OffloadingConnector":
        if tier_keys or (es.offload_config or {}).get("tier"):
            spec = "TieringOffloadingSpec"
        elif es.offload_config is not None:
            spec = "CPUOffloadingSpec"  # 0.33's config info without a tier label
        else:
            spec = UNKNOWN  # 0.26 tiering exports nothing per tier: not distinguishable
        policy = UNKNOWN
        threshold = UNKNOWN
    tiers = ",".join(tier_keys) if tier_keys else (UNKNOWN if spec == UNKNOWN else NONE)
    return BackendConfig(connector, spec, policy, threshold, tiers, "metrics")


# --- derived values ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TierDerived:
    tier: str
    hit_ratio: float | None  # chunk hits / chunk queries of this tier over the window
    read_bandwidth: float | None  # bytes/s of promotions from this tier into the primary
    write_bandwidth: float | None  # bytes/s of cascades from the primary into this tier
    read_bytes_total: float | None
    write_bytes_total: float | None


@dataclass(frozen=True, slots=True)
class BackendDerived:
    config: BackendConfig
    tiers: tuple[TierDerived, ...] = ()
    simple_stored_ratio: float | None = None
    simple_dropped_ratio: float | None = None
    lmcache_hit_ratio: float | None = None
    lmcache_retrieve_tokens_per_second: float | None = None
    lmcache_store_tokens_per_second: float | None = None
    nixl_in_use: bool = False
    nixl_bandwidth: float | None = None  # bytes per second of transfer time
    nixl_tokens_per_second: float | None = None
    nixl_speedup: float | None = None
    nixl_failed_total: float | None = None
    nixl_link: str = UNKNOWN
    recompute_from_peer: bool = False  # the NIXL speedup used another engine's recompute rate


def _div(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0 or num < 0:
        return None
    return num / den


def _ratio(num: float | None, den: float | None) -> float | None:
    value = _div(num, den)
    return None if value is None else min(value, 1.0)


def tier_derived(win: TargetWindow, ek: EngineKey, fresh: bool) -> tuple[TierDerived, ...]:
    """Per-tier values from vLLM 0.32+'s tiering counters."""
    totals = win.totals.get(ek, {})
    tiers = _tier_values(totals)
    out = []

    def one(key: str) -> float | None:
        s = win.sums(ek, (key,)) if fresh else None
        return s[0] if s is not None else None

    def pair(a: str, b: str) -> tuple[float, float] | None:
        s = win.sums(ek, (a, b)) if fresh else None
        return (s[0], s[1]) if s is not None else None

    for t in tiers:
        queries_key, hits_key = f"tier_chunk_queries:{t}", f"tier_chunk_hits:{t}"
        hit: float | None = None
        if hits_key in totals:
            p = pair(hits_key, queries_key)
            hit = _ratio(*p) if p is not None else None
        else:
            # vLLM creates a tier's hit counter at its first hit: queries without it are 0 hits.
            q = one(queries_key)
            hit = 0.0 if q is not None and q > 0 else None
        rb = pair(f"tier_read_bytes:{t}", f"tier_read_seconds:{t}")
        wb = pair(f"tier_write_bytes:{t}", f"tier_write_seconds:{t}")
        out.append(
            TierDerived(
                tier=t,
                hit_ratio=hit,
                read_bandwidth=_div(*rb) if rb is not None else None,
                write_bandwidth=_div(*wb) if wb is not None else None,
                read_bytes_total=totals.get(f"tier_read_bytes:{t}"),
                write_bytes_total=totals.get(f"tier_write_bytes:{t}"),
            )
        )
    return tuple(out)


def simple_ratios(
    win: TargetWindow, ek: EngineKey, fresh: bool
) -> tuple[float | None, float | None]:
    """(stored, dropped) shares of the stores SimpleCPUOffloadConnector classified."""
    if not fresh:
        return None, None
    keys = [k for k in win.totals.get(ek, {}) if k.startswith("simple_save:")]
    per: dict[str, float] = {}
    for k in keys:
        s = win.sums(ek, (k,))
        if s is not None:
            per[k.split(":", 1)[1]] = s[0]
    total = sum(per.values())
    if total <= 0:
        return None, None
    dropped = sum(v for o, v in per.items() if o.startswith("dropped_"))
    return _ratio(per.get("stored", 0.0), total), _ratio(dropped, total)


def nixl_link_type(ucx_tls: str | None, nvlink_active: bool | None = None) -> str:  # noqa: PLR0911  one return per case, in the docstring's order
    """The KV path NIXL can take: nvlink, rdma, cuda_ipc, tcp, or unknown.

    NVML's NVLink state decides where it is readable (NOT_SUPPORTED on single-GPU VMs).
    Otherwise the UCX transports NIXL's default backend may use (`UCX_TLS` of the vLLM
    process): verbs transports (rc, dc, ud, ib) mean RDMA; tcp with only host-local helpers
    means TCP; cuda_ipc without tcp means same-node GPU peer copies (NVLink or PCIe). The
    staging copies (cuda_copy, rocm_copy) are no path of their own: NIXL 1.5 requires one of
    them, so "tcp,cuda_copy" is TCP. cuda_ipc beside tcp is unknown: UCX chooses per
    operation (on one H200 it wrote over cuda_ipc and read over tcp, docs/backends.md). An
    exclusion list ("^...") or "all" lets UCX pick at run time: unknown.
    """
    if nvlink_active:
        return "nvlink"
    if not ucx_tls:
        return UNKNOWN
    text = ucx_tls.strip().lower()
    if text.startswith("^"):
        return UNKNOWN
    names = {t.strip() for t in text.split(",") if t.strip()} - {"cuda_copy", "rocm_copy"}
    if not names or "all" in names:
        return UNKNOWN
    if any(n.split("_", 1)[0] in ("rc", "dc", "ud", "ib") for n in names):
        return "rdma"
    if names <= {"tcp", "self", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem"}:
        return "tcp" if "tcp" in names else UNKNOWN
    if "cuda_ipc" in names and "tcp" not in names:
        return "cuda_ipc"
    return UNKNOWN


def backend_derived(
    win: TargetWindow,
    ek: EngineKey,
    es: EngineSample,
    cache_config: Mapping[str, str] | None,
    launch: LaunchConfig | None,
    *,
    fresh: bool,
    kv_bytes_per_token: float | None,
    recompute_tokens_per_second: float | None,
    recompute_negligible: bool,
) -> BackendDerived:
    cfg = backend_config(launch, cache_config, es)

    def sums(*keys: str) -> tuple[float, ...] | None:
        return win.sums(ek, keys) if fresh else None

    def pair(a: str, b: str) -> tuple[float | None, float | None]:
        s = sums(a, b)
        return (s[0], s[1]) if s is not None else (None, None)

    stored, dropped = simple_ratios(win, ek, fresh)
    totals = win.totals.get(ek, {})
    nixl_in_use = cfg.connector == "NixlConnector" or _has(
        _heads(totals), "nixl_transfers", "nixl_failed"
    )
    bandwidth = _div(*pair("nixl_bytes", "nixl_xfer_seconds")) if nixl_in_use else None
    tokens = _div(bandwidth, kv_bytes_per_token) if bandwidth is not None else None
    return BackendDerived(
        config=cfg,
        tiers=tier_derived(win, ek, fresh),
        simple_stored_ratio=stored,
        simple_dropped_ratio=dropped,
        lmcache_hit_ratio=_ratio(*pair("lmc_hit_tokens", "lmc_requested_tokens")),
        lmcache_retrieve_tokens_per_second=_div(*pair("lmc_hit_tokens", "lmc_retrieve_seconds")),
        lmcache_store_tokens_per_second=_div(*pair("lmc_stored_tokens", "lmc_store_seconds")),
        nixl_in_use=nixl_in_use,
        nixl_bandwidth=bandwidth,
        nixl_tokens_per_second=tokens,
        nixl_speedup=speedup(tokens, recompute_tokens_per_second, recompute_negligible),
        nixl_failed_total=totals.get("nixl_failed") if nixl_in_use else None,
        nixl_link=nixl_link_type(launch.ucx_tls if launch else None) if nixl_in_use else UNKNOWN,
    )


def speedup(
    transfer_tokens_per_second: float | None,
    recompute_tokens_per_second: float | None,
    recompute_negligible: bool,
) -> float | None:
    """Transfer over marginal recompute, as kvoffload_transfer_speedup_ratio defines it."""
    if transfer_tokens_per_second is None:
        return None
    if recompute_tokens_per_second:
        return transfer_tokens_per_second / recompute_tokens_per_second
    if recompute_negligible:
        return 0.0  # recompute costs nothing measurable per token: no transfer can win
    return None
