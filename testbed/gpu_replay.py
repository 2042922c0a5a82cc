"""The real exporter fed by a recorded H200 run (tests/fixtures/gpu/<config>/), cycle by cycle.

`replayed_exporter(config)` builds an `exporter.runtime.Exporter` whose clock is the
recording's: its vLLM target scrapes testbed.replay serving the run's 1 s /metrics bodies
in order; its KV-event source hands over the events vLLM had published by each scrape
(testbed.backfill.RecordedKvEvents, in place of ZMQ). Every run gets the real NVML source on
the recorded H200 readings (the GPU they ran on: its link and PCIe counters); large-b also
gets the real procfs and cgroup sources on its own recorded host (the /proc tree of
tests/fixtures/e2e/, the cgroup v2 fixture), as the golden exposition does. Other runs have
no /proc or cgroup view (their memory chart says "no data").
`run_cycles()` then calls the real `Exporter.run_cycle()` once per recorded scrape, so
advice, hysteresis, history and the status page are computed by the exporter's own code.

The runs are ~25-40 s per server, far below the advisor's 120 s window minimum, so the
exporter uses the threshold the live run used (`min_window_seconds=15`, exporter_cmd.txt).
"""

from __future__ import annotations

import json
import lzma
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from exporter.config import Config
from exporter.kvevents_codec import Message, read_records
from exporter.options import TargetConfig
from exporter.runtime import Exporter
from exporter.sources import Source
from exporter.sources.cgroup import CgroupSource
from exporter.sources.nvml.source import NvmlSource
from exporter.sources.procfs.source import ProcfsSource
from exporter.sources.vllm_http import VllmTarget
from exporter.thresholds import Thresholds
from testbed.backfill import RecordedKvEvents
from testbed.replay import ReplayServer, Reply

REPO = Path(__file__).resolve().parent.parent
GPU_RUNS = REPO / "tests" / "fixtures" / "gpu"
# large-b: the Qwen3-32B shape with a 1.14 GiB CPU buffer (0.5 GiB of the small shape's
# blocks); its replay ends in grow_buffer, a decided action.
DECIDED_RUN = "large-b"
FIXTURES = REPO / "tests" / "fixtures"
HOST_PID = 2614  # the API server of large-b in tests/fixtures/e2e/proc


def _jsonl(path: Path) -> list[dict[str, Any]]:
    with lzma.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@dataclass(frozen=True)
class Recording:
    name: str
    vllm: tuple[tuple[float, str], ...]  # (unix s, vLLM /metrics body), 1 s apart
    exporter: tuple[tuple[float, str], ...]  # the live exporter's /metrics
    events: tuple[Message, ...]
    whatif_sizes: tuple[int, ...]
    kv_bytes_per_token: float | None
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config

    @classmethod
    def load(cls, name: str) -> Recording:
        path = GPU_RUNS / name
        ok = [r for r in _jsonl(path / "vllm_metrics.jsonl.xz") if r.get("status") == 200]
        exp = [r for r in _jsonl(path / "exporter_metrics.jsonl.xz") if r.get("status") == 200]
        with lzma.open(path / "kv_events.jsonl.xz", "rt", encoding="utf-8") as fh:
            events = tuple(read_records(fh))
        cmd = (path / "exporter_cmd.txt").read_text()
        m = re.search(r"--whatif-sizes (\S+)", cmd)
        sizes = tuple(int(x) for x in m.group(1).split(",")) if m else ()
        (target,) = json.loads((path / "exporter-full.yaml").read_text())["targets"]
        server = (path / "cmd.txt").read_text()
        xm = re.search(r"--kv-transfer-config '([^']*)'", server)
        extra = dict(json.loads(xm.group(1)).get("kv_connector_extra_config") or {}) if xm else {}
        return cls(
            name,
            tuple((float(r["t"]), str(r["body"])) for r in ok),
            tuple((float(r["t"]), str(r["body"])) for r in exp),
            events,
            sizes,
            target.get("kv_bytes_per_token"),
            extra,
        )

    def exporter_view(self, t: float) -> str:
        """The live exporter's exposition closest before t."""
        before = [body for ts, body in self.exporter if ts <= t] or [self.exporter[0][1]]
        return before[-1]


def _nvml(clock: Any) -> tuple[NvmlSource, Any, int]:
    """The NVML source on the recorded H200 readings (the machine every run was on), its
    poller's clock, and how many readings make one 1 s cycle."""
    from tests.nvml_doubles import FakeClock, RecordedGpu, RecordedNvml, load_fast

    rows = load_fast("b_offload")
    monotonic = FakeClock()
    source = NvmlSource(
        RecordedNvml([RecordedGpu(rows=rows)]), poll_interval=0.01, monotonic=monotonic, clock=clock
    )
    return source, monotonic, 100  # 10 ms readings: 100 a second


def _host_sources(rec: Recording, label: str, clock: Any) -> list[Source]:
    """The real procfs and cgroup sources on the run's recorded host, where the repository
    has it (large-b's /proc tree); none otherwise."""
    if rec.name != DECIDED_RUN:
        return []
    proc = FIXTURES / "e2e" / "proc"
    shm = 137438953472  # the run's empty /dev/shm (sys/end_dev_shm.txt)

    def statvfs(path: str) -> os.statvfs_result:
        blocks = shm // 4096
        return os.statvfs_result((4096, 4096, blocks, blocks, blocks, 0, 0, 0, 0, 255))

    return [
        ProcfsSource(
            label,
            port=None,
            pid=HOST_PID,
            procfs=proc,
            shm=FIXTURES / "e2e" / "no-shm",
            single_target=True,
            statvfs=statvfs,
            clock=clock,
        ),
        CgroupSource(
            label,
            pid=HOST_PID,
            procfs_root=proc,
            cgroup_root=FIXTURES / "cgroup" / "v2",
            clock=clock,
        ),
    ]


@dataclass
class Replayed:
    exporter: Exporter
    recording: Recording
    server: ReplayServer
    now: list[float]
    nvml: tuple[NvmlSource, Any, int]

    async def run_cycles(self) -> None:
        """One real collection cycle per recorded scrape, at the recorded time; the NVML
        poller reads a second of the recorded H200 counters before each."""
        nvml, monotonic, per_cycle = self.nvml
        for t, _ in self.recording.vllm:
            self.now[0] = t
            for _ in range(per_cycle):
                nvml.poller.step()
                monotonic.advance(0.01)
            await self.exporter.run_cycle()


def replayed_exporter(name: str = DECIDED_RUN, window: float = 30.0) -> Replayed:
    """An Exporter over a recording (not started; the caller starts it, e.g. through
    exporter.server.make_app, and stops the returned `server` afterwards)."""
    rec = Recording.load(name)
    now = [rec.vllm[0][0]]

    def clock() -> float:
        return now[0]

    server = ReplayServer(replies=[Reply(body=body.encode()) for _, body in rec.vllm]).start()
    cfg = Config(
        targets=(
            TargetConfig(url=server.url, name=rec.name, kv_bytes_per_token=rec.kv_bytes_per_token),
        ),
        interval=1.0,
        window=window,
    )
    cfg = replace(
        cfg,
        nvml=False,
        procfs=False,
        cgroup=False,
        whatif_sizes=rec.whatif_sizes,
        whatif_policy=str(rec.extra.get("eviction_policy", "lru")),
        whatif_store_threshold=int(rec.extra.get("store_threshold", 0)),
        thresholds=Thresholds(min_window_seconds=15.0),  # as the live run (exporter_cmd.txt)
    )
    target = VllmTarget(
        cfg.targets[0],
        window_seconds=window,
        timeout=5.0,
        max_body_bytes=1 << 24,
        clock=clock,
    )
    nvml = _nvml(clock)
    sources: list[Source] = [
        target,
        nvml[0],
        *_host_sources(rec, rec.name, clock),
        RecordedKvEvents(cfg.targets[0], rec.events, clock),
    ]
    return Replayed(Exporter(cfg, sources, clock), rec, server, now, nvml)
