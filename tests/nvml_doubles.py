"""Test doubles for the NVML collector, fed with readings recorded on an NVIDIA H200 (no GPU here).

`RecordedNvml` implements `NvmlApi` by replaying tests/fixtures/vllm-0.26.0-h200/*/nvml_fast.csv
(raw 32-bit PCIe counters every ~10 ms, with each field's nvmlReturn), nvml_thr.csv
(nvmlDeviceGetPcieThroughput samples) and the link, memory, GPM and process readings
of tests/fixtures/h200/*.json. The UUID and PCI bus id were not recorded; they are made up.
Shared by the NVML tests (tests/sources/nvml/, tests/render/test_nvml.py), the fault
matrix, the procfs and golden tests, and the benchmarks.
"""

from __future__ import annotations

import csv
import itertools
import json
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from exporter.catalogue import Family
from exporter.sources.nvml.library import (
    NOT_SUPPORTED,
    CounterReading,
    DeviceIdentity,
    MemoryInfo,
    NvmlError,
)
from exporter.sources.nvml.poller import NvmlPoller

FIXTURES = Path(__file__).parent / "fixtures"
H200_RUNS = FIXTURES / "vllm-0.26.0-h200"
PROBE_A = json.loads((FIXTURES / "h200" / "nvml-pinned-probe-a.json").read_text())
PROBE_B = json.loads((FIXTURES / "h200" / "nvml-pinned-probe-b.json").read_text())
POLL_PROBE = json.loads((FIXTURES / "h200" / "nvml-fieldcounter-poll-probe.json").read_text())
MIB = 1 << 20
UUID = "GPU-3f6c2a1e-0000-4000-8000-h200fixture"  # not recorded: made up
BUS_ID = "00000000:00:05.0"  # not recorded: made up


@dataclass(frozen=True)
class Row:
    t: float
    tx: int
    rx: int
    rc_tx: int = 0
    rc_rx: int = 0


def load_fast(run: str) -> list[Row]:
    with (H200_RUNS / run / "nvml_fast.csv").open() as f:
        return [
            Row(float(r["t"]), int(r["tx_raw"]), int(r["rx_raw"]), int(r["rc_tx"]), int(r["rc_rx"]))
            for r in csv.DictReader(f)
        ]


def load_thr(run: str) -> list[tuple[float, float, float]]:
    with (H200_RUNS / run / "nvml_thr.csv").open() as f:
        return [
            (float(r["t"]), float(r["tx_kBps"]), float(r["rx_kBps"])) for r in csv.DictReader(f)
        ]


def reference_totals(rows: Sequence[Row]) -> tuple[int, int]:
    """The plain mod-2**32 sum, written independently of the collector."""
    tx = rx = 0
    for a, b in itertools.pairwise(rows):
        tx += (b.tx - a.tx) % 2**32
        rx += (b.rx - a.rx) % 2**32
    return tx, rx


def wraps(rows: Sequence[Row]) -> int:
    return sum((b.tx < a.tx) + (b.rx < a.rx) for a, b in itertools.pairwise(rows))


def gpm_rates_mib() -> tuple[float, float]:
    by_id = {m[0]: m[2] for m in POLL_PROBE["gpm"]}
    return by_id[20], by_id[21]  # NVML_GPM_METRIC_PCIE_TX_PER_SEC / RX_PER_SEC


@dataclass
class RecordedGpu:
    rows: list[Row]
    thr: list[tuple[float, float, float]] = field(default_factory=list)
    gpm_supported: bool = bool(PROBE_B["gpm"][0])
    unsupported: set[str] = field(default_factory=set)
    # (method, n-th call of it, 1-based) -> nvmlReturn to raise
    errors: dict[tuple[str, int], int] = field(default_factory=dict)
    # row index -> (rc_tx, rc_rx) to report instead of the recorded ones
    field_errors: dict[int, tuple[int, int]] = field(default_factory=dict)
    identity: DeviceIdentity = field(
        default_factory=lambda: DeviceIdentity(UUID, PROBE_A["name"], BUS_ID)
    )


class RecordedNvml:
    """NvmlApi replaying recorded H200 readings; scriptable errors; counts calls."""

    def __init__(self, gpus: list[RecordedGpu], init_errors: Sequence[int] = ()) -> None:
        self.gpus = gpus
        self.init_errors = list(init_errors)
        self.calls: Counter[str] = Counter()
        self.cursor = [0] * len(gpus)
        self.thr_cursor = [0] * len(gpus)
        self.gpm_calls = [0] * len(gpus)
        self.exhausted = threading.Event()
        self.live = False

    def _enter(self, method: str, index: int | None = None) -> RecordedGpu | None:
        self.calls[method] += 1
        if method not in ("init", "shutdown") and not self.live:
            raise NvmlError(1, "UNINITIALIZED")
        if index is None:
            return None
        g = self.gpus[index]
        code = g.errors.get((method, self.calls[method]))
        if code is not None:
            raise NvmlError(code)
        if method in g.unsupported:
            raise NvmlError(NOT_SUPPORTED)
        return g

    def init(self) -> None:
        self._enter("init")
        if self.init_errors:
            code = self.init_errors.pop(0)
            if code:
                raise NvmlError(code)
        self.live = True

    def shutdown(self) -> None:
        self._enter("shutdown")
        self.live = False

    def driver_version(self) -> str:
        self._enter("driver_version")
        return str(PROBE_A["driver"])

    def device_count(self) -> int:
        self._enter("device_count")
        return len(self.gpus)

    def identity(self, index: int) -> DeviceIdentity:
        g = self._enter("identity", index)
        assert g is not None
        return g.identity

    def pcie_counters(self, index: int) -> tuple[CounterReading, CounterReading]:
        g = self._enter("pcie_counters", index)
        assert g is not None
        i = min(self.cursor[index], len(g.rows) - 1)
        row = g.rows[i]
        if self.cursor[index] >= len(g.rows) - 1:
            self.exhausted.set()
        self.cursor[index] += 1
        rc_tx, rc_rx = g.field_errors.get(i, (row.rc_tx, row.rc_rx))
        return (
            CounterReading(rc_tx, row.tx if rc_tx == 0 else 0, 32, row.t),
            CounterReading(rc_rx, row.rx if rc_rx == 0 else 0, 32, row.t),
        )

    def link_generation(self, index: int) -> int:
        self._enter("link_generation", index)
        return int(PROBE_A["pcie_gen_cur"])

    def link_generation_max(self, index: int) -> int:
        self._enter("link_generation_max", index)
        return int(PROBE_A["pcie_gen_max"])

    def link_width(self, index: int) -> int:
        self._enter("link_width", index)
        return int(PROBE_A["pcie_width_cur"])

    def link_width_max(self, index: int) -> int:
        self._enter("link_width_max", index)
        return int(PROBE_A["pcie_width_max"])

    def replay_counter(self, index: int) -> int:
        self._enter("replay_counter", index)
        return int(PROBE_A["replay"])

    def memory(self, index: int) -> MemoryInfo:
        self._enter("memory", index)
        # total from probe a, the v2 reserve from probe b, used = probe a's process usage.
        used = sum(p[1] for p in PROBE_A["procs"])
        return MemoryInfo(int(PROBE_A["mem"]["total"]), used, int(PROBE_B["mv2"][0]))

    def processes(self, index: int) -> tuple[tuple[int, int], ...]:
        self._enter("processes", index)
        return tuple((int(p), int(b)) for p, b in PROBE_A["procs"])

    def gpm_supported(self, index: int) -> bool:
        g = self._enter("gpm_supported", index)
        assert g is not None
        return g.gpm_supported

    def gpm_pcie_rates(self, index: int) -> tuple[float, float] | None:
        self._enter("gpm_pcie_rates", index)
        self.gpm_calls[index] += 1
        if self.gpm_calls[index] == 1:
            return None
        tx, rx = gpm_rates_mib()
        return tx * MIB, rx * MIB

    def pcie_throughput(self, index: int) -> tuple[float, float]:
        g = self._enter("pcie_throughput", index)
        assert g is not None
        if not g.thr:
            raise NvmlError(NOT_SUPPORTED)
        i = min(self.thr_cursor[index], len(g.thr) - 1)
        self.thr_cursor[index] += 1
        _, tx, rx = g.thr[i]
        return tx * 1000, rx * 1000


def series(families: Iterable[Family]) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Non-empty families as {name: [(labels, value)]}."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in families:
        names = fam.definition.labels
        for labels, value in fam.samples:
            out.setdefault(fam.definition.name, []).append(
                (dict(zip(names, labels, strict=True)), value)
            )
    return out


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make_poller(api: RecordedNvml, clock: FakeClock, **kw: Any) -> NvmlPoller:
    return NvmlPoller(api, clock=clock, poll_interval=0.01, slow_interval=1.0, **kw)


def run_steps(poller: NvmlPoller, clock: FakeClock, n: int, dt: float = 0.01) -> list[Any]:
    snaps = []
    for _ in range(n):
        poller.step()
        snaps.append(poller.snapshot)
        clock.advance(dt)
    return snaps


def replay(rows: list[Row], **gpu_kw: Any) -> tuple[RecordedNvml, NvmlPoller, list[Any]]:
    api = RecordedNvml([RecordedGpu(rows=rows, **gpu_kw)])
    clock = FakeClock()
    poller = make_poller(api, clock)
    # One probe read at init, then one read per step: len(rows) steps read every row.
    snaps = run_steps(poller, clock, len(rows))
    return api, poller, snaps


def shifted(rows: Sequence[Row], offset: int) -> list[Row]:
    return [replace(r, tx=(r.tx + offset) % 2**32, rx=(r.rx + offset) % 2**32) for r in rows]


def scaled(rows: Sequence[Row], factor: int) -> list[Row]:
    """The same traffic shape, `factor` times the bytes: raw counters rebuilt mod 2**32."""
    out = [rows[0]]
    tx, rx = rows[0].tx, rows[0].rx
    for a, b in itertools.pairwise(rows):
        tx = (tx + factor * ((b.tx - a.tx) % 2**32)) % 2**32
        rx = (rx + factor * ((b.rx - a.rx) % 2**32)) % 2**32
        out.append(replace(b, tx=tx, rx=rx))
    return out
