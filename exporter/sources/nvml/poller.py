"""The NVML poller: the one thread that owns NVML, and the pure helpers it counts with.

NVML's PCIe byte counters (fields 197/198) are 32-bit and wrap every ~70 ms at Gen5 x16
line rate, so a scrape-time read cannot turn them into a Prometheus counter. The poller
initialises NVML, polls the counters every few milliseconds into 64-bit totals
(`WrapCounter`), reads the slow values (link, memory, processes) every few seconds, and
publishes a frozen `NvmlSnapshot` by reference swap.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from exporter.logs import log_event
from exporter.sources import Clock
from exporter.sources.nvml.library import (
    ABSENT_AT_INIT,
    DISABLING,
    FATAL,
    SUCCESS,
    CounterReading,
    DeviceIdentity,
    MemoryInfo,
    NvmlApi,
    NvmlError,
    code_name,
)

log = logging.getLogger("kvoe.nvml")

METHOD_FIELD_COUNTER = "field_counter"
METHOD_GPM = "gpm"
METHOD_THROUGHPUT = "throughput"
METHODS = (METHOD_FIELD_COUNTER, METHOD_GPM, METHOD_THROUGHPUT)

_COUNTER_MODULUS = {32: 1 << 32, 64: 1 << 64}
# Gen5 x16 after encoding, used to judge poll gaps before the link is known.
_DEFAULT_LINK_BYTES_PER_SECOND = 64e9

# --- pure helpers -------------------------------------------------------------------------

_TRANSFERS_PER_LANE = {1: 2.5e9, 2: 5e9, 3: 8e9, 4: 16e9, 5: 32e9, 6: 64e9, 7: 128e9}


AUTO_POLL_MIN = 0.01
AUTO_POLL_MAX = 0.05
AUTO_POLL_SHARE = 0.7


def auto_poll_interval(bandwidths: Sequence[float | None]) -> float:
    """Poll interval from the fastest link: 70% of the time its 32-bit counter takes to wrap.

    One wrap between two reads is exact (deltas are taken mod 2**32); two are not. The
    margin (20 ms at Gen5 x16) absorbs scheduling jitter, and a late read is counted as a
    poll gap. Polling every 10 ms regardless cost 8% of a core on the H200 VM, where one
    field-value read costs 0.8-1 ms of CPU; 48 ms brings it near 2%.
    """
    known = [b for b in bandwidths if b]
    if not known:
        return AUTO_POLL_MIN
    wrap = (1 << 32) / max(known)
    return min(max(AUTO_POLL_SHARE * wrap, AUTO_POLL_MIN), AUTO_POLL_MAX)


def link_bandwidth_bytes(generation: int | None, width: int | None) -> float | None:
    """Theoretical bytes/s per direction of a PCIe link after line encoding.

    Gen1-2 use 8b/10b, Gen3-5 128b/130b. Gen6+ run in FLIT mode: a 256-byte flit carries
    236 bytes of TLP (the rest is DLLP, CRC and FEC).
    """
    if generation is None or width is None or width <= 0:
        return None
    rate = _TRANSFERS_PER_LANE.get(generation)
    if rate is None:
        return None
    if generation <= 2:
        efficiency = 8 / 10
    elif generation <= 5:
        efficiency = 128 / 130
    else:
        efficiency = 236 / 256
    return rate * efficiency * width / 8


def max_poll_gap(bandwidth: float | None, bits: int = 32) -> float:
    """Longest time between two reads of a `bits`-wide byte counter that cannot hide a wrap."""
    return float(_COUNTER_MODULUS[bits]) / (bandwidth or _DEFAULT_LINK_BYTES_PER_SECOND)


@dataclass(slots=True)
class WrapCounter:
    """A 64-bit running total of a wrapping hardware counter.

    Each read adds `(raw - previous) mod 2**bits`. That is exact while reads come faster
    than one wrap; a longer gap is counted in `gaps`, because whole wraps inside it are
    invisible and the total may be short by multiples of 2**bits.
    """

    total: int = 0
    last: int | None = None
    last_ts: float | None = None
    gaps: int = 0

    def update(self, raw: int, ts: float, bits: int, gap_limit: float) -> None:
        if self.last is not None:
            self.total += (raw - self.last) % _COUNTER_MODULUS[bits]
            if self.last_ts is not None and ts - self.last_ts > gap_limit:
                self.gaps += 1
        self.last = raw
        self.last_ts = ts

    def rebase(self) -> None:
        """Forget the previous raw value (after a re-init the counter may have restarted)."""
        self.last = None
        self.last_ts = None


def utilization(
    prev_total: float, prev_t: float, total: float, t: float, bandwidth: float | None
) -> float | None:
    """Average share of the link used between two counter readings."""
    if bandwidth is None or bandwidth <= 0 or t <= prev_t or total < prev_total:
        return None
    return (total - prev_total) / (t - prev_t) / bandwidth


# --- snapshots ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuSlow:
    """Values read about once a second; None where the device cannot give them."""

    link_generation: int | None = None
    link_generation_max: int | None = None
    link_width: int | None = None
    link_width_max: int | None = None
    replays: int | None = None
    memory: MemoryInfo | None = None
    processes: tuple[tuple[int, int], ...] | None = None

    @property
    def bandwidth(self) -> float | None:
        return link_bandwidth_bytes(self.link_generation, self.link_width)

    @property
    def bandwidth_max(self) -> float | None:
        return link_bandwidth_bytes(
            self.link_generation_max or self.link_generation,
            self.link_width_max or self.link_width,
        )


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    index: int
    identity: DeviceIdentity
    slow: GpuSlow
    method: str | None  # how the byte totals are measured; None: not at all
    tx_bytes: int | None
    rx_bytes: int | None
    counted_at: float | None  # poller clock of the last counter update
    counter_gaps: int
    read_errors: int


@dataclass(frozen=True, slots=True)
class NvmlSnapshot:
    published_at: float  # poller clock
    up: bool
    absent: bool = False
    error: str | None = None
    driver_version: str | None = None
    gpus: tuple[GpuSnapshot, ...] = ()


# --- the poller (owns NVML; runs in one thread) ---------------------------------------------


class _FatalError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class _Device:
    index: int
    identity: DeviceIdentity
    tx: WrapCounter
    rx: WrapCounter
    method: str | None = None
    disabled: set[str] = field(default_factory=set)
    slow: GpuSlow = field(default_factory=GpuSlow)
    rate_at: float | None = None  # poller clock of the last GPM/throughput reading
    read_errors: int = 0
    counted_at: float | None = None


class NvmlPoller:
    """NVML init, polling and shutdown. `step()` does whatever is due and returns the delay
    until the next thing is due; `run()` loops it on a thread until `stop` is set. Tests
    call `step()` directly with a fake clock."""

    def __init__(
        self,
        api: NvmlApi,
        *,
        poll_interval: float | None = 0.01,
        slow_interval: float = 5.0,
        throughput_interval: float = 0.1,
        reinit_interval: float = 5.0,
        absent_retry_interval: float = 60.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.api = api
        # None: derived from the links once they are known (auto_poll_interval).
        self.auto_interval = poll_interval is None
        self.poll_interval = AUTO_POLL_MIN if poll_interval is None else poll_interval
        self.slow_interval = slow_interval
        self.throughput_interval = max(throughput_interval, self.poll_interval)
        self.reinit_interval = reinit_interval
        self.absent_retry_interval = absent_retry_interval
        self.clock = clock
        self.snapshot = NvmlSnapshot(
            published_at=clock(), up=False, absent=True, error="NVML not initialised yet"
        )
        # The NVML call in progress and when it started: a hung driver call shows here.
        self.busy: tuple[str, float] | None = None
        self.polls = 0  # snapshots published
        self.counter_reads = 0
        self._ready = False
        self._driver: str | None = None
        self._devices: list[_Device] = []
        # Totals survive re-initialisation so exported counters stay monotonic.
        self._kept: dict[str, tuple[WrapCounter, WrapCounter, int]] = {}
        self._next_init = 0.0
        self._next_fast = 0.0
        self._next_thr = 0.0
        self._next_slow = 0.0

    # one step --------------------------------------------------------------------------

    def step(self) -> float:
        now = self.clock()
        if not self._ready:
            if now < self._next_init:
                return self._next_init - now
            self._initialise(now)
            if not self._ready:
                return max(self._next_init - self.clock(), 0.0)
        try:
            if now >= self._next_slow:
                self._poll_slow(now)
                self._next_slow = now + self.slow_interval
            if now >= self._next_thr:
                self._poll_throughput(now)
                self._next_thr = now + self.throughput_interval
            if now >= self._next_fast:
                self._poll_counters(now)
                # Deadlines advance from the schedule, not from `now`, so call time does not
                # stretch the interval; a late poll skips ahead instead of bursting.
                self._next_fast += self.poll_interval
                if self._next_fast <= now:
                    self._next_fast = now + self.poll_interval
        except _FatalError as err:
            self._go_down(err.reason, now)
            return self.reinit_interval
        self.polls += 1
        self._publish(now)
        wake = min(self._next_fast, self._next_thr, self._next_slow)
        return max(wake - self.clock(), 0.0)

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                delay = self.step()
                # A plain sleep costs about half the CPU of Event.wait per wake-up, which
                # matters 100 times a second; long waits stay interruptible.
                if delay > 0.05:
                    stop.wait(delay)
                elif delay > 0:
                    time.sleep(delay)
        finally:
            self._shutdown()

    # NVML lifecycle ----------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.busy = (what, self.clock())
        try:
            return fn(*args)
        finally:
            self.busy = None

    def _initialise(self, now: float) -> None:
        try:
            self._call("nvmlInit", self.api.init)
        except NvmlError as err:
            absent = err.code in ABSENT_AT_INIT
            retry = self.absent_retry_interval if absent else self.reinit_interval
            self._next_init = now + retry
            self.snapshot = NvmlSnapshot(
                published_at=self.clock(),
                up=False,
                absent=absent,
                error=f"nvmlInit: {code_name(err.code)}: {err.message}",
            )
            return
        try:
            self._driver = str(self._call("driver version", self.api.driver_version))
            count = int(self._call("device count", self.api.device_count))
            devices: list[_Device] = []
            for i in range(count):
                ident = self._call(f"identity of GPU {i}", self.api.identity, i)
                tx, rx, errors = self._kept.get(ident.uuid, (WrapCounter(), WrapCounter(), 0))
                tx.rebase()
                rx.rebase()
                devices.append(_Device(index=i, identity=ident, tx=tx, rx=rx, read_errors=errors))
        except NvmlError as err:
            self._shutdown()
            absent = err.code in ABSENT_AT_INIT
            self._next_init = now + (self.absent_retry_interval if absent else self.reinit_interval)
            self.snapshot = NvmlSnapshot(
                published_at=self.clock(),
                up=False,
                absent=absent,
                error=f"enumerating GPUs: {code_name(err.code)}: {err.message}",
            )
            return
        if not devices:
            self._shutdown()
            self._next_init = now + self.absent_retry_interval
            self.snapshot = NvmlSnapshot(
                published_at=self.clock(), up=False, absent=True, error="NVML sees no GPU"
            )
            return
        self._devices = devices
        self._ready = True
        try:
            for dev in devices:
                self._choose_method(dev, now)
        except _FatalError as err:
            self._go_down(err.reason, now)
            return
        # The probes just read the counters; link and memory are wanted at once.
        self._next_fast = now + self.poll_interval
        self._next_thr = now + self.throughput_interval
        self._next_slow = now
        log_event(
            log,
            logging.INFO,
            "nvml_initialised",
            driver=self._driver,
            gpus=len(devices),
            methods=",".join(str(d.method) for d in devices),
        )

    def _go_down(self, reason: str, now: float) -> None:
        for dev in self._devices:
            self._kept[dev.identity.uuid] = (dev.tx, dev.rx, dev.read_errors)
        self._shutdown()
        self._next_init = now + self.reinit_interval
        self.snapshot = NvmlSnapshot(
            published_at=self.clock(),
            up=False,
            error=f"{reason}; re-initialising NVML every {self.reinit_interval:g}s",
            driver_version=self._driver,
        )
        log_event(log, logging.WARNING, "nvml_down", reason=reason)

    def _shutdown(self) -> None:
        if not self._ready and not self._devices:
            return
        self._ready = False
        self._devices = []
        # The library is being dropped anyway; the next init tells whether it is broken.
        with contextlib.suppress(NvmlError):
            self._call("nvmlShutdown", self.api.shutdown)

    # reading one value -------------------------------------------------------------------

    def _fatal(self, dev: _Device, what: str, code: int) -> _FatalError:
        return _FatalError(
            f"{what} on GPU {dev.index} ({dev.identity.uuid}): {code_name(code)}",
        )

    def _read(self, dev: _Device, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One capability-probed read: None if the device cannot give it (then never asked
        again until re-init) or the read failed transiently; _FatalError if the GPU is gone."""
        if what in dev.disabled:
            return None
        try:
            return self._call(f"{what} of GPU {dev.index}", fn, *args)
        except NvmlError as err:
            if err.code in FATAL:
                raise self._fatal(dev, what, err.code) from None
            if err.code in DISABLING:
                self._disable(dev, what, err.code)
            else:
                dev.read_errors += 1
            return None

    def _disable(self, dev: _Device, what: str, code: int) -> None:
        dev.disabled.add(what)
        log_event(
            log,
            logging.INFO,
            "nvml_metric_unavailable",
            gpu=dev.index,
            uuid=dev.identity.uuid,
            metric=what,
            reason=code_name(code),
        )

    # choosing how to count PCIe bytes ----------------------------------------------------

    def _choose_method(self, dev: _Device, now: float) -> None:
        """Probe once per device: the exact counters, else GPM rates, else the sampled
        throughput API; each later NotSupported moves to the next."""
        for method in METHODS:
            if method in dev.disabled:
                continue
            if self._probe(dev, method, now):
                dev.method = method
                return
        dev.method = None

    def _probe(self, dev: _Device, method: str, now: float) -> bool:
        if method == METHOD_FIELD_COUNTER:
            return self._probe_counters(dev, method, now)
        if method == METHOD_GPM:
            return self._probe_gpm(dev, method, now)
        return self._probe_throughput(dev, method, now)

    def _probe_counters(self, dev: _Device, method: str, now: float) -> bool:
        readings = self._read(dev, method, self.api.pcie_counters, dev.index)
        if readings is None:
            return False
        bad = next((r.ret for r in readings if r.ret in DISABLING), None)
        if bad is not None:
            self._disable(dev, method, bad)
            return False
        fatal = next((r.ret for r in readings if r.ret in FATAL), None)
        if fatal is not None:
            raise self._fatal(dev, "PCIe byte counters", fatal)
        self._apply_counters(dev, readings, now)
        return True

    def _probe_gpm(self, dev: _Device, method: str, now: float) -> bool:
        if not self._read(dev, method, self.api.gpm_supported, dev.index):
            dev.disabled.add(method)
            return False
        # The first call only takes the baseline sample.
        self._read(dev, method, self.api.gpm_pcie_rates, dev.index)
        if method in dev.disabled:
            return False
        dev.rate_at = now
        return True

    def _probe_throughput(self, dev: _Device, method: str, now: float) -> bool:
        rates = self._read(dev, method, self.api.pcie_throughput, dev.index)
        if rates is None:
            return method not in dev.disabled
        dev.rate_at = now
        return True

    def _fall_back(self, dev: _Device, now: float) -> None:
        old = dev.method
        self._choose_method(dev, now)
        log_event(
            log,
            logging.WARNING,
            "nvml_pcie_method_changed",
            gpu=dev.index,
            uuid=dev.identity.uuid,
            old=old,
            new=dev.method,
        )

    # polling -----------------------------------------------------------------------------

    def _apply_counters(self, dev: _Device, readings: Sequence[CounterReading], now: float) -> None:
        bandwidth = dev.slow.bandwidth_max
        for reading, counter in zip(readings, (dev.tx, dev.rx), strict=True):
            if reading.ret != SUCCESS:
                # A missed read loses nothing by itself: the next delta spans the gap.
                dev.read_errors += 1
                continue
            limit = max_poll_gap(bandwidth, reading.bits)
            counter.update(reading.value, reading.timestamp or now, reading.bits, limit)
        dev.counted_at = now

    def _poll_counters(self, now: float) -> None:
        for dev in self._devices:
            if dev.method != METHOD_FIELD_COUNTER:
                continue
            self.counter_reads += 1
            i = dev.index
            readings = self._read(dev, METHOD_FIELD_COUNTER, self.api.pcie_counters, i)
            if readings is None:
                if METHOD_FIELD_COUNTER in dev.disabled:
                    self._fall_back(dev, now)
                continue
            fatal = next((r.ret for r in readings if r.ret in FATAL), None)
            if fatal is not None:
                raise self._fatal(dev, "PCIe byte counters", fatal)
            bad = next((r.ret for r in readings if r.ret in DISABLING), None)
            if bad is not None:
                self._disable(dev, METHOD_FIELD_COUNTER, bad)
                self._fall_back(dev, now)
                continue
            self._apply_counters(dev, readings, now)

    def _integrate(self, dev: _Device, rates: tuple[float, float] | None, now: float) -> None:
        if rates is not None and dev.rate_at is not None and now > dev.rate_at:
            dt = now - dev.rate_at
            dev.tx.total += round(max(rates[0], 0.0) * dt)
            dev.rx.total += round(max(rates[1], 0.0) * dt)
            dev.counted_at = now
        dev.rate_at = now

    def _poll_throughput(self, now: float) -> None:
        for dev in self._devices:
            if dev.method != METHOD_THROUGHPUT:
                continue
            i = dev.index
            rates = self._read(dev, METHOD_THROUGHPUT, self.api.pcie_throughput, i)
            if rates is None and METHOD_THROUGHPUT in dev.disabled:
                self._fall_back(dev, now)
                continue
            self._integrate(dev, rates, now)

    def _poll_slow(self, now: float) -> None:
        self._poll_slow_devices(now)
        if self.auto_interval:
            interval = auto_poll_interval([d.slow.bandwidth_max for d in self._devices])
            if interval != self.poll_interval:
                self.poll_interval = interval
                self._next_fast = min(self._next_fast, now + interval)

    def _poll_slow_devices(self, now: float) -> None:
        for dev in self._devices:
            i = dev.index
            api = self.api
            dev.slow = GpuSlow(
                link_generation=self._read(dev, "link_generation", api.link_generation, i),
                link_generation_max=self._read(
                    dev, "link_generation_max", api.link_generation_max, i
                ),
                link_width=self._read(dev, "link_width", api.link_width, i),
                link_width_max=self._read(dev, "link_width_max", api.link_width_max, i),
                replays=self._read(dev, "replays", api.replay_counter, i),
                memory=self._read(dev, "memory", api.memory, i),
                processes=self._read(dev, "processes", api.processes, i),
            )
            if dev.method == METHOD_GPM:
                rates = self._read(dev, METHOD_GPM, api.gpm_pcie_rates, i)
                if rates is None and METHOD_GPM in dev.disabled:
                    self._fall_back(dev, now)
                    continue
                self._integrate(dev, rates, now)

    def _publish(self, now: float) -> None:
        self.snapshot = NvmlSnapshot(
            published_at=now,
            up=True,
            driver_version=self._driver,
            gpus=tuple(
                GpuSnapshot(
                    index=d.index,
                    identity=d.identity,
                    slow=d.slow,
                    method=d.method,
                    tx_bytes=d.tx.total if d.method else None,
                    rx_bytes=d.rx.total if d.method else None,
                    counted_at=d.counted_at,
                    counter_gaps=d.tx.gaps + d.rx.gaps,
                    read_errors=d.read_errors,
                )
                for d in self._devices
            ),
        )
