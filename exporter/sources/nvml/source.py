"""The `nvml` collector: PCIe byte counters, link state and GPU memory from NVML.

`NvmlSource` starts the poller thread (exporter/sources/nvml/poller.py), and each
`collect()` takes the poller's latest snapshot by reference, never calling NVML itself;
it adds the link utilization since the previous collection and keeps the result as a
frozen `NvmlReading` (`snapshot()`). Rendering: exporter/render/nvml.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from exporter.logs import log_event
from exporter.sources import Clock, CollectError, ErrorKind, Health
from exporter.sources.nvml.library import NvmlApi, PynvmlApi
from exporter.sources.nvml.poller import NvmlPoller, NvmlSnapshot, utilization

log = logging.getLogger("kvoe.nvml")


@dataclass(frozen=True, slots=True)
class PcieUtilization:
    """Share of one GPU's current link bandwidth used over the last collection interval,
    per direction; None where it cannot be told (no link state, counters went backwards)."""

    tx: float | None
    rx: float | None


@dataclass(frozen=True, slots=True)
class NvmlReading:
    """What one successful collection saw: the poller's snapshot, and the utilization of
    each GPU since the previous collection."""

    snapshot: NvmlSnapshot
    # By GPU UUID; only GPUs counted at this collection and the one before (no rate spans
    # an outage).
    utilization: Mapping[str, PcieUtilization]

    @property
    def link_bandwidth(self) -> float | None:
        """Slowest GPU's theoretical host-link bytes/s per direction.

        From the negotiable maximum, not the current state: links down-train at idle and
        retrain when traffic starts, and derivations want what a reload would get.
        """
        values = [bw for g in self.snapshot.gpus if (bw := g.slow.bandwidth_max) is not None]
        return min(values) if values else None

    @property
    def machine(self) -> str | None:
        """The GPUs seen, by UUID: which machine this is (a sidecar sees its node's GPUs)."""
        uuids = sorted({g.identity.uuid for g in self.snapshot.gpus})
        return ",".join(uuids) if uuids else None

    @property
    def gpu_names(self) -> tuple[str, ...]:
        """The GPUs seen, by NVML's name (their peak FLOP/s: model/derive/compute.py)."""
        return tuple(sorted({g.identity.name for g in self.snapshot.gpus}))

    @property
    def pcie_utilization(self) -> float | None:
        """Busiest direction of the busiest GPU over the last collection interval."""
        values = [v for r in self.utilization.values() for v in (r.tx, r.rx) if v is not None]
        return max(values) if values else None


class NvmlSource:
    """The `nvml` collector: starts the poller thread, reads its snapshots."""

    def __init__(
        self,
        api: NvmlApi | None = None,
        *,
        poll_interval: float | None = 0.01,
        slow_interval: float = 5.0,
        reinit_interval: float = 5.0,
        stall_after: float = 10.0,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
    ) -> None:
        self.name = "nvml"
        self.health = Health(self.name, clock)
        self.poller = NvmlPoller(
            api if api is not None else PynvmlApi(),
            poll_interval=poll_interval,
            slow_interval=slow_interval,
            reinit_interval=reinit_interval,
            clock=monotonic,
        )
        self.stall_after = stall_after
        self._monotonic = monotonic
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reading: NvmlReading | None = None
        self._prev: dict[str, tuple[int, int, float]] = {}
        self._errors_seen = 0

    async def start(self) -> None:
        self._stop.clear()
        # Daemon: a driver call that never returns must not keep the process alive.
        self._thread = threading.Thread(
            target=self.poller.run, args=(self._stop,), name="nvml-poller", daemon=True
        )
        self._thread.start()
        self.health.started = True

    async def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, 5.0)
            if thread.is_alive():
                busy = self.poller.busy
                log_event(log, logging.WARNING, "nvml_poller_stuck", call=busy and busy[0])
        self._thread = None

    async def collect(self) -> None:
        snap = self.poller.snapshot
        # The advisor must not act on a link state from before a failure.
        self._reading = None
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            self._prev.clear()
            raise CollectError(ErrorKind.INTERNAL, "the NVML poller thread died (see the log)")
        busy = self.poller.busy
        if busy is not None and self._monotonic() - busy[1] > self.stall_after:
            self._prev.clear()
            raise CollectError(
                ErrorKind.TIMEOUT,
                f"NVML call {busy[0]} has not returned for {self._monotonic() - busy[1]:.1f}s",
            )
        if not snap.up:
            # Bytes moved while NVML was down were not counted: no rate spans the outage.
            self._prev.clear()
            raise CollectError(
                ErrorKind.UNAVAILABLE, snap.error or "NVML unavailable", absent=snap.absent
            )
        errors = sum(g.read_errors for g in snap.gpus)
        if errors > self._errors_seen:
            for _ in range(errors - self._errors_seen):
                self.health.count(ErrorKind.UNAVAILABLE)
        self._errors_seen = errors
        self._reading = NvmlReading(snap, MappingProxyType(self._utilization(snap)))

    def _utilization(self, snap: NvmlSnapshot) -> dict[str, PcieUtilization]:
        out: dict[str, PcieUtilization] = {}
        seen: dict[str, tuple[int, int, float]] = {}
        for g in snap.gpus:
            uuid = g.identity.uuid
            if g.tx_bytes is None or g.rx_bytes is None or g.counted_at is None:
                continue
            now = (g.tx_bytes, g.rx_bytes, g.counted_at)
            seen[uuid] = now
            prev = self._prev.get(uuid)
            if prev is None:
                continue
            bw = g.slow.bandwidth
            out[uuid] = PcieUtilization(
                tx=utilization(prev[0], prev[2], now[0], now[2], bw),
                rx=utilization(prev[1], prev[2], now[1], now[2], bw),
            )
        self._prev = seen
        return out

    def snapshot(self) -> NvmlReading | None:
        """The last successful collection; None before one and after a failed one.
        Never blocks, never raises."""
        return self._reading
