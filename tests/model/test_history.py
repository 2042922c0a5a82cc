"""exporter.model.history: the status page's per-cycle ring buffer."""

from __future__ import annotations

from exporter.model.advisor.rules import evaluate
from exporter.model.advisor.types import Action, Advice, MemoryState, WhatIfState
from exporter.model.history import EnginePoint, EngineRef, History, cycle_points, engine_point
from tests.model.advisor.common import CURVE, EK, base, inp

REF = EngineRef("vllm:8000", EK.model_name, EK.engine)


def point(t: float, action: str = "keep", **kw: float | None) -> EnginePoint:
    return EnginePoint(t=t, action=action, **kw)  # type: ignore[arg-type]


def test_record_keeps_only_the_window() -> None:
    h = History(window=10.0)
    for t in range(0, 31, 5):
        h.record(float(t), {REF: point(float(t), gpu_prefix_hit_ratio=t / 100)})
    assert [p.t for p in h.points(REF)] == [20.0, 25.0, 30.0]
    assert h.series(REF, "gpu_prefix_hit_ratio") == ((20.0, 0.2), (25.0, 0.25), (30.0, 0.3))


def test_bounded_by_max_points_even_with_a_tiny_interval() -> None:
    h = History(window=1e9, max_points=4)
    for t in range(10):
        h.record(float(t), {REF: point(float(t))})
    assert [p.t for p in h.points(REF)] == [6.0, 7.0, 8.0, 9.0]


def test_since_moves_only_when_the_action_changes() -> None:
    h = History(window=100.0)
    h.record(1.0, {REF: point(1.0, "insufficient_data")})
    h.record(2.0, {REF: point(2.0, "enable_offload")})
    h.record(3.0, {REF: point(3.0, "enable_offload")})
    assert h.since(REF) == 2.0
    h.record(4.0, {REF: point(4.0, "no_action")})
    assert h.since(REF) == 4.0


def test_since_outlives_the_points_of_a_long_standing_action() -> None:
    h = History(window=10.0)
    for t in range(0, 60, 5):
        h.record(float(t), {REF: point(float(t), "keep")})
    assert h.since(REF) == 0.0
    assert h.points(REF)[0].t == 45.0


def test_engine_gone_for_a_whole_window_is_forgotten() -> None:
    other = EngineRef("vllm:8000", EK.model_name, "1")
    h = History(window=10.0)
    h.record(0.0, {REF: point(0.0), other: point(0.0)})
    h.record(5.0, {REF: point(5.0)})
    assert h.engines() == [REF, other]
    h.record(11.0, {REF: point(11.0)})
    assert h.engines() == [REF]
    assert h.since(other) is None and h.points(other) == ()


def test_series_leaves_out_cycles_without_a_value() -> None:
    h = History(window=100.0)
    h.record(1.0, {REF: point(1.0, pcie_utilization=None)})
    h.record(2.0, {REF: point(2.0, pcie_utilization=0.5)})
    assert h.series(REF, "pcie_utilization") == ((2.0, 0.5),)


def test_engine_point_takes_the_advisors_values() -> None:
    w = WhatIfState(CURVE, recomputed_after_eviction_tokens=100_000.0)
    i = inp(
        base(),
        whatif=w,
        memory=MemoryState(limit_bytes=8e9, usage_bytes=2e9, pool_bytes=1e9),
        pcie_utilization=0.25,
    )
    a = evaluate(i)
    p = engine_point(7.0, i, a)
    assert p.action == a.action == Action.ENABLE_OFFLOAD
    assert p.recompute_after_eviction_share == 100_000.0 / 400_000.0
    assert (p.gpu_prefix_hit_ratio, p.offload_hit_ratio) == (0.2, None)
    assert (p.recompute_tokens_per_second, p.reload_tokens_per_second) == (23_000.0, 110_000.0)
    assert p.reload_estimated is True
    assert (p.pool_bytes, p.memory_usage_bytes, p.memory_limit_bytes) == (1e9, 2e9, 8e9)
    assert p.pcie_utilization == 0.25


def test_engine_point_without_kv_events_has_no_recompute_share() -> None:
    i = inp(base())
    p = engine_point(1.0, i, evaluate(i))
    assert p.recompute_after_eviction_share is None
    assert p.pool_bytes is None


def test_cycle_points_pairs_each_advice_with_its_input() -> None:
    i = inp(base())
    adv = Advice(Action.NO_ACTION, "no_kv_pressure", "x")
    pts = cycle_points(3.0, {"vllm:8000": [(EK, adv)]}, {("vllm:8000", EK): i})
    assert list(pts) == [REF]
    assert pts[REF].action == "no_action" and pts[REF].t == 3.0
    # Advice without its input (not evaluated this cycle) gives no point.
    assert cycle_points(3.0, {"vllm:8000": [(EK, adv)]}, {}) == {}
