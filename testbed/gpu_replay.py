"""The real exporter fed by a recorded H200 run (tests/fixtures/gpu/<config>/), cycle by cycle.

`replayed_exporter(config)` builds an `exporter.runtime.Exporter` whose clock is the
recording's: its vLLM target scrapes testbed.replay serving the run's 1 s /metrics bodies
in order; its KV-event source runs the real simulator on the events vLLM had published by
each scrape (fed inline instead of over ZMQ); the host view (NVML PCIe utilisation and
link, container memory, the pinned pool) is what the live exporter exported at that time
(its recorded /metrics), since this machine's GPU, /proc and cgroup are not the run's.
`run_cycles()` then calls the real `Exporter.run_cycle()` once per recorded scrape, so
advice, hysteresis, history and the status page are computed by the exporter's own code.

The runs are ~25-40 s per server, far below the advisor's 120 s window minimum, so the
exporter uses the threshold the live run used (`min_window_seconds=15`, exporter_cmd.txt).
"""

from __future__ import annotations

import json
import lzma
import queue
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from exporter.advisor import MemoryState
from exporter.catalogue import Family
from exporter.config import Config
from exporter.kvevents_codec import Message, read_records
from exporter.runtime import Exporter
from exporter.sources import Clock, Health
from exporter.sources.kv_events import KvEventsSettings, KvEventsSource, Simulator
from exporter.sources.nvml import link_bandwidth_bytes
from exporter.sources.vllm_http import TargetConfig, VllmTarget
from exporter.thresholds import Thresholds
from testbed.replay import ReplayServer, Reply

REPO = Path(__file__).resolve().parent.parent
GPU_RUNS = REPO / "tests" / "fixtures" / "gpu"
# large-b: the Qwen3-32B shape with a 1.14 GiB CPU buffer (0.5 GiB of the small shape's
# blocks); its replay ends in grow_buffer, a decided action.
DECIDED_RUN = "large-b"
ENC = msgspec.msgpack.Encoder()


def _jsonl(path: Path) -> list[dict[str, Any]]:
    with lzma.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _value(body: str, name: str) -> float | None:
    """Sum of one metric's samples in an exposition (the run has one GPU and one target)."""
    total = None
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)$", body, re.M):
        total = (total or 0.0) + float(m.group(1))
    return total


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


class RecordedKvEvents(KvEventsSource):
    """The real KV-event source and simulator, fed the recorded messages up to the clock."""

    def __init__(
        self, target: VllmTarget, settings: KvEventsSettings, rec: Recording, clock: Clock
    ) -> None:
        super().__init__(target, settings, clock=clock)
        self.simulator = Simulator(queue.Queue(), settings, threading.Event())
        self._events = rec.events
        self._fed = 0

    async def start(self) -> None:
        self.health.started = True

    async def stop(self) -> None:
        pass

    async def collect(self) -> None:
        sim = self.simulator
        assert sim is not None
        sim._apply_config()  # as the simulator thread does before its next batch
        now = self._clock()
        while self._fed < len(self._events) and self._events[self._fed].batch.ts <= now:
            m = self._events[self._fed]
            payload = ENC.encode([m.batch.ts, m.raw[1], m.batch.dp_rank or 0])
            sim.handle((0, m.seq, m.topic.encode(), payload))
            self._fed += 1
        sim.publish()


class RecordedHost:
    """NVML, cgroup and /proc as the live exporter saw them (its recorded /metrics)."""

    def __init__(self, rec: Recording, label: str, clock: Clock) -> None:
        self.name = "recorded_host"
        self.rec = rec
        self.label = label
        self.clock = clock
        self.health = Health(self.name, clock)

    async def start(self) -> None:
        self.health.started = True

    async def stop(self) -> None:
        pass

    async def collect(self) -> None:
        pass

    def families(self) -> Iterable[Family]:
        return ()

    def _view(self) -> str:
        return self.rec.exporter_view(self.clock())

    def pcie_utilization(self) -> float | None:
        view = self._view()
        vals = [
            v
            for n in (
                "kvoffload_gpu_pcie_tx_utilization_ratio",
                "kvoffload_gpu_pcie_rx_utilization_ratio",
            )
            if (v := _value(view, n)) is not None
        ]
        return max(vals) if vals else None

    def link_bandwidth(self) -> float | None:
        view = self._view()
        gen = _value(view, "kvoffload_gpu_pcie_link_generation_max")
        width = _value(view, "kvoffload_gpu_pcie_link_width_max")
        return link_bandwidth_bytes(int(gen), int(width)) if gen and width else None

    def memory_state(self, label: str) -> MemoryState | None:
        if label != self.label:
            return None
        view = self._view()
        anon = _value(view, "kvoffload_container_memory_anon_bytes")
        shmem = _value(view, "kvoffload_container_memory_shmem_bytes")
        if anon is None or shmem is None:
            return None
        return MemoryState(
            _value(view, "kvoffload_container_memory_limit_bytes"),
            anon + shmem,
            _value(view, "kvoffload_offload_pool_bytes"),
        )


@dataclass
class Replayed:
    exporter: Exporter
    recording: Recording
    server: ReplayServer
    now: list[float]

    async def run_cycles(self) -> None:
        """One real collection cycle per recorded scrape, at the recorded time."""
        for t, _ in self.recording.vllm:
            self.now[0] = t
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
        thresholds=Thresholds(min_window_seconds=15.0),  # as the live run (exporter_cmd.txt)
    )
    target = VllmTarget(
        cfg.targets[0],
        window_seconds=window,
        timeout=5.0,
        max_body_bytes=1 << 24,
        clock=clock,
    )
    settings = KvEventsSettings(
        sizes_bytes=rec.whatif_sizes,
        policy=str(rec.extra.get("eviction_policy", "lru")),
        store_threshold=int(rec.extra.get("store_threshold", 0)),
    )
    sources = [
        target,
        RecordedKvEvents(target, settings, rec, clock),
        RecordedHost(rec, rec.name, clock),
    ]
    return Replayed(Exporter(cfg, sources, clock), rec, server, now)
