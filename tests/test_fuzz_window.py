"""Property tests of normalisation and the reset-safe window.

normalise(): any mix of wanted series, labels and values (NaN, Inf, negative, too many
engines) gives only finite values, non-negative counters and at most max_engines engines.

TargetWindow: random counter histories with vLLM restarts. Against a model of what really
happened: windowed sums are exactly the increments of intervals without a reset, totals
are exactly all work done (as Prometheus' increase() would count it) and never decrease,
and the derived hit ratio is the model's ratio, within [0, 1].
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.expfmt import Sample
from exporter.model.derive.engines import DeriveSettings, derive_target
from exporter.vllm_metrics import (
    MAX_SPLIT_VALUES,
    QUANTITIES,
    EngineKey,
    EngineSample,
    TargetSample,
    normalise,
)
from exporter.window import TargetWindow

EXAMPLES = int(os.environ.get("KVOE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

CANDIDATES = [(q, c) for q in QUANTITIES for c in q.candidates]
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(0, 10**9).map(float),
    st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf]),
)


@st.composite
def raw_samples(draw: st.DrawFn) -> list[Sample]:
    out: list[Sample] = []
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for _ in range(draw(st.integers(0, 60))):
        q, cand = draw(st.sampled_from(CANDIDATES))
        labels = dict(cand.match)
        if draw(st.integers(0, 9)):
            labels["model_name"] = draw(st.sampled_from(["m", "n"]))
        if draw(st.integers(0, 9)):
            labels["engine"] = str(draw(st.integers(0, 12)))
        if q.by is not None and draw(st.integers(0, 9)):
            labels[q.by] = draw(st.sampled_from(["local_compute", "local_cache_hit", "x"]))
            if draw(st.booleans()):
                labels[q.by] = f"s{draw(st.integers(0, 40))}"
        key = (cand.name, tuple(sorted(labels.items())))
        if key in seen:
            continue  # the parser rejects duplicate series before normalise sees them
        seen.add(key)
        out.append(Sample(cand.name, key[1], draw(VALUES)))
    return out


@FUZZ
@given(
    raw_samples(),
    st.none() | st.integers(1, 8),
    st.sets(st.builds(EngineKey, st.sampled_from(["m", "n"]), st.integers(0, 12).map(str))),
)
def test_normalise_output_is_finite_bounded_and_counted(samples, max_engines, prefer) -> None:
    ts = normalise(samples, 1.0, max_engines=max_engines, prefer=prefer)
    for es in ts.engines.values():
        assert all(math.isfinite(v) and v >= 0 for v in es.counters.values())
        assert all(math.isfinite(v) for v in es.gauges.values())
        splits: dict[str, int] = {}
        for key in es.counters:
            base = key.split(":", 1)[0]
            splits[base] = splits.get(base, 0) + (":" in key)
        assert all(n <= MAX_SPLIT_VALUES for n in splits.values())
    assert ts.dropped_series >= 0 and ts.dropped_engines >= 0
    present = {
        EngineKey(dict(s.labels)["model_name"], dict(s.labels)["engine"])
        for s in samples
        if "model_name" in dict(s.labels) and "engine" in dict(s.labels)
    }
    assert set(ts.engines) <= present
    if max_engines is not None:
        assert len(ts.engines) <= max_engines
        if len(present) > max_engines:
            assert ts.dropped_engines == len(present) - max_engines
            assert ts.dropped_series > 0
            # Engines already tracked are kept first.
            if len(present & set(prefer)) >= max_engines:
                assert set(ts.engines) <= set(prefer)
    if max_engines is None or len(present) <= max_engines:
        assert ts.dropped_engines == 0


EK = EngineKey("m", "0")


@dataclass
class Step:
    dq: int  # queries done since the last scrape
    dh: int  # hits (<= dq)
    restart: bool  # vLLM restarted before this scrape (the increments came after it)


STEPS = st.lists(
    st.builds(
        lambda dq, frac, restart: Step(dq, int(dq * frac), restart),
        st.integers(0, 5000),
        st.floats(0, 1),
        st.integers(0, 6).map(lambda r: r == 0),
    ),
    min_size=1,
    max_size=40,
)


def _sample(ts: float, queries: int, hits: int, start: float | None) -> TargetSample:
    es = EngineSample(counters={"prefix_queries": queries, "prefix_hits": hits}, gauges={})
    return TargetSample(ts=ts, engines={EK: es}, process_start=start)


@FUZZ
@given(
    st.integers(0, 10**6),
    st.floats(0, 1),
    STEPS,
    st.sampled_from([5.0, 12.0, 1e9]),
    st.booleans(),
)
def test_window_matches_a_model_of_the_work_done(q0, f0, steps, window, with_start) -> None:
    """Scrapes 1 s apart; a restart resets both counters to 0 before the step's work."""
    h0 = int(q0 * f0)
    win = TargetWindow(window)
    start = 1000.0
    queries, hits = q0, h0
    win.add(_sample(0.0, queries, hits, start if with_start else None))
    true_q, true_h = q0, h0  # all work ever done: what a reset-safe total must show
    intervals: list[tuple[float, int, int] | None] = []  # (t0, dq, dh); None = reset
    last_totals = (q0, h0)
    for i, step in enumerate(steps, start=1):
        restart, dq, dh = step.restart, step.dq, step.dh
        if restart and not with_start:
            # Without a process start time a restart is visible only as a decrease.
            if queries == 0:
                restart = False
            else:
                dq = min(dq, queries - 1)
                dh = min(dh, dq)
        if restart:
            start += 10.0
            queries, hits = dq, dh  # counters restart from 0, then this step's work
        else:
            queries, hits = queries + dq, hits + dh
        true_q, true_h = true_q + dq, true_h + dh
        resets = win.add(_sample(float(i), queries, hits, start if with_start else None))
        assert bool(resets) == restart
        intervals.append(None if restart else (float(i - 1), dq, dh))
        totals = win.totals[EK]
        # Totals count every unit of work exactly once, and so never decrease.
        assert totals == {"prefix_queries": true_q, "prefix_hits": true_h}
        assert totals["prefix_queries"] >= last_totals[0]
        assert totals["prefix_hits"] >= last_totals[1]
        last_totals = (totals["prefix_queries"], totals["prefix_hits"])
        # Windowed sums: exactly the intervals without a reset inside the window.
        horizon = i - window
        kept = [iv for iv in intervals if iv is not None and iv[0] >= horizon]
        sums = win.sums(EK, ("prefix_hits", "prefix_queries"))
        if not kept:
            assert sums is None
        else:
            assert sums == (sum(iv[2] for iv in kept), sum(iv[1] for iv in kept))
        (d,) = derive_target(win, float(i), DeriveSettings(stale_after=2.5))
        ratio = d.gpu_prefix_hit_ratio
        if sums is None or sums[1] == 0:
            assert ratio is None
        else:
            assert ratio is not None and 0.0 <= ratio <= 1.0
            assert math.isclose(ratio, sums[0] / sums[1])
