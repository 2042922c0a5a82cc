"""What-if simulator throughput and memory, against an OrderedDict LRU per size.

    .venv/bin/python -m bench.whatif_bench [--requests 20000] [--sizes 7]

One synthetic trace (Zipf-popular shared prefixes with unique suffixes through a
vLLM-like GPU block pool) is rebuilt into request accesses once; then each simulator
replays the same accesses on one core. Rates are given per block event of the KV
stream (hashes named by BlockStored/BlockRemoved, what vLLM publishes) and per block
access (every block of every request is touched, as vLLM's CPU manager does). Memory
is tracemalloc's growth while the simulator is built and fed, over its tracked blocks.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter.kvevents_codec import BlockRemoved, BlockStored, decode_payload
from exporter.model.whatif.simulator import (
    Access,
    Model,
    StackModel,
    StackReference,
    TierSet,
    TraceBuilder,
)
from tests.test_whatif_synth import shared_prefix_messages


def build(requests: int, seed: int) -> tuple[list[tuple[float, list[Access]]], int, list[bytes]]:
    msgs = list(
        shared_prefix_messages(
            requests,
            gpu_blocks=2048,
            prefixes=2000,
            prefix_blocks=(8, 64),
            suffix_blocks=(1, 16),
            skew=0.8,
            seed=seed,
        )
    )
    enc = msgspec.msgpack.Encoder()
    payloads = [enc.encode(m.raw) for m in msgs]
    builder = TraceBuilder()
    batches = []
    block_events = 0
    for m in msgs:
        for e in m.batch.events:
            if isinstance(e, BlockStored | BlockRemoved):
                block_events += len(e.hashes)
        batches.append((m.batch.ts, builder.process(m.batch, m.seq)))
    return batches, block_events, payloads


def run(
    make: Callable[[], Model], batches: Sequence[tuple[float, list[Access]]], repeat: int
) -> tuple[float, list[float]]:
    """Best of `repeat` timed replays (the machine may be shared), and the hit totals."""
    best = float("inf")
    totals: list[float] = []
    for _ in range(repeat):
        model = make()
        totals = []
        gc.collect()
        t0 = time.perf_counter()
        for ts, accesses in batches:
            hits = model.process_batch(ts, accesses)
            if not totals:
                totals = [0.0] * len(hits)
            for i, h in enumerate(hits):
                totals[i] += h
        best = min(best, time.perf_counter() - t0)
    return best, totals


def memory(make: Callable[[], Model], batches: Sequence[tuple[float, list[Access]]]) -> float:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    model = make()
    for ts, accesses in batches:
        model.process_batch(ts, accesses)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / max(1, model.tracked_blocks)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--sizes", type=int, default=7, help="candidate sizes (doubling from 1024)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3, help="best of N timings per simulator")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    batches, block_events, payloads = build(args.requests, args.seed)
    gen = time.perf_counter() - t0
    accesses = sum(len(a.keys) for _, b in batches for a in b)
    sizes = [1024 << i for i in range(args.sizes)]
    print(
        f"trace: {args.requests} requests, {len(batches)} batches, {block_events} block events, "
        f"{accesses} block accesses (built in {gen:.1f}s); sizes {sizes[0]}..{sizes[-1]} blocks"
    )

    t0 = time.perf_counter()
    for p in payloads:
        decode_payload(p)
    generic = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in payloads:
        decode_payload(p, keep_raw=False)
    fast = time.perf_counter() - t0
    t0 = time.perf_counter()
    b2 = TraceBuilder()
    for p in payloads:
        batch, _ = decode_payload(p, keep_raw=False)
        b2.process(batch, 0)
    rebuild = time.perf_counter() - t0
    print(
        f"decode, generic msgpack (token ids as ints): {block_events / generic:,.0f} block "
        f"events/s; typed fast path: {block_events / fast:,.0f}; fast decode + request "
        f"rebuild: {block_events / rebuild:,.0f}"
    )

    models: list[tuple[str, Callable[[], Model]]] = [
        ("baseline: OrderedDict LRU per size", lambda: StackReference(sizes)),
        ("stack one-pass, exact", lambda: StackModel(sizes)),
        ("stack one-pass, SHARDS 0.1", lambda: StackModel(sizes, sample_rate=0.1)),
        ("stack one-pass, SHARDS 0.01", lambda: StackModel(sizes, sample_rate=0.01)),
        ("vllm 0.26 replay per size (exact)", lambda: TierSet(sizes)),
    ]
    base_rate = None
    exact: list[float] = []
    print(
        f"{'simulator':36s} {'block ev/s':>12s} {'access/s':>12s} {'vs base':>8s} "
        f"{'B/block':>8s} {'max |dHR|':>9s}"
    )
    for name, make in models:
        secs, totals = run(make, batches, args.repeat)
        rate = block_events / secs
        if base_rate is None:
            base_rate = rate
        if name.startswith("stack one-pass, exact"):
            exact = totals
        stored = sum(
            len(a.keys) - a.start for _, b in batches for a in b
        )  # tokens/16, for the ratio error below
        err = (
            max(abs(x - y) for x, y in zip(totals, exact, strict=True)) / (16 * stored)
            if exact and name.startswith("stack")
            else float("nan")
        )
        per_block = memory(make, batches)
        print(
            f"{name:36s} {rate:12,.0f} {accesses / secs:12,.0f} {rate / base_rate:7.2f}x "
            f"{per_block:8.0f} {err:9.4f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
