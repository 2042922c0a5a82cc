"""exporter/sources/nvml/library.py: the pynvml adapter on pynvml's own structures, with
field values recorded on an H200, and the real library where no driver is installed."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from exporter.sources.nvml.library import (
    GPU_IS_LOST,
    NOT_SUPPORTED,
    CounterReading,
    NvmlError,
    PynvmlApi,
)
from exporter.sources.nvml.poller import NvmlPoller
from tests.nvml_doubles import PROBE_A, PROBE_B


def test_real_pynvml_without_a_driver_is_absent():
    import ctypes.util

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("libnvidia-ml is installed here")
    poller = NvmlPoller(PynvmlApi())
    poller.step()
    assert not poller.snapshot.up and poller.snapshot.absent
    assert "LIBRARY_NOT_FOUND" in (poller.snapshot.error or "")


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
