"""What-if cost as the number of tracked blocks grows (1e5, 1e6, 1e7).

    python -m bench.whatif_growth [--blocks 100000,1000000,10000000] [--reuse 2000000]

The one-pass simulator's memory grows with the blocks it tracks (its largest candidate
size); its time per access should not. For each N: seven sizes doubling up to N blocks,
a cold fill of N distinct blocks (documents of 32 blocks in prefix order, each a new
request), then `--reuse` block accesses by requests for documents drawn uniformly from
1.25 N blocks' worth (hits at every size, misses that push blocks out, markers moving).
Reported: block accesses/s of the fill and of the reuse phase, and resident memory (RSS
growth, tracemalloc would triple the run time at 1e7) per tracked block. Each measurement
runs in a fresh interpreter, so one run's freed memory does not hide the next one's.

Baseline, same run: the OrderedDict LRU per size (`StackReference`) at every N up to
`--baseline-max` (default 1e6: at 1e7 it would hold seven dicts of up to 1e7 entries).
SHARDS at R = 0.1 (`--whatif-sample-rate 0.1`) is measured beside the exact pass.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter.model.whatif.simulator import Access, Model, StackModel, StackReference

DOC_BLOCKS = 32
SIZES = 7


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def doc_access(req: int, doc: int) -> Access:
    base = doc * DOC_BLOCKS
    keys = tuple(range(base, base + DOC_BLOCKS))
    return Access(req=req, keys=keys, start=0, first=True, tokens_per_chunk=16, computed_tokens=0)


def fill(n_blocks: int) -> Iterator[Access]:
    for d in range(n_blocks // DOC_BLOCKS):
        yield doc_access(d, d)


def reuse(n_blocks: int, accesses: int, seed: int) -> list[Access]:
    rng = random.Random(seed)
    docs = int(1.25 * n_blocks) // DOC_BLOCKS
    first_req = n_blocks // DOC_BLOCKS
    return [doc_access(first_req + i, rng.randrange(docs)) for i in range(accesses // DOC_BLOCKS)]


def feed(model: Model, accesses: Iterator[Access] | Sequence[Access], batch: int = 64) -> int:
    """Accesses fed in engine-step-sized batches; returns block accesses fed."""
    n = 0
    buf: list[Access] = []
    for a in accesses:
        buf.append(a)
        if len(buf) == batch:
            model.process_batch(0.0, buf)
            n += batch * DOC_BLOCKS
            buf = []
    if buf:
        model.process_batch(0.0, buf)
        n += len(buf) * DOC_BLOCKS
    return n


def measure(
    make: Callable[[], Model], n_blocks: int, reuse_accesses: int, seed: int
) -> dict[str, float]:
    gc.collect()
    rss0 = rss_bytes()
    model = make()
    t0 = time.perf_counter()
    filled = feed(model, fill(n_blocks))
    t_fill = time.perf_counter() - t0
    rss1 = rss_bytes()
    tracked = model.tracked_blocks
    trace = reuse(n_blocks, reuse_accesses, seed)  # built outside the timed part
    t0 = time.perf_counter()
    reused = feed(model, trace)
    t_reuse = time.perf_counter() - t0
    return {
        "fill_per_s": filled / t_fill,
        "reuse_per_s": reused / t_reuse,
        "tracked": float(tracked),
        "bytes_per_block": (rss1 - rss0) / max(1, tracked),
    }


MODELS: dict[str, Callable[[list[int]], Model]] = {
    "baseline: OrderedDict LRU per size": StackReference,
    "stack one-pass, exact": StackModel,
    "stack one-pass, SHARDS 0.1": lambda s: StackModel(s, sample_rate=0.1),
}


def sizes_for(n: int) -> list[int]:
    return [max(1, n >> (SIZES - 1 - i)) for i in range(SIZES)]


def in_child(name: str, n: int, reuse_accesses: int, seed: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "bench.whatif_growth", "--one", name, "--blocks", str(n)]
    cmd += ["--reuse", str(reuse_accesses), "--seed", str(seed)]
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=root)
    return dict(json.loads(out.stdout))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--blocks", default="100000,1000000,10000000")
    ap.add_argument("--reuse", type=int, default=2_000_000, help="block accesses after the fill")
    ap.add_argument("--baseline-max", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--one", choices=sorted(MODELS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    blocks = [int(float(b)) for b in args.blocks.split(",")]
    if args.one:  # the child: one measurement, JSON on stdout
        make = MODELS[args.one]
        print(
            json.dumps(
                measure(lambda: make(sizes_for(blocks[0])), blocks[0], args.reuse, args.seed)
            )
        )
        return 0

    print(
        f"{'N tracked':>11} {'simulator':<34} {'fill acc/s':>12} {'reuse acc/s':>12} "
        f"{'vs baseline':>11} {'B/block':>8}"
    )
    for n in blocks:
        names = [m for m in MODELS if n <= args.baseline_max or not m.startswith("baseline")]
        base = None
        for name in names:
            r = in_child(name, n, args.reuse, args.seed)
            if base is None and name.startswith("baseline"):
                base = r["reuse_per_s"]
            ratio = f"{r['reuse_per_s'] / base:.2f}x" if base else "n/a"
            print(
                f"{n:>11,} {name:<34} {r['fill_per_s']:>12,.0f} {r['reuse_per_s']:>12,.0f} "
                f"{ratio:>11} {r['bytes_per_block']:>8.0f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
