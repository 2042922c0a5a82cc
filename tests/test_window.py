from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

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


# --- sums() and points() against a direct reading of the intervals -------------------------

EK2 = EngineKey("m", "1")
KEYS = ("a", "b", "c")
QUERIES = [("a",), ("b",), ("c",), ("a", "b"), ("b", "a"), ("a", "c"), ("a", "b", "c")]


def _direct_points(
    w: TargetWindow, ek: EngineKey, keys: tuple[str, ...]
) -> list[tuple[float, ...]]:
    return [
        tuple(iv.deltas[ek][k] for k in keys)
        for iv in w.intervals()
        if ek in iv.deltas and all(k in iv.deltas[ek] for k in keys)
    ]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([1.0, 1.0, 1.0, 3.0, 40.0]),  # seconds since the last scrape
            st.lists(st.sampled_from(KEYS), unique=True),  # counters engine 0 exports now
            st.booleans(),  # engine 1 scraped too
            st.integers(0, 9),  # 0: engine 0's counters go down (a reset)
        ),
        max_size=40,
    ),
    st.sampled_from([5.0, 30.0]),
    st.lists(st.sampled_from(QUERIES), min_size=1, max_size=6),
)
def test_sums_and_points_read_what_the_intervals_hold(steps, window, queries):
    """The running sums and the incremental point series answer exactly what a scan of
    the window's intervals answers (integer deltas, so sums are exact), whatever order of
    calls, key sets appearing and vanishing, resets, pruning and engines leaving."""
    w = TargetWindow(window)
    t = 0.0
    level = 0.0
    for dt, keys, second, reset in steps:
        t += dt
        level = 1.0 if reset == 0 else level + 7.0
        engines = {EK: EngineSample(counters={k: level for k in keys}, gauges={})}
        if second:
            engines[EK2] = EngineSample(counters={"a": t, "b": 2 * t}, gauges={})
        w.add(TargetSample(t, engines, process_start=100.0))
        for keys_q in queries:
            for ek in (EK, EK2):
                expect = _direct_points(w, ek, keys_q)
                assert w.points(ek, keys_q) == expect
                sums = w.sums(ek, keys_q)
                if not expect:
                    assert sums is None
                else:
                    assert sums == tuple(sum(p[i] for p in expect) for i in range(len(keys_q)))
