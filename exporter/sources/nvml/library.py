"""The NVML library as the collector sees it: the `NvmlApi` calls with plain Python values,
nvmlReturn_t codes and how they are classed, and `PynvmlApi`, the adapter over nvidia-ml-py.

Only the poller thread calls an `NvmlApi`; tests pass a fake that replays readings recorded
on an H200 (tests/nvml_doubles.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

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

MIB = 1 << 20


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
