"""Helpers for the fault matrix: scrape the exporter process, record history, check invariants."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from testbed.procs import http_get

Series = tuple[str, frozenset[tuple[str, str]]]

# Ratios that are shares of a whole: they must stay in [0, 1] whatever the input.
UNIT_RATIOS = (
    "kvoffload_kv_cache_usage_ratio",
    "kvoffload_gpu_prefix_hit_ratio",
    "kvoffload_offload_hit_ratio",
    "kvoffload_offload_lookup_hit_ratio",
)


def parse_metrics(text: str) -> dict[Series, float]:
    out: dict[Series, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def scrape(base_url: str) -> tuple[int, dict[Series, float]]:
    status, body = http_get(base_url + "/metrics", timeout=10.0)
    return status, parse_metrics(body.decode()) if status == 200 else {}


def value(metrics: dict[Series, float], name: str, **labels: str) -> float | None:
    """The one series of `name` whose labels include `labels`, else None."""
    found = [v for (n, ls), v in metrics.items() if n == name and set(labels.items()) <= ls]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} series"
    return found[0] if found else None


def series_of(metrics: dict[Series, float], name: str, **labels: str) -> list[Series]:
    return [k for k in metrics if k[0] == name and set(labels.items()) <= k[1]]


def status_json(base_url: str) -> dict:
    status, body = http_get(base_url + "/api/v1/status", timeout=10.0)
    assert status == 200, status
    return dict(json.loads(body))


def wait_until(
    what: str, check: Callable[[], bool], timeout: float = 60.0, step: float = 0.25
) -> None:
    """Poll `check` until true; fail naming `what` after `timeout` seconds (a liveness bound)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:.0f}s: {what}")
        time.sleep(step)


@dataclass
class Recorder:
    """Scrapes the exporter every `period` seconds in a thread and keeps every answer."""

    base_url: str
    period: float = 0.25
    statuses: list[int] = field(default_factory=list)
    history: list[dict[Series, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Recorder:
        self._thread = threading.Thread(target=self._run, name="recorder", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status, metrics = scrape(self.base_url)
                self.statuses.append(status)
                if status == 200:
                    self.history.append(metrics)
            except OSError as exc:
                self.errors.append(repr(exc))
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)


def monotonic_violations(history: list[dict[Series, float]]) -> list[str]:
    """Every exporter counter (kvoffload_*_total) that went down between two scrapes."""
    last: dict[Series, float] = {}
    bad = []
    for i, metrics in enumerate(history):
        for key, v in metrics.items():
            if not key[0].startswith("kvoffload_") or not key[0].endswith("_total"):
                continue
            if key in last and v < last[key]:
                bad.append(f"scrape {i}: {key[0]}{dict(key[1])} {last[key]} -> {v}")
            last[key] = v
    return bad


def ratio_violations(history: list[dict[Series, float]]) -> list[str]:
    bad = []
    for i, metrics in enumerate(history):
        for (name, labels), v in metrics.items():
            if name in UNIT_RATIOS and not 0.0 <= v <= 1.0:  # NaN fails too
                bad.append(f"scrape {i}: {name}{dict(labels)} = {v}")
    return bad


def nan_series(metrics: dict[Series, float]) -> list[str]:
    return [f"{n}{dict(ls)}" for (n, ls), v in metrics.items() if v != v]
