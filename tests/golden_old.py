"""One-off: the golden exposition from the code before the pipeline change (issue 14)."""

from __future__ import annotations

import asyncio
import json
import lzma
import platform
from dataclasses import replace
from pathlib import Path

import msgspec
import zmq

from exporter.config import Config
from exporter.options import TargetConfig
from exporter.runtime import Exporter, kv_events_settings
from exporter.sources.cgroup import CgroupSource
from exporter.sources.kv_events.discovery import StreamSpec
from exporter.sources.kv_events.receiver import Receiver
from exporter.sources.kv_events.source import KvEventsSource
from exporter.sources.nvml.source import NvmlSource
from exporter.sources.procfs.source import ProcfsSource
from exporter.sources.vllm_http import VllmTarget
from tests.nvml_doubles import FakeClock, RecordedGpu, RecordedNvml, load_fast
from tests.proc_tree import CGROUP, build_proc, recorded_statvfs

HERE = Path(__file__).parent / "fixtures"
import os

RUN = HERE / "gpu" / "large-b"


class Fetching(VllmTarget):
    def __init__(self, *a, bodies, **kw):
        super().__init__(*a, **kw)
        self.bodies = bodies
        self.i = 0

    async def _fetch(self, url, limit):
        if url.endswith("/version"):
            return b'{"version": "0.26.0"}'
        body = self.bodies[self.i]
        return body


async def main() -> str:
    import time

    time.perf_counter = lambda: 0.0
    scrapes = [json.loads(l) for l in lzma.open(RUN / "vllm_metrics.jsonl.xz", "rt")]
    events = [json.loads(l) for l in lzma.open(RUN / "kv_events.jsonl.xz", "rt")]
    import tempfile

    base = HERE / "e2e"
    proc = base / "proc"
    clock = FakeClock(scrapes[0]["t"])
    import os as _os

    def statvfs(path):
        return _os.statvfs_result(
            (
                4096,
                4096,
                137438953472 // 4096,
                137438953472 // 4096,
                137438953472 // 4096,
                0,
                0,
                0,
                0,
                255,
            )
        )

    tc = TargetConfig(url="http://127.0.0.1:8000", name="e2e", pid=2614, kv_bytes_per_token=262144)
    from exporter.thresholds import DEFAULT

    cfg = Config(
        targets=(tc,),
        interval=1.0,
        window=300.0,
        kv_events=True,
        thresholds=replace(DEFAULT, min_window_seconds=15),
        whatif_sizes=(134217728, 268435456, 536870912, 1073741824, 2147483648, 4294967296),
    )
    target = Fetching(
        tc,
        window_seconds=cfg.window,
        timeout=5.0,
        max_body_bytes=cfg.max_body_bytes,
        clock=clock,
        bodies=[s["body"].encode() for s in scrapes],
    )
    api = RecordedNvml([RecordedGpu(rows=load_fast("b_offload"))])
    mono = FakeClock()
    nvml = NvmlSource(api, monotonic=mono, clock=clock)
    procfs = ProcfsSource(
        "e2e",
        port=8000,
        pid=2614,
        procfs=proc,
        shm=base / "shm",
        single_target=True,
        statvfs=statvfs,
        clock=clock,
    )
    cg = CgroupSource(
        "e2e", procfs=procfs, pid=2614, procfs_root=proc, cgroup_root=CGROUP / "v2", clock=clock
    )
    kv = KvEventsSource(target, kv_events_settings(cfg, tc), clock=clock)
    spec = StreamSpec(0, "tcp://127.0.0.1:1", False)
    stop = __import__("threading").Event()
    kv.receiver = Receiver(zmq.Context.instance(), [spec], kv.queue, kv.counters, stop)
    kv.receiver.is_alive = lambda: True
    exp = Exporter(cfg, [target, nvml, procfs, cg, kv], clock=clock)
    await target.start()
    rows = len(load_fast("b_offload"))
    per = rows // len(scrapes)
    ei = 0
    enc = msgspec.msgpack.Encoder()
    for i, s in enumerate(scrapes):
        clock.t = s["t"]
        target.i = i
        for _ in range(per):
            nvml.poller.step()
            mono.advance(0.01)
        while ei < len(events) and events[ei]["payload"][0] <= s["t"]:
            e = events[ei]
            kv.receiver.on_frames(
                spec, [e["topic"].encode(), e["seq"].to_bytes(8, "big"), enc.encode(e["payload"])]
            )
            ei += 1
        # run_cycle: kv.collect() drains and decodes the queue, the pipeline steps the
        # what-if with its items (the configs planned in the previous cycle first), then
        # derives, advises, plans and renders.
        await exp.run_cycle()
    await target.stop()
    return exp.exposition.text.decode()


if __name__ == "__main__":
    out = asyncio.run(main())
    (HERE / "e2e" / "expected.prom").write_text(out)
    print(len(out.splitlines()))
