"""Serve the benchmark corpus as a stand-in vLLM /metrics in its own process.

python -m bench.serve_corpus PORT [--engines N]
"""

from __future__ import annotations

import argparse

from aiohttp import web

from bench.corpus import data_parallel, single_engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("port", type=int)
    parser.add_argument("--engines", type=int, default=8)
    args = parser.parse_args(argv)
    body = (single_engine() if args.engines == 1 else data_parallel(args.engines)).encode()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
