"""The window's balance of offload: loaded tokens' measured saving minus the stores."""

from __future__ import annotations

import random

import pytest

from exporter.model.derive.balance import (
    DELIVERED_KEYS,
    SAME_LOAD,
    OffloadBalance,
    delivered_saving,
    offload_balance,
    request_cost,
)
from exporter.model.derive.fits import (
    OffloadFit,
    PrefillFit,
    offload_fit,
    prefill_fit,
    total_scale,
)
from tests.helpers import balance_sums

# 40 us a computed token, 10 us a loaded one (saving 30 +- 2 us), valid.
FIT = OffloadFit(0.005, 40e-6, 10e-6, 100, 0.9, 2e-6, 1e-6, 1e-6)
SUMS = balance_sums(loaded=100_000.0, computed=400_000.0, store=1.0, ttft=20.0)


def test_saving_minus_the_stores_of_every_loaded_and_computed_token() -> None:
    b = offload_balance(FIT, SUMS)
    assert b is not None
    assert b.saved_seconds == pytest.approx(3.0)  # 30 us x 100k loaded
    # 1 s of stores over 400k computed tokens, charged to 500k tokens.
    assert b.store_seconds == pytest.approx(1.25)
    assert b.net_seconds == pytest.approx(1.75)
    assert b.stderr_seconds == pytest.approx(0.2)
    # Against the TTFT without offload: 20 s with it + 1.75 s saved.
    assert b.share() == pytest.approx(1.75 / 21.75)
    assert b.share(2.0) == pytest.approx(2.15 / 22.15)
    assert b.share(-2.0) == pytest.approx(1.35 / 21.35)


def test_a_floor_has_no_store_in_it_so_loaded_tokens_carry_none() -> None:
    # Stores of 2.5 us per computed token. A floor of 25 us saves 15 us a loaded token, no
    # store in it; less than the fit's 30 us less the 2.5 us store it never had: the fit
    # decides, as without a floor.
    low = offload_balance(FIT, SUMS, floor=25e-6)
    plain = offload_balance(FIT, SUMS)
    assert low is not None and plain is not None
    assert low.net_seconds == pytest.approx(1.75)
    # At its floor (42 us) a computed token saves 32 us a loaded token, against 27.5 us by
    # the fit less the store it never had: the floor decides, and only the 400k computed
    # tokens pay stores (1 s), not the loaded ones too (0.25 s more).
    at_floor = offload_balance(FIT, SUMS, floor=42e-6)
    assert at_floor is not None
    assert at_floor.priced() == pytest.approx((3.2, 1.0))
    assert at_floor.net_seconds == pytest.approx(2.2)
    # The floor is exact: its interval is the loaded token's alone (1 us).
    assert at_floor.net(-2.0) == pytest.approx(2.0)
    assert at_floor.net_stderr_seconds == pytest.approx(0.1)
    # Dearer stores keep them on the computed tokens: 32 us x 100k - 2 x 1 s.
    assert at_floor.net(0.0, 2.0) == pytest.approx(1.2)
    # Without the floor the same stores at 2x: 30 us x 100k - 2 x 1.25 s.
    assert plain.net(0.0, 2.0) == pytest.approx(0.5)
    # The what-if at another size: 300k of the same 500k tokens loaded.
    assert at_floor.net(tokens=(300_000.0, 500_000.0)) == pytest.approx(9.6 - 0.5)


def test_a_balance_that_costs_has_a_negative_share() -> None:
    b = offload_balance(FIT, {**SUMS, "store_seconds": 4.0})
    assert b is not None and b.net_seconds == pytest.approx(-2.0)
    share = b.share()
    assert share is not None and share < 0


def test_no_balance_without_a_valid_fit_its_error_or_the_sums() -> None:
    assert offload_balance(None, SUMS) is None
    assert offload_balance(FIT, None) is None
    no_error = OffloadFit(0.005, 40e-6, 10e-6, 100, 0.9)
    assert offload_balance(no_error, SUMS) is None
    invalid = OffloadFit(0.005, -1e-6, 10e-6, 100, 0.9, 2e-6, 1e-6, 1e-6)
    assert offload_balance(invalid, SUMS) is None
    for key in ("prompt_by_source:external_kv_transfer", "prompt_by_source:local_compute"):
        assert offload_balance(FIT, {**SUMS, key: 0.0}) is None
    assert offload_balance(FIT, {**SUMS, "ttft_seconds": 0.0}) is None


def test_share_is_undefined_when_the_time_without_offload_would_be_negative() -> None:
    b = OffloadBalance(1.0, 1.0, 0.0, 30.0, 0.0, 10.0)
    assert b.share() is None


# Before offload: 20 ms a request, 10 us a token, their errors anti-correlated.
BEFORE = PrefillFit(0.020, 10e-6, 60, 0.9, 1e-6, 2e-3, -1.5e-9)
RATE = 4.0  # requests per second when BEFORE was measured


def delivered_sums(
    requests: float, loaded: float, computed: float, ttft: float
) -> dict[str, float]:
    return dict(zip(DELIVERED_KEYS, (requests, loaded, computed, ttft), strict=True))


def test_what_enabling_delivered_prices_the_windows_traffic_at_the_cost_before() -> None:
    """480 requests in 120 s (the rate before), 100k tokens loaded and 300k computed: before
    offload they would have cost 480 x 20 ms + 400k x 10 us = 13.6 s; they took 10 s."""
    d = delivered_saving(BEFORE, RATE, 1.0, delivered_sums(480, 100_000, 300_000, 10.0), 120.0)
    assert d is not None
    assert d.without_seconds == pytest.approx(13.6)
    assert d.net_seconds == pytest.approx(3.6)
    var = (480 * 2e-3) ** 2 + (400_000 * 1e-6) ** 2 + 2 * 480 * 400_000 * -1.5e-9
    assert d.stderr_seconds == pytest.approx(var**0.5)
    assert d.share() == pytest.approx(3.6 / 13.6)
    hi, lo = d.share(2.0), d.share(-2.0)
    assert hi is not None and lo is not None and lo < 3.6 / 13.6 < hi
    # Slower than before: a negative share.
    slower = delivered_saving(BEFORE, RATE, 1.0, delivered_sums(480, 100_000, 300_000, 20.0), 120.0)
    assert slower is not None and (slower.share() or 0.0) < 0


def test_nothing_is_delivered_without_a_comparable_before() -> None:
    sums = delivered_sums(480, 100_000, 300_000, 10.0)
    assert delivered_saving(None, RATE, 1.0, sums, 120.0) is None
    assert delivered_saving(BEFORE, None, 1.0, sums, 120.0) is None
    assert delivered_saving(BEFORE, RATE, 1.0, None, 120.0) is None
    no_covariance = PrefillFit(0.020, 10e-6, 60, 0.9, 1e-6)
    assert delivered_saving(no_covariance, RATE, 1.0, sums, 120.0) is None
    assert delivered_saving(BEFORE, RATE, 1.0, delivered_sums(0, 0, 0, 0.0), 120.0) is None
    # A busier or quieter engine queues differently: the fit before does not price it.
    for factor in (1 + SAME_LOAD + 0.05, 1 / (1 + SAME_LOAD + 0.05)):
        assert delivered_saving(BEFORE, RATE * factor, 1.0, sums, 120.0) is None
    assert delivered_saving(BEFORE, RATE * (1 + SAME_LOAD - 0.05), 1.0, sums, 120.0) is not None


def test_the_fits_bias_on_its_own_window_is_taken_out() -> None:
    """A fit that predicted 1.25x the summed TTFT of the window it was measured on (scale
    0.8) prices the window with offload 0.8 times as high, and its error with it: the 32B
    runs of the H200 matrix, where the uncorrected fit promised savings of 3-7 % on
    traffic that loaded nothing."""
    sums = delivered_sums(480, 100_000, 300_000, 10.0)
    plain = delivered_saving(BEFORE, RATE, 1.0, sums, 120.0)
    scaled = delivered_saving(BEFORE, RATE, 0.8, sums, 120.0)
    assert plain is not None and scaled is not None
    assert scaled.without_seconds == pytest.approx(0.8 * 13.6)
    assert scaled.stderr_seconds == pytest.approx(0.8 * plain.stderr_seconds)
    assert scaled.share() == pytest.approx((10.88 - 10.0) / 10.88)
    assert delivered_saving(BEFORE, RATE, 0.0, sums, 120.0) is None


def test_a_fits_scale_is_its_windows_total_over_its_prediction() -> None:
    # 480 requests and 400k tokens: 13.6 s predicted.
    assert total_scale(BEFORE, (480.0, 400_000.0, 10.88)) == pytest.approx(0.8)
    assert total_scale(BEFORE, None) is None
    assert total_scale(BEFORE, (480.0, 400_000.0, 0.0)) is None
    assert total_scale(PrefillFit(0.0, 0.0, 10, 0.0), (480.0, 400_000.0, 1.0)) is None


def test_what_the_tier_adds_to_every_request_is_the_rise_of_the_fits_cost_per_request() -> None:
    """Before: 30 ms a request and 200 us a computed token. With the tier: 50 ms a request,
    the same computed token, 20 us a loaded one. The offload fit's own per-request cost,
    less the one before, is the 20 ms the tier adds; a fit given its computed token's cost
    has no error of its own for it, so there is nothing to state."""
    rng = random.Random(3)
    before_pts, on_pts = [], []
    for _ in range(40):
        n = rng.randint(5, 15)
        computed = n * rng.uniform(600, 1200)
        loaded = n * rng.uniform(0, 800)
        noise = rng.gauss(0, 0.01)
        before_pts.append((n, computed, 0.030 * n + 200e-6 * computed + noise))
        on_pts.append((n, computed, loaded, 0.050 * n + 200e-6 * computed + 20e-6 * loaded + noise))
    before = prefill_fit(before_pts, 10)
    on = offload_fit(on_pts, 10)
    assert before is not None and on is not None
    got = request_cost(on, before)
    assert got is not None
    cost, stderr = got
    assert 0 < stderr < 0.005
    assert abs(cost - 0.020) < 2 * stderr
    assert request_cost(None, before) is None and request_cost(on, None) is None
    given = OffloadFit(0.05, 200e-6, 20e-6, 40, 0.9, 1e-6, 1e-6, 1e-6, computed_before=True)
    assert request_cost(given, before) is None
