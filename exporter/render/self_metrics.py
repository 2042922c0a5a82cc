"""The exporter's own families: build info, window, and per-collector health."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from exporter.catalogue import Family
from exporter.sources import ErrorKind, SourceState

COLLECTOR_ERROR_KINDS = tuple(ErrorKind)


def self_families(
    version: str, python_version: str, window_seconds: float, collectors: Sequence[SourceState]
) -> Iterator[Family]:
    """Self-metrics of the non-vLLM sources (targets report through kvoffload_target_*)."""
    info = Family("kvoffload_build_info")
    info.add([version, python_version], 1)
    yield info
    win = Family("kvoffload_window_seconds")
    win.add([], window_seconds)
    yield win
    up = Family("kvoffload_collector_up")
    dur = Family("kvoffload_collector_duration_seconds")
    last = Family("kvoffload_collector_last_success_timestamp_seconds")
    errs = Family("kvoffload_collector_errors_total")
    for h in collectors:
        up.add([h.name], 1.0 if h.up else 0.0)
        if h.duration is not None:
            dur.add([h.name], h.duration)
        if h.last_success is not None:
            last.add([h.name], h.last_success)
        for kind in COLLECTOR_ERROR_KINDS:
            errs.add([h.name, str(kind)], h.errors_total.get(kind, 0))
    yield from (up, dur, last, errs)
