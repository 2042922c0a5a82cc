"""KV-event source: vLLM's ZMQ KV-cache events, decoded, in arrival order.

The receiver thread (`receiver.py`) owns the sockets and queues raw frames into a bounded
queue. `collect()` drains the queue, decodes the payloads (off the event loop when the
batch is large or --record-events is on), appends each message to the --record-events
file, and publishes a `KvEventsSnapshot`: the transport counters and the decoded items
since the last collect (messages and publisher restarts, in order). What the items mean
(requests, the what-if simulation) is the model's business (exporter.model.whatif); this
module does I/O only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import zmq

from exporter.kvevents_codec import DecodeError, Message, decode_payload, encode_record
from exporter.logs import log_event
from exporter.options import TargetConfig
from exporter.sources import Clock, CollectError, ErrorKind, Health
from exporter.sources.kv_events.discovery import StreamSpec, discover, streams_from
from exporter.sources.kv_events.receiver import (
    REPLAY_TIMEOUT_SECONDS,
    RESTART,
    QueueItem,
    Receiver,
    ReceiverCounters,
    StreamCounters,
)

log = logging.getLogger("kvoe.kv_events")

# A vLLM without KV events (or without /kv_event_sources) is asked again this often.
DISCOVERY_RETRY_SECONDS = 30.0
# Up to this many queued batches are decoded on the event loop; more go to a thread.
DECODE_INLINE_MAX = 64


@dataclass(frozen=True, slots=True)
class KvEventsSettings:
    """Transport settings; the simulation's are the model's WhatIfSettings."""

    endpoints: tuple[str, ...] = ()  # vLLM binds, the exporter connects (one per DP rank)
    bind: tuple[str, ...] = ()  # vLLM connects, the exporter binds (one per DP rank)
    replay_endpoints: tuple[str, ...] = ()  # vLLM's replay ROUTER per DP rank
    queue_size: int = 10_000
    record_path: str = ""
    topic: str = ""
    replay_timeout: float = REPLAY_TIMEOUT_SECONDS
    discovery_timeout: float = 5.0


@dataclass(frozen=True, slots=True)
class StreamStats:
    """One stream's transport counters (totals since the source started)."""

    batches: int
    gaps: int
    replayed: int
    lost: int
    restarts: int

    @staticmethod
    def of(c: StreamCounters) -> StreamStats:
        return StreamStats(c.batches, c.gaps, c.replayed, c.lost, c.restarts)


@dataclass(frozen=True, slots=True)
class StreamItem:
    """One item of a stream, in arrival order."""

    rank: int  # the stream's DP rank (a batch's own dp_rank, when set, names its engine)
    message: Message | None  # None: the publisher restarted (sequence went back): caches cold


@dataclass(frozen=True, slots=True)
class KvEventsSnapshot:
    streams: Mapping[int, StreamStats]  # by DP rank
    dropped: int  # batches dropped at the full queue, total
    queue_depth: int  # batches left in the queue after this collect's drain
    bad_frames: int  # malformed ZMQ messages, total
    bad_payloads: int  # payloads that did not decode, total
    decoded: int  # messages decoded, total
    items: tuple[StreamItem, ...]  # decoded since the previous collect, in arrival order


@dataclass(frozen=True, slots=True)
class _Decoded:
    items: tuple[StreamItem, ...]
    bad: int


class KvEventsSource:
    """One vLLM target's KV-event stream(s)."""

    def __init__(
        self,
        target: TargetConfig,
        settings: KvEventsSettings,
        *,
        clock: Clock = time.time,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.target = target
        self.settings = settings
        self.label = target.label
        self.name = f"kv_events:{self.label}"
        self.health = Health(self.name, clock)
        self._clock = clock
        self._ctx = context
        self._own_ctx = context is None
        self.queue: queue.Queue[QueueItem] = queue.Queue(maxsize=max(1, settings.queue_size))
        self.counters = ReceiverCounters()
        self._stop = threading.Event()
        self.receiver: Receiver | None = None
        self.streams: list[StreamSpec] = streams_from(
            settings.endpoints, settings.bind, settings.replay_endpoints
        )
        self._snapshot: KvEventsSnapshot | None = None
        self._inflight: asyncio.Future[_Decoded] | None = None
        self._bad_payloads = 0
        self._decoded = 0
        self._record: IO[str] | None = None
        self._record_failed = False
        self.record_errors = 0
        self._seen_gaps = 0
        self._seen_bad = 0
        self._discovery_error: CollectError | None = None
        self._discover_after = 0.0

    def snapshot(self) -> KvEventsSnapshot | None:
        """The last collect's snapshot; None until the streams are open."""
        return self._snapshot

    # --- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        self.health.started = True
        if self.streams:
            await self._launch(self.streams)

    async def _launch(self, streams: list[StreamSpec]) -> Receiver:
        if self._ctx is None:
            self._ctx = zmq.Context()
        self._stop.clear()
        self.streams = streams
        self.receiver = Receiver(
            self._ctx,
            streams,
            self.queue,
            self.counters,
            self._stop,
            topic=self.settings.topic,
            replay_timeout=self.settings.replay_timeout,
            rcvhwm=max(1000, self.settings.queue_size),
        )
        self.receiver.start()
        await asyncio.to_thread(self.receiver.ready.wait, 5.0)
        log_event(
            log,
            logging.INFO,
            "kv_events_streams",
            target=self.label,
            streams=[(s.rank, s.address, "bind" if s.bind else "connect") for s in streams],
        )
        return self.receiver

    async def stop(self) -> None:
        self._stop.set()
        if self.receiver is not None and self.receiver.is_alive():
            await asyncio.to_thread(self.receiver.join, 5.0)
        if self._inflight is not None:
            await asyncio.wait([self._inflight], timeout=5.0)
        if self._record is not None and (self._inflight is None or self._inflight.done()):
            with contextlib.suppress(OSError):
                self._record.close()
            self._record = None
        alive = self.receiver is not None and self.receiver.is_alive()
        if self._own_ctx and self._ctx is not None and not alive:
            self._ctx.term()
            self._ctx = None

    async def _discover(self) -> list[StreamSpec]:
        cfg = self.target
        return await discover(cfg.url, cfg.base_url, self.settings.discovery_timeout)

    # --- collection -------------------------------------------------------------------

    async def collect(self) -> None:
        if self._snapshot is not None and self._snapshot.items:
            # Items are handed over once: a collect that fails or is cancelled before its
            # own snapshot leaves none behind to be stepped twice.
            self._snapshot = replace(self._snapshot, items=())
        receiver = self.receiver
        if receiver is None:
            if self._discovery_error is not None and time.monotonic() < self._discover_after:
                raise self._discovery_error
            try:
                streams = await self._discover()
            except CollectError as err:
                self._discovery_error = err
                self._discover_after = time.monotonic() + DISCOVERY_RETRY_SECONDS
                raise
            self._discovery_error = None
            receiver = await self._launch(streams)
        decoded = await self._drain()
        self._bad_payloads += decoded.bad
        self._decoded += len(decoded.items) - sum(1 for i in decoded.items if i.message is None)
        c = self.counters
        self._snapshot = KvEventsSnapshot(
            # list() copies in one step: the receiver thread may add a stream meanwhile.
            streams={r: StreamStats.of(s) for r, s in sorted(list(c.streams.items()))},
            dropped=c.dropped,
            queue_depth=self.queue.qsize(),
            bad_frames=c.bad_frames,
            bad_payloads=self._bad_payloads,
            decoded=self._decoded,
            items=decoded.items,
        )
        if c.error is not None:
            raise CollectError(ErrorKind.UNAVAILABLE, c.error)
        if not receiver.is_alive():
            raise CollectError(ErrorKind.UNAVAILABLE, "KV-event receiver stopped")
        gaps = sum(s.gaps for s in self._snapshot.streams.values())
        for _ in range(gaps - self._seen_gaps):
            self.health.count(ErrorKind.SEQ_GAP)
        self._seen_gaps = gaps
        bad = self._snapshot.bad_frames + self._snapshot.bad_payloads
        for _ in range(bad - self._seen_bad):
            self.health.count(ErrorKind.PARSE)
        self._seen_bad = bad

    def _take(self) -> list[QueueItem]:
        out: list[QueueItem] = []
        for _ in range(self.queue.maxsize):  # bounded: the receiver keeps adding
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return out

    async def _drain(self) -> _Decoded:
        """The queued batches, decoded and recorded. A collect cancelled by its deadline
        leaves the decoding thread's result to the next collect."""
        if self._inflight is None:
            raw = self._take()
            if len(raw) <= DECODE_INLINE_MAX and not (raw and self.settings.record_path):
                return self._decode(raw)
            self._inflight = asyncio.ensure_future(asyncio.to_thread(self._decode, raw))
        done = await asyncio.shield(self._inflight)
        self._inflight = None
        return done

    def _decode(self, raw: Sequence[QueueItem]) -> _Decoded:
        record = bool(self.settings.record_path)
        items: list[StreamItem] = []
        bad = 0
        for rank, seq, topic, payload in raw:
            if seq == RESTART:
                items.append(StreamItem(rank, None))
                continue
            try:
                batch, raw_doc = decode_payload(payload, keep_raw=record)
            except DecodeError:
                bad += 1
                continue
            msg = Message(topic.decode("utf-8", "replace"), seq, batch, raw_doc)
            if record:
                self._write(msg)
            items.append(StreamItem(rank, msg))
        if record and self._record is not None and not self._record_failed:
            with contextlib.suppress(OSError):
                self._record.flush()
        return _Decoded(tuple(items), bad)

    def _write(self, msg: Message) -> None:
        if self._record_failed:
            return
        try:
            if self._record is None:
                # Kept open across collects and closed by stop().
                self._record = Path(self.settings.record_path).open("a", encoding="utf-8")  # noqa: SIM115
            self._record.write(encode_record(msg) + "\n")
        except (OSError, TypeError, ValueError) as exc:
            self._record_failed = True
            self.record_errors += 1
            log_event(
                log,
                logging.ERROR,
                "record_events_failed",
                path=self.settings.record_path,
                error=str(exc),
            )
