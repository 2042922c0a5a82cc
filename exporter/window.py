"""Sliding window of scrape-to-scrape counter deltas for one vLLM target.

Pure state, no I/O: fed normalised samples, it keeps per-interval deltas for the
last `window` seconds and reset-safe running totals, so derivations can be tested
on recorded scrapes.

Reset rules (a vLLM restart): the process start time changed, or any counter of an
engine went down. The interval holding a reset is left out of every windowed value
of that engine (numerator and denominator together, so ratios stay in 0..1), and
the running totals add the post-restart value, as Prometheus' increase() would.
A counter that first appears for an engine already seen starts from 0: vLLM
creates its offload series lazily on first use, and their first value is real work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import islice

from exporter.vllm_metrics import EngineKey, TargetSample


@dataclass(frozen=True, slots=True)
class Interval:
    t0: float
    t1: float
    deltas: Mapping[EngineKey, Mapping[str, float]]


# Bound on the per-(engine, keys) point series kept by TargetWindow.points: the derivations
# ask for a fixed handful per engine; anything beyond this is a caller asking at random.
_POINT_SERIES_MAX = 1024


class TargetWindow:
    def __init__(self, window_seconds: float) -> None:
        if window_seconds <= 0:
            raise ValueError("window must be positive")
        self.window_seconds = window_seconds
        self.latest: TargetSample | None = None
        self.totals: dict[EngineKey, dict[str, float]] = {}
        self.last_seen: dict[EngineKey, float] = {}
        self.resets = 0
        self._intervals: deque[Interval] = deque()
        self._last_raw: dict[EngineKey, dict[str, float]] = {}
        # Running sums and presence counts of each engine's deltas over the window, so the
        # common query (every key present in every interval) costs O(keys), not O(window).
        self._sum: dict[EngineKey, dict[str, float]] = {}
        self._present: dict[EngineKey, dict[str, int]] = {}
        # Intervals ever appended: the one at self._intervals[i] is number
        # self._appended - len(self._intervals) + i. Per (engine, keys), the points already
        # extracted, tagged with their interval's number, and how far extraction has got;
        # so points() touches each interval once, not the whole window on every call.
        self._appended = 0
        self._points: dict[
            tuple[EngineKey, tuple[str, ...]],
            tuple[list[int], deque[tuple[int, tuple[float, ...]]]],
        ] = {}

    def add(self, sample: TargetSample) -> list[EngineKey]:
        """Add a scrape; return the engines on which a counter reset was detected."""
        prev = self.latest
        reset_engines: list[EngineKey] = []
        deltas: dict[EngineKey, dict[str, float]] = {}
        restarted = (
            prev is not None
            and prev.process_start is not None
            and sample.process_start is not None
            and sample.process_start != prev.process_start
        )
        for ek, es in sample.engines.items():
            self.last_seen[ek] = sample.ts
            totals = self.totals.setdefault(ek, {})
            raw = self._last_raw.get(ek)
            if raw is None:
                # First sighting: totals start at vLLM's own values, no delta yet.
                self._last_raw[ek] = dict(es.counters)
                for key, value in es.counters.items():
                    totals.setdefault(key, value)
                continue
            if restarted or any(v < raw[k] for k, v in es.counters.items() if k in raw):
                reset_engines.append(ek)
                for key, value in es.counters.items():
                    totals[key] = totals.get(key, 0.0) + value
                self._last_raw[ek] = dict(es.counters)
                continue
            d = {key: value - raw.get(key, 0.0) for key, value in es.counters.items()}
            for key, delta in d.items():
                totals[key] = totals.get(key, 0.0) + delta
            raw.update(es.counters)
            deltas[ek] = d
        if reset_engines:
            self.resets += 1
        if prev is not None:
            self._intervals.append(Interval(prev.ts, sample.ts, deltas))
            self._appended += 1
            self._account(deltas, +1)
        self.latest = sample
        self.prune(sample.ts)
        return reset_engines

    def prune(self, now: float) -> None:
        horizon = now - self.window_seconds
        while self._intervals and self._intervals[0].t0 < horizon:
            self._account(self._intervals.popleft().deltas, -1)
        gone = [ek for ek, t in self.last_seen.items() if t < horizon]
        for ek in gone:
            del self.last_seen[ek]
            self.totals.pop(ek, None)
            self._last_raw.pop(ek, None)
        if gone and self._points:
            for key in [key for key in self._points if key[0] in gone]:
                del self._points[key]

    def _account(self, deltas: Mapping[EngineKey, Mapping[str, float]], sign: int) -> None:
        for ek, d in deltas.items():
            sums = self._sum.setdefault(ek, {})
            present = self._present.setdefault(ek, {})
            for key, value in d.items():
                sums[key] = sums.get(key, 0.0) + sign * value
                count = present.get(key, 0) + sign
                if count:
                    present[key] = count
                else:
                    present.pop(key, None)
                    sums.pop(key, None)

    def intervals(self) -> tuple[Interval, ...]:
        return tuple(self._intervals)

    def covered_seconds(self) -> float:
        return sum(i.t1 - i.t0 for i in self._intervals)

    def engines(self) -> list[EngineKey]:
        return sorted(self.last_seen)

    def sums(self, ek: EngineKey, keys: Iterable[str]) -> tuple[float, ...] | None:
        """Sum each key's deltas over the intervals where all keys were present.

        None when no interval had them all: the quantity is unknown, not zero.
        """
        keys = tuple(keys)
        present = self._present.get(ek, {})
        n = len(self._intervals)
        if not keys:
            # (): every interval has them all; KeyError for an unknown engine, as ever.
            return () if n and self._sum[ek] is not None else None
        # How many intervals of the window hold each key: all of them, the running sums
        # answer; none for some key, no interval has them all (the derivations ask for many
        # quantities an engine does not export, and scanning the whole window for each was
        # most of a cycle's derivation time once the window is full).
        fewest = min([present.get(k, 0) for k in keys])
        if fewest == 0:
            return None
        if fewest == n:
            sums = self._sum[ek]
            return tuple([sums[k] for k in keys])
        acc = [0.0] * len(keys)
        found = False
        for iv in self._intervals:
            d = iv.deltas.get(ek)
            if d is None or any(k not in d for k in keys):
                continue
            found = True
            for i, k in enumerate(keys):
                acc[i] += d[k]
        return tuple(acc) if found else None

    def points(self, ek: EngineKey, keys: Iterable[str]) -> list[tuple[float, ...]]:
        """Per-interval deltas of the given keys (intervals where all are present)."""
        keys = tuple(keys)
        first = self._appended - len(self._intervals)
        entry = self._points.get((ek, keys))
        if entry is None:
            if len(self._points) >= _POINT_SERIES_MAX:
                self._points.clear()
            entry = self._points[(ek, keys)] = ([first], deque())
        done, points = entry
        while points and points[0][0] < first:
            points.popleft()
        start = max(done[0], first)
        if start < self._appended:
            for seq, iv in enumerate(islice(self._intervals, start - first, None), start):
                d = iv.deltas.get(ek)
                if d is not None and all(k in d for k in keys):
                    points.append((seq, tuple([d[k] for k in keys])))
            done[0] = self._appended
        return [p for _, p in points]
