"""HTTP serving: /metrics from the cached exposition, health, a status page and JSON."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from exporter import __version__
from exporter.logs import log_event
from exporter.model.derive.engines import EngineDerived
from exporter.render.exposition import OPENMETRICS, TEXT
from exporter.render.status_page import render_html
from exporter.runtime import Exporter
from exporter.status import advice_items, status_view
from exporter.webconfig import BasicAuth, TokenBucket, WebConfig, load_web_config, peer_sans

log = logging.getLogger("kvoe.server")

EXPORTER_KEY = web.AppKey("exporter", Exporter)
LOOP_KEY = web.AppKey("loop", asyncio.Task[None])

TEXT_CT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CT = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def _wants_openmetrics(accept: str) -> bool:
    return "application/openmetrics-text" in accept


async def metrics(request: web.Request) -> web.Response:
    exp = request.app[EXPORTER_KEY].exposition
    om = _wants_openmetrics(request.headers.get("Accept", ""))
    gz = "gzip" in request.headers.get("Accept-Encoding", "")
    body = exp.body(OPENMETRICS if om else TEXT, gz)
    headers = {"Content-Type": OPENMETRICS_CT if om else TEXT_CT}
    if gz:
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=body, headers=headers)


async def healthz(request: web.Request) -> web.Response:
    task = request.app.get(LOOP_KEY)
    if task is not None and task.done():
        return web.Response(status=503, text="collection loop stopped\n")
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    exp = request.app[EXPORTER_KEY]
    if exp.started and exp.cycles > 0:
        return web.Response(text="ready\n")
    return web.Response(status=503, text="not ready: no collection cycle has completed\n")


def _derived_json(d: EngineDerived) -> dict[str, Any]:
    fit = d.prefill_fit
    return {
        "model_name": d.key.model_name,
        "engine": d.key.engine,
        "fresh": d.fresh,
        "offload_enabled": d.offload_enabled,
        "offload_buffer_bytes": d.offload_buffer_bytes,
        "kv_cache_usage_ratio": d.kv_usage,
        "gpu_prefix_hit_ratio": d.gpu_prefix_hit_ratio,
        "offload_hit_ratio": d.offload_hit_ratio,
        "offload_lookup_hit_ratio": d.offload_lookup_hit_ratio,
        "offload_reuse_ratio": d.reuse_ratio,
        "load_bandwidth_bytes_per_second": d.load_bandwidth,
        "kv_bytes_per_token": d.kv_bytes_per_token,
        "kv_bytes_per_token_method": d.kv_bytes_per_token_method,
        "recompute_tokens_per_second": d.recompute_tokens_per_second,
        "prefill_request_overhead_seconds": fit.overhead_seconds if fit else None,
        "prefill_fit_points": fit.points if fit else 0,
        "prefill_average_tokens_per_second": d.prefill_average_tokens_per_second,
        "transfer_tokens_per_second": d.transfer_tokens_per_second,
        "transfer_rate_estimated": d.transfer_estimated,
        "transfer_speedup_ratio": d.transfer_speedup,
        "window": dict(d.window),
        "totals": dict(d.totals),
    }


def status_json(exp: Exporter) -> dict[str, Any]:
    targets = []
    for t in exp.targets:
        h = t.health
        targets.append(
            {
                "target": t.config.label,
                "url": t.config.url,
                "up": h.up,
                "vllm_version": t.version,
                "last_success": h.last_success,
                "error_kind": str(h.error_kind) if h.error_kind else None,
                "error": h.error,
                "window_covered_seconds": t.window.covered_seconds(),
                "engines": [_derived_json(d) for d in exp.derived.get(t.config.label, [])],
            }
        )
    collectors = [
        {
            "collector": s.name,
            "up": s.health.up,
            "error_kind": str(s.health.error_kind) if s.health.error_kind else None,
            "error": s.health.error,
        }
        for s in exp.sources
        if s not in exp.targets
    ]
    for entry, s in zip(collectors, [s for s in exp.sources if s not in exp.targets], strict=True):
        # Bounded event queues report their fill (a `queue_depth`, or a queue.Queue `queue`).
        depth = getattr(s, "queue_depth", None) or getattr(getattr(s, "queue", None), "qsize", None)
        if depth is not None:
            entry["queue_depth"] = depth() if callable(depth) else depth
    return {
        "version": __version__,
        "window_seconds": exp.cfg.window,
        "interval_seconds": exp.cfg.interval,
        "cycles": exp.cycles,
        "last_cycle": exp.last_cycle,
        "targets": targets,
        "collectors": collectors,
        "runtime": _runtime_json(),
    }


def _runtime_json() -> dict[str, Any]:
    """The process's own resource use, for soak tests and leak hunting."""
    try:
        tasks: int | None = len(asyncio.all_tasks())
    except RuntimeError:  # no running loop (called outside the server)
        tasks = None
    return {"asyncio_tasks": tasks}


def advice_doc(exp: Exporter) -> dict[str, Any]:
    items = advice_items(exp)  # advice_json() plus what the status page's card shows
    return {"version": __version__, "cycles": exp.cycles, "advice": items}


async def advice(request: web.Request) -> web.Response:
    return web.json_response(advice_doc(request.app[EXPORTER_KEY]))


async def status(request: web.Request) -> web.Response:
    return web.json_response(status_json(request.app[EXPORTER_KEY]))


async def index(request: web.Request) -> web.Response:
    exp = request.app[EXPORTER_KEY]
    page = render_html(status_view(exp, exp.clock(), advice_items(exp)))
    return web.Response(text=page, content_type="text/html")


# Request limits: every endpoint is a GET without a body, on a fixed path.
MAX_BODY_BYTES = 64 * 1024
MAX_LINE_SIZE = 4096  # request line (method, path, query) and header lines
MAX_FIELD_SIZE = 8190  # one header value
MAX_HEADERS = 64
KEEPALIVE_TIMEOUT = 75.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _security_middlewares(web_config: WebConfig) -> list[Any]:
    """Rate limit, client-certificate SANs and basic auth, in that order, on every path."""
    out: list[Any] = []
    headers = dict(web_config.headers)
    if web_config.rate_limit is not None:
        bucket = TokenBucket(web_config.rate_limit)

        @web.middleware
        async def rate_limit(request: web.Request, handler: Handler) -> web.StreamResponse:
            if not bucket.take():
                return web.Response(status=429, text="too many requests\n", headers=headers)
            return await handler(request)

        out.append(rate_limit)
    tls = web_config.tls
    if tls is not None and tls.client_allowed_sans:
        allowed = set(tls.client_allowed_sans)

        @web.middleware
        async def client_sans(request: web.Request, handler: Handler) -> web.StreamResponse:
            transport = request.transport
            cert = transport.get_extra_info("peercert") if transport is not None else None
            if not peer_sans(cert) & allowed:
                return web.Response(status=403, text="client certificate not allowed\n")
            return await handler(request)

        out.append(client_sans)
    if web_config.users:
        auth = BasicAuth(web_config.users)
        challenge = {**headers, "WWW-Authenticate": 'Basic realm="kv-offload-exporter"'}

        @web.middleware
        async def basic_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            ok = False
            if scheme.lower() == "basic" and token:
                try:
                    user, sep, password = base64.b64decode(token, validate=True).partition(b":")
                    if sep:
                        ok = await auth.verify(user.decode("utf-8"), password)
                except (binascii.Error, UnicodeDecodeError):
                    ok = False
            if not ok:
                return web.Response(status=401, text="unauthorized\n", headers=challenge)
            return await handler(request)

        out.append(basic_auth)
    if headers:

        @web.middleware
        async def add_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
            resp = await handler(request)
            resp.headers.update(headers)
            return resp

        out.insert(0, add_headers)
    return out


def make_app(
    exporter: Exporter, *, run_loop: bool = True, web_config: WebConfig | None = None
) -> web.Application:
    # Requests are small GETs; cap what a client may send (no endpoint takes a body).
    # No handler reads a URL, host or file path from the request: the routes are fixed.
    app = web.Application(
        client_max_size=MAX_BODY_BYTES,
        middlewares=_security_middlewares(web_config) if web_config else (),
    )
    app[EXPORTER_KEY] = exporter
    app.router.add_get("/", index)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/api/v1/status", status)
    app.router.add_get("/advice", advice)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await exporter.start()
        if run_loop:
            app[LOOP_KEY] = asyncio.create_task(exporter.run_forever(), name="collect")
        yield
        task = app.get(LOOP_KEY)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await exporter.stop()

    app.cleanup_ctx.append(lifecycle)
    return app


async def serve(exporter: Exporter, host: str, port: int) -> None:
    path = getattr(exporter.cfg, "web_config_file", "")
    web_config = load_web_config(path) if path else None
    app = make_app(exporter, web_config=web_config)
    runner = web.AppRunner(
        app,
        access_log=None,
        max_line_size=MAX_LINE_SIZE,
        max_field_size=MAX_FIELD_SIZE,
        max_headers=MAX_HEADERS,
        keepalive_timeout=KEEPALIVE_TIMEOUT,
    )
    await runner.setup()
    tls = web_config.tls if web_config else None
    site = web.TCPSite(runner, host, port, ssl_context=tls.context() if tls else None)
    await site.start()
    log_event(
        log,
        logging.INFO,
        "listening",
        address=f"{host}:{port}",
        tls=tls is not None,
        basic_auth=bool(web_config and web_config.users),
    )
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
