"""exporter/model/derive/fits.py: the least-squares fits of prefill cost."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from exporter.model.derive.balance import offload_balance
from exporter.model.derive.fits import (
    OffloadFit,
    PrefillFit,
    least_squares,
    offload_fit,
    prefill_fit,
)


def test_prefill_fit_recovers_marginal_cost_and_fixed_overhead():
    rng = random.Random(1)
    overhead, per_token = 0.012, 2e-6
    pts = []
    for _ in range(20):
        n = rng.randint(1, 30)
        tokens = sum(rng.choice([0, 144, 1600]) for _ in range(n))
        y = n * overhead + tokens * per_token
        pts.append((float(n), float(tokens), y * (1 + rng.uniform(-0.005, 0.005))))
    fit = prefill_fit(pts, 4)
    assert fit is not None
    assert fit.seconds_per_token == pytest.approx(per_token, rel=0.1)
    assert fit.overhead_seconds == pytest.approx(overhead, rel=0.1)
    # The average rate mixes the fixed cost in and understates how fast recompute is.
    average = sum(t for _, t, _ in pts) / sum(y for _, _, y in pts)
    assert average < 0.5 / per_token


def test_prefill_fit_refuses_when_request_size_never_varies():
    pts = [(float(n), 1600.0 * n, 0.01 * n + 1600 * n * 2e-6) for n in range(1, 10)]
    assert prefill_fit(pts, 4) is None


def test_prefill_fit_needs_enough_points():
    assert prefill_fit([(1.0, 10.0, 0.1), (2.0, 100.0, 0.3)], 4) is None


def test_residuals_and_dot_are_the_generator_sums_bit_for_bit():
    # map(operator.mul) in place of generator sums: the same additions in the same order
    # (from the int 0), so every fit is bit-identical to the generator form.
    from exporter.model.derive.fits import _dot, _residuals

    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 40)
        cols = [[rng.choice([0.0, -0.0, rng.uniform(-1e6, 1e6)]) for _ in range(n)] for _ in "abc"]
        y = [rng.choice([0.0, -0.0, rng.uniform(-1e3, 1e3)]) for _ in range(n)]
        coef = [rng.uniform(-1, 1) for _ in cols]
        want = [
            yi - sum(c * col[i] for c, col in zip(coef, cols, strict=True))
            for i, yi in enumerate(y)
        ]
        got = _residuals(cols, y, coef)
        assert [repr(v) for v in got] == [repr(v) for v in want]  # -0.0 too
        assert repr(_dot(cols[0], y)) == repr(sum(a * b for a, b in zip(cols[0], y, strict=True)))
    with pytest.raises(ValueError):
        _dot([1.0], [1.0, 2.0])


def test_outlier_pass_keeps_the_high_leverage_intervals_that_identify_a_cost():
    """The H200 8B long-context run with 9 GiB of offload: most intervals only load or hit
    the cache; the few that computed a cold 10k-token document have the largest residuals
    (noise grows with the work) and are the only evidence of a computed token's cost.
    Dropping them as outliers gave 58 +- 77 us per loaded token; kept, 38.9 +- 1.3 us."""
    from exporter.config import Config
    from exporter.replay import replay_one

    run = Path(__file__).parents[2] / "fixtures/gpu/matrix/qwen3-8b-long-context-cpu64k"
    r = replay_one(run, Config())
    (e,) = (x for t in r.final.targets for x in t.engines)
    saving = e.advice.numbers["measured_saving_seconds_per_loaded_token"]
    assert saving == pytest.approx(38.9e-6, rel=0.05)


def test_reload_dearer_beyond_doubt_needs_the_two_intervals_apart() -> None:
    """Computed 10 +- 2 us (2 sigma: 6-14) against loaded 20 +- 2 us (16-24): apart. With
    5 us of standard error on the computed cost (0-20), they overlap; without an error
    estimate nothing is beyond doubt."""
    fit = OffloadFit(0.0, 10e-6, 20e-6, 60, 0.9, 1e-6, 1e-6, 1e-6)
    assert fit.reload_dearer_beyond_doubt
    assert not OffloadFit(0.0, 10e-6, 20e-6, 60, 0.9, 1e-6, 5e-6, 1e-6).reload_dearer_beyond_doubt
    assert not OffloadFit(0.0, 10e-6, 20e-6, 60, 0.9, 1e-6, None, 1e-6).reload_dearer_beyond_doubt


def _intervals(
    seed: int,
    computed: tuple[int, int] = (240, 360),
    loaded: tuple[int, int] = (500, 5000),
    noise: float = 0.08,
) -> list[tuple[float, ...]]:
    """60 intervals of 1-4 requests, each computing and loading tokens in these ranges:
    TTFT = 20 ms x requests + 300 us x computed + 15 us x loaded, with noise. By default each
    request loads its history and computes a similar few hundred new tokens: the computed
    tokens follow the requests, so their cost is not identified by these intervals alone."""
    rng = random.Random(seed)
    pts = []
    for _ in range(60):
        n = rng.randint(1, 4)
        comp = sum(rng.randint(*computed) for _ in range(n))
        load = sum(rng.randint(*loaded) for _ in range(n))
        ttft = 0.020 * n + 300e-6 * comp + 15e-6 * load + rng.gauss(0.0, noise)
        pts.append((float(n), float(comp), float(load), ttft))
    return pts


def test_a_computed_tokens_cost_from_before_offload_prices_what_the_window_cannot() -> None:
    """Every request loads and computes a similar few hundred tokens: alone the window prices
    a loaded token but not a computed one; with the cost measured while offload was off, the
    saving per loaded token is identified, and its error carries both."""
    pts = _intervals(4)
    alone = offload_fit(pts, 8)
    assert alone is not None and alone.computed_stderr is not None
    assert not alone.proves_gain and not alone.computed_before
    assert alone.computed_seconds_per_token - 2 * alone.computed_stderr <= 0  # unidentified
    before = PrefillFit(0.02, 300e-6, 40, 0.9, 5e-6)
    fit = offload_fit(pts, 8, before)
    assert fit is not None and fit.computed_before and fit.proves_gain
    assert fit.computed_seconds_per_token == 300e-6 and fit.computed_stderr == 5e-6
    assert fit.loaded_seconds_per_token == pytest.approx(15e-6, abs=3e-6)
    assert fit.loaded_stderr is not None and fit.saving_stderr is not None
    assert fit.saving_stderr == pytest.approx(math.hypot(5e-6, fit.loaded_stderr))


def test_a_cost_from_before_offload_does_not_override_what_the_window_identifies() -> None:
    """A window whose prefills vary identifies the computed token's cost itself; a cost from
    before that is not significant, or less precise than the window's, is not used."""
    varied = _intervals(5, computed=(100, 3000), loaded=(0, 3000), noise=0.004)
    precise = PrefillFit(0.02, 250e-6, 40, 0.9, 1e-7)
    fit = offload_fit(varied, 8, precise)
    assert fit is not None and not fit.computed_before
    assert fit.computed_seconds_per_token == pytest.approx(300e-6, rel=0.05)
    pts = _intervals(4)
    for before in (PrefillFit(0.02, 300e-6, 40, 0.9, 200e-6), PrefillFit(0.02, 300e-6, 40, 0.9)):
        got = offload_fit(pts, 8, before)
        assert got is not None and not got.computed_before  # not significant: no help


def test_a_computed_tokens_floor_bounds_the_window_fit_from_below() -> None:
    """Where the window puts a computed token below its floor (or cannot price it), the fit
    under that bound has it on the bound, exactly, and fits the rest around it; a window
    that prices it above the floor is left as it is."""
    pts = _intervals(4)
    alone = offload_fit(pts, 8)
    assert alone is not None and alone.computed_seconds_per_token < 200e-6
    fit = offload_fit(pts, 8, None, 200e-6)
    assert fit is not None and fit.computed_floor and not fit.computed_before
    assert fit.computed_seconds_per_token == 200e-6 and fit.computed_stderr == 0.0
    assert fit.loaded_stderr is not None and fit.saving_stderr == fit.loaded_stderr
    assert fit.proves_gain  # 200 us against ~15-30 us per loaded token
    # Above the floor: the window's own fit.
    varied = _intervals(5, computed=(100, 3000), loaded=(0, 3000), noise=0.004)
    own = offload_fit(varied, 8, None, 100e-6)
    assert own is not None and not own.computed_floor
    assert own.computed_seconds_per_token == pytest.approx(300e-6, rel=0.05)
    # A cost remembered from before offload that clears the floor is used as before.
    before = PrefillFit(0.02, 300e-6, 40, 0.9, 5e-6)
    got = offload_fit(pts, 8, before, 200e-6)
    assert got is not None and got.computed_before and got.computed_seconds_per_token == 300e-6


def test_at_its_floor_a_computed_tokens_cost_is_uncertain_upwards_only() -> None:
    """The floor is a lower bound: a fit on it has no error below, but above it the cost is
    as uncertain as the window's own fit left it. The interval's lower ends (what proves a
    saving) stay at the floor; its upper ends (what rules a saving out) reach the window's
    own upper end, in the speedup, the saving and the balance."""
    pts = _intervals(4)
    alone = offload_fit(pts, 8)
    assert alone is not None and alone.computed_stderr is not None
    own_upper = alone.computed_seconds_per_token + 2 * alone.computed_stderr
    floor = (alone.computed_seconds_per_token + own_upper) / 2  # inside the window's interval
    fit = offload_fit(pts, 8, None, floor)
    assert fit is not None and fit.computed_floor and fit.computed_stderr == 0.0
    assert fit.computed_upper_stderr == pytest.approx((own_upper - floor) / 2)
    assert fit.loaded_stderr is not None and fit.saving_stderr == fit.loaded_stderr
    lo, hi = fit.saving_bounds() or (0.0, 0.0)
    s = fit.saving_seconds_per_token
    assert s - lo == pytest.approx(2 * fit.loaded_stderr)  # below: the loaded token only
    assert hi - s == pytest.approx(2 * math.hypot(fit.loaded_stderr, (own_upper - floor) / 2))
    speed = fit.speedup_bounds()
    assert speed is not None
    assert speed[1] == pytest.approx(
        own_upper / (fit.loaded_seconds_per_token - 2 * fit.loaded_stderr)
    )
    sums = {
        "prompt_by_source:external_kv_transfer": 100_000.0,
        "prompt_by_source:local_compute": 50_000.0,
        "store_seconds": 0.5,
        "ttft_seconds": 60.0,
    }
    bal = offload_balance(fit, sums)
    assert bal is not None and bal.upper_stderr_seconds is not None
    assert bal.upper_stderr_seconds > bal.stderr_seconds
    net = bal.net_seconds
    assert bal.share(-2.0) == pytest.approx(
        (net - 2 * bal.stderr_seconds) / (60.0 + net - 2 * bal.stderr_seconds)
    )
    assert bal.share(2.0) == pytest.approx(
        (net + 2 * bal.upper_stderr_seconds) / (60.0 + net + 2 * bal.upper_stderr_seconds)
    )
    # A floor above the window's whole interval: nothing above it is left uncertain.
    high = offload_fit(pts, 8, None, own_upper * 1.5)
    assert high is not None and high.computed_upper_stderr == 0.0
    assert high.saving_bounds() == pytest.approx(
        (
            high.saving_seconds_per_token - 2 * (high.loaded_stderr or 0.0),
            high.saving_seconds_per_token + 2 * (high.loaded_stderr or 0.0),
        )
    )


def test_a_fits_prediction_of_a_total_carries_its_covariance() -> None:
    """The TTFT a window's requests and tokens would cost, from a fit of other intervals: its
    stated standard error covers the truth as often as a standard error should (Monte Carlo
    over noisy windows), and is far below what the two costs' errors give without their
    covariance where requests and tokens move together (the 0.6B engines on the H200: a
    token's cost indistinguishable from zero, the total known to a few per cent)."""
    rng = random.Random(7)
    overhead, per_token, noise = 0.030, 3e-6, 0.02
    requests, tokens = 500.0, 400_000.0  # the window priced: ~800 tokens a request
    truth = overhead * requests + per_token * tokens
    inside = 0
    for _ in range(300):
        pts = []
        for _ in range(60):
            n = rng.randint(2, 8)
            t = sum(rng.randint(600, 1000) for _ in range(n))
            pts.append((float(n), float(t), n * overhead + t * per_token + rng.gauss(0, noise)))
        fit = prefill_fit(pts, 4)
        assert fit is not None
        value, stderr = fit.predict(requests, tokens)
        assert stderr is not None and fit.stderr is not None and fit.overhead_stderr is not None
        inside += abs(value - truth) <= 2 * stderr
        naive = math.hypot(requests * fit.overhead_stderr, tokens * fit.stderr)
        assert stderr < naive / 3
    assert 0.90 <= inside / 300 <= 0.99
    # Without the covariance nothing is claimed.
    bare = PrefillFit(overhead, per_token, 60, 0.9, 1e-6)
    assert bare.predict(requests, tokens) == (pytest.approx(truth), None)


def test_least_squares_gives_coefficients_and_standard_errors() -> None:
    """`least_squares` (bench.burst_steps reads a load job's cost with it): exact data gives
    the coefficients back with no error; noise gives the textbook standard error of a slope;
    collinear columns, or no more points than columns, give none."""
    xs = [float(x) for x in range(12)]
    zs = [float(x * x % 7) for x in range(12)]
    ones = [1.0] * 12
    exact = least_squares(
        [ones, xs, zs], [2.0 + 0.5 * x - 1.5 * z for x, z in zip(xs, zs, strict=True)]
    )
    assert exact is not None
    assert exact[0] == pytest.approx([2.0, 0.5, -1.5], abs=1e-9)
    assert exact[1] == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)
    noisy = [1.0 + 2.0 * x + (0.5 if k % 2 else -0.5) for k, x in enumerate(xs)]
    fit = least_squares([ones, xs], noisy)
    assert fit is not None
    mean = sum(xs) / len(xs)
    resid = [y - fit[0][0] - fit[0][1] * x for x, y in zip(xs, noisy, strict=True)]
    slope_se = (sum(e * e for e in resid) / 10 / sum((x - mean) ** 2 for x in xs)) ** 0.5
    assert fit[1][1] == pytest.approx(slope_se, rel=1e-9)
    assert least_squares([ones, [2.0] * 12], noisy) is None
    assert least_squares([ones[:2], xs[:2]], noisy[:2]) is None
