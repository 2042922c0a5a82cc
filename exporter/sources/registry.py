"""Every optional source, registered once: its on/off switch and its own flags.

config.py builds the flags, KVOE_* variables and YAML keys from these; runtime.py builds
the sources the switches leave on.
"""

from __future__ import annotations

from exporter.options import Option, Registration
from exporter.sources.kv_events import REGISTRATION as KV_EVENTS
from exporter.sources.nvml import REGISTRATION as NVML
from exporter.sources.procfs import REGISTRATION as PROCFS

CGROUP = Registration(
    "cgroup",
    True,
    "read the vLLM container's memory limit and usage",
    (
        Option("path.cgroup", "str", "/sys/fs/cgroup", "cgroup filesystem mount point", "PATH"),
        Option(
            "memory-limit",
            "bytes",
            0,
            "vLLM container memory limit when its cgroup is not visible here (0: from the cgroup)",
            "SIZE",
        ),
    ),
)

REGISTRATIONS: tuple[Registration, ...] = (NVML, PROCFS, CGROUP, KV_EVENTS)
