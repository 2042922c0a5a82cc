from __future__ import annotations

from exporter.vllm_metrics import EngineKey, EngineSample, TargetSample
from exporter.window import TargetWindow

EK = EngineKey("m", "0")


def ts(t: float, start: float | None = 100.0, **counters: float) -> TargetSample:
    return TargetSample(t, {EK: EngineSample(counters=counters, gauges={})}, process_start=start)


def test_deltas_and_totals_follow_counters():
    w = TargetWindow(60)
    w.add(ts(0, q=10, h=5))
    w.add(ts(1, q=20, h=8))
    w.add(ts(2, q=40, h=8))
    assert w.sums(EK, ("h", "q")) == (3.0, 30.0)
    assert w.totals[EK] == {"q": 40.0, "h": 8.0}


def test_decrease_is_a_reset_left_out_of_the_window_but_totals_stay_monotonic():
    w = TargetWindow(60)
    w.add(ts(0, q=100, h=50))
    w.add(ts(1, q=120, h=60))
    assert w.add(ts(2, q=5, h=1)) == [EK]
    w.add(ts(3, q=15, h=2))
    assert w.sums(EK, ("h", "q")) == (10.0 + 1.0, 20.0 + 10.0)
    assert w.totals[EK] == {"q": 135.0, "h": 62.0}
    assert w.resets == 1


def test_process_restart_without_decrease_is_still_a_reset():
    # A restarted vLLM can overtake its old counter value before the next scrape.
    w = TargetWindow(60)
    w.add(ts(0, start=100, q=10))
    assert w.add(ts(1, start=200, q=500)) == [EK]
    assert w.sums(EK, ("q",)) is None
    assert w.totals[EK]["q"] == 510.0


def test_lazily_created_series_count_from_zero():
    w = TargetWindow(60)
    w.add(ts(0, q=10))
    w.add(ts(1, q=10, load=4096))
    assert w.sums(EK, ("load",)) == (4096.0,)
    assert w.totals[EK]["load"] == 4096.0


def test_window_prunes_old_intervals_and_vanished_engines():
    w = TargetWindow(10)
    for t in range(0, 30, 5):
        w.add(ts(t, q=t))
    assert [(i.t0, i.t1) for i in w.intervals()] == [(15, 20), (20, 25)]
    assert w.covered_seconds() == 10
    w.add(TargetSample(100, {}, process_start=100.0))
    assert w.engines() == []
    assert EK not in w.totals


def test_missing_quantity_is_unknown_not_zero():
    w = TargetWindow(60)
    w.add(ts(0, q=1))
    w.add(ts(1, q=2))
    assert w.sums(EK, ("q", "h")) is None
