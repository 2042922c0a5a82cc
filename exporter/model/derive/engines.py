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
from exporter.vllm_cmdline import LaunchConfig
from exporter.vllm_metrics import EngineKey, EngineSample, TargetSample
from exporter.window import TargetWindow

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class DeriveSettings:
    stale_after: float  # seconds after which the last scrape no longer counts as current
    kv_bytes_per_token: float | None = None  # operator override for the target
    assumed_load_bandwidth: float | None = None  # bytes/s, for engines without offload
    link_bandwidth: float | None = None  # bytes/s, theoretical host link (from NVML)
    link_efficiency: float = 0.56  # achieved/theoretical for vLLM's block copies (H200: 31/55)
    min_fit_points: int = 4
    launch: LaunchConfig | None = None  # the target's vLLM command line, when readable


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """prefill_seconds = overhead * requests + seconds_per_token * computed_tokens."""

    overhead_seconds: float
    seconds_per_token: float
    points: int
    r2: float
    stderr: float | None = None  # standard error of seconds_per_token

    @property
    def significant(self) -> bool:
        """The per-token cost is distinguishable from zero (about 95%)."""
        return self.stderr is not None and self.seconds_per_token - 2 * self.stderr > 0

    @property
    def upper(self) -> float | None:
        """Upper end of the per-token cost's ~95% interval."""
        return None if self.stderr is None else self.seconds_per_token + 2 * self.stderr


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


def _lstsq(columns: list[list[float]], y: list[float], min_det: float) -> list[float] | None:
    """Least squares without intercept; None when the columns are (nearly) collinear.

    Columns are scaled to unit norm first, so `min_det` bounds the determinant of a
    correlation-like Gram matrix: 1 for orthogonal regressors, 0 for collinear ones.
    """
    k = len(columns)
    norms = [math.sqrt(sum(v * v for v in col)) for col in columns]
    if any(n <= 0 for n in norms):
        return None
    cols = [[v / n for v in col] for col, n in zip(columns, norms, strict=True)]
    gram = [[sum(a * b for a, b in zip(ci, cj, strict=True)) for cj in cols] for ci in cols]
    rhs = [sum(a * b for a, b in zip(ci, y, strict=True)) for ci in cols]
    m = [[*row, r] for row, r in zip(gram, rhs, strict=True)]
    det = 1.0
    for i in range(k):
        pivot = max(range(i, k), key=lambda r: abs(m[r][i]))
        if abs(m[pivot][i]) < 1e-12:
            return None
        if pivot != i:
            m[i], m[pivot] = m[pivot], m[i]
            det = -det
        det *= m[i][i]
        for r in range(i + 1, k):
            f = m[r][i] / m[i][i]
            for c in range(i, k + 1):
                m[r][c] -= f * m[i][c]
    if abs(det) < min_det:
        return None
    coef = [0.0] * k
    for i in reversed(range(k)):
        coef[i] = (m[i][k] - sum(m[i][c] * coef[c] for c in range(i + 1, k))) / m[i][i]
    return [c / n for c, n in zip(coef, norms, strict=True)]


def _inverse_gram(columns: list[list[float]]) -> list[list[float]] | None:
    """(X^T X)^-1 by Gauss-Jordan on the unit-norm Gram matrix, then unscaled."""
    k = len(columns)
    norms = [math.sqrt(sum(v * v for v in col)) for col in columns]
    if any(n <= 0 for n in norms):
        return None
    cols = [[v / n for v in col] for col, n in zip(columns, norms, strict=True)]
    m = [
        [sum(a * b for a, b in zip(ci, cj, strict=True)) for cj in cols]
        + [1.0 if i == j else 0.0 for j in range(k)]
        for i, ci in enumerate(cols)
    ]
    for i in range(k):
        pivot = max(range(i, k), key=lambda r: abs(m[r][i]))
        if abs(m[pivot][i]) < 1e-12:
            return None
        m[i], m[pivot] = m[pivot], m[i]
        p = m[i][i]
        m[i] = [v / p for v in m[i]]
        for r in range(k):
            if r != i and m[r][i] != 0.0:
                f = m[r][i]
                m[r] = [a - f * b for a, b in zip(m[r], m[i], strict=True)]
    return [[m[i][k + j] / (norms[i] * norms[j]) for j in range(k)] for i in range(k)]


def _covariance(
    columns: list[list[float]], y: list[float], coef: list[float]
) -> list[list[float]] | None:
    """Covariance of the least-squares coefficients: sigma^2 (X^T X)^-1."""
    n, k = len(y), len(columns)
    if n <= k:
        return None
    ss_res = sum(
        (yi - sum(c * col[i] for c, col in zip(coef, columns, strict=True))) ** 2
        for i, yi in enumerate(y)
    )
    inv = _inverse_gram(columns)
    if inv is None:
        return None
    sigma2 = ss_res / (n - k)
    return [[sigma2 * v for v in row] for row in inv]


def _robust_lstsq(
    columns: list[list[float]], y: list[float], min_det: float
) -> tuple[list[float], list[list[float]], list[float]] | None:
    """Least squares, then once more without outliers (beyond 4 robust sigmas).

    A scrape interval that caught a warm-up request or a compile stall would otherwise
    drag the whole fit; the median absolute deviation is not moved by a few of them.
    """
    coef = _lstsq(columns, y, min_det)
    if coef is None:
        return None
    res = [
        yi - sum(c * col[i] for c, col in zip(coef, columns, strict=True)) for i, yi in enumerate(y)
    ]
    mad = sorted(abs(r) for r in res)[len(res) // 2] * 1.4826
    if mad <= 0:
        return coef, columns, y
    keep = [i for i, r in enumerate(res) if abs(r) <= 4 * mad]
    if len(keep) == len(y) or len(keep) < len(columns) + 2:
        return coef, columns, y
    cols2 = [[col[i] for i in keep] for col in columns]
    y2 = [y[i] for i in keep]
    coef2 = _lstsq(cols2, y2, min_det)
    return (coef2, cols2, y2) if coef2 is not None else (coef, columns, y)


def _r2(columns: list[list[float]], y: list[float], coef: list[float]) -> float:
    syy = sum(v * v for v in y)
    res = sum(
        (yi - sum(c * col[i] for c, col in zip(coef, columns, strict=True))) ** 2
        for i, yi in enumerate(y)
    )
    return max(0.0, 1.0 - res / syy) if syy > 0 else 0.0


def prefill_fit(points: list[tuple[float, ...]], min_points: int) -> PrefillFit | None:
    """Least squares of prefill seconds on (requests, computed tokens) per interval.

    The average tokens/s of a window mixes a fixed per-request cost (scheduling,
    sampling, kernel launches) with the per-token cost; only the per-token part is
    what a reload saves, so break-even needs the slope, not the average.
    """
    pts = [(n, t, y) for n, t, y in points if n > 0 and t >= 0 and y >= 0]
    if len(pts) < min_points:
        return None
    n = [p[0] for p in pts]
    t = [p[1] for p in pts]
    y = [p[2] for p in pts]
    # Requests and tokens moving in lockstep (every request the same size) leave the
    # two costs inseparable; say so instead of returning a number.
    fitted = _robust_lstsq([n, t], y, 1e-3)
    if fitted is None:
        return None
    (a, b), cols, yy = fitted
    if a < 0:
        tt = cols[1]
        stt = sum(v * v for v in tt)
        if stt <= 0:
            return None
        a, b = 0.0, sum(ti * yi for ti, yi in zip(tt, yy, strict=True)) / stt
        cov = _covariance([tt], yy, [b])
        stderr = math.sqrt(cov[0][0]) if cov is not None and cov[0][0] >= 0 else None
    else:
        cov = _covariance(cols, yy, [a, b])
        stderr = math.sqrt(cov[1][1]) if cov is not None and cov[1][1] >= 0 else None
    # b <= 0 is kept: a per-token cost below the noise can itself be the finding, when even
    # its upper bound is below what a reload costs (derive_engine decides).
    return PrefillFit(a, b, len(yy), _r2(cols, yy, [a, b]), stderr)


@dataclass(frozen=True, slots=True)
class OffloadFit:
    """ttft = overhead * requests + computed_cost * computed + loaded_cost * loaded tokens.

    vLLM's load-time counter is GPU copy time only; what a reload really costs a request
    (waiting a scheduler step for the async load, lookups, the copy) shows in TTFT. The
    difference of the two per-token costs is what offload saves per loaded token.
    """

    overhead_seconds: float
    computed_seconds_per_token: float
    loaded_seconds_per_token: float
    points: int
    r2: float
    saving_stderr: float | None = None  # standard error of the saving per token
    computed_stderr: float | None = None
    loaded_stderr: float | None = None

    @property
    def valid(self) -> bool:
        """Physically meaningful: recomputing costs something, loading does not cost
        significantly less than nothing. Near-collinear windows fail this."""
        if self.loaded_stderr is None:
            return False
        return (
            self.computed_seconds_per_token > 0
            and self.loaded_seconds_per_token + 2 * self.loaded_stderr >= 0
        )

    def speedup_bounds(self, z: float = 2.0) -> tuple[float, float] | None:
        """Approximate interval of recompute cost / reload cost (upper may be infinite)."""
        if self.computed_stderr is None or self.loaded_stderr is None:
            return None
        b, c = self.computed_seconds_per_token, self.loaded_seconds_per_token
        b_lo, b_hi = max(b - z * self.computed_stderr, 0.0), b + z * self.computed_stderr
        c_lo, c_hi = c - z * self.loaded_stderr, c + z * self.loaded_stderr
        lo = b_lo / c_hi if c_hi > 0 else math.inf
        hi = b_hi / c_lo if c_lo > 0 else math.inf
        return lo, hi

    @property
    def proves_gain(self) -> bool:
        """The saving per loaded token is positive beyond doubt (~95%)."""
        bounds = self.saving_bounds()
        return (
            self.valid
            and self.computed_stderr is not None
            and self.computed_seconds_per_token - 2 * self.computed_stderr > 0
            and bounds is not None
            and bounds[0] > 0
        )

    @property
    def reload_significantly_costly(self) -> bool:
        """A loaded token costs TTFT, beyond doubt."""
        return (
            self.loaded_stderr is not None
            and self.loaded_seconds_per_token - 2 * self.loaded_stderr > 0
        )

    @property
    def saving_seconds_per_token(self) -> float:
        return self.computed_seconds_per_token - self.loaded_seconds_per_token

    @property
    def measured_speedup(self) -> float | None:
        """Recompute cost over reload cost per token, both as TTFT sees them; None when the
        fit is not valid or a reload costs nothing measurable (unbounded)."""
        if not self.valid or self.loaded_seconds_per_token <= 0:
            return None
        return self.computed_seconds_per_token / self.loaded_seconds_per_token

    def saving_bounds(self, z: float = 2.0) -> tuple[float, float] | None:
        """Approximate 95% interval of the saving per token; None without an error estimate."""
        if self.saving_stderr is None:
            return None
        s = self.saving_seconds_per_token
        return s - z * self.saving_stderr, s + z * self.saving_stderr


def offload_fit(points: list[tuple[float, ...]], min_points: int) -> OffloadFit | None:
    """Fit TTFT per interval on (requests, computed tokens, loaded tokens)."""
    pts = [p for p in points if p[0] > 0 and min(p) >= 0]
    if len(pts) < min_points or not any(p[2] > 0 for p in pts):
        return None
    fitted = _robust_lstsq([[p[i] for p in pts] for i in range(3)], [p[3] for p in pts], 1e-4)
    if fitted is None:
        return None
    coef, cols, y = fitted
    cov = _covariance(cols, y, coef)
    stderr = se_b = se_c = None
    if cov is not None:
        var = cov[1][1] + cov[2][2] - 2 * cov[1][2]
        stderr = math.sqrt(var) if var >= 0 else None
        se_b = math.sqrt(cov[1][1]) if cov[1][1] >= 0 else None
        se_c = math.sqrt(cov[2][2]) if cov[2][2] >= 0 else None
    return OffloadFit(coef[0], coef[1], coef[2], len(y), _r2(cols, y, coef), stderr, se_b, se_c)


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
)


def derive_engine(
    win: TargetWindow, ek: EngineKey, now: float, settings: DeriveSettings
) -> EngineDerived | None:
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
        )
        if fresh and enabled
        else None
    )
    average = _rate(sums("computed_tokens", "prefill_seconds"))

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

    return EngineDerived(
        key=ek,
        fresh=fresh,
        offload_enabled=enabled,
        offload_buffer_bytes=buffer_bytes,
        gpu_capacity_tokens=_float((cc or {}).get("kv_cache_size_tokens")),
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
    )


def derive_target(win: TargetWindow, now: float, settings: DeriveSettings) -> list[EngineDerived]:
    out = []
    for ek in win.engines():
        d = derive_engine(win, ek, now, settings)
        if d is not None:
            out.append(d)
    return out
