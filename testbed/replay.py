"""A stand-in vLLM /metrics endpoint that replays recorded expositions or misbehaves.

Offload cannot run on a CPU vLLM, so offload-enabled paths are tested by replaying
expositions recorded from a real vLLM on an H200. The same server injects faults:
HTTP errors, hangs, garbage, oversized and truncated bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from testbed.procs import free_port


@dataclass(frozen=True)
class Reply:
    body: bytes = b""
    status: int = 200
    delay: float = 0.0
    stream_bytes: int = 0  # >0: stream this many filler bytes instead of body
    truncate: bool = False  # close the connection mid-body
    content_type: str = "text/plain; version=0.0.4; charset=utf-8"


def text(body: str | bytes, **kw: object) -> Reply:
    return Reply(body=body.encode() if isinstance(body, str) else body, **kw)  # type: ignore[arg-type]


def files(paths: Sequence[Path]) -> list[Reply]:
    return [Reply(body=Path(p).read_bytes()) for p in paths]


@dataclass
class ReplayServer:
    replies: list[Reply] = field(default_factory=list)
    hold_last: bool = True  # after the script ends, keep serving the last reply
    version: str = "0.26.0"
    port: int = field(default_factory=free_port)
    requests: int = 0
    in_flight: int = 0  # requests being answered whose client is still connected
    max_in_flight: int = 0  # the most at once since start() (fault tests: no pile-up)
    _thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _runner: web.AppRunner | None = None
    _script: Callable[[int], Reply] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, replies: Sequence[Reply] | Callable[[int], Reply]) -> None:
        if callable(replies):
            self._script = replies
        else:
            self._script = None
            self.replies = list(replies)
        self.requests = 0

    def _pick(self) -> Reply:
        i = self.requests
        self.requests += 1
        if self._script is not None:
            return self._script(i)
        if not self.replies:
            return Reply(status=404)
        if i < len(self.replies):
            return self.replies[i]
        return self.replies[-1] if self.hold_last else self.replies[i % len(self.replies)]

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        reply = self._pick()
        if reply.delay:
            # A hang that ends when the client gives up, so in_flight counts live requests.
            loop = asyncio.get_running_loop()
            until = loop.time() + reply.delay
            while loop.time() < until:
                transport = request.transport
                if transport is None or transport.is_closing():
                    return web.Response(status=499)
                await asyncio.sleep(min(0.05, until - loop.time()))
        if reply.stream_bytes:
            resp = web.StreamResponse(status=reply.status)
            resp.content_type = "text/plain"
            await resp.prepare(request)
            chunk = b"# filler\n" * 7000
            sent = 0
            with contextlib.suppress(ConnectionResetError):
                while sent < reply.stream_bytes:
                    await resp.write(chunk)
                    sent += len(chunk)
            return resp
        if reply.truncate:
            resp = web.StreamResponse(
                status=reply.status, headers={"Content-Length": str(len(reply.body) * 2)}
            )
            await resp.prepare(request)
            await resp.write(reply.body)
            assert request.transport is not None
            request.transport.close()
            return resp
        return web.Response(
            body=reply.body, status=reply.status, headers={"Content-Type": reply.content_type}
        )

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.version})

    def start(self) -> ReplayServer:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_get("/metrics", self._metrics)
            app.router.add_get("/version", self._version)
            runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
            self._runner = runner
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="replay", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("replay server did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None
        self._thread = None

    def __enter__(self) -> ReplayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
