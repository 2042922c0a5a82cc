"""/metrics under load: many concurrent scrapers against the running exporter on 127.0.0.1.

    python -m bench.scrape_load [--connections 50] [--duration 60]

Uses wrk (Debian package) when present, else a bounded aiohttp client loop. The exporter
scrapes the 8-engine corpus every second while it is being hammered. Baseline, same run: the
same families served by prometheus_client rendering on every scrape (bench/baseline_server.py).
Reports p50/p99 latency, requests/s and the exporter's RSS afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import table
from testbed.procs import free_port, start, stop, wait_http

UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def with_wrk(url: str, connections: int, duration: int) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{duration}s", "--latency", "--timeout", "10s", url],
        capture_output=True,
        text=True,
        check=True,
        timeout=duration + 60,
    ).stdout
    res: dict[str, float] = {}
    for pct in ("50", "99"):
        m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        assert m, out
        res[f"p{pct}"] = float(m.group(1)) * UNITS[m.group(2)]
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    assert m, out
    res["rps"] = float(m.group(1))
    return res


async def _client(url: str, connections: int, duration: float) -> dict[str, float]:
    import aiohttp

    lat: list[float] = []
    deadline = time.monotonic() + duration

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            async with session.get(url) as resp:
                await resp.read()
            lat.append(time.perf_counter() - t0)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(connections)))
    lat.sort()
    return {"p50": lat[len(lat) // 2], "p99": lat[int(len(lat) * 0.99)], "rps": len(lat) / duration}


def load(url: str, connections: int, duration: int) -> dict[str, float]:
    if shutil.which("wrk"):
        return with_wrk(url, connections, duration)
    return asyncio.run(_client(url, connections, duration))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument("--duration", type=int, default=60)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvoe-load-"))
    corpus_port, exp_port, base_port = free_port(), free_port(), free_port()
    procs = []
    try:
        corpus = start(
            [sys.executable, "-m", "bench.serve_corpus", str(corpus_port)], work / "corpus.log"
        )
        procs.append(corpus)
        wait_http(f"http://127.0.0.1:{corpus_port}/metrics", 30, corpus)
        vllm = f"http://127.0.0.1:{corpus_port}"
        exporter = start(
            [
                sys.executable,
                "-m",
                "exporter",
                "--vllm-url",
                vllm,
                "--listen",
                f"127.0.0.1:{exp_port}",
                "--interval",
                "1",
            ],
            work / "exporter.log",
        )
        procs.append(exporter)
        wait_http(f"http://127.0.0.1:{exp_port}/readyz", 30, exporter)
        baseline = start(
            [sys.executable, "-m", "bench.baseline_server", vllm, str(base_port)],
            work / "baseline.log",
        )
        procs.append(baseline)
        wait_http(f"http://127.0.0.1:{base_port}/metrics", 30, baseline)

        ours = load(f"http://127.0.0.1:{exp_port}/metrics", args.connections, args.duration)
        ours_rss = rss_mib(exporter.pid)
        base = load(f"http://127.0.0.1:{base_port}/metrics", args.connections, args.duration)
        base_rss = rss_mib(baseline.pid)
    finally:
        for p in reversed(procs):
            stop(p)
    rows = [
        (
            "exporter (cached exposition)",
            f"{ours['p50'] * 1e3:.2f} ms",
            f"{ours['p99'] * 1e3:.2f} ms",
            f"{ours['rps']:,.0f}",
            f"{ours_rss:.0f} MiB",
        ),
        (
            "baseline (render per scrape)",
            f"{base['p50'] * 1e3:.2f} ms",
            f"{base['p99'] * 1e3:.2f} ms",
            f"{base['rps']:,.0f}",
            f"{base_rss:.0f} MiB",
        ),
    ]
    print(
        f"{args.connections} concurrent scrapers for {args.duration} s on 127.0.0.1 "
        f"({'wrk' if shutil.which('wrk') else 'aiohttp client'})"
    )
    print(table(rows, ("server", "p50", "p99", "requests/s", "RSS after")))
    print(
        f"p99 ratio baseline/exporter: {base['p99'] / ours['p99']:.1f}x; "
        f"throughput ratio: {ours['rps'] / base['rps']:.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
