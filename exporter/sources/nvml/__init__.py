"""The NVML collector: library wrapper, poller thread, source; registered here."""

from __future__ import annotations

from exporter.options import Option, Registration

REGISTRATION = Registration(
    "nvml",
    True,
    "collect GPU PCIe byte counters, link state and memory via NVML",
    (
        Option(
            "nvml-poll-interval",
            "float",
            0.0,
            "seconds between reads of NVML's 32-bit PCIe byte counters, which wrap every "
            "~70 ms at Gen5 x16 line rate (0: 70%% of the wrap time at the link's maximum "
            "bandwidth, kept within 10-50 ms: 48 ms on Gen5 x16)",
            "SECONDS",
        ),
    ),
)
