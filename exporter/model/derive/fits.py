"""Least-squares fits over scrape intervals: the marginal cost of a prefilled token, and the
TTFT cost of a loaded against a computed token, with standard errors (pure arithmetic)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import repeat
from operator import add, mul, sub, truediv


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """prefill_seconds = overhead * requests + seconds_per_token * computed_tokens."""

    overhead_seconds: float
    seconds_per_token: float
    points: int
    r2: float
    stderr: float | None = None  # standard error of seconds_per_token
    overhead_stderr: float | None = None
    covariance: float | None = None  # of overhead_seconds and seconds_per_token

    def predict(self, requests: float, tokens: float) -> tuple[float, float | None]:
        """The fitted seconds of this many requests and tokens, and its standard error
        (None without the coefficients' covariance). A total can be precise where the
        split between the two costs is not: their errors are strongly anti-correlated."""
        value = self.overhead_seconds * requests + self.seconds_per_token * tokens
        if self.stderr is None or self.overhead_stderr is None or self.covariance is None:
            return value, None
        var = (
            (requests * self.overhead_stderr) ** 2
            + (tokens * self.stderr) ** 2
            + 2 * requests * tokens * self.covariance
        )
        return value, math.sqrt(max(var, 0.0))

    @property
    def significant(self) -> bool:
        """The per-token cost is distinguishable from zero (about 95%)."""
        return self.stderr is not None and self.seconds_per_token - 2 * self.stderr > 0

    @property
    def upper(self) -> float | None:
        """Upper end of the per-token cost's ~95% interval."""
        return None if self.stderr is None else self.seconds_per_token + 2 * self.stderr


def total_scale(fit: PrefillFit, sums: tuple[float, ...] | None) -> float | None:
    """Measured total over the fit's prediction of it, for sums (requests, tokens, seconds)
    of the intervals it was fitted on; None where either is not positive. Least squares
    without an intercept, after the outlier pass, need not reproduce its window's total: the
    TTFT fits of the H200 matrix's runs without offload predicted 0.98-1.19x their own
    summed TTFT."""
    if sums is None:
        return None
    requests, tokens, seconds = sums
    predicted, _ = fit.predict(requests, tokens)
    if predicted <= 0 or seconds <= 0:
        return None
    return seconds / predicted


def _dot(a: list[float], b: list[float]) -> float:
    """sum(a[i] * b[i]): the same products added in the same order as a generator sum,
    so bit-identical, at C speed."""
    if len(a) != len(b):
        raise ValueError("vectors of different lengths")
    total: float = sum(map(mul, a, b))
    return total


def _residuals(columns: list[list[float]], y: list[float], coef: list[float]) -> list[float]:
    """y[i] - sum(coef[j] * columns[j][i] for j): the same additions in the same order as
    that sum (which starts from the int 0), a column at a time. Callers square with `** 2`,
    as before (pow, not r * r, keeps them bit-identical)."""
    if len(coef) != len(columns) or any(len(col) < len(y) for col in columns):
        raise ValueError("coefficients, columns and y do not match")
    fitted: list[float] = [0] * len(y)  # sum()'s int start
    for c, col in zip(coef, columns, strict=True):
        fitted = list(map(add, fitted, map(mul, repeat(c), col)))
    return list(map(sub, y, fitted))


def _scaled(columns: list[list[float]], norms: list[float]) -> list[list[float]]:
    return [list(map(truediv, col, repeat(n))) for col, n in zip(columns, norms, strict=True)]


@dataclass(frozen=True, slots=True)
class _Unit:
    """Columns scaled to unit norm, their norms and their Gram matrix."""

    norms: list[float]
    cols: list[list[float]]
    gram: list[list[float]]


def _unit(columns: list[list[float]]) -> _Unit | None:
    """None when a column is all zeros. The Gram matrix is symmetric to the bit (the same
    products, commuted, added in the same order): its lower half is the upper's."""
    norms = [math.sqrt(sum(map(mul, col, col))) for col in columns]
    if any(n <= 0 for n in norms):
        return None
    cols = _scaled(columns, norms)
    k = len(cols)
    gram = [[0.0] * k for _ in range(k)]
    for i in range(k):
        for j in range(i, k):
            gram[i][j] = gram[j][i] = _dot(cols[i], cols[j])
    return _Unit(norms, cols, gram)


def _lstsq(
    columns: list[list[float]], y: list[float], min_det: float
) -> tuple[list[float], _Unit] | None:
    """Least squares without intercept; None when the columns are (nearly) collinear.

    Columns are scaled to unit norm first, so `min_det` bounds the determinant of a
    correlation-like Gram matrix: 1 for orthogonal regressors, 0 for collinear ones.
    The scaled columns come back with the coefficients, for the covariance.
    """
    k = len(columns)
    unit = _unit(columns)
    if unit is None:
        return None
    norms = unit.norms
    rhs = [_dot(ci, y) for ci in unit.cols]
    m = [[*row, r] for row, r in zip(unit.gram, rhs, strict=True)]
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
    return [c / n for c, n in zip(coef, norms, strict=True)], unit


def _inverse_gram(
    columns: list[list[float]], unit: _Unit | None = None
) -> list[list[float]] | None:
    """(X^T X)^-1 by Gauss-Jordan on the unit-norm Gram matrix, then unscaled. `unit`:
    the columns' _unit() if already computed."""
    k = len(columns)
    if unit is None:
        unit = _unit(columns)
        if unit is None:
            return None
    norms = unit.norms
    m = [row + [1.0 if i == j else 0.0 for j in range(k)] for i, row in enumerate(unit.gram)]
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
    columns: list[list[float]],
    y: list[float],
    coef: list[float],
    unit: _Unit | None = None,
    res: list[float] | None = None,
) -> list[list[float]] | None:
    """Covariance of the least-squares coefficients: sigma^2 (X^T X)^-1. `unit` and `res`:
    the columns' _unit() and the residuals, if already computed."""
    n, k = len(y), len(columns)
    if n <= k:
        return None
    if res is None:
        res = _residuals(columns, y, coef)
    ss_res = sum(map(pow, res, repeat(2)))
    inv = _inverse_gram(columns, unit)
    if inv is None:
        return None
    sigma2 = ss_res / (n - k)
    return [[sigma2 * v for v in row] for row in inv]


def least_squares(
    columns: list[list[float]], y: list[float], min_det: float = 1e-6
) -> tuple[list[float], list[float]] | None:
    """Ordinary least squares of y on the columns (an intercept is a column of ones): the
    coefficients and their standard errors; None where the columns are (nearly) collinear
    (`_lstsq`'s `min_det`) or there are no more points than columns."""
    fitted = _lstsq(columns, y, min_det)
    if fitted is None:
        return None
    coef, unit = fitted
    cov = _covariance(columns, y, coef, unit)
    if cov is None:
        return None
    return coef, [math.sqrt(max(cov[i][i], 0.0)) for i in range(len(coef))]


@dataclass(frozen=True, slots=True)
class _Fitted:
    coef: list[float]
    columns: list[list[float]]  # the points kept
    y: list[float]
    unit: _Unit  # of those columns
    res: list[float]  # their residuals


def _robust_lstsq(columns: list[list[float]], y: list[float], min_det: float) -> _Fitted | None:
    """Least squares, then once more without outliers (beyond 4 robust sigmas, and not
    of high leverage: see below).

    A scrape interval that caught a warm-up request or a compile stall would otherwise
    drag the whole fit; the median absolute deviation is not moved by a few of them.
    """
    first = _lstsq(columns, y, min_det)
    if first is None:
        return None
    coef, unit = first
    res = _residuals(columns, y, coef)
    whole = _Fitted(coef, columns, y, unit, res)
    mad = sorted(map(abs, res))[len(res) // 2] * 1.4826
    if mad <= 0:
        return whole
    bound = 4 * mad
    outliers = [i for i, r in enumerate(res) if abs(r) > bound]
    if not outliers:
        return whole
    # A point far out in the regressors (the few intervals where a long prompt was computed
    # while most intervals only hit the cache) has a large residual simply because the
    # noise grows with the work, and it is the only evidence for its regressor's cost:
    # dropping it leaves that cost unidentified (the 8B long-context runs: +-77 us instead
    # of +-0.7 us per token). Outlier tests on raw residuals are not valid for such
    # high-leverage points, so only ordinary-leverage intervals are dropped.
    inv = _inverse_gram(columns, unit)
    if inv is not None:
        k = len(columns)
        cap = 3.0 * k / len(y)
        outliers = [
            i
            for i in outliers
            if sum(columns[a][i] * inv[a][b] * columns[b][i] for a in range(k) for b in range(k))
            <= cap
        ]
    drop = set(outliers)
    keep = [i for i in range(len(y)) if i not in drop]
    if len(keep) == len(y) or len(keep) < len(columns) + 2:
        return whole
    cols2 = [[col[i] for i in keep] for col in columns]
    y2 = [y[i] for i in keep]
    second = _lstsq(cols2, y2, min_det)
    if second is None:
        return whole
    return _Fitted(second[0], cols2, y2, second[1], _residuals(cols2, y2, second[0]))


def _r2(
    columns: list[list[float]], y: list[float], coef: list[float], res: list[float] | None = None
) -> float:
    syy = sum(map(mul, y, y))
    if res is None:
        res = _residuals(columns, y, coef)
    ss_res = sum(map(pow, res, repeat(2)))
    return max(0.0, 1.0 - ss_res / syy) if syy > 0 else 0.0


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
    (a, b), cols, yy = fitted.coef, fitted.columns, fitted.y
    res: list[float] | None = None
    if a < 0:
        tt = cols[1]
        stt = sum(map(mul, tt, tt))
        if stt <= 0:
            return None
        a, b = 0.0, _dot(tt, yy) / stt
        cov = _covariance([tt], yy, [b])
        stderr = math.sqrt(cov[0][0]) if cov is not None and cov[0][0] >= 0 else None
        se_a, cov_ab = (0.0, 0.0) if stderr is not None else (None, None)  # a held at zero
    else:
        res = fitted.res  # of these very coefficients
        cov = _covariance(cols, yy, [a, b], fitted.unit, res)
        stderr = math.sqrt(cov[1][1]) if cov is not None and cov[1][1] >= 0 else None
        se_a = math.sqrt(cov[0][0]) if cov is not None and cov[0][0] >= 0 else None
        cov_ab = cov[0][1] if cov is not None else None
    # b <= 0 is kept: a per-token cost below the noise can itself be the finding, when even
    # its upper bound is below what a reload costs (derive_engine decides).
    return PrefillFit(a, b, len(yy), _r2(cols, yy, [a, b], res), stderr, se_a, cov_ab)


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
    # The computed token's cost is the one measured before offload was enabled (offload_fit's
    # `before`): the window did not separate it from the per-request cost.
    computed_before: bool = False
    # The computed token's cost is its floor (offload_fit's `floor`): the window put it lower.
    computed_floor: bool = False
    # At the floor the computed token's interval is one-sided: from the floor (stderr 0 below)
    # up to where the window's own fit reaches, two of these above the floor.
    computed_upper_stderr: float | None = None
    # Of overhead_seconds, where the window fitted all three costs itself; None where a
    # computed token's cost was given (from before, or its floor), whose error would move it.
    overhead_stderr: float | None = None

    @property
    def _computed_upper_se(self) -> float | None:
        if self.computed_upper_stderr is not None:
            return self.computed_upper_stderr
        return self.computed_stderr

    @property
    def saving_upper_stderr(self) -> float | None:
        """The saving's standard error on its upper side: at the floor, wider than below by
        the computed token's upper side (a saving proven at the floor is a lower bound; one
        ruled out is ruled out up to the window's own fit, not up to the floor)."""
        if self.saving_stderr is None or self.computed_upper_stderr is None:
            return self.saving_stderr
        extra = self.computed_upper_stderr**2 - (self.computed_stderr or 0.0) ** 2
        return math.sqrt(self.saving_stderr**2 + max(extra, 0.0))

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
        b_lo = max(b - z * self.computed_stderr, 0.0)
        b_hi = b + z * (self._computed_upper_se or 0.0)
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
    def reload_dearer_beyond_doubt(self) -> bool:
        """Even the upper end of a computed token's cost is below the lower end of a loaded
        token's (~95 % each, taken apart)."""
        upper_se = self._computed_upper_se
        if upper_se is None or self.loaded_stderr is None:
            return False
        return (
            self.computed_seconds_per_token + 2 * upper_se
            < self.loaded_seconds_per_token - 2 * self.loaded_stderr
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
        upper_se = self.saving_upper_stderr
        if self.saving_stderr is None or upper_se is None:
            return None
        s = self.saving_seconds_per_token
        return s - z * self.saving_stderr, s + z * upper_se


def offload_fit(
    points: list[tuple[float, ...]],
    min_points: int,
    before: PrefillFit | None = None,
    floor: float | None = None,
) -> OffloadFit | None:
    """Fit TTFT per interval on (requests, computed tokens, loaded tokens).

    `before` is the TTFT fit of the same engine while offload was off (summed TTFT on
    requests and computed tokens). Where every request loads and computes a similar few
    hundred tokens, no interval separates a computed token's cost from the per-request cost
    (32B chat with 48 GiB on the H200: -45 +- 65 us); where the window leaves that cost
    unidentified and `before` measured it more precisely, it is taken as known and the rest
    is fitted around it, its error carried into the saving's.

    `floor` is the least a computed token can cost (compute.computed_token_floor): where the
    fit puts it below, the least-squares fit under that bound has it on the bound, and the
    per-request and loaded-token costs are fitted around it (14B chat with 30 GiB on the
    H200: -14.0 +- 28.0 us by the window, 29.9 us by physics, 58.0 by its run without
    offload). The bound is one-sided: above the floor the cost keeps the window's own upper
    end (`OffloadFit.computed_upper_stderr`)."""
    pts = [p for p in points if p[0] > 0 and min(p) >= 0]
    if len(pts) < min_points or not any(p[2] > 0 for p in pts):
        return None
    fit = _offload_fit_known(pts, before)
    if (
        fit is None
        or floor is None
        or fit.computed_seconds_per_token >= floor
        or fit.computed_stderr is None
    ):
        return fit
    # The bound is exact, not an estimate: no error of its own to carry below. Above it the
    # cost is as uncertain as the window's own fit left it: up to that fit's upper end (8B
    # chat with 16 GiB on the H200: -10.8 +- 32.5 us by the window, a floor of 16.6 us, so
    # 16.6 to 21.7 us, and a reload at most 1.8x cheaper rather than 1.4x).
    upper = fit.computed_seconds_per_token + 2 * fit.computed_stderr
    floored = _offload_fit_given(pts, floor, 0.0, at_floor=True)
    if floored is None:
        return fit
    return replace(floored, computed_upper_stderr=max(upper - floor, 0.0) / 2)


def _offload_fit_known(
    pts: list[tuple[float, ...]], before: PrefillFit | None
) -> OffloadFit | None:
    fit = _offload_fit(pts)
    if before is None or not before.significant or before.stderr is None:
        return fit
    if fit is not None and fit.computed_stderr is not None:
        identified = fit.computed_seconds_per_token - 2 * fit.computed_stderr > 0
        if identified or fit.computed_stderr <= before.stderr:
            return fit
    return _offload_fit_given(pts, before.seconds_per_token, before.stderr) or fit


def _offload_fit_given(
    pts: list[tuple[float, ...]], computed: float, computed_stderr: float, at_floor: bool = False
) -> OffloadFit | None:
    """The fit with a computed token's cost known: TTFT less computed x that cost, on
    (requests, loaded tokens)."""
    y = [p[3] - computed * p[1] for p in pts]
    fitted = _robust_lstsq([[p[i] for p in pts] for i in (0, 2)], y, 1e-4)
    if fitted is None:
        return None
    coef = fitted.coef
    cov = _covariance(fitted.columns, fitted.y, coef, fitted.unit, fitted.res)
    se_c = math.sqrt(cov[1][1]) if cov is not None and cov[1][1] >= 0 else None
    # The two costs come from disjoint windows: their errors add in quadrature.
    stderr = math.sqrt(computed_stderr**2 + se_c**2) if se_c is not None else None
    r2 = _r2(fitted.columns, fitted.y, coef, fitted.res)  # of the TTFT the known cost leaves
    return OffloadFit(
        coef[0],
        computed,
        coef[1],
        len(fitted.y),
        r2,
        stderr,
        computed_stderr,
        se_c,
        computed_before=not at_floor,
        computed_floor=at_floor,
    )


def _offload_fit(pts: list[tuple[float, ...]]) -> OffloadFit | None:
    fitted = _robust_lstsq([[p[i] for p in pts] for i in range(3)], [p[3] for p in pts], 1e-4)
    if fitted is None:
        return None
    coef, cols, y = fitted.coef, fitted.columns, fitted.y
    cov = _covariance(cols, y, coef, fitted.unit, fitted.res)
    stderr = se_a = se_b = se_c = None
    if cov is not None:
        var = cov[1][1] + cov[2][2] - 2 * cov[1][2]
        stderr = math.sqrt(var) if var >= 0 else None
        se_a = math.sqrt(cov[0][0]) if cov[0][0] >= 0 else None
        se_b = math.sqrt(cov[1][1]) if cov[1][1] >= 0 else None
        se_c = math.sqrt(cov[2][2]) if cov[2][2] >= 0 else None
    r2 = _r2(cols, y, coef, fitted.res)
    return OffloadFit(
        coef[0], coef[1], coef[2], len(y), r2, stderr, se_b, se_c, overhead_stderr=se_a
    )
