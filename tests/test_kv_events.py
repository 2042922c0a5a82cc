"""KV-event consumer: wire decoding, the ZMQ receiver (gaps, replay, restarts, floods),
and the source end to end on real sockets bound to 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter import expfmt
from exporter.kvevents_codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    Message,
    decode_batch,
    decode_frames,
    decode_payload,
    decode_record,
    encode_record,
    read_file,
)
from exporter.model.derive.engines import DeriveSettings, derive_target
from exporter.sources import CollectError
from exporter.sources.kv_events.source import (
    RESTART,
    KvEventsSettings,
    KvEventsSource,
    Receiver,
    ReceiverCounters,
    StreamSpec,
    streams_from_sources,
)
from exporter.sources.vllm_http import TargetConfig, VllmTarget
from exporter.vllm_metrics import WANTED, normalise
from testbed.procs import free_port
from tests.test_whatif_synth import abcab_messages

FIXTURES = Path(__file__).parent / "fixtures"
CPU_EVENTS = FIXTURES / "vllm-0.32.0-cpu" / "kv-events.jsonl"
A_NOOFFLOAD = FIXTURES / "vllm-0.26.0-h200" / "a_nooffload"
ENC = msgspec.msgpack.Encoder()


# --- codec -------------------------------------------------------------------------------


def test_decode_map_events_as_vllm_032_sends_them() -> None:
    line = CPU_EVENTS.read_text().splitlines()[1]
    msg = decode_record(line)
    assert msg.seq == 1 and msg.topic == "kv" and msg.batch.dp_rank == 0
    kinds = [type(e) for e in msg.batch.events]
    assert kinds.count(BlockRemoved) == 6 and kinds[-1] is BlockStored
    stored = msg.batch.events[-1]
    assert isinstance(stored, BlockStored)
    assert len(stored.hashes) == 12 and stored.block_size == 128 and stored.medium == "GPU"
    assert stored.num_tokens == 1536


def test_decode_positional_events_and_bytes_hashes() -> None:
    h = bytes(range(32))
    folded = int.from_bytes(h, "big") & ((1 << 64) - 1)  # vLLM's int conversion
    payload = ENC.encode(
        [
            1.5,
            [
                ["BlockStored", [h], None, [1, 2], 16, None, "CPU"],
                ["BlockStored", [7], 3, [1], 16, None],  # before the medium field
                ["BlockRemoved", [h], "GPU"],
                ["AllBlocksCleared"],
            ],
            2,
        ]
    )
    batch, _ = decode_payload(payload)
    a, b, c, d = batch.events
    assert isinstance(a, BlockStored) and a.hashes == (folded,) and a.medium == "CPU"
    assert isinstance(b, BlockStored) and b.medium == "GPU" and b.parent == 3
    assert isinstance(c, BlockRemoved) and c.hashes == (folded,)
    assert isinstance(d, AllBlocksCleared)
    assert batch.dp_rank == 2


def test_decode_batch_as_a_map_from_older_releases() -> None:
    batch = decode_batch({"ts": 3.0, "events": [{"type": "AllBlocksCleared"}]})
    assert batch.ts == 3.0 and batch.dp_rank is None and len(batch.events) == 1


@pytest.mark.parametrize(
    "payload",
    [
        [1.0, [{"type": "Nope"}], 0],
        [1.0, [{"type": "BlockStored", "block_hashes": "x"}], 0],
        [float("nan"), [], 0],
        [1.0, [], -1],
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}], 0],
        "text",
        [1.0],
    ],
)
def test_decode_rejects_malformed_batches(payload: Any) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_decode_frames_checks_shape() -> None:
    payload = ENC.encode([1.0, [], 0])
    assert decode_frames([b"kv", (5).to_bytes(8, "big"), payload]).seq == 5
    for frames in ([b"kv", b"\x00", payload], [b"kv", payload], [b"kv", b"\0" * 8, b"\xc1"]):
        with pytest.raises(DecodeError):
            decode_frames(frames)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decode_payload_never_raises_anything_but_decode_error(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode_payload(data)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
        max_leaves=20,
    )
)
def test_decode_batch_fuzz(doc: Any) -> None:
    with contextlib.suppress(DecodeError):
        decode_batch(doc)


def test_fast_decoder_agrees_with_the_generic_one() -> None:
    for line in CPU_EVENTS.read_text().splitlines():
        payload = ENC.encode(json.loads(line)["payload"])
        fast, raw = decode_payload(payload, keep_raw=False)
        slow, _ = decode_payload(payload)
        assert raw is None and fast == slow
    # Older layouts fall back to the generic path.
    legacy = ENC.encode([1.0, [["BlockRemoved", [5], "GPU"]], 0])
    assert decode_payload(legacy, keep_raw=False)[0].events == (BlockRemoved((5,), "GPU", 0),)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fast_decoder_never_raises_anything_but_decode_error(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode_payload(data, keep_raw=False)


def test_records_survive_values_json_cannot_hold() -> None:
    # A msgpack Ext among the token ids (one flipped byte of a real payload) must not stop
    # --record-events: the batch is written and reads back the same.
    ext = msgspec.msgpack.Ext(1, b"x")
    event = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, ext], "block_size": 16}
    msg = decode_frames([b"kv", (0).to_bytes(8, "big"), ENC.encode([1.0, [event], 0])])
    assert decode_record(encode_record(msg)).batch == msg.batch


def test_record_roundtrip_of_the_recorded_file() -> None:
    for line in CPU_EVENTS.read_text().splitlines():
        msg = decode_record(line)
        again = decode_record(encode_record(msg))
        assert again.batch == msg.batch and again.seq == msg.seq


# --- discovery ---------------------------------------------------------------------------


def test_streams_from_kv_event_sources() -> None:
    doc = {
        "0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5560", "topic": "kv"},
        "1": {"endpoint": "tcp://*:5558", "replay_endpoint": None},
        "2": {"endpoint": "tcp://exporter:5559"},
        "3": {"endpoint": "inproc://cache_dp3"},
    }
    streams = streams_from_sources(doc, "10.1.2.3")
    assert streams == [
        StreamSpec(0, "tcp://10.1.2.3:5557", False, "tcp://10.1.2.3:5560"),
        StreamSpec(1, "tcp://10.1.2.3:5558", False, None),
        StreamSpec(2, "tcp://exporter:5559", True, None),
    ]
    assert streams_from_sources({}, "h") == []
    with pytest.raises(ValueError):
        streams_from_sources({"x": {"endpoint": "tcp://*:1"}}, "h")


# --- receiver on real sockets ------------------------------------------------------------


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

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, _, start = self.sock.recv_multipart()
            first = int.from_bytes(start, "big")
            self.requests.append(first)
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
    ctx: zmq.Context[Any], spec: StreamSpec, q: queue.Queue[Any]
) -> tuple[Receiver, ReceiverCounters, threading.Event]:
    counters = ReceiverCounters()
    stop = threading.Event()
    r = Receiver(ctx, [spec], q, counters, stop, replay_timeout=2.0)
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


def test_receiver_replays_a_gap_in_order(ctx: zmq.Context[Any]) -> None:
    port, rport = free_port(), free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    buffer: dict[int, list[bytes]] = {}
    replay = FakeReplay(ctx, f"tcp://127.0.0.1:{rport}", buffer)
    replay.start()
    q: queue.Queue[Any] = queue.Queue(100)
    spec = StreamSpec(0, f"tcp://127.0.0.1:{port}", False, f"tcp://127.0.0.1:{rport}")
    r, counters, stop = start_receiver(ctx, spec, q)
    try:
        base = join_pub(pub, q)
        for seq in range(base, base + 6):
            buffer[seq] = frames(seq)
            if seq not in (base + 2, base + 3):  # the PUB drops two batches
                pub.send_multipart(frames(seq))
        wait_for(lambda: q.qsize() >= 6)
        seqs = [item[1] for item in drain(q)]
        assert seqs == list(range(base, base + 6))
        c = counters.streams[0]
        assert (c.gaps, c.replayed, c.lost) == (1, 2, 0)
        assert replay.requests == [base + 2]
    finally:
        stop.set()
        r.join(5)
        replay.stop.set()
        replay.join(5)
        pub.close(linger=0)


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
        wait_for(lambda: counters.streams[0].batches >= 50)
        assert q.qsize() == 2 and counters.dropped >= 48
    finally:
        stop.set()
        r.join(5)
        pub.close(linger=0)


# --- the source end to end ---------------------------------------------------------------


def h200_target(t0: float, t1: float) -> VllmTarget:
    """A target whose window holds a_nooffload's real scrapes, stamped t0 and t1."""
    target = VllmTarget(
        TargetConfig(url="http://127.0.0.1:1"), window_seconds=3600, timeout=1, max_body_bytes=1
    )
    for name, ts in (("metrics_before.txt", t0), ("metrics_after.txt", t1)):
        samples = expfmt.parse((A_NOOFFLOAD / name).read_text(), WANTED)
        target.window.add(normalise(samples, ts))
    return target


def families_by_name(fams: Any) -> dict[str, list[tuple[tuple[str, ...], float]]]:
    return {f._def.name: f.samples for f in fams}


async def wait_async(cond: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_source_predicts_the_h200_offload_share(tmp_path: Path) -> None:
    """Events of the no-offload workload through ZMQ -> the what-if ratio at 0.5 GiB."""
    msgs = abcab_messages()
    t_first, t_last = msgs[0].batch.ts, msgs[-1].batch.ts
    target = h200_target(t_first - 5, t_last + 5)
    port = free_port()
    record = tmp_path / "events.jsonl"
    settings_ = KvEventsSettings(
        bind=(f"tcp://127.0.0.1:{port}",),
        sizes_bytes=(64 << 20, 1 << 29, 1 << 30),
        record_path=str(record),
    )
    source = KvEventsSource(target, settings_)
    await source.start()
    ctx: zmq.Context[Any] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")
    try:
        derived = {"127.0.0.1:1": derive_target(target.window, t_last, DeriveSettings(1e9))}
        # Before the bytes per block are known nothing is simulated: no what-if series.
        fams = families_by_name(source.derived_families(derived))
        assert fams["kvoffload_whatif_offload_hit_ratio"] == []
        assert source._configs[0].capacities == (36, 292, 584)
        sim = source.simulator
        assert sim is not None
        await wait_async(lambda: 0 in sim.engines and sim.engines[0].config is not None)
        # Warm-up batches (empty, older than the window) beat ZMQ's slow joiner.
        seq = 0
        while source.counters.streams.get(0) is None:
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), ENC.encode([t_first - 60, [], 0])])
            seq += 1
            await asyncio.sleep(0.05)
        for m in msgs:
            payload = ENC.encode([m.batch.ts, m.raw[1], 0])
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
            seq += 1
        receiver = source.receiver
        assert receiver is not None
        received = source.counters.streams[0]
        await wait_async(
            lambda: (
                receiver._expected.get(0) == seq
                and sim.processed == received.batches
                and sum(e.batches for e in sim.snapshots.values()) == received.batches
            )
        )
        await source.collect()
        fams = families_by_name(source.derived_families(derived))
        ratios = {labels[3]: v for labels, v in fams["kvoffload_whatif_offload_hit_ratio"]}
        # b_offload observed 7360 external_kv_transfer tokens of 40000 prompt tokens.
        assert ratios[str(1 << 29)] == pytest.approx(7360 / 40000)
        assert ratios[str(64 << 20)] == pytest.approx(0.0)
        assert ratios[str(1 << 30)] == pytest.approx(8080 / 40000)
        assert fams["kvoffload_whatif_configured_hit_ratio"] == []  # offload is off in (a)
        base = families_by_name(source.families())
        labels = ("127.0.0.1:1", "qwen3-dummy", "0")
        assert dict(base["kvoffload_recomputed_after_eviction_tokens_total"]) == {
            labels: 5 * 1600.0
        }
        events = {k[3:]: v for k, v in base["kvoffload_kv_events_total"]}
        assert events[("BlockStored", "GPU")] == 25  # one per request without offload
        resident = {k[3]: v for k, v in base["kvoffload_kv_resident_blocks"]}
        assert resident == {"GPU": 145.0, "CPU": 0.0}
        d = derived["127.0.0.1:1"][0]
        state = source.whatif_state("127.0.0.1:1", d.key, d)
        assert state is not None
        assert state.recomputed_after_eviction_tokens == 8000
        assert [p.hit_ratio for p in state.points] == [pytest.approx(v) for v in (0, 0.184, 0.202)]
    finally:
        pub.close(linger=0)
        ctx.term()
        await source.stop()
    lines = record.read_text().splitlines()
    assert len(lines) == received.batches
    replayed = [decode_record(line) for line in lines][-len(msgs) :]
    assert [r.batch.events for r in replayed] == [m.batch.events for m in msgs]


async def test_source_discovers_endpoints_from_vllm() -> None:
    app = web.Application()
    port = free_port()
    answers: list[Any] = [web.Response(status=404), web.json_response({})]
    asked: list[int] = []

    async def sources(_: web.Request) -> web.StreamResponse:
        asked.append(1)
        if answers:
            return answers.pop(0)
        return web.json_response({"0": {"endpoint": f"tcp://*:{port + 0}", "topic": "kv"}})

    app.router.add_get("/kv_event_sources", sources)
    runner = web.AppRunner(app)
    await runner.setup()
    http_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", http_port).start()
    target = VllmTarget(
        TargetConfig(url=f"http://127.0.0.1:{http_port}"),
        window_seconds=60,
        timeout=1,
        max_body_bytes=1,
    )
    source = KvEventsSource(target, KvEventsSettings())
    try:
        await source.start()
        for _ in range(2):  # 404 (older vLLM), then {} (events off): absent, not errors
            with pytest.raises(CollectError) as err:
                await source.collect()
            assert err.value.absent
            with pytest.raises(CollectError):  # backed off: vLLM is not asked again at once
                await source.collect()
            source._discover_after = 0.0  # skip the rest of the back-off
        assert len(asked) == 2
        await source.collect()
        assert source.streams == [StreamSpec(0, f"tcp://127.0.0.1:{port}", False, None)]
        assert source.receiver is not None and source.receiver.is_alive()
    finally:
        await source.stop()
        await runner.cleanup()


def test_simulator_counts_bad_payloads_and_restarts() -> None:
    from exporter.sources.kv_events.source import Simulator

    sim = Simulator(queue.Queue(), KvEventsSettings(), threading.Event())
    good = ENC.encode([1.0, [{"type": "BlockStored", "block_hashes": [1, 2], "block_size": 16}], 0])
    sim.handle((0, 0, b"kv", good))
    sim.handle((0, 1, b"kv", b"\xc1garbage"))
    assert sim.bad_payloads == 1 and sim.engines[0].builder.gpu_resident == 2
    sim.handle((0, RESTART, b"", b""))
    assert sim.engines[0].builder.gpu_resident == 0


def test_recorded_file_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text(
        CPU_EVENTS.read_text().splitlines()[0] + "\nnot json\n" + json.dumps({"seq": 1}) + "\n"
    )
    from exporter.kvevents_codec import ReadStats

    stats = ReadStats()
    got: list[Message] = list(read_file(path, stats))
    assert len(got) == 1 and stats.bad_lines == 2


# --- configuration -----------------------------------------------------------------------


def _load(argv: list[str], yaml_text: str | None = None, tmp: Path | None = None) -> Any:
    import argparse

    from exporter.config import add_arguments, load_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    if yaml_text is not None:
        assert tmp is not None
        (tmp / "c.yaml").write_text(yaml_text)
        argv = [*argv, "--config", str(tmp / "c.yaml")]
    return load_config(parser.parse_args(argv), environ={})


def test_flags_become_kv_event_settings() -> None:
    from exporter.sources.kv_events.source import settings_for

    cfg = _load(
        [
            "--vllm-url",
            "http://127.0.0.1:8000",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:5557,tcp://127.0.0.1:5558",
            "--kv-events-replay-endpoint",
            "tcp://127.0.0.1:5560",
            "--whatif-sizes",
            "0.5GiB,1GiB",
            "--whatif-policy",
            "arc",
            "--record-events",
            "/tmp/x.jsonl",
        ]
    )
    s = settings_for(cfg, cfg.targets[0])
    assert s.endpoints == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert s.sizes_bytes == (1 << 29, 1 << 30) and s.policy == "arc"
    assert s.record_path == "/tmp/x.jsonl"
    from exporter.sources.kv_events.source import streams_from

    assert [(x.rank, x.replay) for x in streams_from(s)] == [
        (0, "tcp://127.0.0.1:5560"),
        (1, None),
    ]


def test_per_target_endpoints_from_yaml(tmp_path: Path) -> None:
    from exporter.runtime import build_sources

    cfg = _load(
        ["--no-nvml", "--no-procfs", "--no-cgroup"],
        "targets:\n"
        "  - {url: 'http://a:8000', name: a, kv_events_endpoint: 'tcp://a:5557'}\n"
        "  - {url: 'http://b:8000', name: b, kv_events_bind: ['tcp://127.0.0.1:6000']}\n"
        "record_events: /tmp/ev.jsonl\n",
        tmp_path,
    )
    sources = [s for s in build_sources(cfg) if isinstance(s, KvEventsSource)]
    assert [(s.label, s.settings.endpoints, s.settings.bind) for s in sources] == [
        ("a", ("tcp://a:5557",), ()),
        ("b", (), ("tcp://127.0.0.1:6000",)),
    ]
    assert [s.settings.record_path for s in sources] == ["/tmp/ev.a.jsonl", "/tmp/ev.b.jsonl"]
    off = _load(["--vllm-url", "http://a:8000", "--no-kv-events", "--no-nvml"])
    assert not [s for s in build_sources(off) if isinstance(s, KvEventsSource)]


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--kv-events-endpoint", "localhost:5557"], "expected tcp://HOST:PORT"),
        (["--whatif-sample-rate", "0.1"], "needs --whatif-model stack"),
        (["--whatif-model", "stack", "--whatif-policy", "arc"], "plain LRU"),
        (["--kv-events-queue", "0"], "at least 1"),
        (["--whatif-sample-rate", "0", "--whatif-model", "stack"], "(0, 1]"),
        (
            ["--vllm-url", "http://b:1", "--kv-events-bind", "tcp://127.0.0.1:1"],
            "single target",
        ),
    ],
)
def test_bad_kv_event_options_are_config_errors(argv: list[str], problem: str) -> None:
    from exporter.config import ConfigError

    with pytest.raises(ConfigError) as err:
        _load(["--vllm-url", "http://a:8000", *argv])
    assert problem in str(err.value)


def test_simulation_coverage_starts_after_the_last_unsimulated_batch() -> None:
    from exporter.sources.kv_events.source import SimConfig, _EngineSim

    def batch(ts: float, h: int) -> Message:
        payload = [ts, [{"type": "BlockStored", "block_hashes": [h], "block_size": 16}], 0]
        return Message("kv", int(ts), decode_batch(payload), payload)

    late = _EngineSim(0, KvEventsSettings())
    late.process(batch(10.0, 1))  # seen before the bytes per block were known
    late.configure(SimConfig((4,), None))
    late.process(batch(20.0, 2))
    assert late.sim_start == pytest.approx(10.0)
    early = _EngineSim(0, KvEventsSettings())
    early.configure(SimConfig((4,), None))
    early.process(batch(5.0, 1))
    assert early.sim_start == 5.0
