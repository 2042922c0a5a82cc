"""exporter/sources/nvml/source.py: NvmlSource over the recorded H200 NVML double
(tests/nvml_doubles.py): its reading, health and error counting, the poller thread, a
hung NVML call; and bench/gpu_probe.py, which runs this source on a real GPU."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest

from exporter.sources import CollectError, ErrorKind, execute
from exporter.sources.nvml.library import GPU_IS_LOST, TIMEOUT
from exporter.sources.nvml.poller import NvmlPoller
from exporter.sources.nvml.source import NvmlReading, NvmlSource, PcieUtilization
from tests.nvml_doubles import (
    POLL_PROBE,
    PROBE_B,
    UUID,
    FakeClock,
    RecordedGpu,
    RecordedNvml,
    Row,
    load_fast,
    reference_totals,
    run_steps,
)


async def test_field_read_errors_reach_the_error_counter():
    rows = load_fast("b_offload")
    api = RecordedNvml([RecordedGpu(rows=rows, field_errors={5: (TIMEOUT, TIMEOUT)})])
    clock = FakeClock()
    src = NvmlSource(api, monotonic=clock)
    run_steps(src.poller, clock, 10)
    assert await execute(src, 1.0)
    assert src.health.errors_total.get(ErrorKind.UNAVAILABLE) == 2


async def test_gpu_lost_then_back_keeps_totals_monotonic():
    rows = load_fast("b_offload")
    lost_at_call = 150
    gpu = RecordedGpu(rows=rows, errors={("pcie_counters", lost_at_call): GPU_IS_LOST})
    api = RecordedNvml([gpu])
    clock = FakeClock()
    src = NvmlSource(api, reinit_interval=5.0, monotonic=clock)
    poller = src.poller
    poller.reinit_interval = 5.0

    totals: list[int] = []
    down_seen = False
    cursor_at_loss = None
    for step in range(len(rows) + 20):
        poller.step()
        snap = poller.snapshot
        if snap.up:
            totals.append(snap.gpus[0].tx_bytes)
            if step in (50, 100):  # two good collections before the loss: a rate exists
                assert await execute(src, 1.0)
                reading = src.snapshot()
                assert reading is not None and reading.snapshot is snap
                assert step == 50 or reading.pcie_utilization is not None
        elif not down_seen:
            down_seen = True
            cursor_at_loss = api.cursor[0]
            assert "GPU_IS_LOST" in (snap.error or "")
            assert api.calls["shutdown"] == 1
            assert not await execute(src, 1.0)
            assert src.health.error_kind == ErrorKind.UNAVAILABLE
            assert src.health.errors_total[ErrorKind.UNAVAILABLE] == 1  # a failure, not absence
            assert src.snapshot() is None  # no families, no utilization, no bandwidth
            clock.advance(5.0)  # wait out the re-init delay
            continue
        clock.advance(0.01)
    assert down_seen and cursor_at_loss is not None
    assert api.calls["init"] == 2
    assert totals == sorted(totals)  # monotonic across the outage
    # The interval spanning the outage is not counted (the counter may have restarted).
    before = reference_totals(rows[:cursor_at_loss])
    after = reference_totals(rows[cursor_at_loss:])
    assert totals[-1] == before[0] + after[0]
    assert await execute(src, 1.0)
    assert src.health.up
    assert src.snapshot() is not None


async def test_no_gpu_keeps_collector_down_without_errors():
    api = RecordedNvml([])
    clock = FakeClock()
    src = NvmlSource(api, monotonic=clock)
    src.poller.step()
    assert not await execute(src, 1.0)
    assert src.health.error_kind == ErrorKind.UNAVAILABLE
    assert "no GPU" in (src.health.error or "")
    assert src.health.errors_total == {}
    assert src.snapshot() is None


async def test_reading_from_recorded_h200():
    rows = load_fast("b_offload")
    api = RecordedNvml([RecordedGpu(rows=rows)])
    clock = FakeClock()
    src = NvmlSource(api, monotonic=clock)
    assert src.snapshot() is None  # nothing read yet
    run_steps(src.poller, clock, 100)
    assert await execute(src, 1.0)
    first = src.snapshot()
    assert first is not None
    assert first.utilization == {}  # one reading: no rate yet
    assert first.pcie_utilization is None
    mid = src.poller.snapshot.gpus[0]
    run_steps(src.poller, clock, len(rows) - 100)
    assert await execute(src, 1.0)
    reading = src.snapshot()
    assert isinstance(reading, NvmlReading)
    assert reading.snapshot is src.poller.snapshot
    end = reading.snapshot.gpus[0]
    bw = end.slow.bandwidth
    assert bw == pytest.approx(63.015e9, rel=1e-4)
    # Utilization over the interval between the two collections.
    dt = end.counted_at - mid.counted_at
    expected_tx = (end.tx_bytes - mid.tx_bytes) / dt / bw
    expected_rx = (end.rx_bytes - mid.rx_bytes) / dt / bw
    rate = reading.utilization[UUID]
    assert isinstance(rate, PcieUtilization)
    assert rate.tx == pytest.approx(expected_tx) and rate.rx == pytest.approx(expected_rx)
    assert reading.pcie_utilization == pytest.approx(max(expected_tx, expected_rx))
    assert reading.link_bandwidth == pytest.approx(63.015e9, rel=1e-4)
    assert reading.machine == UUID  # the GPUs seen tell one machine from another
    with pytest.raises(TypeError):
        reading.utilization[UUID] = rate  # type: ignore[index]  # frozen


async def test_poller_thread_replays_the_run_and_stops():
    rows = load_fast("b_offload")
    api = RecordedNvml([RecordedGpu(rows=rows)])
    src = NvmlSource(api, poll_interval=0.001)
    await src.start()
    try:
        assert await asyncio.to_thread(api.exhausted.wait, 30.0)
        # Wait for a snapshot published after the last row was read.
        assert await asyncio.to_thread(wait_for_polls, src.poller, src.poller.polls + 2)
        assert await execute(src, 1.0)
        gpu = src.poller.snapshot.gpus[0]
        assert (gpu.tx_bytes, gpu.rx_bytes) == reference_totals(rows)
    finally:
        await src.stop()
    assert src._thread is None
    assert api.calls["shutdown"] == 1 and not api.live


def wait_for_polls(poller: NvmlPoller, n: int, limit: float = 30.0) -> bool:
    deadline = time.monotonic() + limit
    while poller.polls < n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class HangingNvml(RecordedNvml):
    def __init__(self, rows: list[Row]) -> None:
        super().__init__([RecordedGpu(rows=rows)])
        self.entered = threading.Event()
        self.release = threading.Event()

    def link_generation(self, index: int) -> int:
        self.entered.set()
        self.release.wait(10.0)
        return super().link_generation(index)


async def test_a_hung_nvml_call_is_a_timeout_not_a_hang():
    api = HangingNvml(load_fast("a_nooffload"))
    clock = FakeClock()
    src = NvmlSource(api, monotonic=clock, stall_after=10.0)
    worker = threading.Thread(target=src.poller.step)
    worker.start()
    try:
        assert await asyncio.to_thread(api.entered.wait, 10.0)
        clock.advance(11.0)
        with pytest.raises(CollectError) as exc:
            await src.collect()
        assert exc.value.kind == ErrorKind.TIMEOUT
        assert "link_generation of GPU 0" in exc.value.message
    finally:
        api.release.set()
        worker.join(10.0)


# --- bench/gpu_probe.py, which runs this source on a real GPU, stays runnable here -------


def test_gpu_probe_without_a_gpu_says_skipped(tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[3]
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(repo))
    run = subprocess.run(
        [sys.executable, str(repo / "bench" / "gpu_probe.py"), "--deadline", "60"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    report = json.loads((tmp_path / "gpu_probe.json").read_text())
    assert run.returncode == 2, run.stderr
    assert report["status"] == "skipped" and report["skipped"]
    assert json.loads(run.stdout) == report


def test_gpu_probe_evaluation_on_recorded_h200_numbers():
    from bench.gpu_probe import evaluate, next_pow2

    h2d, d2h = POLL_PROBE["h2d"], POLL_PROBE["d2h"]
    # Cross-direction bytes from the mid-run throughput samples (TX/RX share during H2D).
    tx_share = h2d["mid_thr_KBps"][0] / h2d["mid_thr_KBps"][1]
    rx_share = d2h["mid_thr_KBps"][1] / d2h["mid_thr_KBps"][0]
    kb = 1024
    report = {
        "method": "field_counter",
        "h2d": {
            "payload_bytes": h2d["bytes"],
            "rx_bytes": h2d["acc"],
            "tx_bytes": round(h2d["acc"] * tx_share),
        },
        "d2h": {
            "payload_bytes": d2h["bytes"],
            "tx_bytes": d2h["acc"],
            "rx_bytes": round(d2h["acc"] * rx_share),
        },
        # RssShmem before/after torch.empty(3 GiB, pin_memory=True) on the H200.
        "pinned": {
            "requested_bytes": 3 << 30,
            "before_bytes": int(PROBE_B["s0"]["RssShmem"].split()[0]) * kb,
            "after_bytes": int(PROBE_B["s_pin3G"]["RssShmem"].split()[0]) * kb,
            "locked_after_bytes": int(PROBE_B["s_pin3G"]["VmLck"].split()[0]) * kb,
        },
    }
    checks = evaluate(report)
    assert checks and all(checks.values()), checks
    assert report["h2d"]["rx_over_payload"] == pytest.approx(1.078, abs=1e-3)
    assert report["d2h"]["tx_over_payload"] == pytest.approx(1.094, abs=1e-3)
    assert report["pinned"]["expected_growth_bytes"] == next_pow2(3 << 30) == 4 << 30
    # What a 200 ms sampler would have counted fails the check.
    report["h2d"]["rx_bytes"] = h2d["coarse200ms"]
    assert not evaluate(report)["h2d_rx_over_payload_in_1.0_1.2"]
