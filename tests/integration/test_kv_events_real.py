"""KV events of a real vLLM CPU server through the exporter: discovery, recompute count,
what-if curve, recording and the whatif command on the recording."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from exporter.config import add_arguments, load_config
from exporter.runtime import Exporter, build_sources
from exporter.sources.kv_events.source import KvEventsSource
from exporter.whatif_cli import run as whatif_cli
from testbed.procs import free_port
from testbed.vllm_cpu import BLOCK_SIZE, MODEL_NAME, complete, kv_bytes_per_token, seed_workload

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def samples(exporter: Exporter, name: str) -> dict[tuple[str, ...], float]:
    for fam in exporter.families():
        if fam._def.name == name:
            return dict(fam.samples)
    raise AssertionError(f"{name} not emitted")


def exporter_from_flags(flags: list[str]) -> tuple[Exporter, KvEventsSource]:
    """The exporter as the command line builds it, host collectors off."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([*flags, "--no-nvml", "--no-procfs", "--no-cgroup"])
    cfg = load_config(args, environ={})
    exporter = Exporter(cfg, build_sources(cfg))
    kv = next(s for s in exporter.sources if isinstance(s, KvEventsSource))
    return exporter, kv


async def cycles_until(exporter: Exporter, cond: Any, timeout: float, what: str) -> None:
    """Run the exporter's cycle until `cond`: collect() drains the KV-event queue, the
    pipeline steps the what-if with it (the config planned by the previous cycle first)."""
    deadline = time.monotonic() + timeout
    while True:
        await exporter.run_cycle()
        if cond():
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def join_stream(
    exporter: Exporter, kv: KvEventsSource, url: str, rng: random.Random, what: str
) -> None:
    """ZMQ's slow joiner: fresh probe prompts until their events arrive, and the model
    config with them."""
    for _ in range(20):
        probe = [rng.randrange(3, 2048) for _ in range(300)]
        await asyncio.to_thread(complete, url, probe)
        await asyncio.sleep(0.5)
        if kv.counters.streams.get(0) is not None:
            break
    assert kv.counters.streams.get(0) is not None, f"no KV event reached the exporter {what}"

    def configured() -> bool:
        sim = exporter.pipeline.simulation(kv.label)  # the runtime's what-if of the target
        return sim is not None and 0 in sim.engines and sim.engines[0].model is not None

    await cycles_until(exporter, configured, 10, "config")


async def test_real_vllm_recompute_after_eviction_and_whatif(vllm_server, tmp_path: Path) -> None:
    per_token = kv_bytes_per_token()
    per_block = per_token * BLOCK_SIZE
    sizes = [8 * per_block, 35 * per_block, 36 * per_block, 39 * per_block]
    record = tmp_path / "events.jsonl"
    exporter, kv = exporter_from_flags(
        [
            "--vllm-url",
            vllm_server.url,
            "--interval",
            "1",
            "--window",
            "600",
            "--kv-bytes-per-token",
            str(per_token),
            "--whatif-sizes",
            ",".join(str(s) for s in sizes),
            "--record-events",
            str(record),
        ]
    )
    cfg = exporter.cfg
    await exporter.start()
    try:
        # No endpoint given: the source asks GET /kv_event_sources. vLLM connects to the
        # endpoint it was given, so the exporter binds it.
        await exporter.run_cycle()
        assert [(s.address, s.bind) for s in kv.streams] == [(vllm_server.kv_events_endpoint, True)]
        rng = random.Random(time.time_ns())
        await join_stream(exporter, kv, vllm_server.url, rng, "")
        sim = exporter.pipeline.simulation(kv.label)
        assert sim is not None
        await exporter.run_cycle()
        rec0 = sim.engines[0].builder.stats.recomputed_tokens

        records = await asyncio.to_thread(
            seed_workload, vllm_server.url, batches=5, seed=rng.randrange(1 << 30), pause=0.1
        )
        assert sum(r.prompt_tokens for r in records) == 40000

        stream = kv.counters.streams[0]
        await cycles_until(
            exporter,
            lambda: sim.processed == stream.batches and kv.queue.empty(),
            20,
            "simulator",
        )
        await asyncio.sleep(1.5)  # one more scrape interval past the last event
        await exporter.run_cycle()

        # The request pattern: each batch stores A's 12 full blocks again after B and C
        # evicted them from the 20-block GPU pool.
        assert sim.engines[0].builder.stats.recomputed_tokens - rec0 == 5 * 12 * BLOCK_SIZE
        assert (stream.gaps, stream.lost, kv.counters.dropped) == (0, 0, 0)

        lab = (cfg.targets[0].label, MODEL_NAME, "0")
        ratios = {
            int(k[3]): v for k, v in samples(exporter, "kvoffload_whatif_offload_hit_ratio").items()
        }
        # Hit tokens over all prompt tokens of the window (the probes came before it).
        assert ratios[8 * per_block] == 0.0  # A (12 blocks) does not fit: nothing is stored
        assert ratios[36 * per_block] == pytest.approx(5 * 12 * BLOCK_SIZE / 40000)
        assert ratios[39 * per_block] == pytest.approx(5 * 12 * BLOCK_SIZE / 40000)
        assert 0 < ratios[35 * per_block] < ratios[36 * per_block]
        total = samples(exporter, "kvoffload_recomputed_after_eviction_tokens_total")
        assert total[lab] >= 5 * 12 * BLOCK_SIZE
        resident = samples(exporter, "kvoffload_kv_resident_blocks")
        assert 0 < resident[(*lab, "GPU")] <= 20
        events = samples(exporter, "kvoffload_kv_events_total")
        assert events[(*lab, "BlockStored", "GPU")] >= 20
    finally:
        await exporter.stop()

    out = io.StringIO()
    rc = whatif_cli(
        [
            "--events",
            str(record),
            "--blocks",
            "8,36,39",
            "--json",
            "--kv-bytes-per-block",
            str(per_block),
        ],
        out=out,
    )
    assert rc == 0
    doc = json.loads(out.getvalue())
    hits = [s["hit_tokens"] for s in doc["sizes"]]
    assert hits == [0, 5 * 12 * BLOCK_SIZE, 5 * 12 * BLOCK_SIZE]
    assert doc["recomputed_after_eviction_tokens"] >= 5 * 12 * BLOCK_SIZE


class LossyProxy:
    """Between vLLM and the exporter: binds the endpoint vLLM connects to, republishes
    on its own PUB, and once armed drops `drop` consecutive batches after `skip` more."""

    def __init__(self, upstream: str, skip: int = 3, drop: int = 2) -> None:
        self.upstream = upstream
        self.downstream = f"tcp://127.0.0.1:{free_port()}"
        self.skip, self.drop = skip, drop
        self.armed = threading.Event()
        self.dropped: list[int] = []
        self.forwarded = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LossyProxy:
        self._thread.start()
        assert self._ready.wait(10), "proxy did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind(self.upstream)
        pub = ctx.socket(zmq.PUB)
        pub.bind(self.downstream)
        self._ready.set()
        seen_armed = 0
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if self.armed.is_set():
                    seen_armed += 1
                    if self.skip < seen_armed <= self.skip + self.drop:
                        self.dropped.append(int.from_bytes(frames[1], "big"))
                        continue
                pub.send_multipart(frames)
                self.forwarded += 1
        finally:
            sub.close(0)
            pub.close(0)
            ctx.term()


async def test_a_gap_is_recovered_from_the_real_replay_endpoint(
    vllm_server, tmp_path: Path
) -> None:
    """Batches lost on the way are fetched from vLLM's own replay ROUTER, in order, so the
    simulator sees the same stream as without the loss."""
    assert vllm_server.replay_endpoint, "the session's vLLM runs without a replay endpoint"
    with LossyProxy(vllm_server.kv_events_endpoint) as proxy:
        exporter, kv = exporter_from_flags(
            [
                "--vllm-url",
                vllm_server.url,
                "--interval",
                "1",
                "--kv-bytes-per-token",
                str(kv_bytes_per_token()),
                "--kv-events-endpoint",
                proxy.downstream,
                "--kv-events-replay-endpoint",
                vllm_server.replay_endpoint,
                # vLLM answers between two publishes; on two cores shared with the other test
                # worker that took over the default 2 s once (CI, stop 56).
                "--kv-events-replay-timeout",
                "30",
            ]
        )
        cfg = exporter.cfg
        await exporter.start()
        try:
            await exporter.run_cycle()
            assert kv.receiver is not None and kv.receiver.replay_timeout == 30
            assert [(s.address, s.bind, s.replay) for s in kv.streams] == [
                (proxy.downstream, False, vllm_server.replay_endpoint)
            ]
            rng = random.Random(time.time_ns())
            await join_stream(exporter, kv, vllm_server.url, rng, "through the proxy")
            stream = kv.counters.streams[0]
            sim = exporter.pipeline.simulation(kv.label)
            assert sim is not None

            def simulated() -> bool:
                return sim.processed == stream.batches and kv.queue.empty()

            await cycles_until(exporter, simulated, 20, "sim")
            rec0 = sim.engines[0].builder.stats.recomputed_tokens
            gaps0, replayed0, lost0 = stream.gaps, stream.replayed, stream.lost

            proxy.armed.set()
            await asyncio.to_thread(
                seed_workload, vllm_server.url, batches=5, seed=rng.randrange(1 << 30), pause=0.1
            )
            await cycles_until(exporter, simulated, 20, "sim")
            await exporter.run_cycle()

            assert len(proxy.dropped) == 2, f"the workload published too few batches: {proxy}"
            assert proxy.dropped[1] == proxy.dropped[0] + 1
            assert stream.gaps - gaps0 == 1
            assert stream.replayed - replayed0 == 2
            assert stream.lost - lost0 == 0
            # The same count as over a lossless stream (test above): every batch simulated.
            assert sim.engines[0].builder.stats.recomputed_tokens - rec0 == 5 * 12 * BLOCK_SIZE
            target = cfg.targets[0].label
            replayed = samples(exporter, "kvoffload_kv_events_replayed_total")
            assert replayed[(target, "0")] == stream.replayed
        finally:
            await exporter.stop()
