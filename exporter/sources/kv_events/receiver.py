"""The ZMQ receiver thread of the KV-event collector.

It owns the sockets (a SUB per DP rank, connecting to a vLLM that binds or binding for a
vLLM that connects, and a DEALER per replay endpoint), only checks sequence numbers and
queues raw frames, so it keeps up with any publisher. On a gap it asks vLLM's replay
ROUTER for the missing batches and counts what did not come back; a sequence number
going backwards is a publisher restart. A full queue drops the batch and counts it: the
publisher is never slowed down. It never touches asyncio objects.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from exporter.logs import log_event
from exporter.sources.kv_events.discovery import StreamSpec

log = logging.getLogger("kvoe.kv_events")

# A forward jump this large is not a gap that replay could fill: treat it as a restart.
MAX_GAP = 1 << 24


@dataclass(slots=True)
class StreamCounters:
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0
    restarts: int = 0


@dataclass(slots=True)
class ReceiverCounters:
    """Written by the receiver thread only; plain ints, read racily but never torn."""

    streams: dict[int, StreamCounters] = field(default_factory=dict)
    dropped: int = 0
    bad_frames: int = 0
    error: str | None = None
    running: bool = False

    def stream(self, rank: int) -> StreamCounters:
        c = self.streams.get(rank)
        if c is None:
            c = self.streams[rank] = StreamCounters()
        return c


# Queue items: (rank, seq, topic, payload) or (rank, -1, b"", b"") for a restart.
QueueItem = tuple[int, int, bytes, bytes]
RESTART = -1
# vLLM answers a replay between publishes (every 0.1 s when idle); a loaded host takes longer.
REPLAY_TIMEOUT_SECONDS = 2.0


class Receiver(threading.Thread):
    def __init__(
        self,
        ctx: zmq.Context[Any],
        streams: Sequence[StreamSpec],
        out: queue.Queue[QueueItem],
        counters: ReceiverCounters,
        stop: threading.Event,
        *,
        topic: str = "",
        replay_timeout: float = REPLAY_TIMEOUT_SECONDS,
        rcvhwm: int = 100_000,
        name: str = "kvoe-kv-receiver",
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.ctx = ctx
        self.specs = list(streams)
        self.out = out
        self.counters = counters
        self.stop_event = stop
        self.topic = topic.encode()
        self.replay_timeout = replay_timeout
        self.rcvhwm = rcvhwm
        self.ready = threading.Event()
        self._subs: list[tuple[StreamSpec, zmq.Socket[Any]]] = []
        self._dealers: dict[int, zmq.Socket[Any]] = {}
        self._expected: dict[int, int] = {}

    def _open(self) -> None:
        for spec in self.specs:
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic)
            self._subs.append((spec, sock))
            if spec.bind:
                sock.bind(spec.address)
            else:
                sock.connect(spec.address)

    def _close(self) -> None:
        for _, sock in self._subs:
            sock.close(linger=0)
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._subs.clear()
        self._dealers.clear()

    def run(self) -> None:
        try:
            self._open()
        except zmq.ZMQError as exc:
            self.counters.error = f"cannot open KV-event sockets: {exc}"
            self._close()
            self.ready.set()
            return
        self.counters.running = True
        self.ready.set()
        poller = zmq.Poller()
        for _, sock in self._subs:
            poller.register(sock, zmq.POLLIN)
        try:
            while not self.stop_event.is_set():
                ready = dict(poller.poll(200))
                for spec, sock in self._subs:
                    if sock not in ready:
                        continue
                    for _ in range(1000):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.on_frames(spec, frames)
        except zmq.ZMQError as exc:
            self.counters.error = f"KV-event socket failed: {exc}"
        finally:
            self.counters.running = False
            self._close()

    def _put(self, item: QueueItem) -> None:
        try:
            self.out.put_nowait(item)
        except queue.Full:
            self.counters.dropped += 1

    def on_frames(self, spec: StreamSpec, frames: Sequence[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counters.bad_frames += 1
            return
        seq = int.from_bytes(frames[1], "big")
        c = self.counters.stream(spec.rank)
        expected = self._expected.get(spec.rank)
        if expected is not None and seq != expected:
            if expected < seq <= expected + MAX_GAP:
                c.gaps += 1
                got = self.replay(spec, expected, seq) if spec.replay else []
                for s, topic, payload in got:
                    self._put((spec.rank, s, topic, payload))
                c.replayed += len(got)
                c.lost += seq - expected - len(got)
                c.batches += len(got)
            else:
                # Sequence numbers restart at 0 with a new publisher: caches are cold again.
                c.restarts += 1
                self._put((spec.rank, RESTART, b"", b""))
        self._expected[spec.rank] = seq + 1
        c.batches += 1
        self._put((spec.rank, seq, frames[0], frames[2]))

    def _dealer(self, spec: StreamSpec) -> zmq.Socket[Any]:
        sock = self._dealers.get(spec.rank)
        if sock is None:
            assert spec.replay is not None
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(spec.replay)
            self._dealers[spec.rank] = sock
        return sock

    def replay(self, spec: StreamSpec, start: int, stop: int) -> list[tuple[int, bytes, bytes]]:
        """Batches start..stop-1 from vLLM's replay buffer, in order; missing ones skipped."""
        got: dict[int, tuple[bytes, bytes]] = {}
        try:
            sock = self._dealer(spec)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                    # A late answer would confuse the next request: start a fresh socket.
                    self._dealers.pop(spec.rank).close(linger=0)
                    log_event(
                        log,
                        logging.WARNING,
                        "kv_events_replay_timed_out",
                        rank=spec.rank,
                        first_seq=start,
                        missing=stop - start,
                        received=sum(1 for s in got if s < stop),
                        timeout_seconds=self.replay_timeout,
                    )
                    break
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:
                    topic, seq_frame, payload = frames
                elif len(frames) == 2:  # older vLLM: (seq, payload) without the topic
                    topic, (seq_frame, payload) = b"", frames
                else:
                    self.counters.bad_frames += 1
                    continue
                if len(seq_frame) != 8:
                    self.counters.bad_frames += 1
                    continue
                seq = int.from_bytes(seq_frame, "big", signed=True)
                if seq == -1:
                    break
                if start <= seq < stop:
                    got[seq] = (topic, payload)
        except zmq.ZMQError as exc:
            log_event(log, logging.WARNING, "kv_events_replay_failed", error=str(exc))
            broken = self._dealers.pop(spec.rank, None)
            if broken is not None:
                broken.close(linger=0)
        return [(s, *got[s]) for s in sorted(got)]
