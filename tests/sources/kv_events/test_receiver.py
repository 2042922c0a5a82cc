"""exporter/sources/kv_events/receiver.py: the ZMQ receiver on real sockets bound to
127.0.0.1 (gaps and replay, lost batches, restarts, garbage, a full queue)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import zmq

from exporter.sources.kv_events.discovery import StreamSpec
from exporter.sources.kv_events.receiver import RESTART, Receiver, ReceiverCounters
from testbed.procs import free_port

ENC = msgspec.msgpack.Encoder()


def frames(seq: int, events: list[dict[str, Any]] | None = None) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), ENC.encode([1000.0 + seq, events or [], 0])]


class FakeReplay(threading.Thread):
    """vLLM's replay ROUTER: [id, b"", start] -> buffered batches >= start, then -1."""

    def __init__(self, ctx: zmq.Context[Any], address: str, buffer: dict[int, list[bytes]]) -> None:
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.bind(address)
        self.buffer = buffer
        self.stop = threading.Event()
        self.requests: list[int] = []
        self.delay = 0.0  # seconds before answering: a vLLM busy with its engine

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, _, start = self.sock.recv_multipart()
            first = int.from_bytes(start, "big")
            self.requests.append(first)
            time.sleep(self.delay)
            for seq in sorted(self.buffer):
                if seq >= first:
                    self.sock.send_multipart([ident, b"", *self.buffer[seq]])
            self.sock.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        self.sock.close(linger=0)


@pytest.fixture()
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.term()


def drain(q: queue.Queue[Any]) -> list[Any]:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def start_receiver(
    ctx: zmq.Context[Any], spec: StreamSpec, q: queue.Queue[Any], replay_timeout: float = 2.0
) -> tuple[Receiver, ReceiverCounters, threading.Event]:
    counters = ReceiverCounters()
    stop = threading.Event()
    r = Receiver(ctx, [spec], q, counters, stop, replay_timeout=replay_timeout)
    r.start()
    assert r.ready.wait(5) and counters.error is None
    return r, counters, stop


def join_pub(pub: zmq.Socket[Any], q: queue.Queue[Any]) -> int:
    """Beat ZMQ's slow joiner: publish empty batches until one arrives; next free seq."""
    seq = 0
    deadline = time.monotonic() + 10
    while q.empty():
        assert time.monotonic() < deadline, "subscriber never joined"
        pub.send_multipart(frames(seq))
        seq += 1
        time.sleep(0.05)
    time.sleep(0.2)
    drain(q)
    return seq


def wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@dataclass
class ReplayRig:
    """A PUB, vLLM's replay ROUTER (FakeReplay) over `buffer`, and a receiver of both."""

    pub: zmq.Socket[Any]
    buffer: dict[int, list[bytes]]
    replay: FakeReplay
    q: queue.Queue[Any]
    counters: ReceiverCounters


@contextmanager
def replay_rig(ctx: zmq.Context[Any], replay_timeout: float = 2.0) -> Iterator[ReplayRig]:
    port, rport = free_port(), free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    buffer: dict[int, list[bytes]] = {}
    replay = FakeReplay(ctx, f"tcp://127.0.0.1:{rport}", buffer)
    replay.start()
    q: queue.Queue[Any] = queue.Queue(100)
    spec = StreamSpec(0, f"tcp://127.0.0.1:{port}", False, f"tcp://127.0.0.1:{rport}")
    r, counters, stop = start_receiver(ctx, spec, q, replay_timeout=replay_timeout)
    try:
        yield ReplayRig(pub, buffer, replay, q, counters)
    finally:
        stop.set()
        r.join(5)
        replay.stop.set()
        replay.join(5)
        pub.close(linger=0)


def test_receiver_replays_a_gap_in_order(ctx: zmq.Context[Any]) -> None:
    with replay_rig(ctx) as rig:
        base = join_pub(rig.pub, rig.q)
        for seq in range(base, base + 6):
            rig.buffer[seq] = frames(seq)
            if seq not in (base + 2, base + 3):  # the PUB drops two batches
                rig.pub.send_multipart(frames(seq))
        wait_for(lambda: rig.q.qsize() >= 6)
        seqs = [item[1] for item in drain(rig.q)]
        assert seqs == list(range(base, base + 6))
        c = rig.counters.streams[0]
        assert (c.gaps, c.replayed, c.lost) == (1, 2, 0)
        assert rig.replay.requests == [base + 2]


def test_a_late_replay_counts_as_lost_is_logged_and_does_not_confuse_the_next(
    ctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    with replay_rig(ctx, replay_timeout=0.2) as rig:
        rig.replay.delay = 1.0
        base = join_pub(rig.pub, rig.q)
        for seq in range(base, base + 3):
            rig.buffer[seq] = frames(seq)
        with caplog.at_level("WARNING", logger="kvoe.kv_events"):
            rig.pub.send_multipart(frames(base))
            rig.pub.send_multipart(frames(base + 2))  # base + 1 lost; the replay answers late
            wait_for(lambda: rig.q.qsize() >= 2)
        c = rig.counters.streams[0]
        assert (c.gaps, c.replayed, c.lost) == (1, 0, 1)
        assert [i[1] for i in drain(rig.q)] == [base, base + 2]
        assert any("kv_events_replay_timed_out" in m for m in caplog.messages), caplog.messages

        # The late answer (base + 1 and on) arrives on the closed socket, not on the next one.
        time.sleep(1.0)
        rig.replay.delay = 0.0
        for seq in range(base + 3, base + 6):
            rig.buffer[seq] = frames(seq)
        rig.pub.send_multipart(frames(base + 3))
        rig.pub.send_multipart(frames(base + 5))
        wait_for(lambda: rig.q.qsize() >= 3)
        assert [i[1] for i in drain(rig.q)] == [base + 3, base + 4, base + 5]
        assert (c.gaps, c.replayed, c.lost) == (2, 1, 1)
        assert rig.replay.requests == [base + 1, base + 4]


def test_receiver_counts_lost_batches_restarts_garbage_and_drops(ctx: zmq.Context[Any]) -> None:
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    q: queue.Queue[Any] = queue.Queue(1000)
    r, counters, stop = start_receiver(ctx, StreamSpec(0, f"tcp://127.0.0.1:{port}", False), q)
    try:
        base = join_pub(pub, q)
        pub.send_multipart(frames(base))
        pub.send_multipart(frames(base + 5))  # 4 lost, no replay endpoint
        pub.send_multipart([b"kv", b"short", b"x"])  # garbage
        pub.send_multipart([b"only-one-frame"])
        pub.send_multipart(frames(0))  # a new publisher starts over
        wait_for(lambda: q.qsize() >= 4 and counters.bad_frames >= 2)
        items = drain(q)
        assert [i[1] for i in items] == [base, base + 5, RESTART, 0]
        c = counters.streams[0]
        assert (c.gaps, c.lost, c.restarts) == (1, 4, 1)
        assert counters.bad_frames == 2
    finally:
        stop.set()
        r.join(5)
        pub.close(linger=0)


def test_receiver_never_blocks_on_a_full_queue(ctx: zmq.Context[Any]) -> None:
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    q: queue.Queue[Any] = queue.Queue(2)
    r, counters, stop = start_receiver(ctx, StreamSpec(0, f"tcp://127.0.0.1:{port}", False), q)
    try:
        base = join_pub(pub, q)
        for seq in range(base, base + 50):
            pub.send_multipart(frames(seq))
        # The receiver counts a batch before it offers it to the queue: wait for the drops
        # themselves, or the last one may still be on its way (CI saw 47 of 48 once).
        wait_for(lambda: counters.streams[0].batches >= 50 and counters.dropped >= 48)
        assert q.qsize() == 2
    finally:
        stop.set()
        r.join(5)
        pub.close(linger=0)
