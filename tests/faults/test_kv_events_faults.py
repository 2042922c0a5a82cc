"""Fault matrix, KV events: a real pyzmq PUB socket on 127.0.0.1 against KvEventsSource.

The publisher speaks vLLM's wire format ([topic, 8-byte big-endian seq, msgpack
EventBatch]) and misbehaves: it skips sequence numbers, restarts with its sequence
back at 0, and floods far more batches than the exporter's bounded queue holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import pytest
import zmq

from exporter.model.whatif.engine import WhatIf, WhatIfSettings
from exporter.options import TargetConfig
from exporter.render.kv_events import kv_events_families
from exporter.sources import ErrorKind, execute
from exporter.sources.kv_events.source import KvEventsSettings, KvEventsSource
from exporter.sources.vllm_http import VllmTarget
from exporter.vllm_metrics import EngineKey, EngineSample, TargetSample
from testbed.procs import free_port

ENC = msgspec.msgpack.Encoder()
QUEUE = 4


def _batch(first_hash: int, blocks: int, ts: float) -> bytes:
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [first_hash + i],
            "parent_block_hash": None,
            "token_ids": list(range(16)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
        }
        for i in range(blocks)
    ]
    return ENC.encode([ts, events, 0])


@dataclass
class Publisher:
    ctx: zmq.Context
    address: str
    sock: zmq.Socket | None = None
    seq: int = 0
    next_hash: int = 1

    def open(self) -> None:
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 1_000_000)
        for _ in range(100):  # the old socket releases the port asynchronously
            try:
                self.sock.bind(self.address)
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE:
                    raise
                time.sleep(0.05)
        else:
            raise AssertionError(f"{self.address} stayed in use")
        self.seq = 0

    def close(self) -> None:
        assert self.sock is not None
        self.sock.close(linger=0)
        self.sock = None

    def send(self, blocks: int = 1) -> None:
        assert self.sock is not None
        payload = _batch(self.next_hash, blocks, time.time())
        self.next_hash += blocks
        self.sock.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


async def _until(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:.0f}s: {what}")
        await asyncio.sleep(0.02)


@dataclass
class Rig:
    src: KvEventsSource
    pub: Publisher
    target: VllmTarget  # its window names the engines of the KV-event families
    sim: WhatIf = field(default_factory=lambda: WhatIf(WhatIfSettings()))

    async def collect(self) -> None:
        """The exporter's cycle: collect, then step the what-if with the items."""
        await self.src.collect()
        self.step()

    def step(self) -> None:
        snap = self.src.snapshot()
        if snap is not None:
            self.sim.step(snap.items)

    async def execute(self) -> bool:
        ok = await execute(self.src, 5.0)
        self.step()
        return ok

    def series(self) -> dict[str, list[tuple[tuple[str, ...], float]]]:
        latest = self.target.window.latest
        keys = latest.engines if latest is not None else ()
        fams = kv_events_families(self.src.label, self.src.snapshot(), keys, self.sim.snapshots())
        return {f.definition.name: list(f.samples) for f in fams if len(f)}

    def stream(self):  # the receiver's counters of rank 0
        return self.src.counters.streams[0]

    async def until(self, what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
        """As _until, running the exporter's cycle (collect, step) first each time."""
        deadline = time.monotonic() + timeout
        while True:
            await self.collect()
            if check():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not reached within {timeout:.0f}s: {what}")
            await asyncio.sleep(0.02)

    async def join(self) -> None:
        """Send until the subscription is live (ZMQ's slow joiner): no gap is left."""
        start = self.src.counters.streams.get(0)
        seen = start.batches if start else 0
        for _ in range(500):
            self.pub.send()
            await asyncio.sleep(0.02)
            c = self.src.counters.streams.get(0)
            received = c is not None and c.batches > seen
            await self.collect()  # drained as the exporter's cycle would (QUEUE = 4)
            if received:
                return
        raise AssertionError("subscriber never received a batch")


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    address = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    pub = Publisher(ctx, address)
    pub.open()
    target = VllmTarget(
        TargetConfig(url="http://127.0.0.1:1"), window_seconds=60, timeout=1, max_body_bytes=1 << 20
    )
    # One scrape's worth of engine identity, so the KV-event families get their labels.
    es = EngineSample(counters={}, gauges={})
    target.window.add(TargetSample(ts=time.time(), engines={EngineKey("m", "0"): es}))
    src = KvEventsSource(target.config, KvEventsSettings(endpoints=(address,), queue_size=QUEUE))
    await src.start()
    try:
        yield Rig(src, pub, target)
    finally:
        await src.stop()
        if pub.sock is not None:
            pub.close()
        ctx.term()


async def test_sequence_gap_is_counted_and_visible(rig: Rig) -> None:
    await rig.join()
    before = rig.stream().batches
    for _ in range(5):
        rig.pub.send()
    await _until("5 in-order batches", lambda: rig.stream().batches == before + 5)
    assert rig.stream().gaps == 0
    rig.pub.seq += 3  # the publisher dropped three batches (PUB high-water mark)
    rig.pub.send()
    await _until("the batch after the gap", lambda: rig.stream().batches == before + 6)
    assert rig.stream().gaps == 1
    assert rig.stream().lost == 3  # no replay endpoint configured: lost, and said so
    assert await rig.execute()  # a gap is counted, the collector stays up
    assert rig.src.health.errors_total.get(ErrorKind.SEQ_GAP) == 1
    fams = rig.series()
    assert [v for _, v in fams["kvoffload_kv_event_gaps_total"]] == [1]
    assert [v for _, v in fams["kvoffload_kv_events_lost_total"]] == [3]


async def test_publisher_restart_resets_the_simulation_not_the_counters(rig: Rig) -> None:
    await rig.join()
    for _ in range(10):
        rig.pub.send()
        await asyncio.sleep(0.05)  # paced: nothing dropped at the queue (QUEUE = 4)
        await rig.collect()  # the exporter's cycle drains it
    await rig.until("batches simulated", lambda: rig.src.queue.qsize() == 0)
    assert rig.src.counters.dropped == 0
    await rig.until(
        "blocks resident",
        lambda: any(
            v >= 10 and labels[-1] == "GPU"
            for labels, v in rig.series().get("kvoffload_kv_resident_blocks", [])
        ),
    )
    # vLLM restarts: a new publisher on the same address, sequence back at 0.
    rig.pub.close()
    rig.pub.open()
    await rig.join()
    assert rig.stream().restarts == 1
    assert rig.stream().gaps == 0  # a restart is not a gap
    assert await rig.execute()
    restarts = rig.series()["kvoffload_kv_event_publisher_restarts_total"]
    assert [v for _, v in restarts] == [1.0]

    def resident() -> float:
        fams = rig.series()
        return next(v for labels, v in fams["kvoffload_kv_resident_blocks"] if labels[-1] == "GPU")

    # The simulated cache starts cold: only blocks stored since the restart are resident.
    since = rig.pub.seq
    await rig.until("restart applied", lambda: resident() <= since)
    assert resident() <= since
    assert rig.src.health.errors_total.get(ErrorKind.SEQ_GAP) is None


async def test_flood_beyond_the_queue_drops_and_counts(rig: Rig) -> None:
    await rig.join()
    received0 = rig.stream().batches
    processed0 = rig.sim.processed
    sent = 3000
    for _ in range(sent):
        rig.pub.send(blocks=64)  # heavy batches: the simulator cannot keep up
    await _until("all batches received", lambda: rig.stream().batches >= received0 + sent, 60)
    await rig.until("queue drained", lambda: rig.src.queue.qsize() == 0, 60)
    sim = rig.sim
    await rig.until(
        "simulator idle",
        lambda: (
            sim.processed + rig.src.counters.dropped
            == rig.stream().batches - received0 + processed0
        ),
        30,
    )
    dropped = rig.src.counters.dropped
    assert dropped > 0
    assert rig.stream().gaps == 0  # dropped inside the exporter, not on the wire
    # Every received batch was either simulated or counted as dropped.
    assert sim.processed - processed0 + dropped == rig.stream().batches - received0
    assert await rig.execute()
    fams = rig.series()
    assert [v for _, v in fams["kvoffload_kv_events_dropped_total"]] == [dropped]
    assert all(v <= QUEUE for _, v in fams["kvoffload_kv_event_queue_depth"])
