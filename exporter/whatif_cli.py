"""`kv-offload-exporter whatif`: the offload hit-ratio curve of a recorded KV-event file.

Returns exit codes; cli.py is the only module that exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from exporter.config import parse_bytes
from exporter.kvevents_codec import Message, ReadStats, read_records
from exporter.model.whatif.simulator import MODELS, Curve, blocks_for_bytes, replay

GIB = 1 << 30


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kv-offload-exporter whatif",
        description="Replay a recorded KV-event file (--record-events, one ZMQ message per "
        "JSON line) through a simulated CPU offload tier of each size and print how many of "
        "the computed prompt tokens it would have served.",
    )
    p.add_argument("--events", required=True, metavar="FILE", help="recorded KV events (JSONL)")
    sizes = p.add_mutually_exclusive_group(required=True)
    sizes.add_argument(
        "--sizes",
        metavar="SIZES",
        help="CPU buffer sizes, e.g. 0.5GiB,1GiB (needs --kv-bytes-per-block)",
    )
    sizes.add_argument("--blocks", metavar="N,N", help="CPU buffer sizes in blocks, e.g. 8,16,64")
    p.add_argument(
        "--kv-bytes-per-block",
        type=int,
        metavar="N",
        help="KV bytes of one GPU block across all layers and workers (bytes/token x block size)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the curve (needs matplotlib)")
    p.add_argument(
        "--model",
        choices=MODELS,
        default="vllm",
        help="vllm: vLLM 0.26's CPU offload manager, one replay per size (default); stack: "
        "one-pass LRU stack distances; plain: LRU over the GPU-miss stream (baseline)",
    )
    p.add_argument("--policy", choices=("lru", "arc"), default="lru", help="eviction policy")
    p.add_argument(
        "--store-threshold", type=int, default=0, metavar="N", help="vLLM store_threshold"
    )
    p.add_argument(
        "--sample-rate", type=float, default=1.0, metavar="R", help="SHARDS rate (stack model)"
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        metavar="N",
        help="average N permutations of vLLM's set-ordered stores (vllm model)",
    )
    p.add_argument(
        "--blocks-per-chunk", type=int, default=1, metavar="N", help="offload chunk size"
    )
    p.add_argument(
        "--prompt-tokens",
        type=float,
        metavar="N",
        help="all prompt tokens of the run (delta of vllm:prompt_tokens_total): adds each size's "
        "share of them, the number comparable to the observed external_kv_transfer share",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


class Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, total: int, stream: IO[str], enabled: bool) -> None:
        self.total = max(1, total)
        self.stream = stream
        self.enabled = enabled and stream.isatty()
        self._last = 0.0

    def update(self, done: int, label: str) -> None:
        now = time.monotonic()
        if not self.enabled or now - self._last < 0.2:
            return
        self._last = now
        frac = min(1.0, done / self.total)
        bar = "#" * int(30 * frac)
        self.stream.write(f"\r{label:10s} [{bar:30s}] {100 * frac:5.1f}%")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 60 + "\r")
            self.stream.flush()


def _read(path: Path, progress: Progress, stats: ReadStats) -> list[Message]:
    out: list[Message] = []
    with path.open(encoding="utf-8") as fh:
        it: Iterator[Message] = read_records(fh, stats)
        for msg in it:
            out.append(msg)
            progress.update(stats.bytes_read, "reading")
    return out


def _parse_list(text: str, what: str, convert: Any) -> list[int]:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{what}: empty list")
    return [int(convert(t.strip())) for t in items]


def _document(curve: Curve, prompt_tokens: float | None) -> dict[str, Any]:
    sizes = []
    for i, s in enumerate(curve.sizes):
        item: dict[str, Any] = {
            "cpu_buffer_blocks": s.cpu_buffer_blocks,
            "cpu_buffer_bytes": s.cpu_buffer_bytes,
            "hit_tokens": round(s.hit_tokens),
            "hit_ratio": curve.hit_ratio(i),
        }
        if prompt_tokens:
            item["share_of_prompt_tokens"] = s.hit_tokens / prompt_tokens
        sizes.append(item)
    return {
        "stored_tokens": curve.stored_tokens,
        "recomputed_after_eviction_tokens": curve.recomputed_after_eviction_tokens,
        "sizes": sizes,
    }


def _table(doc: dict[str, Any], curve: Curve, path: Path, bad_lines: int, out: IO[str]) -> None:
    out.write(
        f"{path}: {curve.batches} batches, {curve.requests} requests, "
        f"{doc['stored_tokens']} computed prompt tokens stored, "
        f"{doc['recomputed_after_eviction_tokens']} recomputed after eviction"
        + (f", {bad_lines} unreadable lines skipped" if bad_lines else "")
        + "\n"
    )
    share = any("share_of_prompt_tokens" in s for s in doc["sizes"])
    head = f"{'cpu buffer':>12} {'blocks':>9} {'hit tokens':>12} {'hit ratio':>10}"
    out.write(head + (f" {'of prompt':>10}" if share else "") + "\n")
    for s in doc["sizes"]:
        size = "-" if s["cpu_buffer_bytes"] is None else _human(s["cpu_buffer_bytes"])
        line = (
            f"{size:>12} {s['cpu_buffer_blocks']:>9} {s['hit_tokens']:>12} "
            f"{100 * s['hit_ratio']:>9.2f}%"
        )
        if share:
            line += f" {100 * s['share_of_prompt_tokens']:>9.2f}%"
        out.write(line + "\n")


def _human(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def _plot(doc: dict[str, Any], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = doc["sizes"]
    in_bytes = all(s["cpu_buffer_bytes"] is not None for s in sizes)
    big = in_bytes and max(s["cpu_buffer_bytes"] for s in sizes) >= GIB
    unit, scale = ("GiB", GIB) if big else ("MiB", 1 << 20)
    xs = [s["cpu_buffer_bytes"] / scale if in_bytes else s["cpu_buffer_blocks"] for s in sizes]
    ys = [100 * s["hit_ratio"] for s in sizes]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, marker="o")
    if len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(f"CPU offload buffer ({unit})" if in_bytes else "CPU offload buffer (blocks)")
    ax.set_ylabel("computed prompt tokens served from CPU (%)")
    ax.set_ylim(0, max(5.0, 1.1 * max(ys, default=0)))
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _capacities(args: argparse.Namespace) -> tuple[list[int], list[int | None]]:
    """The simulated capacities (from --sizes or --blocks) and the bytes each stands for
    (None without --kv-bytes-per-block); ValueError on a bad list."""
    if args.sizes:
        if not args.kv_bytes_per_block or args.kv_bytes_per_block <= 0:
            raise ValueError("--sizes needs --kv-bytes-per-block (a positive byte count)")
        sizes_bytes: list[int | None] = list(_parse_list(args.sizes, "--sizes", parse_bytes))
        caps = [
            blocks_for_bytes(b or 0, args.kv_bytes_per_block, args.blocks_per_chunk)
            for b in sizes_bytes
        ]
    else:
        caps = _parse_list(args.blocks, "--blocks", int)
        sizes_bytes = [
            c * args.kv_bytes_per_block * args.blocks_per_chunk if args.kv_bytes_per_block else None
            for c in caps
        ]
    if any(c < 0 for c in caps):
        raise ValueError("sizes must not be negative")
    return caps, sizes_bytes


def run(argv: Sequence[str], out: IO[str] = sys.stdout, err: IO[str] = sys.stderr) -> int:
    args = parser().parse_args(argv)
    path = Path(args.events)
    try:
        caps, sizes_bytes = _capacities(args)
        if args.seeds < 1:
            raise ValueError("--seeds must be at least 1")
        if not 0 < args.sample_rate <= 1:
            raise ValueError("--sample-rate must be in (0, 1]")
        size = path.stat().st_size
    except (OSError, ValueError) as exc:
        err.write(f"kv-offload-exporter whatif: {exc}\n")
        return 2
    progress = Progress(size, err, not args.no_progress and not args.json)
    stats = ReadStats()
    try:
        messages = _read(path, progress, stats)
        done = 0

        def tick(_: Message) -> None:
            nonlocal done
            done += 1
            progress.update(done, "simulating")

        progress.total = max(1, len(messages))
        curve = replay(
            messages,
            caps,
            model=args.model,
            policy=args.policy,
            store_threshold=args.store_threshold,
            sample_rate=args.sample_rate,
            seeds=list(range(args.seeds)),
            blocks_per_chunk=args.blocks_per_chunk,
            sizes_bytes=sizes_bytes,
            on_message=tick,
        )
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        progress.close()
        err.write(f"kv-offload-exporter whatif: {path}: {exc}\n")
        return 1
    progress.close()
    if not messages:
        err.write(f"kv-offload-exporter whatif: {path}: no KV-event messages\n")
        return 1
    doc = _document(curve, args.prompt_tokens)
    if args.json:
        out.write(json.dumps(doc, indent=2) + "\n")
    else:
        _table(doc, curve, path, stats.bad_lines, out)
    if args.plot:
        try:
            _plot(doc, args.plot, f"{path.name}: {args.model} model, {args.policy}")
        except ImportError:
            err.write("kv-offload-exporter whatif: --plot needs matplotlib (pip install .[plot])\n")
            return 1
    return 0
