"""Every optional source, registered once: its on/off switch and its own flags.

config.py builds the flags, KVOE_* variables and YAML keys from these; runtime.py builds
the sources the switches leave on.
"""

from __future__ import annotations

from exporter.options import Registration
from exporter.sources.cgroup import REGISTRATION as CGROUP
from exporter.sources.kv_events import REGISTRATION as KV_EVENTS
from exporter.sources.nvml import REGISTRATION as NVML
from exporter.sources.procfs import REGISTRATION as PROCFS

REGISTRATIONS: tuple[Registration, ...] = (NVML, PROCFS, CGROUP, KV_EVENTS)
