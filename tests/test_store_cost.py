"""bench/store_cost.py: a store's cost to computing requests against its copy time, measured
on pairs of the real-GPU matrix (docs/advisor.md, "Its limit")."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.store_cost import (
    COMPUTED,
    FACTORS,
    MATRIX,
    Judged,
    Row,
    _correlation,
    decide,
    intervals,
    judged,
    measure,
    rows,
    score,
    sweep,
    table,
)


def test_on_long_prefills_a_store_costs_more_than_its_copy() -> None:
    """The finding the balance's limit rests on: on 10 k-token prefills a computed token's
    TTFT cost rises with offload on by more than the store copy time per computed token."""
    for run, base in (
        ("qwen3-0.6b-long-context-cpu64k", "qwen3-0.6b-long-context-none-ctl"),
        ("qwen3-8b-long-context-cpu64k", "qwen3-8b-long-context-none"),
    ):
        r = measure(MATRIX / run, MATRIX / base)
        assert r.copy_us is not None and r.copy_us > 0, run
        assert r.ratio is not None and r.ratio > 1.2, (run, r)


def test_a_rise_within_its_error_gives_no_ratio() -> None:
    """0.6B concurrent: a computed token's cost without offload is 3 +- 25 us, so no ratio is
    stated, however the point estimates fall."""
    r = measure(MATRIX / "qwen3-0.6b-concurrent-cpu64k", MATRIX / "qwen3-0.6b-concurrent-none")
    assert r.computed_us is not None and r.ratio is None


@pytest.fixture(scope="module")
def measured() -> list[Row]:
    return rows()


def test_every_offload_run_is_measured_against_its_base(measured: list[Row]) -> None:
    rs = measured
    assert len(rs) >= 20
    assert all(r.base != r.run and "-cpu" in r.run for r in rs)
    lines = table(rs).splitlines()
    assert len(lines) == len(rs) + 2
    assert all(line.count("|") == 11 for line in lines)


def test_with_offload_on_nearly_every_computed_token_is_stored_in_its_interval(
    measured: list[Row],
) -> None:
    """Why the run alone cannot price a store: stored and computed tokens move together, so
    no interval computes without storing (the last two columns of the table). Where a
    burst's steps are long (14B's bursts, batch 29: 120-190 ms a step, a burst every 2.8 s)
    a step's stores land in the next 1 s interval more often, and the two move together
    over a burst's period (3 intervals) instead."""
    rs = measured
    assert all(r.stored_share is not None and r.stored_share > 0.8 for r in rs)
    for r in rs:
        assert r.stored_correlation is not None, r.run
        if r.stored_correlation <= 0.8:
            summed = _summed_correlation(MATRIX / r.run, 3)
            assert summed is not None and summed > 0.9, r.run


def _summed_correlation(run: Path, k: int) -> float | None:
    """The correlation of computed and stored tokens over sums of k scrape intervals."""
    ds = intervals(run)
    xs, ys = [d[COMPUTED] for d in ds], [d["store_bytes"] for d in ds]
    n = len(xs) - len(xs) % k
    return _correlation(
        [sum(xs[i : i + k]) for i in range(0, n, k)], [sum(ys[i : i + k]) for i in range(0, n, k)]
    )


def test_no_fixed_store_factor_is_learned_across_shapes() -> None:
    """The sweep's finding (docs/advisor.md, "Its limit"): at the copy time alone the balance
    keeps where a paired run measured a cost, some larger factor turns off offload where it
    pays, and a shape held out meets harm at the factor the others choose."""
    js = judged()
    assert len(js) >= 20 and {j.truth for j in js} == {"pays", "neutral", "costs"}
    at = {k: score(js, k) for k in FACTORS}
    assert any(h.endswith(": pays") for h in at[1.0]["harmful"])
    assert any(h.endswith(": costs") for k in FACTORS for h in at[k]["harmful"])
    sw = sweep(js)
    assert any(h["harmful"] for h in sw["leave_one_shape_out"])


def test_a_decision_is_harmful_only_against_the_opposite_truth() -> None:
    """score's bookkeeping, on balances built by hand: a neutral truth agrees with either
    decision, a wait is neither agreeing nor harmful."""
    from exporter.model.derive.balance import OffloadBalance

    # saves 10 s of 100 s +- 1 s: pays at any factor up to 5 (stores cost 1 s)
    saving = OffloadBalance(1e5, 1e5, 11.0, 1.0, 0.5, 90.0)
    # costs 10 s: the stores (12 s) outweigh the loads (2 s)
    cost = OffloadBalance(1e5, 1e5, 2.0, 12.0, 0.5, 110.0)
    unsure = OffloadBalance(1e5, 1e5, 5.0, 1.0, 10.0, 100.0)
    assert [decide(b, 1.0) for b in (saving, cost, unsure, None)] == [
        "pays",
        "costs",
        "wait",
        "wait",
    ]
    js = [
        Judged("a", "s", "costs", saving),
        Judged("b", "s", "pays", cost),
        Judged("c", "s", "neutral", saving),
        Judged("d", "s", "pays", unsure),
    ]
    got = score(js, 1.0)
    assert got["harmful"] == ["a: pays", "b: costs"] and got["agree"] == 1 and got["wait"] == 1


def test_a_loads_steps_are_charged_only_where_the_engine_decoded_enough_to_time_a_step() -> None:
    """balance.decode_step_seconds and the load-step bound, by hand: two steps per load job
    at the mean inter-token latency, none without gaps enough to time a step; the bound only
    lowers the share it is asked for, never the balance's estimate."""
    from exporter.model.derive import balance as b
    from exporter.model.derive.fits import OffloadFit
    from tests.helpers import balance_sums

    assert b.decode_step_seconds(None) is None
    assert b.decode_step_seconds({"itl_seconds": 1.0, "itl_gaps": b.MIN_DECODE_GAPS - 1}) is None
    assert b.decode_step_seconds({"itl_seconds": 0.0, "itl_gaps": 1000.0}) is None
    step = b.decode_step_seconds({"itl_seconds": 20.0, "itl_gaps": 1000.0})
    assert step == pytest.approx(0.02)
    # a loaded token 50 us cheaper than a computed one, +- 5 us
    fit = OffloadFit(0.01, 60e-6, 10e-6, 40, 0.9, 5e-6, 2e-6, 2e-6)
    sums = balance_sums(1e5, 1e5, 0.0, 95.0)
    plain = b.offload_balance(fit, sums)
    steps = {"load_ops": 100.0, "itl_seconds": 20.0, "itl_gaps": 1000.0}
    charged = b.offload_balance(fit, sums, steps=sums | steps)
    assert plain is not None and charged is not None
    assert plain.load_step_seconds == 0.0
    assert charged.load_step_seconds == pytest.approx(b.LOAD_STEPS * 100 * 0.02)
    assert charged.share() == plain.share() and charged.net_seconds == plain.net_seconds
    # 5.0 s saved, 1.0 s below at -2 sigma, 4 s of steps: (4.0 - 4.0) / (95 + 0)
    assert charged.share(-2.0) == pytest.approx(4.0 / 99.0)
    assert charged.share(-2.0, load_steps=True) == pytest.approx(0.0, abs=1e-12)
    assert plain.share(-2.0, load_steps=True) == plain.share(-2.0)
    # too few gaps: no step time, no charge
    few = b.offload_balance(fit, sums, steps=sums | steps | {"itl_gaps": 10.0})
    assert few is not None and few.load_step_seconds == 0.0
