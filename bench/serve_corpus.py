"""Serve the benchmark corpus as a stand-in vLLM /metrics in its own process.

python -m bench.serve_corpus PORT [--engines N] [--advance] [--children N]

`--advance` makes the counters move like a busy server's: every scrape multiplies each
counter sample (`_total`, `_count`, `_sum`, `_bucket`) by a factor that grows by 0.2 % per
scrape, so the exporter sees positive deltas, consistent histograms and fresh values
every cycle (a body that never changes would flatter anything that caches by content).
`--children N` forks N idle child processes, so a /proc collector pointed at this server
walks a process tree shaped like vLLM's (an API server and its engine cores).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from aiohttp import web

from bench.corpus import data_parallel, single_engine

COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket")
# An idle child that exits once its parent is gone (the process group is killed anyway).
CHILD = "import os, time\nppid = os.getppid()\nwhile os.getppid() == ppid: time.sleep(1)\n"


def advancing(text: str) -> tuple[list[str], list[tuple[int, float]]]:
    """The body split into fixed pieces and the (piece index, base value) of each counter."""
    pieces: list[str] = []
    counters: list[tuple[int, float]] = []
    for line in text.splitlines():
        head, sep, value = line.rpartition(" ")
        name = head.split("{", 1)[0]
        if line.startswith("#") or not sep or not name.endswith(COUNTER_SUFFIXES):
            pieces.append(line + "\n")
            continue
        try:
            base = float(value)
        except ValueError:
            pieces.append(line + "\n")
            continue
        pieces.append(head + " ")
        counters.append((len(pieces), base))
        pieces.append("")  # the value, filled per scrape
        pieces.append("\n")
    return pieces, counters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("port", type=int)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--advance", action="store_true", help="counters grow every scrape")
    parser.add_argument("--children", type=int, default=0, help="idle child processes")
    args = parser.parse_args(argv)
    text = single_engine() if args.engines == 1 else data_parallel(args.engines)
    body = text.encode()
    pieces, counters = advancing(text)
    scrapes = 0
    children = [
        subprocess.Popen([sys.executable, "-c", CHILD]) for _ in range(max(args.children, 0))
    ]

    async def metrics(_: web.Request) -> web.Response:
        nonlocal scrapes
        if not args.advance:
            return web.Response(body=body, content_type="text/plain")
        scrapes += 1
        factor = 1.0 + 0.002 * scrapes
        for index, base in counters:
            pieces[index] = repr(base * factor)
        return web.Response(body="".join(pieces).encode(), content_type="text/plain")

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    try:
        web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)
    finally:
        for child in children:
            child.kill()
            child.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
