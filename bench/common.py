"""Shared benchmark plumbing: repeated timing with medians, printed as a table; the
recordings and command line the matrix tools share."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


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


def loaded_tokens(base: Mapping[str, Any], offload: Mapping[str, Any]) -> int:
    """Tokens a request of an offload run found cached beyond its own in the run without
    offload (paired records, `cached_tokens`): above 0, it loaded from the CPU tier."""
    return int(offload.get("cached_tokens") or 0) - int(base.get("cached_tokens") or 0)


def recording_metas(root: Path, names: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Every recording's meta.json under `root` by folder name (the matrix's layout); exits
    with a message naming any of `names` not there."""
    metas = {m.parent.name: json.loads(m.read_text()) for m in sorted(root.glob("*/meta.json"))}
    unknown = [n for n in names if n not in metas]
    if unknown:
        raise SystemExit(f"no recording named {', '.join(unknown)} under {root}")
    return metas


def recordings_parser(doc: str | None, root: Path, runs_help: str) -> argparse.ArgumentParser:
    """The command line the matrix tools share: [ROOT] [RUN ...] [--json]."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("root", nargs="?", type=Path, default=root)
    ap.add_argument("runs", nargs="*", help=runs_help)
    ap.add_argument("--json", action="store_true")
    return ap


def recordings_main(
    doc: str | None,
    root: Path,
    table: Callable[[Path, Sequence[str]], Mapping[str, Any]],
    markdown: Callable[[Mapping[str, Any]], str],
    argv: Sequence[str] | None = None,
) -> int:
    """`main` of a matrix tool that prints one row per recording: `table(root, runs)` as
    Markdown, or as JSON with --json."""
    a = recordings_parser(doc, root, "recordings under ROOT (default: all)").parse_args(argv)
    rows = table(a.root, a.runs)
    print(json.dumps(rows, indent=1) if a.json else markdown(rows))
    return 0
