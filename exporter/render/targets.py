"""Families of the vLLM targets: up, scrape failures by reason, window coverage, info."""

from __future__ import annotations

from collections.abc import Iterator

from exporter.catalogue import Family
from exporter.sources import ErrorKind
from exporter.sources.vllm_http import TARGET_FAILURE_REASONS, TargetSnapshot


def target_families(snap: TargetSnapshot) -> Iterator[Family]:
    """kvoffload_target_*: the scrape's health and what it learnt about the target."""
    label = snap.config.label
    h = snap.health
    up = Family("kvoffload_target_up")
    up.add([label], 1.0 if h.up else 0.0)
    yield up
    if h.duration is not None:
        dur = Family("kvoffload_target_scrape_duration_seconds")
        dur.add([label], h.duration)
        yield dur
    failures = Family("kvoffload_target_scrape_failures_total")
    for kind in TARGET_FAILURE_REASONS:
        failures.add([label, str(kind)], h.errors_total.get(kind, 0))
    yield failures
    if h.last_success is not None:
        last = Family("kvoffload_target_last_success_timestamp_seconds")
        last.add([label], h.last_success)
        yield last
    resets = Family("kvoffload_target_resets_total")
    resets.add([label], h.errors_total.get(ErrorKind.COUNTER_RESET, 0))
    yield resets
    dropped = Family("kvoffload_target_series_dropped_total")
    dropped.add([label], snap.series_dropped_total)
    yield dropped
    covered = Family("kvoffload_target_window_covered_seconds")
    covered.add([label], snap.window.covered_seconds())
    yield covered
    info = Family("kvoffload_target_info")
    info.add([label, snap.config.url, snap.version or "unknown"], 1.0)
    yield info
