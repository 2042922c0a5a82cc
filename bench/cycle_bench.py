"""CPU time of one collection cycle as the number of vLLM targets grows.

    python -m bench.cycle_bench [--targets 1,8,64] [--cycles N] [--nvml fake|off]

Each target serves the 8-engine corpus (bench/corpus.py, ~390 KB) from a separate process,
so the exporter process's CPU time (time.process_time) is the exporter's own work: HTTP
client, parsing, window update, derivations, advice, rendering, and the /proc and cgroup
collectors (they run in worker threads; each target's /proc source finds the corpus server
by its port, as it finds vLLM). With `--nvml fake` (default) the NVML collector reads the
recorded H200 sequence (tests/nvml_doubles.py) with its poller thread running; that thread's
own CPU clock is subtracted from the cycle and reported on its own line (its cost depends
on the poll interval, not on the cycle: bench/nvml_poller_cost.py). Baseline, same run: the
same cycle with prometheus_client's text parser in place of the exporter's targeted parser.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import replace

from bench.common import median, table
from exporter import expfmt
from exporter.config import Config
from exporter.options import TargetConfig
from exporter.render.exposition import OPENMETRICS
from exporter.runtime import Exporter, build_sources
from exporter.sources.nvml.source import NvmlSource
from testbed.procs import free_port, start, stop, wait_http


@contextmanager
def corpus_server(engines: int) -> Iterator[str]:
    import tempfile
    from pathlib import Path

    port = free_port()
    log = Path(tempfile.mkdtemp()) / "corpus.log"
    proc = start(
        [sys.executable, "-m", "bench.serve_corpus", str(port), "--engines", str(engines)], log
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/metrics", 30, proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@contextmanager
def baseline_parser() -> Iterator[None]:
    """Swap in prometheus_client's parser (what an exporter would use off the shelf)."""
    from prometheus_client.parser import text_string_to_metric_families

    original = expfmt.parse

    def parse(text: str, wanted: Collection[str]) -> list[expfmt.Sample]:
        return [
            expfmt.Sample(s.name, tuple(sorted(s.labels.items())), s.value)
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name in wanted
        ]

    expfmt.parse = parse
    try:
        yield
    finally:
        expfmt.parse = original


def _fake_nvml() -> NvmlSource:
    from bench.nvml_poller_cost import fake_api

    return NvmlSource(fake_api(), poll_interval=None)


async def cycle_cpu(url: str, targets: int, cycles: int, nvml: str) -> tuple[float, float]:
    """Median CPU seconds per cycle (poller thread excluded), poller CPU per wall second."""
    cfg = Config(
        targets=tuple(TargetConfig(url=url, name=f"t{i}") for i in range(targets)),
        interval=1.0,
        window=300.0,
    )
    cfg = replace(cfg, scrape_timeout=30.0, nvml=False)
    sources = build_sources(cfg)
    gpu = _fake_nvml() if nvml == "fake" else None
    if gpu is not None:
        sources.append(gpu)
    exp = Exporter(cfg, sources)
    await exp.start()
    try:
        await exp.run_cycle()  # warm-up: connections, first window sample
        if gpu is not None:
            for _ in range(1000):  # the fake comes up at once; bounded all the same
                if gpu.poller.snapshot.up:
                    break
                await asyncio.sleep(0.01)
            await exp.run_cycle()

        def poller_cpu() -> float:
            if gpu is None or gpu._thread is None or gpu._thread.ident is None:
                return 0.0
            return time.clock_gettime(time.pthread_getcpuclockid(gpu._thread.ident))

        samples = []
        wall0, poll0 = time.monotonic(), poller_cpu()
        for _ in range(cycles):
            p0, t0 = poller_cpu(), time.process_time()
            await exp.run_cycle()
            # One Prometheus scrape per cycle renders the OpenMetrics body once.
            exp.exposition.body(OPENMETRICS)
            samples.append(time.process_time() - t0 - (poller_cpu() - p0))
        poll_share = (poller_cpu() - poll0) / (time.monotonic() - wall0)
        return median(samples), poll_share
    finally:
        await exp.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--targets", default="1,8,64")
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--nvml", choices=("fake", "off"), default="fake")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.targets.split(",")]
    rows = []
    poller = []
    with corpus_server(args.engines) as url:
        for n in counts:
            ours, poll_share = asyncio.run(cycle_cpu(url, n, args.cycles, args.nvml))
            poller.append(poll_share)
            with baseline_parser():
                base, _ = asyncio.run(cycle_cpu(url, n, max(2, args.cycles // 3), args.nvml))
            rows.append(
                (
                    str(n),
                    f"{ours * 1e3:.1f} ms",
                    f"{ours / n * 1e3:.2f} ms",
                    f"{base * 1e3:.1f} ms",
                    f"{base / ours:.1f}x",
                )
            )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.engines} engines per target, median over {args.cycles} cycles")
    print(
        table(
            rows,
            ("targets", "CPU per cycle", "per target", "baseline parser", "speedup vs baseline"),
        )
    )
    if args.nvml == "fake":
        print(
            "NVML poller thread (recorded H200, auto interval), not in the cycle: "
            + ", ".join(f"{p:.1%}" for p in poller)
            + " of a core"
        )
    print(f"peak RSS of the benchmark process: {rss:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
