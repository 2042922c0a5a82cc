"""KV events of a real vLLM CPU server through the exporter: discovery, recompute count,
what-if curve, recording and the whatif command on the recording."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from exporter.config import add_arguments, load_config
from exporter.runtime import Exporter, build_sources
from exporter.sources.kv_events import KvEventsSource
from exporter.whatif_cli import run as whatif_cli
from testbed.vllm_cpu import BLOCK_SIZE, MODEL_NAME, complete, kv_bytes_per_token, seed_workload

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def samples(exporter: Exporter, name: str) -> dict[tuple[str, ...], float]:
    for fam in exporter.families():
        if fam._def.name == name:
            return dict(fam.samples)
    raise AssertionError(f"{name} not emitted")


async def until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_real_vllm_recompute_after_eviction_and_whatif(vllm_server, tmp_path: Path) -> None:
    per_token = kv_bytes_per_token()
    per_block = per_token * BLOCK_SIZE
    sizes = [8 * per_block, 35 * per_block, 36 * per_block, 39 * per_block]
    record = tmp_path / "events.jsonl"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
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
            "--no-nvml",
            "--no-procfs",
            "--no-cgroup",
        ]
    )
    cfg = load_config(args, environ={})
    exporter = Exporter(cfg, build_sources(cfg))
    kv = next(s for s in exporter.sources if isinstance(s, KvEventsSource))
    await exporter.start()
    try:
        # No endpoint given: the source asks GET /kv_event_sources. vLLM connects to the
        # endpoint it was given, so the exporter binds it.
        await exporter.run_cycle()
        assert [(s.address, s.bind) for s in kv.streams] == [(vllm_server.kv_events_endpoint, True)]
        # ZMQ's slow joiner: fresh probe prompts until their events arrive.
        rng = random.Random(time.time_ns())
        for _ in range(20):
            probe = [rng.randrange(3, 2048) for _ in range(300)]
            await asyncio.to_thread(complete, vllm_server.url, probe)
            await asyncio.sleep(0.5)
            if kv.counters.streams.get(0) is not None:
                break
        assert kv.counters.streams.get(0) is not None, "no KV event reached the exporter"
        sim = kv.simulator
        assert sim is not None
        await until(lambda: 0 in sim.engines and sim.engines[0].model is not None, 10, "config")
        await exporter.run_cycle()
        rec0 = sim.engines[0].builder.stats.recomputed_tokens

        records = await asyncio.to_thread(
            seed_workload, vllm_server.url, batches=5, seed=rng.randrange(1 << 30), pause=0.1
        )
        assert sum(r.prompt_tokens for r in records) == 40000

        stream = kv.counters.streams[0]
        await until(lambda: sim.processed == stream.batches and kv.queue.empty(), 20, "simulator")
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
