"""The golden end-to-end exposition: every source on fixture data, a fixed clock.

- vLLM: the recorded H200 run large-b (vLLM 0.26, Qwen3-32B shape, 1.14 GiB native CPU
  offload), its /metrics at 1 s (tests/fixtures/gpu/large-b/vllm_metrics.jsonl.xz) served
  in order, and the KV events it published, each fed to the receiver before the first
  scrape at or after its timestamp;
- /proc: tests/fixtures/e2e/proc (tests/fixtures/e2e/make_tree.py, from the same run);
- cgroup: tests/fixtures/cgroup/v2; /dev/shm: the run's df;
- NVML: the recorded H200 readings of tests/nvml_doubles.py (no GPU here);
- the clock: each scrape's recorded time; durations read as 0 (they are the one value
  that differs between two runs of the same input);
- --state-file: tests/fixtures/e2e/state.json (tests/fixtures/e2e/make_state.py: the TTFT
  fit of large-a, the same engine and traffic without offload), copied to a temporary
  folder, so the e2e engine's advice after enabling compares with what it cost before.

`./run gen` rewrites tests/fixtures/e2e/expected.prom; tests/test_golden.py compares it
exactly. A change to it is reviewed like code.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import lzma
import os
import platform
import shutil
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

import msgspec
import zmq

from exporter.config import Config
from exporter.options import TargetConfig
from exporter.runtime import Exporter, kv_events_settings
from exporter.sources import CollectError, ErrorKind, Source
from exporter.sources.cgroup import CgroupSource
from exporter.sources.kv_events.discovery import StreamSpec
from exporter.sources.kv_events.receiver import Receiver
from exporter.sources.kv_events.source import KvEventsSource
from exporter.sources.nvml.source import NvmlSource
from exporter.sources.procfs.source import ProcfsSource
from exporter.sources.vllm_http import VllmTarget
from exporter.thresholds import DEFAULT
from tests.nvml_doubles import FakeClock, RecordedGpu, RecordedNvml, load_fast

FIXTURES = Path(__file__).parent / "fixtures"
RUN = FIXTURES / "gpu" / "large-b"
E2E = FIXTURES / "e2e"
EXPECTED = E2E / "expected.prom"
BACKENDS = FIXTURES / "backends"
# Targets beside the recorded run, each serving one exposition and then a later one (the
# second from the middle of the run on), so every backend's families are in the golden:
# (target name, before, after).
EXTRA_TARGETS = (
    (
        "tiering",
        BACKENDS / "vllm-0.32-tiering.before.prom",
        BACKENDS / "vllm-0.32-tiering.after.prom",
    ),
    ("simple", BACKENDS / "vllm-0.32-simple.before.prom", BACKENDS / "vllm-0.32-simple.after.prom"),
    ("lmcache", BACKENDS / "lmcache-v1-tp2.before.prom", BACKENDS / "lmcache-v1-tp2.after.prom"),
    (
        "nixl",
        BACKENDS / "vllm-0.32-nixl-rdma.before.prom",
        BACKENDS / "vllm-0.32-nixl-rdma.after.prom",
    ),
    (
        "threshold",
        FIXTURES / "gpu" / "small-thr2" / "metrics_before_W2.prom.gz",
        FIXTURES / "gpu" / "small-thr2" / "metrics_after_W2.prom.gz",
    ),
)
SHM_BYTES = 137438953472  # the run's /dev/shm (sys/end_dev_shm.txt), empty
PYTHON_LABEL = 'python_version="X.Y.Z"'


def _read(path: Path) -> bytes:
    return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()


def _statvfs(path: str) -> os.statvfs_result:
    blocks = SHM_BYTES // 4096
    return os.statvfs_result((4096, 4096, blocks, blocks, blocks, 0, 0, 0, 0, 255))


def normalised(text: str) -> str:
    """The exposition with the one environment-dependent label value replaced."""
    return text.replace(f'python_version="{platform.python_version()}"', PYTHON_LABEL)


async def golden_exposition() -> str:
    with lzma.open(RUN / "vllm_metrics.jsonl.xz", "rt") as fh:
        scrapes = [json.loads(line) for line in fh]
    with lzma.open(RUN / "kv_events.jsonl.xz", "rt") as fh:
        events = [json.loads(line) for line in fh]
    bodies = [s["body"].encode() for s in scrapes]
    at = 0

    extra = {name: (_read(before), _read(after)) for name, before, after in EXTRA_TARGETS}

    async def fetch(url: str, limit: int) -> bytes:
        if url.endswith("/version"):
            return b'{"version": "0.26.0"}'
        host = url.split("/")[2].split(":", maxsplit=1)[0]
        body = extra[host][at >= len(bodies) // 2] if host in extra else bodies[at]
        if len(body) > limit:
            raise CollectError(ErrorKind.TOO_LARGE, "fixture body over the limit")
        return body

    clock = FakeClock(scrapes[0]["t"])
    monotonic = FakeClock()
    tc = TargetConfig(url="http://127.0.0.1:8000", name="e2e", pid=2614, kv_bytes_per_token=262144)
    state = Path(tempfile.mkdtemp(prefix="kvoe-golden-")) / "state.json"
    shutil.copyfile(E2E / "state.json", state)
    extra_configs = tuple(
        TargetConfig(url=f"http://{name}:8000", name=name) for name, _, _ in EXTRA_TARGETS
    )
    cfg = Config(
        targets=(tc, *extra_configs),
        interval=1.0,
        window=300.0,
        # A collection never times out here, however loaded the machine: timeouts are the
        # fault tests' business, and the golden must not depend on the wall clock.
        scrape_timeout=600.0,
        # The run is 40 s long: the advisor decides after 15 s instead of the default 120.
        thresholds=replace(DEFAULT, min_window_seconds=15),
        whatif_sizes=tuple(int(g * (1 << 30)) for g in (0.125, 0.25, 0.5, 1, 2, 4)),
        state_file=str(state),
    )
    target = VllmTarget(
        tc,
        window_seconds=cfg.window,
        timeout=5.0,
        max_body_bytes=cfg.max_body_bytes,
        clock=clock,
        fetch=fetch,
    )
    others = [
        VllmTarget(
            c,
            window_seconds=cfg.window,
            timeout=5.0,
            max_body_bytes=cfg.max_body_bytes,
            clock=clock,
            fetch=fetch,
        )
        for c in extra_configs
    ]
    nvml = NvmlSource(
        RecordedNvml([RecordedGpu(rows=load_fast("b_offload"))]), monotonic=monotonic, clock=clock
    )
    proc = E2E / "proc"
    procfs = ProcfsSource(
        "e2e",
        port=8000,
        pid=2614,
        procfs=proc,
        shm=E2E / "no-shm",
        single_target=True,
        statvfs=_statvfs,
        clock=clock,
    )
    cgroup = CgroupSource(
        "e2e", pid=2614, procfs_root=proc, cgroup_root=FIXTURES / "cgroup" / "v2", clock=clock
    )
    kv = KvEventsSource(tc, kv_events_settings(cfg, tc), clock=clock)
    # The receiver thread is not started: frames go through its checks and queue by hand.
    spec = StreamSpec(0, "tcp://127.0.0.1:1", False)
    kv.receiver = Receiver(zmq.Context.instance(), [spec], kv.queue, kv.counters, threading.Event())
    kv.receiver.is_alive = lambda: True  # type: ignore[method-assign]
    sources: list[Source] = [target, *others, nvml, procfs, cgroup, kv]
    exporter = Exporter(cfg, sources, clock=clock, timer=lambda: 0.0)
    for t in (target, *others):
        await t.start()
    per_scrape = len(load_fast("b_offload")) // len(scrapes)
    enc = msgspec.msgpack.Encoder()
    pending = iter(events)
    event = next(pending, None)
    for i, s in enumerate(scrapes):
        at = i
        clock.t = s["t"]
        for _ in range(per_scrape):
            nvml.poller.step()
            monotonic.advance(0.01)
        while event is not None and event["payload"][0] <= s["t"]:
            frames = [event["topic"].encode(), event["seq"].to_bytes(8, "big")]
            kv.receiver.on_frames(spec, [*frames, enc.encode(event["payload"])])
            event = next(pending, None)
        await exporter.run_cycle()
    for t in (target, *others):
        await t.stop()
    shutil.rmtree(state.parent, ignore_errors=True)
    return normalised(exporter.exposition.text.decode())


def main() -> None:
    EXPECTED.write_text(asyncio.run(golden_exposition()))


if __name__ == "__main__":
    main()
