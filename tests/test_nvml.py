"""The NVML collector, fed with readings recorded on an NVIDIA H200 (no GPU here).

`RecordedNvml` implements `NvmlApi` by replaying tests/fixtures/vllm-0.26.0-h200/*/nvml_fast.csv
(raw 32-bit PCIe counters every ~10 ms, with each field's nvmlReturn), nvml_thr.csv
(nvmlDeviceGetPcieThroughput samples) and the link, memory, GPM and process readings
of tests/fixtures/h200/*.json. The UUID and PCI bus id were not recorded; they are made up.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from exporter.catalogue import Family
from exporter.sources import CollectError, ErrorKind, execute
from exporter.sources.nvml.source import (
    GPU_IS_LOST,
    LIBRARY_NOT_FOUND,
    METHOD_FIELD_COUNTER,
    METHOD_GPM,
    METHOD_THROUGHPUT,
    NOT_SUPPORTED,
    TIMEOUT,
    CounterReading,
    DeviceIdentity,
    MemoryInfo,
    NvmlError,
    NvmlPoller,
    NvmlSource,
    PynvmlApi,
    WrapCounter,
    link_bandwidth_bytes,
    max_poll_gap,
    utilization,
)

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


# --- pure helpers ---------------------------------------------------------------------------


def test_link_bandwidth_follows_generation_encoding():
    assert link_bandwidth_bytes(5, 16) == pytest.approx(32e9 * 128 / 130 * 2)
    assert link_bandwidth_bytes(3, 16) == pytest.approx(8e9 * 128 / 130 * 2)
    assert link_bandwidth_bytes(2, 16) == pytest.approx(5e9 * 0.8 * 2)
    assert link_bandwidth_bytes(1, 1) == pytest.approx(2.5e9 * 0.8 / 8)
    assert link_bandwidth_bytes(6, 16) == pytest.approx(64e9 * 236 / 256 * 2)
    assert link_bandwidth_bytes(0, 16) is None
    assert link_bandwidth_bytes(5, 0) is None
    assert link_bandwidth_bytes(None, 16) is None


def test_link_bandwidth_bounds_the_measured_h200_counter_rate():
    # 60 GiB host->device copied in `el` seconds, counted bytes `acc`: the counted rate
    # must sit just under the Gen5 x16 theoretical figure.
    gen, width = POLL_PROBE["link"][0], POLL_PROBE["link"][3]
    bw = link_bandwidth_bytes(gen, width)
    assert bw is not None
    for direction in ("h2d", "d2h"):
        rate = POLL_PROBE[direction]["acc"] / POLL_PROBE[direction]["el"]
        assert 0.9 < rate / bw < 1.0


def test_max_poll_gap_is_the_wrap_time_at_line_rate():
    gap = max_poll_gap(link_bandwidth_bytes(5, 16))
    assert gap == pytest.approx(2**32 / 63.015e9, rel=1e-3)  # ~68 ms
    assert max_poll_gap(None, 64) > 1e6


def test_wrap_counter_adds_modular_deltas_and_counts_long_gaps():
    c = WrapCounter()
    c.update(2**32 - 10, 0.00, 32, 0.05)
    c.update(5, 0.01, 32, 0.05)  # wrapped: 15 bytes
    c.update(25, 0.10, 32, 0.05)  # 90 ms later: possibly hidden wraps
    assert (c.total, c.gaps) == (35, 1)
    c.rebase()
    c.update(7, 5.0, 32, 0.05)  # a fresh baseline adds nothing
    assert c.total == 35


def test_utilization_is_rate_over_bandwidth():
    assert utilization(0, 10.0, 63.015e9, 11.0, 63.015e9) == pytest.approx(1.0)
    assert utilization(0, 10.0, 1e9, 12.0, 1e9) == pytest.approx(0.5)
    assert utilization(5, 10.0, 4, 11.0, 1e9) is None  # went backwards
    assert utilization(0, 10.0, 4, 10.0, 1e9) is None
    assert utilization(0, 10.0, 4, 11.0, None) is None


# --- replaying recorded counters --------------------------------------------------------------


def test_recorded_offload_run_totals_are_reproduced():
    rows = load_fast("b_offload")
    assert wraps(rows) >= 1  # the recording wraps: the test exercises it
    _, _, snaps = replay(rows)
    gpu = snaps[-1].gpus[0]
    assert gpu.method == METHOD_FIELD_COUNTER
    assert (gpu.tx_bytes, gpu.rx_bytes) == reference_totals(rows)
    # The figures of the fixture README, and above vLLM's own (payload) byte counters.
    assert gpu.tx_bytes == pytest.approx(3.18e9, rel=2e-3)
    assert gpu.rx_bytes == pytest.approx(0.95e9, rel=5e-3)
    assert gpu.tx_bytes > 2.826e9 and gpu.rx_bytes > 0.844e9
    assert gpu.counter_gaps == 0


def test_background_traffic_without_offload_is_small():
    rows = load_fast("a_nooffload")
    _, _, snaps = replay(rows)
    gpu = snaps[-1].gpus[0]
    assert (gpu.tx_bytes, gpu.rx_bytes) == reference_totals(rows)
    assert gpu.tx_bytes == pytest.approx(14.6e6, rel=5e-3)
    assert gpu.rx_bytes == pytest.approx(34.4e6, rel=5e-3)


@pytest.mark.parametrize("offset", [0, 2**31, 2**32 - 1265920480 + 7, 3_000_000_000])
def test_totals_do_not_depend_on_where_the_counter_wraps(offset):
    rows = load_fast("b_offload")
    moved = shifted(rows, offset)
    _, _, snaps = replay(moved)
    gpu = snaps[-1].gpus[0]
    assert (gpu.tx_bytes, gpu.rx_bytes) == reference_totals(rows)


def test_many_wraps_at_high_traffic_are_all_counted():
    rows = scaled(load_fast("b_offload"), 16)
    assert wraps(rows) >= 10
    _, _, snaps = replay(rows)
    gpu = snaps[-1].gpus[0]
    true_tx, true_rx = reference_totals(load_fast("b_offload"))
    assert (gpu.tx_bytes, gpu.rx_bytes) == (16 * true_tx, 16 * true_rx)
    assert gpu.counter_gaps == 0
    totals = [s.gpus[0].tx_bytes for s in snaps]
    assert totals == sorted(totals)


def test_slow_polling_undercounts_and_says_so():
    # Reading every 20th row (~200 ms) is what a scrape-time read would do.
    rows = scaled(load_fast("b_offload"), 16)
    coarse = rows[::20]
    _, _, snaps = replay(coarse)
    gpu = snaps[-1].gpus[0]
    true_tx, _ = reference_totals(rows)
    assert gpu.tx_bytes is not None and gpu.tx_bytes < true_tx
    assert gpu.counter_gaps > 0


def test_a_failed_field_read_loses_no_bytes_and_is_counted():
    rows = load_fast("b_offload")
    errors = {50: (0, TIMEOUT), 51: (0, TIMEOUT), 52: (0, TIMEOUT), 100: (TIMEOUT, 0)}
    _, _, snaps = replay(rows, field_errors=errors)
    gpu = snaps[-1].gpus[0]
    assert (gpu.tx_bytes, gpu.rx_bytes) == reference_totals(rows)
    assert gpu.read_errors == 4
    assert gpu.method == METHOD_FIELD_COUNTER


async def test_field_read_errors_reach_the_error_counter():
    rows = load_fast("b_offload")
    api = RecordedNvml([RecordedGpu(rows=rows, field_errors={5: (TIMEOUT, TIMEOUT)})])
    clock = FakeClock()
    src = NvmlSource(api, monotonic=clock)
    run_steps(src.poller, clock, 10)
    assert await execute(src, 1.0)
    assert src.health.errors_total.get(ErrorKind.UNAVAILABLE) == 2


def test_counters_not_supported_fall_back_to_gpm_asking_once():
    rows = load_fast("b_offload")
    api = RecordedNvml([RecordedGpu(rows=rows, field_errors={0: (NOT_SUPPORTED, NOT_SUPPORTED)})])
    clock = FakeClock()
    poller = make_poller(api, clock)
    run_steps(poller, clock, 3, dt=1.0)
    gpu = poller.snapshot.gpus[0]
    assert gpu.method == METHOD_GPM
    assert api.calls["pcie_counters"] == 1  # probed once, never again
    tx, rx = gpm_rates_mib()
    # Baseline at init and at the first step (same instant), then two 1 s intervals.
    assert gpu.tx_bytes == round(tx * MIB) * 2
    assert gpu.rx_bytes == round(rx * MIB) * 2


def test_without_counters_or_gpm_the_throughput_api_is_integrated():
    rows = load_fast("b_offload")
    thr = load_thr("b_offload")
    api = RecordedNvml(
        [
            RecordedGpu(
                rows=rows,
                thr=thr,
                gpm_supported=False,
                field_errors={0: (NOT_SUPPORTED, NOT_SUPPORTED)},
            )
        ]
    )
    clock = FakeClock()
    poller = NvmlPoller(api, clock=clock, poll_interval=0.01, throughput_interval=0.1)
    run_steps(poller, clock, len(thr), dt=0.1)
    gpu = poller.snapshot.gpus[0]
    assert gpu.method == METHOD_THROUGHPUT
    # The first sample is the baseline; each later one covers the 0.1 s before it. "KB" is
    # 1000 bytes (measured on the H200).
    expected_tx = sum(round(tx * 1000 * 0.1) for _, tx, _ in thr[1:])
    assert gpu.tx_bytes == pytest.approx(expected_tx, abs=len(thr))
    assert api.calls["gpm_supported"] == 1


def test_no_method_at_all_exports_no_byte_totals():
    rows = load_fast("b_offload")
    api = RecordedNvml(
        [
            RecordedGpu(
                rows=rows,
                gpm_supported=False,
                field_errors={0: (NOT_SUPPORTED, NOT_SUPPORTED)},
                unsupported={"pcie_throughput"},
            )
        ]
    )
    clock = FakeClock()
    poller = make_poller(api, clock)
    run_steps(poller, clock, 5)
    gpu = poller.snapshot.gpus[0]
    assert gpu.method is None and gpu.tx_bytes is None
    assert poller.snapshot.up  # link and memory still come


def test_unsupported_slow_value_is_disabled_not_zero():
    api = RecordedNvml([RecordedGpu(rows=load_fast("a_nooffload"), unsupported={"replay_counter"})])
    clock = FakeClock()
    poller = make_poller(api, clock)
    run_steps(poller, clock, 5, dt=1.0)
    assert poller.snapshot.gpus[0].slow.replays is None
    assert poller.snapshot.gpus[0].slow.link_generation == 5
    assert api.calls["replay_counter"] == 1


async def test_gpu_lost_then_back_keeps_totals_monotonic():
    rows = load_fast("b_offload")
    lost_at_call = 150
    gpu = RecordedGpu(rows=rows, errors={("pcie_counters", lost_at_call): GPU_IS_LOST})
    api = RecordedNvml([gpu])
    clock = FakeClock()
    src = NvmlSource(api, reinit_interval=5.0, monotonic=clock)
    poller = src.poller
    poller.reinit_interval = 5.0

    totals: list[int] = []
    down_seen = False
    cursor_at_loss = None
    for step in range(len(rows) + 20):
        poller.step()
        snap = poller.snapshot
        if snap.up:
            totals.append(snap.gpus[0].tx_bytes)
            if step in (50, 100):  # two good collections before the loss: a rate exists
                assert await execute(src, 1.0)
                assert step == 50 or src.pcie_utilization() is not None
        elif not down_seen:
            down_seen = True
            cursor_at_loss = api.cursor[0]
            assert "GPU_IS_LOST" in (snap.error or "")
            assert api.calls["shutdown"] == 1
            assert not await execute(src, 1.0)
            assert src.health.error_kind == ErrorKind.UNAVAILABLE
            assert src.health.errors_total[ErrorKind.UNAVAILABLE] == 1  # a failure, not absence
            assert series(src.families()) == {}
            assert src.pcie_utilization() is None and src.link_bandwidth() is None
            clock.advance(5.0)  # wait out the re-init delay
            continue
        clock.advance(0.01)
    assert down_seen and cursor_at_loss is not None
    assert api.calls["init"] == 2
    assert totals == sorted(totals)  # monotonic across the outage
    # The interval spanning the outage is not counted (the counter may have restarted).
    before = reference_totals(rows[:cursor_at_loss])
    after = reference_totals(rows[cursor_at_loss:])
    assert totals[-1] == before[0] + after[0]
    assert await execute(src, 1.0)
    assert src.health.up


def test_no_library_is_absence_not_failure():
    api = RecordedNvml([], init_errors=[LIBRARY_NOT_FOUND])
    poller = make_poller(api, FakeClock())
    poller.step()
    snap = poller.snapshot
    assert not snap.up and snap.absent
    assert "LIBRARY_NOT_FOUND" in (snap.error or "")


async def test_no_gpu_keeps_collector_down_without_errors():
    api = RecordedNvml([])
    clock = FakeClock()
    src = NvmlSource(api, monotonic=clock)
    src.poller.step()
    assert not await execute(src, 1.0)
    assert src.health.error_kind == ErrorKind.UNAVAILABLE
    assert "no GPU" in (src.health.error or "")
    assert src.health.errors_total == {}


def test_real_pynvml_without_a_driver_is_absent():
    import ctypes.util

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("libnvidia-ml is installed here")
    poller = NvmlPoller(PynvmlApi())
    poller.step()
    assert not poller.snapshot.up and poller.snapshot.absent
    assert "LIBRARY_NOT_FOUND" in (poller.snapshot.error or "")


# --- the source: families, hooks, thread ----------------------------------------------------


async def test_families_from_recorded_h200():
    rows = load_fast("b_offload")
    api = RecordedNvml([RecordedGpu(rows=rows)])
    clock = FakeClock()
    src = NvmlSource(api, monotonic=clock)
    run_steps(src.poller, clock, 100)
    assert await execute(src, 1.0)
    mid = src.poller.snapshot.gpus[0]
    run_steps(src.poller, clock, len(rows) - 100)
    assert await execute(src, 1.0)
    end = src.poller.snapshot.gpus[0]
    fams = series(src.families())
    gpu = {"gpu": "0", "uuid": UUID, "pci_bus_id": BUS_ID}

    def value(metric: str, **labels: str) -> float:
        (sample,) = [v for lab, v in fams[metric] if lab == labels]
        return sample

    assert value("kvoffload_gpu_pcie_tx_bytes_total", **gpu) == end.tx_bytes
    assert value("kvoffload_gpu_pcie_rx_bytes_total", **gpu) == end.rx_bytes
    assert value("kvoffload_gpu_pcie_measurement_info", method="field_counter", **gpu) == 1
    assert value("kvoffload_gpu_pcie_link_generation", **gpu) == 5
    assert value("kvoffload_gpu_pcie_link_width_max", **gpu) == 16
    bw = value("kvoffload_gpu_pcie_link_bandwidth_bytes_per_second", **gpu)
    assert bw == pytest.approx(63.015e9, rel=1e-4)
    assert value("kvoffload_gpu_memory_total_bytes", **gpu) == 150754820096
    assert value("kvoffload_gpu_memory_reserved_bytes", **gpu) == 644939776
    assert value("kvoffload_gpu_process_memory_bytes", gpu="0", uuid=UUID, pid="588") == 1616904192
    assert value("kvoffload_gpu_info", name="NVIDIA H200", driver_version="580.159.04", **gpu) == 1
    assert value("kvoffload_gpu_pcie_poll_gaps_total", **gpu) == 0
    # Utilization over the interval between the two collections.
    dt = end.counted_at - mid.counted_at
    expected = (end.tx_bytes - mid.tx_bytes) / dt / bw
    assert value("kvoffload_gpu_pcie_tx_utilization_ratio", **gpu) == pytest.approx(expected)
    assert src.pcie_utilization() == pytest.approx(
        max(expected, (end.rx_bytes - mid.rx_bytes) / dt / bw)
    )
    assert src.link_bandwidth() == pytest.approx(63.015e9, rel=1e-4)


async def test_poller_thread_replays_the_run_and_stops():
    rows = load_fast("b_offload")
    api = RecordedNvml([RecordedGpu(rows=rows)])
    src = NvmlSource(api, poll_interval=0.001)
    await src.start()
    try:
        assert await asyncio.to_thread(api.exhausted.wait, 30.0)
        # Wait for a snapshot published after the last row was read.
        assert await asyncio.to_thread(wait_for_polls, src.poller, src.poller.polls + 2)
        assert await execute(src, 1.0)
        gpu = src.poller.snapshot.gpus[0]
        assert (gpu.tx_bytes, gpu.rx_bytes) == reference_totals(rows)
    finally:
        await src.stop()
    assert src._thread is None
    assert api.calls["shutdown"] == 1 and not api.live


def wait_for_polls(poller: NvmlPoller, n: int, limit: float = 30.0) -> bool:
    deadline = time.monotonic() + limit
    while poller.polls < n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class HangingNvml(RecordedNvml):
    def __init__(self, rows: list[Row]) -> None:
        super().__init__([RecordedGpu(rows=rows)])
        self.entered = threading.Event()
        self.release = threading.Event()

    def link_generation(self, index: int) -> int:
        self.entered.set()
        self.release.wait(10.0)
        return super().link_generation(index)


async def test_a_hung_nvml_call_is_a_timeout_not_a_hang():
    api = HangingNvml(load_fast("a_nooffload"))
    clock = FakeClock()
    src = NvmlSource(api, monotonic=clock, stall_after=10.0)
    worker = threading.Thread(target=src.poller.step)
    worker.start()
    try:
        assert await asyncio.to_thread(api.entered.wait, 10.0)
        clock.advance(11.0)
        with pytest.raises(CollectError) as exc:
            await src.collect()
        assert exc.value.kind == ErrorKind.TIMEOUT
        assert "link_generation of GPU 0" in exc.value.message
    finally:
        api.release.set()
        worker.join(10.0)


# --- the pynvml adapter on pynvml's own structures -----------------------------------------


def _field_values(entries: list[list[int]]) -> Any:
    import pynvml

    arr = (pynvml.c_nvmlFieldValue_t * len(entries))()
    for slot, (fid, scope, ret, vtype, value, latency) in zip(arr, entries, strict=True):
        slot.fieldId, slot.scopeId, slot.nvmlReturn, slot.valueType = fid, scope, ret, vtype
        slot.latencyUsec = latency
        slot.timestamp = 1795935696581911
        slot.value.ullVal = 0
        slot.value.uiVal = value
    return arr


def test_pynvml_adapter_reads_recorded_field_values_and_errors():
    import pynvml

    # probe b: [fieldId, scopeId, nvmlReturn, valueType, value, latencyUsec] as recorded.
    tx, rx = PROBE_B["f0"][0][0], PROBE_B["f0"][0][1]
    nvlink_unsupported = json.loads(PROBE_B["nvl"][0])[1]  # field 138: nvmlReturn 3
    calls: list[str] = []

    def get_fields(handle: object, ids: list[int]) -> Any:
        calls.append("fields")
        assert ids == [
            pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
            pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
        ]
        return _field_values([tx, rx] if len(calls) == 1 else [tx, nvlink_unsupported])

    def throughput(handle: object, counter: int) -> int:
        return PROBE_A["thr_samples"][0][counter]

    def lost(handle: object) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    fake = SimpleNamespace(
        **{n: getattr(pynvml, n) for n in dir(pynvml) if n.isupper() or n.startswith("NVML")},
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: object(),
        nvmlDeviceGetFieldValues=get_fields,
        nvmlDeviceGetPcieThroughput=throughput,
        nvmlDeviceGetCurrPcieLinkGeneration=lost,
    )
    api = PynvmlApi(fake)
    api.init()
    first = api.pcie_counters(0)
    assert first[0] == CounterReading(0, tx[4], 32, 1795935696.581911)
    assert first[1].value == rx[4] and first[1].bits == 32
    second = api.pcie_counters(0)
    assert second[1].ret == NOT_SUPPORTED
    assert api.pcie_throughput(0) == (
        PROBE_A["thr_samples"][0][0] * 1000.0,
        PROBE_A["thr_samples"][0][1] * 1000.0,
    )
    with pytest.raises(NvmlError) as exc:
        api.link_generation(0)
    assert exc.value.code == GPU_IS_LOST


# --- the benchmarks stay runnable here ------------------------------------------------------


def test_gpu_probe_without_a_gpu_says_skipped(tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(repo))
    run = subprocess.run(
        [sys.executable, str(repo / "bench" / "gpu_probe.py"), "--deadline", "60"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    report = json.loads((tmp_path / "gpu_probe.json").read_text())
    assert run.returncode == 2, run.stderr
    assert report["status"] == "skipped" and report["skipped"]
    assert json.loads(run.stdout) == report


def test_gpu_probe_evaluation_on_recorded_h200_numbers():
    from bench.gpu_probe import evaluate, next_pow2

    h2d, d2h = POLL_PROBE["h2d"], POLL_PROBE["d2h"]
    # Cross-direction bytes from the mid-run throughput samples (TX/RX share during H2D).
    tx_share = h2d["mid_thr_KBps"][0] / h2d["mid_thr_KBps"][1]
    rx_share = d2h["mid_thr_KBps"][1] / d2h["mid_thr_KBps"][0]
    kb = 1024
    report = {
        "method": "field_counter",
        "h2d": {
            "payload_bytes": h2d["bytes"],
            "rx_bytes": h2d["acc"],
            "tx_bytes": round(h2d["acc"] * tx_share),
        },
        "d2h": {
            "payload_bytes": d2h["bytes"],
            "tx_bytes": d2h["acc"],
            "rx_bytes": round(d2h["acc"] * rx_share),
        },
        # RssShmem before/after torch.empty(3 GiB, pin_memory=True) on the H200.
        "pinned": {
            "requested_bytes": 3 << 30,
            "before_bytes": int(PROBE_B["s0"]["RssShmem"].split()[0]) * kb,
            "after_bytes": int(PROBE_B["s_pin3G"]["RssShmem"].split()[0]) * kb,
            "locked_after_bytes": int(PROBE_B["s_pin3G"]["VmLck"].split()[0]) * kb,
        },
    }
    checks = evaluate(report)
    assert checks and all(checks.values()), checks
    assert report["h2d"]["rx_over_payload"] == pytest.approx(1.078, abs=1e-3)
    assert report["d2h"]["tx_over_payload"] == pytest.approx(1.094, abs=1e-3)
    assert report["pinned"]["expected_growth_bytes"] == next_pow2(3 << 30) == 4 << 30
    # What a 200 ms sampler would have counted fails the check.
    report["h2d"]["rx_bytes"] = h2d["coarse200ms"]
    assert not evaluate(report)["h2d_rx_over_payload_in_1.0_1.2"]


def test_poller_cost_bench_runs_on_the_recordings():
    from bench.nvml_poller_cost import fake_api, measure

    result = measure(fake_api(), interval=0.005, seconds=0.2)
    assert "error" not in result, result
    assert result["methods"] == ["field_counter"] and result["gpus"] == 1
    assert result["counter_reads_per_second"] > 0 and result["cpu_seconds_per_second"] >= 0


def test_auto_poll_interval_follows_the_link():
    from exporter.sources.nvml.source import auto_poll_interval, link_bandwidth_bytes

    gen5 = link_bandwidth_bytes(5, 16)
    assert gen5 is not None
    # 70% of the 68 ms a 32-bit counter needs to wrap at Gen5 x16 line rate.
    assert auto_poll_interval([gen5]) == pytest.approx(0.7 * (1 << 32) / gen5)
    assert 0.047 < auto_poll_interval([gen5]) < 0.048
    # Slower links would allow longer waits, but the wait is capped; faster ones shorten it.
    assert auto_poll_interval([link_bandwidth_bytes(4, 16)]) == 0.05
    gen6 = link_bandwidth_bytes(6, 16)
    assert gen6 is not None and auto_poll_interval([gen5, gen6]) < auto_poll_interval([gen5])
    # Unknown links: the fastest schedule.
    assert auto_poll_interval([None]) == 0.01
