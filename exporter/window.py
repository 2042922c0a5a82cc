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

from exporter.vllm_metrics import EngineKey, TargetSample


@dataclass(frozen=True, slots=True)
class Interval:
    t0: float
    t1: float
    deltas: Mapping[EngineKey, Mapping[str, float]]


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
            self._account(deltas, +1)
        self.latest = sample
        self.prune(sample.ts)
        return reset_engines

    def prune(self, now: float) -> None:
        horizon = now - self.window_seconds
        while self._intervals and self._intervals[0].t0 < horizon:
            self._account(self._intervals.popleft().deltas, -1)
        for ek in [ek for ek, t in self.last_seen.items() if t < horizon]:
            del self.last_seen[ek]
            self.totals.pop(ek, None)
            self._last_raw.pop(ek, None)

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
        if n and all(present.get(k) == n for k in keys):
            sums = self._sum[ek]
            return tuple(sums[k] for k in keys)
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
        out = []
        for iv in self._intervals:
            d = iv.deltas.get(ek)
            if d is not None and all(k in d for k in keys):
                out.append(tuple(d[k] for k in keys))
        return out
