"""Shared benchmark plumbing: repeated timing with medians, printed as a table."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def measure(fn: Callable[[], object], repeats: int, inner: int = 1) -> list[float]:
    """Seconds per call of `fn`, one value per repeat (each the mean of `inner` calls)."""
    fn()  # warm-up: imports, caches
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner)
    return out


def cpu_measure(fn: Callable[[], object], repeats: int, inner: int = 1) -> list[float]:
    """CPU seconds (process time) per call: not distorted by other load on the machine."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(inner):
            fn()
        out.append((time.process_time() - t0) / inner)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def table(rows: Sequence[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table, as the docs carry the benches' results."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
