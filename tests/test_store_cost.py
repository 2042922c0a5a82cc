"""bench/store_cost.py: a store's cost to computing requests against its copy time, measured
on pairs of the real-GPU matrix (docs/advisor.md, "Its limit")."""

from __future__ import annotations

from bench.store_cost import MATRIX, measure, rows, table


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


def test_every_offload_run_is_measured_against_its_base() -> None:
    rs = rows()
    assert len(rs) >= 20
    assert all(r.base != r.run and "-cpu" in r.run for r in rs)
    lines = table(rs).splitlines()
    assert len(lines) == len(rs) + 2
    assert all(line.count("|") == 9 for line in lines)
