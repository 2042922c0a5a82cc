"""exporter/render/nvml.py: the GPU families of one NvmlReading, from the recorded H200
sequence (tests/nvml_doubles.py) and from hand-built readings."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from exporter.render.nvml import FAMILIES, nvml_families
from exporter.sources import execute
from exporter.sources.nvml.library import DeviceIdentity, MemoryInfo
from exporter.sources.nvml.poller import (
    METHOD_FIELD_COUNTER,
    METHOD_GPM,
    GpuSlow,
    GpuSnapshot,
    NvmlSnapshot,
)
from exporter.sources.nvml.source import NvmlReading, NvmlSource, PcieUtilization
from tests.nvml_doubles import (
    BUS_ID,
    UUID,
    FakeClock,
    RecordedGpu,
    RecordedNvml,
    load_fast,
    run_steps,
    series,
)


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
    fams = series(nvml_families(src.snapshot()))
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
    expected_tx = (end.tx_bytes - mid.tx_bytes) / dt / bw
    expected_rx = (end.rx_bytes - mid.rx_bytes) / dt / bw
    assert value("kvoffload_gpu_pcie_tx_utilization_ratio", **gpu) == pytest.approx(expected_tx)
    assert value("kvoffload_gpu_pcie_rx_utilization_ratio", **gpu) == pytest.approx(expected_rx)


def test_no_reading_no_families():
    assert nvml_families(None) == []


IDENT = DeviceIdentity("GPU-made-up", "NVIDIA H200", "00000000:00:06.0")


def _reading(gpu: GpuSnapshot, *, driver: str | None = "580.159.04", **rates: PcieUtilization):
    snap = NvmlSnapshot(published_at=5.0, up=True, driver_version=driver, gpus=(gpu,))
    return NvmlReading(snap, MappingProxyType(dict(rates)))


def _gpu(method: str | None, slow: GpuSlow | None = None) -> GpuSnapshot:
    counted = method is not None
    return GpuSnapshot(
        index=1,
        identity=IDENT,
        slow=slow or GpuSlow(),
        method=method,
        tx_bytes=1000 if counted else None,
        rx_bytes=2000 if counted else None,
        counted_at=4.0 if counted else None,
        counter_gaps=3,
        read_errors=0,
    )


def test_every_family_in_one_order_even_when_empty():
    fams = nvml_families(_reading(_gpu(None), driver=None))
    assert [f.definition.name for f in fams] == list(FAMILIES)
    gpu = {"gpu": "1", "uuid": IDENT.uuid, "pci_bus_id": IDENT.pci_bus_id}
    # No measurement method, no link or memory state: only the info series, never a 0.
    info = {**gpu, "name": "NVIDIA H200", "driver_version": "unknown"}
    assert series(fams) == {"kvoffload_gpu_info": [(info, 1)]}


def test_poll_gaps_only_for_the_field_counters():
    gpm = series(nvml_families(_reading(_gpu(METHOD_GPM))))
    assert gpm["kvoffload_gpu_pcie_tx_bytes_total"][0][1] == 1000
    assert gpm["kvoffload_gpu_pcie_rx_bytes_total"][0][1] == 2000
    assert gpm["kvoffload_gpu_pcie_measurement_info"][0][0]["method"] == "gpm"
    assert "kvoffload_gpu_pcie_poll_gaps_total" not in gpm
    counters = series(nvml_families(_reading(_gpu(METHOD_FIELD_COUNTER))))
    assert counters["kvoffload_gpu_pcie_poll_gaps_total"][0][1] == 3


def test_v1_memory_has_no_reserve_and_unknown_rates_are_absent():
    slow = GpuSlow(
        link_generation=4,
        link_width=8,
        memory=MemoryInfo(total=100, used=60, reserved=None),
        processes=((42, 7), (43, 8)),
    )
    rate = PcieUtilization(tx=None, rx=0.25)
    fams = series(nvml_families(_reading(_gpu(METHOD_FIELD_COUNTER, slow), **{IDENT.uuid: rate})))
    assert "kvoffload_gpu_memory_reserved_bytes" not in fams
    assert fams["kvoffload_gpu_memory_used_bytes"][0][1] == 60
    assert "kvoffload_gpu_pcie_tx_utilization_ratio" not in fams
    assert fams["kvoffload_gpu_pcie_rx_utilization_ratio"][0][1] == 0.25
    assert "kvoffload_gpu_pcie_link_generation_max" not in fams
    bw = fams["kvoffload_gpu_pcie_link_bandwidth_bytes_per_second"][0][1]
    assert bw == pytest.approx(16e9 * 128 / 130 * 8 / 8)
    pids = [(lab["pid"], v) for lab, v in fams["kvoffload_gpu_process_memory_bytes"]]
    assert pids == [("42", 7), ("43", 8)]
