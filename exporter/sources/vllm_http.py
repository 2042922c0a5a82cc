"""vLLM target source: scrape one vLLM API server's /metrics into its sliding window."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from exporter import expfmt
from exporter.lmcache import lmcache_samples
from exporter.logs import log_event
from exporter.options import TargetConfig
from exporter.sources import Clock, CollectError, ErrorKind, Health, SourceState
from exporter.vllm_metrics import WANTED, normalise
from exporter.window import TargetWindow

log = logging.getLogger("kvoe.vllm")

TARGET_FAILURE_REASONS = (
    ErrorKind.TIMEOUT,
    ErrorKind.CONNECT,
    ErrorKind.HTTP_STATUS,
    ErrorKind.PARSE,
    ErrorKind.TOO_LARGE,
    ErrorKind.TRUNCATED,
    ErrorKind.INVALID_VALUE,
    ErrorKind.INTERNAL,
)


def _parse(body: bytes) -> list[expfmt.Sample]:
    """The wanted samples of a /metrics body, LMCache's series onto vLLM's engine key."""
    return lmcache_samples(expfmt.parse(body.decode("utf-8"), WANTED))


@dataclass(frozen=True, slots=True)
class TargetSnapshot:
    """One vLLM target after a collection. The window is the live one (it only grows at the
    next collect(), which the runtime does not overlap with reading it)."""

    config: TargetConfig
    window: TargetWindow
    version: str | None
    series_dropped_total: int
    health: SourceState
    body: bytes | None = None  # the last /metrics body read (None: the last scrape failed)


# (url, body size limit) -> body; raises CollectError. Replaces HTTP for recorded data.
Fetch = Callable[[str, int], Awaitable[bytes]]


class VllmTarget:
    """Scrapes one target; the window it fills is what derivations read."""

    def __init__(
        self,
        config: TargetConfig,
        *,
        window_seconds: float,
        timeout: float,
        max_body_bytes: int,
        clock: Clock = time.time,
        fetch: Fetch | None = None,
    ) -> None:
        self.config = config
        self._fetcher = fetch
        self.name = f"vllm:{config.label}"
        self.health = Health(self.name, clock)
        self.window = TargetWindow(window_seconds)
        self.timeout = timeout
        self.max_body_bytes = max_body_bytes
        self.version: str | None = None
        self.body: bytes | None = None
        self.invalid_series: tuple[str, ...] = ()
        self.series_dropped_total = 0
        self.dropped_engines = 0  # in the last scrape; logged when it changes
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._want_version = True

    async def start(self) -> None:
        self.health.started = True
        if self._fetcher is not None:
            return
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=2),
            headers={"User-Agent": "kv-offload-exporter"},
        )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _fetch(self, url: str, limit: int) -> bytes:
        if self._fetcher is not None:
            return await self._fetcher(url, limit)
        assert self._session is not None, "start() first"
        try:
            async with self._session.get(url) as resp:
                if resp.status != 200:
                    raise CollectError(ErrorKind.HTTP_STATUS, f"GET {url}: HTTP {resp.status}")
                if resp.content_length is not None and resp.content_length > limit:
                    raise CollectError(
                        ErrorKind.TOO_LARGE,
                        f"GET {url}: body of {resp.content_length} bytes exceeds {limit}",
                    )
                buf = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    buf += chunk
                    if len(buf) > limit:
                        raise CollectError(
                            ErrorKind.TOO_LARGE, f"GET {url}: body exceeds {limit} bytes"
                        )
                return bytes(buf)
        except TimeoutError:
            raise CollectError(
                ErrorKind.TIMEOUT, f"GET {url}: no answer in {self.timeout:g}s"
            ) from None
        except aiohttp.ClientConnectorError as exc:
            raise CollectError(ErrorKind.CONNECT, f"GET {url}: {exc.strerror or exc}") from None
        except aiohttp.ClientPayloadError as exc:
            raise CollectError(ErrorKind.TRUNCATED, f"GET {url}: truncated: {exc}") from None
        except aiohttp.ServerDisconnectedError as exc:
            raise CollectError(ErrorKind.CONNECT, f"GET {url}: disconnected: {exc}") from None
        except aiohttp.ClientError as exc:
            raise CollectError(ErrorKind.CONNECT, f"GET {url}: {exc}") from None

    async def collect(self) -> None:
        self.body = None
        body = await self._fetch(self.config.metrics_url, self.max_body_bytes)
        self.body = body
        try:
            # Parsing an 8-engine body takes a few ms of CPU: off the event loop, so
            # /metrics requests arriving meanwhile are not held behind it.
            samples = await asyncio.to_thread(_parse, body)
        except UnicodeDecodeError as exc:
            raise CollectError(ErrorKind.PARSE, f"body is not UTF-8: {exc}") from None
        except expfmt.ExpositionError as exc:
            raise CollectError(ErrorKind.PARSE, str(exc)) from None
        sample = normalise(
            samples,
            self._clock(),
            max_engines=self.config.max_engines,
            prefer=self.window.last_seen.keys(),
        )
        self._note_dropped(sample.dropped_series, sample.dropped_engines)
        if not sample.engines:
            raise CollectError(
                ErrorKind.PARSE,
                "no vllm:* series with model_name and engine labels: not a vLLM /metrics "
                "endpoint, or vLLM runs with --disable-log-stats",
            )
        if sample.invalid != self.invalid_series:
            if sample.invalid:
                log_event(
                    log,
                    logging.WARNING,
                    "invalid_series_dropped",
                    target=self.config.label,
                    series=list(sample.invalid),
                )
            self.invalid_series = sample.invalid
        if sample.invalid:
            self.health.count(ErrorKind.INVALID_VALUE)
        resets = self.window.add(sample)
        if resets:
            self.health.count(ErrorKind.COUNTER_RESET)
            self._want_version = True
            log_event(
                log,
                logging.WARNING,
                "counter_reset",
                target=self.config.label,
                engines=[f"{e.model_name}/{e.engine}" for e in resets],
            )
        if self._want_version:
            self._want_version = False
            await self._fetch_version()

    def _note_dropped(self, series: int, engines: int) -> None:
        self.series_dropped_total += series
        if engines != self.dropped_engines:
            log_event(
                log,
                logging.WARNING if engines else logging.INFO,
                "engine_cap_exceeded" if engines else "engine_cap_cleared",
                target=self.config.label,
                dropped_engines=engines,
                max_engines=self.config.max_engines,
            )
            self.dropped_engines = engines

    async def _fetch_version(self) -> None:
        # Best effort: an old vLLM or a proxy may not serve /version.
        try:
            body = await asyncio.wait_for(
                self._fetch(self.config.base_url + "/version", 1 << 14), self.timeout
            )
            version = json.loads(body).get("version")
            self.version = str(version) if version else None
        except (CollectError, TimeoutError, ValueError, AttributeError):
            self.version = None

    def snapshot(self) -> TargetSnapshot:
        """What this target's last scrapes left: the window and what was learnt on the way."""
        return TargetSnapshot(
            config=self.config,
            window=self.window,
            version=self.version,
            series_dropped_total=self.series_dropped_total,
            health=self.health.state(),
            body=self.body,
        )
