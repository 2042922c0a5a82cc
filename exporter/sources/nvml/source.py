"""GPU source: PCIe byte counters, link state and GPU memory from NVML.

NVML's PCIe byte counters (fields 197/198) are 32-bit and wrap every ~70 ms at Gen5 x16
line rate, so a scrape-time read cannot turn them into a Prometheus counter. One owning
thread initialises NVML, polls the counters every few milliseconds into 64-bit totals,
reads the slow values (link, memory, processes) about once a second, and publishes a
frozen snapshot by reference swap; `collect()` only reads the latest snapshot.

All NVML calls go through the small `NvmlApi` interface: `PynvmlApi` is the real one,
tests pass a fake that replays readings recorded on an H200.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from exporter.catalogue import Family
from exporter.logs import log_event
from exporter.sources import Clock, CollectError, ErrorKind, Health

log = logging.getLogger("kvoe.nvml")

# nvmlReturn_t codes (nvml.h); stable across driver branches.
SUCCESS = 0
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
IRQ_ISSUE = 11
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
RESET_REQUIRED = 16
LIB_RM_VERSION_MISMATCH = 18
NO_DATA = 21
ARGUMENT_VERSION_MISMATCH = 25
GPU_NOT_FOUND = 28
UNKNOWN = 999
# Not an NVML code: a counter field came back with a value type we cannot accumulate.
UNEXPECTED_VALUE_TYPE = -1

CODE_NAMES = {
    SUCCESS: "SUCCESS",
    UNINITIALIZED: "UNINITIALIZED",
    INVALID_ARGUMENT: "INVALID_ARGUMENT",
    NOT_SUPPORTED: "NOT_SUPPORTED",
    NO_PERMISSION: "NO_PERMISSION",
    NOT_FOUND: "NOT_FOUND",
    INSUFFICIENT_SIZE: "INSUFFICIENT_SIZE",
    DRIVER_NOT_LOADED: "DRIVER_NOT_LOADED",
    TIMEOUT: "TIMEOUT",
    IRQ_ISSUE: "IRQ_ISSUE",
    LIBRARY_NOT_FOUND: "LIBRARY_NOT_FOUND",
    FUNCTION_NOT_FOUND: "FUNCTION_NOT_FOUND",
    GPU_IS_LOST: "GPU_IS_LOST",
    RESET_REQUIRED: "RESET_REQUIRED",
    LIB_RM_VERSION_MISMATCH: "LIB_RM_VERSION_MISMATCH",
    NO_DATA: "NO_DATA",
    ARGUMENT_VERSION_MISMATCH: "ARGUMENT_VERSION_MISMATCH",
    GPU_NOT_FOUND: "GPU_NOT_FOUND",
    UNKNOWN: "UNKNOWN",
    UNEXPECTED_VALUE_TYPE: "UNEXPECTED_VALUE_TYPE",
}

# The device or driver cannot give this value: stop asking (no fake 0).
DISABLING = frozenset(
    {
        NOT_SUPPORTED,
        NO_PERMISSION,
        FUNCTION_NOT_FOUND,
        INVALID_ARGUMENT,
        ARGUMENT_VERSION_MISMATCH,
        UNEXPECTED_VALUE_TYPE,
    }
)
# The GPU or the driver is gone: every value is suspect until NVML is initialised again.
FATAL = frozenset(
    {
        UNINITIALIZED,
        DRIVER_NOT_LOADED,
        IRQ_ISSUE,
        LIBRARY_NOT_FOUND,
        GPU_IS_LOST,
        RESET_REQUIRED,
        LIB_RM_VERSION_MISMATCH,
        GPU_NOT_FOUND,
        UNKNOWN,
    }
)
# At start-up these mean "no GPU here", which is absence, not failure.
ABSENT_AT_INIT = frozenset({LIBRARY_NOT_FOUND, DRIVER_NOT_LOADED, GPU_NOT_FOUND})

METHOD_FIELD_COUNTER = "field_counter"
METHOD_GPM = "gpm"
METHOD_THROUGHPUT = "throughput"
METHODS = (METHOD_FIELD_COUNTER, METHOD_GPM, METHOD_THROUGHPUT)

MIB = 1 << 20
_COUNTER_MODULUS = {32: 1 << 32, 64: 1 << 64}
# Gen5 x16 after encoding, used to judge poll gaps before the link is known.
_DEFAULT_LINK_BYTES_PER_SECOND = 64e9


def code_name(code: int) -> str:
    return CODE_NAMES.get(code, f"error {code}")


class NvmlError(Exception):
    """An NVML call failed with `code` (an nvmlReturn_t)."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message or code_name(code))
        self.code = code
        self.message = message or code_name(code)


@dataclass(frozen=True, slots=True)
class CounterReading:
    """One field value: its own nvmlReturn, the raw value, its width, and when it was read."""

    ret: int
    value: int
    bits: int = 32
    timestamp: float = 0.0  # seconds; 0 when the driver does not say


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    uuid: str
    name: str
    pci_bus_id: str


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    total: int
    used: int
    reserved: int | None  # None: only the v1 API, whose `used` includes the reserve


class NvmlApi(Protocol):
    """The NVML calls the collector makes, with plain Python values in and out.

    Every method raises NvmlError on failure; `pcie_counters` reports per-field
    failures in each reading's `ret` instead, as NVML does.
    """

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def device_count(self) -> int: ...
    def identity(self, index: int) -> DeviceIdentity: ...
    def pcie_counters(self, index: int) -> tuple[CounterReading, CounterReading]: ...
    def link_generation(self, index: int) -> int: ...
    def link_generation_max(self, index: int) -> int: ...
    def link_width(self, index: int) -> int: ...
    def link_width_max(self, index: int) -> int: ...
    def replay_counter(self, index: int) -> int: ...
    def memory(self, index: int) -> MemoryInfo: ...
    def processes(self, index: int) -> tuple[tuple[int, int], ...]: ...
    def gpm_supported(self, index: int) -> bool: ...
    def gpm_pcie_rates(self, index: int) -> tuple[float, float] | None: ...
    def pcie_throughput(self, index: int) -> tuple[float, float]: ...


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
        i = dev.index
        if method == METHOD_FIELD_COUNTER:
            readings = self._read(dev, method, self.api.pcie_counters, i)
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
        if method == METHOD_GPM:
            if not self._read(dev, method, self.api.gpm_supported, i):
                dev.disabled.add(method)
                return False
            # The first call only takes the baseline sample.
            self._read(dev, method, self.api.gpm_pcie_rates, i)
            if method in dev.disabled:
                return False
            dev.rate_at = now
            return True
        rates = self._read(dev, method, self.api.pcie_throughput, i)
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


# --- the asyncio-side source --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Rate:
    tx: float | None
    rx: float | None


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
        self._view: NvmlSnapshot | None = None
        self._prev: dict[str, tuple[int, int, float]] = {}
        self._rates: dict[str, _Rate] = {}
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
        self._view = None
        self._rates = {}  # the advisor must not act on a link state from before a failure
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
        self._rates = self._utilization(snap)
        self._view = snap

    def _utilization(self, snap: NvmlSnapshot) -> dict[str, _Rate]:
        out: dict[str, _Rate] = {}
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
            out[uuid] = _Rate(
                tx=utilization(prev[0], prev[2], now[0], now[2], bw),
                rx=utilization(prev[1], prev[2], now[1], now[2], bw),
            )
        self._prev = seen
        return out

    # hooks for the rest of the exporter -------------------------------------------------

    def link_bandwidth(self) -> float | None:
        """Slowest GPU's theoretical host-link bytes/s per direction.

        From the negotiable maximum, not the current state: links down-train at idle and
        retrain when traffic starts, and derivations want what a reload would get.
        """
        view = self._view
        if view is None:
            return None
        values = [bw for g in view.gpus if (bw := g.slow.bandwidth_max) is not None]
        return min(values) if values else None

    def pcie_utilization(self) -> float | None:
        """Busiest direction of the busiest GPU over the last collection interval."""
        values = [v for r in self._rates.values() for v in (r.tx, r.rx) if v is not None]
        return max(values) if values else None

    # families ----------------------------------------------------------------------------

    def families(self) -> Iterable[Family]:
        view = self._view
        if view is None:
            return []
        fam = {
            name: Family(name)
            for name in (
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
        }

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
            rate = self._rates.get(ident.uuid)
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


# --- the real NVML ------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class PynvmlApi:
    """NvmlApi over nvidia-ml-py (`import pynvml`). Only the poller thread calls it.

    `module` stands in for pynvml in tests of this adapter; by default pynvml is imported
    at init, so a missing package is "no GPU", not an import error.
    """

    def __init__(self, module: Any = None) -> None:
        self._module = module
        self._nv: Any = None
        self._handles: dict[int, Any] = {}
        self._gpm_prev: dict[int, Any] = {}

    def _wrap(self, fn: Callable[..., Any], *args: Any) -> Any:
        nv = self._nv
        try:
            return fn(*args)
        except nv.NVMLError as err:
            raise NvmlError(int(err.value), str(err)) from None

    def _handle(self, index: int) -> Any:
        h = self._handles.get(index)
        if h is None:
            h = self._wrap(self._nv.nvmlDeviceGetHandleByIndex, index)
            self._handles[index] = h
        return h

    def init(self) -> None:
        if self._module is None:
            try:
                import pynvml
            except ImportError as exc:
                raise NvmlError(
                    LIBRARY_NOT_FOUND, f"nvidia-ml-py is not installed: {exc}"
                ) from None
            self._module = pynvml
        self._nv = self._module
        self._handles = {}
        self._gpm_prev = {}
        self._wrap(self._nv.nvmlInit)

    def shutdown(self) -> None:
        nv = self._nv
        if nv is None:
            return
        for sample in self._gpm_prev.values():
            # Freeing during a failing shutdown: nothing else can be done with it.
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlGpmSampleFree(sample)
        self._gpm_prev = {}
        self._handles = {}
        self._wrap(nv.nvmlShutdown)

    def driver_version(self) -> str:
        return _text(self._wrap(self._nv.nvmlSystemGetDriverVersion))

    def device_count(self) -> int:
        return int(self._wrap(self._nv.nvmlDeviceGetCount))

    def identity(self, index: int) -> DeviceIdentity:
        nv = self._nv
        h = self._handle(index)
        pci = self._wrap(nv.nvmlDeviceGetPciInfo, h)
        return DeviceIdentity(
            uuid=_text(self._wrap(nv.nvmlDeviceGetUUID, h)),
            name=_text(self._wrap(nv.nvmlDeviceGetName, h)),
            pci_bus_id=_text(pci.busId),
        )

    def pcie_counters(self, index: int) -> tuple[CounterReading, CounterReading]:
        nv = self._nv
        values = self._wrap(
            nv.nvmlDeviceGetFieldValues,
            self._handle(index),
            [nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES],
        )
        return (self._reading(values[0]), self._reading(values[1]))

    def _reading(self, v: Any) -> CounterReading:
        nv = self._nv
        ret = int(v.nvmlReturn)
        ts = float(v.timestamp) / 1e6
        if ret != SUCCESS:
            return CounterReading(ret=ret, value=0, timestamp=ts)
        vt = int(v.valueType)
        if vt == nv.NVML_VALUE_TYPE_UNSIGNED_INT:
            return CounterReading(ret, int(v.value.uiVal), 32, ts)
        if vt in (nv.NVML_VALUE_TYPE_UNSIGNED_LONG, nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG):
            return CounterReading(ret, int(v.value.ullVal), 64, ts)
        return CounterReading(UNEXPECTED_VALUE_TYPE, 0, 32, ts)

    def link_generation(self, index: int) -> int:
        return int(self._wrap(self._nv.nvmlDeviceGetCurrPcieLinkGeneration, self._handle(index)))

    def link_generation_max(self, index: int) -> int:
        return int(self._wrap(self._nv.nvmlDeviceGetMaxPcieLinkGeneration, self._handle(index)))

    def link_width(self, index: int) -> int:
        return int(self._wrap(self._nv.nvmlDeviceGetCurrPcieLinkWidth, self._handle(index)))

    def link_width_max(self, index: int) -> int:
        return int(self._wrap(self._nv.nvmlDeviceGetMaxPcieLinkWidth, self._handle(index)))

    def replay_counter(self, index: int) -> int:
        return int(self._wrap(self._nv.nvmlDeviceGetPcieReplayCounter, self._handle(index)))

    def memory(self, index: int) -> MemoryInfo:
        nv = self._nv
        h = self._handle(index)
        try:
            m = self._wrap(nv.nvmlDeviceGetMemoryInfo, h, nv.nvmlMemory_v2)
            return MemoryInfo(int(m.total), int(m.used), int(m.reserved))
        except NvmlError as err:
            if err.code not in DISABLING:
                raise
        m = self._wrap(nv.nvmlDeviceGetMemoryInfo, h)
        return MemoryInfo(int(m.total), int(m.used), None)

    def processes(self, index: int) -> tuple[tuple[int, int], ...]:
        procs = self._wrap(self._nv.nvmlDeviceGetComputeRunningProcesses, self._handle(index))
        return tuple(
            (int(p.pid), int(p.usedGpuMemory)) for p in procs if p.usedGpuMemory is not None
        )

    def gpm_supported(self, index: int) -> bool:
        support = self._wrap(self._nv.nvmlGpmQueryDeviceSupport, self._handle(index))
        return bool(support.isSupportedDevice)

    def gpm_pcie_rates(self, index: int) -> tuple[float, float] | None:
        nv = self._nv
        h = self._handle(index)
        sample = self._wrap(nv.nvmlGpmSampleAlloc)
        try:
            self._wrap(nv.nvmlGpmSampleGet, h, sample)
        except NvmlError:
            nv.nvmlGpmSampleFree(sample)
            raise
        prev = self._gpm_prev.get(index)
        self._gpm_prev[index] = sample
        if prev is None:
            return None
        try:
            req = nv.c_nvmlGpmMetricsGet_t()
            req.version = nv.NVML_GPM_METRICS_GET_VERSION
            req.numMetrics = 2
            req.sample1 = prev
            req.sample2 = sample
            req.metrics[0].metricId = nv.NVML_GPM_METRIC_PCIE_TX_PER_SEC
            req.metrics[1].metricId = nv.NVML_GPM_METRIC_PCIE_RX_PER_SEC
            self._wrap(nv.nvmlGpmMetricsGet, req)
        finally:
            nv.nvmlGpmSampleFree(prev)
        for m in (req.metrics[0], req.metrics[1]):
            if int(m.nvmlReturn) != SUCCESS:
                raise NvmlError(int(m.nvmlReturn), f"GPM metric {int(m.metricId)}")
        # GPM reports MiB/s.
        return (float(req.metrics[0].value) * MIB, float(req.metrics[1].value) * MIB)

    def pcie_throughput(self, index: int) -> tuple[float, float]:
        nv = self._nv
        h = self._handle(index)
        # Each call blocks ~20 ms while the driver samples; "KB" is 1000 bytes (measured).
        tx = self._wrap(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._wrap(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES)
        return (float(tx) * 1000.0, float(rx) * 1000.0)
