"""The one interface every source implements, and the health bookkeeping they share.

A source owns its I/O: `collect()` refreshes its snapshot (raising CollectError on
failure), `snapshot()` hands the last one over as a typed frozen value without any I/O,
and `health` records outcomes so self-metrics look the same for every source. Sources
import nothing of exporter.model or exporter.render: the runtime turns snapshots into the
model's inputs, and exporter/render/ turns them into metric families.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from exporter.logs import log_event

log = logging.getLogger("kvoe.sources")

Clock = Callable[[], float]


class ErrorKind(StrEnum):
    TIMEOUT = "timeout"
    CONNECT = "connect"
    HTTP_STATUS = "http_status"
    PARSE = "parse"
    TOO_LARGE = "too_large"
    TRUNCATED = "truncated"
    INVALID_VALUE = "invalid_value"
    UNAVAILABLE = "unavailable"
    COUNTER_RESET = "counter_reset"
    SEQ_GAP = "seq_gap"
    INTERNAL = "internal"


class CollectError(Exception):
    """A failed collection with its kind; `absent` marks "nothing here" (no GPU, no pid)."""

    def __init__(self, kind: ErrorKind, message: str, *, absent: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.absent = absent


@dataclass(frozen=True, slots=True)
class SourceState:
    name: str
    up: bool
    started: bool
    last_success: float | None
    last_attempt: float | None
    duration: float | None
    error_kind: ErrorKind | None
    error: str | None
    errors_total: Mapping[ErrorKind, int]


class Health:
    """Outcome bookkeeping for one source; logs once per state change."""

    def __init__(self, name: str, clock: Clock = time.time) -> None:
        self.name = name
        self._clock = clock
        self.up = False
        self.started = False
        self.last_success: float | None = None
        self.last_attempt: float | None = None
        self.duration: float | None = None
        self.error_kind: ErrorKind | None = None
        self.error: str | None = None
        self.errors_total: dict[ErrorKind, int] = {}

    def count(self, kind: ErrorKind) -> None:
        """Count an event that is not a failed collection (a counter reset, a sequence gap)."""
        self.errors_total[kind] = self.errors_total.get(kind, 0) + 1

    def success(self, duration: float) -> None:
        now = self._clock()
        if not self.up:
            log_event(log, logging.INFO, "source_up", source=self.name)
        self.up = True
        self.last_success = now
        self.last_attempt = now
        self.duration = duration
        self.error_kind = None
        self.error = None

    def failure(self, err: CollectError, duration: float) -> None:
        changed = self.up or self.error_kind != err.kind or self.last_attempt is None
        self.up = False
        self.last_attempt = self._clock()
        self.duration = duration
        self.error_kind = err.kind
        self.error = err.message
        if not err.absent:
            self.count(err.kind)
        if changed:
            level = logging.DEBUG if err.absent else logging.WARNING
            log_event(
                log, level, "source_down", source=self.name, kind=str(err.kind), error=err.message
            )

    def state(self) -> SourceState:
        return SourceState(
            name=self.name,
            up=self.up,
            started=self.started,
            last_success=self.last_success,
            last_attempt=self.last_attempt,
            duration=self.duration,
            error_kind=self.error_kind,
            error=self.error,
            errors_total=dict(self.errors_total),
        )


@runtime_checkable
class Source(Protocol):
    name: str
    health: Health

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def collect(self) -> None: ...

    def snapshot(self) -> object | None: ...


async def execute(source: Source, timeout: float, timer: Clock = time.perf_counter) -> bool:
    """Run one collection under a deadline; never raises. Returns success.

    `timer` measures the collection's duration (a fixed one makes expositions repeatable)."""
    t0 = timer()
    try:
        await asyncio.wait_for(source.collect(), timeout)
    except CollectError as err:
        source.health.failure(err, timer() - t0)
        return False
    except TimeoutError:
        late = CollectError(ErrorKind.TIMEOUT, f"collection took longer than {timeout:g}s")
        source.health.failure(late, timer() - t0)
        return False
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the source boundary: a bug must not stop the loop
        log.exception("collector bug in %s", source.name)
        bug = CollectError(ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}")
        source.health.failure(bug, timer() - t0)
        return False
    source.health.success(timer() - t0)
    return True
