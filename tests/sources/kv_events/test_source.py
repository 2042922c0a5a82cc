"""exporter/sources/kv_events/source.py: the source end to end on real sockets bound to
127.0.0.1 (queue drained and decoded by collect(), --record-events, discovery) with its
items stepped through the what-if as the runtime does, its snapshot, and its settings
from the configuration."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from aiohttp import web

from exporter import expfmt
from exporter.catalogue import Family
from exporter.kvevents_codec import decode_record
from exporter.model.advisor.types import WhatIfState
from exporter.model.derive.engines import DeriveSettings, EngineDerived, derive_target
from exporter.model.whatif.engine import WhatIf, WhatIfSettings
from exporter.model.whatif.plan import sim_config
from exporter.model.whatif.view import engine_rank, policy_points, whatif_state
from exporter.options import TargetConfig
from exporter.render.kv_events import kv_events_families
from exporter.render.whatif import whatif_families
from exporter.runtime import kv_events_settings, whatif_settings
from exporter.sources import CollectError, ErrorKind, execute
from exporter.sources.kv_events.discovery import StreamSpec, streams_from
from exporter.sources.kv_events.receiver import RESTART, Receiver
from exporter.sources.kv_events.source import (
    DECODE_INLINE_MAX,
    KvEventsSettings,
    KvEventsSource,
    StreamStats,
)
from exporter.sources.vllm_http import VllmTarget
from exporter.vllm_metrics import WANTED, normalise
from testbed.procs import free_port
from tests.test_whatif_synth import abcab_messages

FIXTURES = Path(__file__).parents[2] / "fixtures"
A_NOOFFLOAD = FIXTURES / "vllm-0.26.0-h200" / "a_nooffload"
ENC = msgspec.msgpack.Encoder()


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


class Cycle:
    """What runtime.py and the model's Pipeline do with a KV-event source each cycle: step
    the what-if with the items of the collect, plan it, read it, render it."""

    def __init__(
        self, source: KvEventsSource, settings: WhatIfSettings, target: VllmTarget
    ) -> None:
        self.source = source
        self.target = target  # the scrape window the what-if is read over
        self.sim = WhatIf(settings)

    async def collect(self) -> None:
        await self.source.collect()
        snap = self.source.snapshot()
        assert snap is not None
        self.sim.step(snap.items)

    def state(self, d: EngineDerived) -> WhatIfState | None:
        rank = engine_rank(d.key)
        es = self.sim.snapshots().get(rank) if rank is not None else None
        return whatif_state(es, self.target.window, d, self.sim.settings.sizes_bytes)

    def whatif_families(self, derived: dict[str, list[EngineDerived]]) -> list[Family]:
        rows = []
        for d in derived.get(self.source.label, []):
            rank = engine_rank(d.key)
            cfg = sim_config(d, self.sim.settings, None)
            assert rank is not None
            if cfg is not None:
                self.sim.configure(rank, cfg)
            es = self.sim.snapshots().get(rank)
            window = self.target.window
            points = policy_points(es, window, d, self.sim.planned(rank), None)
            rows.append((d.key, self.state(d), points))
        return whatif_families(self.source.label, rows)

    def kv_events_families(self) -> list[Family]:
        latest = self.target.window.latest
        keys = latest.engines if latest is not None else ()
        return kv_events_families(
            self.source.label, self.source.snapshot(), keys, self.sim.snapshots()
        )


async def test_source_predicts_the_h200_offload_share(tmp_path: Path) -> None:
    """Events of the no-offload workload through ZMQ -> the what-if ratio at 0.5 GiB."""
    msgs = abcab_messages()
    t_first, t_last = msgs[0].batch.ts, msgs[-1].batch.ts
    target = h200_target(t_first - 5, t_last + 5)
    port = free_port()
    record = tmp_path / "events.jsonl"
    settings_ = KvEventsSettings(bind=(f"tcp://127.0.0.1:{port}",), record_path=str(record))
    source = KvEventsSource(target.config, settings_)
    cycle = Cycle(source, WhatIfSettings(sizes_bytes=(64 << 20, 1 << 29, 1 << 30)), target)
    await source.start()
    ctx: zmq.Context[Any] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")
    try:
        derived = {"127.0.0.1:1": derive_target(target.window, t_last, DeriveSettings(1e9))}
        # Before the bytes per block are known nothing is simulated: no what-if series.
        fams = families_by_name(cycle.whatif_families(derived))
        assert fams["kvoffload_whatif_offload_hit_ratio"] == []
        sim = cycle.sim
        planned = sim.planned(0)
        assert planned is not None and planned.capacities == (36, 292, 584)
        await cycle.collect()  # the next step applies the planned config, before any event
        assert 0 in sim.engines and sim.engines[0].config is not None
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
        await wait_async(lambda: receiver._expected.get(0) == seq)
        await cycle.collect()
        snap = source.snapshot()
        assert snap is not None and snap.decoded == received.batches
        assert sim.processed == received.batches
        assert sum(e.batches for e in sim.snapshots().values()) == received.batches
        fams = families_by_name(cycle.whatif_families(derived))
        ratios = {labels[3]: v for labels, v in fams["kvoffload_whatif_offload_hit_ratio"]}
        # b_offload observed 7360 external_kv_transfer tokens of 40000 prompt tokens.
        assert ratios[str(1 << 29)] == pytest.approx(7360 / 40000)
        assert ratios[str(64 << 20)] == pytest.approx(0.0)
        assert ratios[str(1 << 30)] == pytest.approx(8080 / 40000)
        assert fams["kvoffload_whatif_configured_hit_ratio"] == []  # offload is off in (a)
        base = families_by_name(cycle.kv_events_families())
        labels = ("127.0.0.1:1", "qwen3-dummy", "0")
        assert dict(base["kvoffload_recomputed_after_eviction_tokens_total"]) == {
            labels: 5 * 1600.0
        }
        events = {k[3:]: v for k, v in base["kvoffload_kv_events_total"]}
        assert events[("BlockStored", "GPU")] == 25  # one per request without offload
        resident = {k[3]: v for k, v in base["kvoffload_kv_resident_blocks"]}
        assert resident == {"GPU": 145.0, "CPU": 0.0}
        d = derived["127.0.0.1:1"][0]
        state = cycle.state(d)
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
    source = KvEventsSource(target.config, KvEventsSettings())
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


def offline_source(settings_: KvEventsSettings | None = None) -> KvEventsSource:
    """A source whose receiver thread is never started: the test fills its queue."""
    source = KvEventsSource(TargetConfig(url="http://127.0.0.1:1"), settings_ or KvEventsSettings())
    spec = StreamSpec(0, "tcp://127.0.0.1:1", False)
    receiver = Receiver(
        zmq.Context.instance(), [spec], source.queue, source.counters, threading.Event()
    )
    receiver.is_alive = lambda: True  # type: ignore[method-assign]
    source.receiver = receiver
    return source


def stored(ts: float, *hashes: int, rank: int = 0) -> bytes:
    event = {"type": "BlockStored", "block_hashes": list(hashes), "block_size": 16}
    return ENC.encode([ts, [event], rank])


async def test_source_counts_bad_payloads_and_passes_restarts() -> None:
    source = offline_source()
    assert source.snapshot() is None
    source.queue.put((0, 0, b"kv", stored(1.0, 1, 2)))
    source.queue.put((0, 1, b"kv", b"\xc1garbage"))
    assert await execute(source, 5.0)
    snap = source.snapshot()
    assert snap is not None
    assert (snap.bad_payloads, snap.decoded, snap.queue_depth) == (1, 1, 0)
    assert [(i.rank, i.message.seq if i.message else None) for i in snap.items] == [(0, 0)]
    assert source.health.errors_total.get(ErrorKind.PARSE) == 1
    sim = WhatIf(WhatIfSettings())
    sim.step(snap.items)
    assert sim.engines[0].builder.gpu_resident == 2
    source.queue.put((0, RESTART, b"", b""))
    await source.collect()
    snap = source.snapshot()
    assert snap is not None and [(i.rank, i.message) for i in snap.items] == [(0, None)]
    sim.step(snap.items)
    assert sim.engines[0].builder.gpu_resident == 0


@pytest.mark.parametrize("n", [3, DECODE_INLINE_MAX + 50])
async def test_source_items_keep_arrival_order_inline_and_off_the_loop(
    n: int, tmp_path: Path
) -> None:
    record = tmp_path / "r.jsonl"
    source = offline_source(KvEventsSettings(record_path=str(record)))
    for seq in range(n):
        source.queue.put((seq % 2, seq, b"kv", stored(float(seq), seq + 1, rank=seq % 2)))
    source.counters.stream(0).batches = n
    source.counters.dropped = 7
    await source.collect()
    snap = source.snapshot()
    assert snap is not None
    assert [(i.rank, i.message.seq) for i in snap.items if i.message] == [
        (s % 2, s) for s in range(n)
    ]
    assert snap.streams == {0: StreamStats(n, 0, 0, 0, 0)} and snap.dropped == 7
    await source.collect()  # the items are those since the previous collect
    snap = source.snapshot()
    assert snap is not None and snap.items == () and snap.decoded == n
    assert source.receiver is not None
    source.receiver.is_alive = lambda: False  # type: ignore[method-assign]
    await source.stop()  # closes the record file
    assert [decode_record(line).seq for line in record.read_text().splitlines()] == list(range(n))


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
    s = kv_events_settings(cfg, cfg.targets[0])
    assert s.endpoints == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    w = whatif_settings(cfg)
    assert w.sizes_bytes == (1 << 29, 1 << 30) and w.policy == "arc"
    assert s.record_path == "/tmp/x.jsonl"
    assert [(x.rank, x.replay) for x in streams_from(s.endpoints, s.bind, s.replay_endpoints)] == [
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
        (["--kv-events-replay-timeout", "0"], "(0, 60]"),
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


async def test_items_are_handed_over_once_even_when_a_collect_fails() -> None:
    source = offline_source()
    source.queue.put((0, 0, b"kv", stored(1.0, 1)))
    await source.collect()
    snap = source.snapshot()
    assert snap is not None and len(snap.items) == 1
    source.counters.error = "KV-event socket failed: boom"
    with pytest.raises(CollectError):  # a new snapshot, then the failure
        await source.collect()
    snap = source.snapshot()
    assert snap is not None and snap.items == ()
    source.counters.error = None
    source.queue.put((0, 1, b"kv", stored(2.0, 2)))
    await source.collect()

    async def cancelled() -> None:  # the deadline hits while decoding
        raise asyncio.CancelledError

    source._drain = cancelled  # type: ignore[method-assign]
    with pytest.raises(asyncio.CancelledError):
        await source.collect()
    snap = source.snapshot()
    assert snap is not None and snap.items == ()  # not the previous cycle's items again
