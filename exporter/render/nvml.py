"""The `nvml` collector's families, from its last reading (exporter/sources/nvml/source.py).

Every family is returned, empty ones included, in the same order each cycle; a value the
GPU cannot give is an absent series, never 0.
"""

from __future__ import annotations

from exporter.catalogue import Family
from exporter.sources.nvml.poller import METHOD_FIELD_COUNTER
from exporter.sources.nvml.source import NvmlReading

FAMILIES = (
    "kvoffload_gpu_info",
    "kvoffload_gpu_pcie_measurement_info",
    "kvoffload_gpu_pcie_tx_bytes_total",
    "kvoffload_gpu_pcie_rx_bytes_total",
    "kvoffload_gpu_pcie_poll_gaps_total",
    "kvoffload_gpu_pcie_tx_utilization_ratio",
    "kvoffload_gpu_pcie_rx_utilization_ratio",
    "kvoffload_gpu_pcie_link_generation",
    "kvoffload_gpu_pcie_link_generation_max",
    "kvoffload_gpu_pcie_link_width",
    "kvoffload_gpu_pcie_link_width_max",
    "kvoffload_gpu_pcie_link_bandwidth_bytes_per_second",
    "kvoffload_gpu_pcie_replays_total",
    "kvoffload_gpu_memory_total_bytes",
    "kvoffload_gpu_memory_used_bytes",
    "kvoffload_gpu_memory_reserved_bytes",
    "kvoffload_gpu_process_memory_bytes",
)


def nvml_families(reading: NvmlReading | None) -> list[Family]:
    """The GPU families of one reading; none at all without one (NVML down or absent)."""
    if reading is None:
        return []
    view = reading.snapshot
    fam = {name: Family(name) for name in FAMILIES}

    def add(name: str, labels: list[str], value: float | None) -> None:
        if value is not None:
            fam[name].add(labels, value)

    for g in view.gpus:
        ident = g.identity
        gpu = [str(g.index), ident.uuid, ident.pci_bus_id]
        fam["kvoffload_gpu_info"].add([*gpu, ident.name, view.driver_version or "unknown"], 1)
        if g.method is not None:
            fam["kvoffload_gpu_pcie_measurement_info"].add([*gpu, g.method], 1)
            add("kvoffload_gpu_pcie_tx_bytes_total", gpu, g.tx_bytes)
            add("kvoffload_gpu_pcie_rx_bytes_total", gpu, g.rx_bytes)
        if g.method == METHOD_FIELD_COUNTER:
            add("kvoffload_gpu_pcie_poll_gaps_total", gpu, g.counter_gaps)
        rate = reading.utilization.get(ident.uuid)
        if rate is not None:
            add("kvoffload_gpu_pcie_tx_utilization_ratio", gpu, rate.tx)
            add("kvoffload_gpu_pcie_rx_utilization_ratio", gpu, rate.rx)
        s = g.slow
        add("kvoffload_gpu_pcie_link_generation", gpu, s.link_generation)
        add("kvoffload_gpu_pcie_link_generation_max", gpu, s.link_generation_max)
        add("kvoffload_gpu_pcie_link_width", gpu, s.link_width)
        add("kvoffload_gpu_pcie_link_width_max", gpu, s.link_width_max)
        add("kvoffload_gpu_pcie_link_bandwidth_bytes_per_second", gpu, s.bandwidth)
        add("kvoffload_gpu_pcie_replays_total", gpu, s.replays)
        if s.memory is not None:
            add("kvoffload_gpu_memory_total_bytes", gpu, s.memory.total)
            add("kvoffload_gpu_memory_used_bytes", gpu, s.memory.used)
            add("kvoffload_gpu_memory_reserved_bytes", gpu, s.memory.reserved)
        for pid, used in s.processes or ():
            fam["kvoffload_gpu_process_memory_bytes"].add(
                [str(g.index), ident.uuid, str(pid)], used
            )
    return list(fam.values())
