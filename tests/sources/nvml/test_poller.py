"""exporter/sources/nvml/poller.py: the pure helpers, and the poller stepped with a fake clock
over PCIe counters recorded on an H200 (tests/nvml_doubles.py)."""

from __future__ import annotations

import pytest

from exporter.sources.nvml.library import LIBRARY_NOT_FOUND, NOT_SUPPORTED, TIMEOUT
from exporter.sources.nvml.poller import (
    METHOD_FIELD_COUNTER,
    METHOD_GPM,
    METHOD_THROUGHPUT,
    NvmlPoller,
    WrapCounter,
    auto_poll_interval,
    link_bandwidth_bytes,
    max_poll_gap,
    utilization,
)
from tests.nvml_doubles import (
    MIB,
    POLL_PROBE,
    FakeClock,
    RecordedGpu,
    RecordedNvml,
    gpm_rates_mib,
    load_fast,
    load_thr,
    make_poller,
    reference_totals,
    replay,
    run_steps,
    scaled,
    shifted,
    wraps,
)

# --- pure helpers ---------------------------------------------------------------------------


def test_link_bandwidth_follows_generation_encoding():
    assert link_bandwidth_bytes(5, 16) == pytest.approx(32e9 * 128 / 130 * 2)
    assert link_bandwidth_bytes(3, 16) == pytest.approx(8e9 * 128 / 130 * 2)
    assert link_bandwidth_bytes(2, 16) == pytest.approx(5e9 * 0.8 * 2)
    assert link_bandwidth_bytes(1, 1) == pytest.approx(2.5e9 * 0.8 / 8)
    assert link_bandwidth_bytes(6, 16) == pytest.approx(64e9 * 236 / 256 * 2)
    assert link_bandwidth_bytes(0, 16) is None
    assert link_bandwidth_bytes(5, 0) is None
    assert link_bandwidth_bytes(None, 16) is None


def test_link_bandwidth_bounds_the_measured_h200_counter_rate():
    # 60 GiB host->device copied in `el` seconds, counted bytes `acc`: the counted rate
    # must sit just under the Gen5 x16 theoretical figure.
    gen, width = POLL_PROBE["link"][0], POLL_PROBE["link"][3]
    bw = link_bandwidth_bytes(gen, width)
    assert bw is not None
    for direction in ("h2d", "d2h"):
        rate = POLL_PROBE[direction]["acc"] / POLL_PROBE[direction]["el"]
        assert 0.9 < rate / bw < 1.0


def test_max_poll_gap_is_the_wrap_time_at_line_rate():
    gap = max_poll_gap(link_bandwidth_bytes(5, 16))
    assert gap == pytest.approx(2**32 / 63.015e9, rel=1e-3)  # ~68 ms
    assert max_poll_gap(None, 64) > 1e6


def test_wrap_counter_adds_modular_deltas_and_counts_long_gaps():
    c = WrapCounter()
    c.update(2**32 - 10, 0.00, 32, 0.05)
    c.update(5, 0.01, 32, 0.05)  # wrapped: 15 bytes
    c.update(25, 0.10, 32, 0.05)  # 90 ms later: possibly hidden wraps
    assert (c.total, c.gaps) == (35, 1)
    c.rebase()
    c.update(7, 5.0, 32, 0.05)  # a fresh baseline adds nothing
    assert c.total == 35


def test_utilization_is_rate_over_bandwidth():
    assert utilization(0, 10.0, 63.015e9, 11.0, 63.015e9) == pytest.approx(1.0)
    assert utilization(0, 10.0, 1e9, 12.0, 1e9) == pytest.approx(0.5)
    assert utilization(5, 10.0, 4, 11.0, 1e9) is None  # went backwards
    assert utilization(0, 10.0, 4, 10.0, 1e9) is None
    assert utilization(0, 10.0, 4, 11.0, None) is None


# --- replaying recorded counters --------------------------------------------------------------


def test_recorded_offload_run_totals_are_reproduced():
    rows = load_fast("b_offload")
    assert wraps(rows) >= 1  # the recording wraps: the test exercises it
    _, _, snaps = replay(rows)
    gpu = snaps[-1].gpus[0]
    assert gpu.method == METHOD_FIELD_COUNTER
    assert (gpu.tx_bytes, gpu.rx_bytes) == reference_totals(rows)
    # The figures of the fixture README, and above vLLM's own (payload) byte counters.
    assert gpu.tx_bytes == pytest.approx(3.18e9, rel=2e-3)
    assert gpu.rx_bytes == pytest.approx(0.95e9, rel=5e-3)
    assert gpu.tx_bytes > 2.826e9 and gpu.rx_bytes > 0.844e9
    assert gpu.counter_gaps == 0


def test_background_traffic_without_offload_is_small():
    rows = load_fast("a_nooffload")
    _, _, snaps = replay(rows)
    gpu = snaps[-1].gpus[0]
    assert (gpu.tx_bytes, gpu.rx_bytes) == reference_totals(rows)
    assert gpu.tx_bytes == pytest.approx(14.6e6, rel=5e-3)
    assert gpu.rx_bytes == pytest.approx(34.4e6, rel=5e-3)


@pytest.mark.parametrize("offset", [0, 2**31, 2**32 - 1265920480 + 7, 3_000_000_000])
def test_totals_do_not_depend_on_where_the_counter_wraps(offset):
    rows = load_fast("b_offload")
    moved = shifted(rows, offset)
    _, _, snaps = replay(moved)
    gpu = snaps[-1].gpus[0]
    assert (gpu.tx_bytes, gpu.rx_bytes) == reference_totals(rows)


def test_many_wraps_at_high_traffic_are_all_counted():
    rows = scaled(load_fast("b_offload"), 16)
    assert wraps(rows) >= 10
    _, _, snaps = replay(rows)
    gpu = snaps[-1].gpus[0]
    true_tx, true_rx = reference_totals(load_fast("b_offload"))
    assert (gpu.tx_bytes, gpu.rx_bytes) == (16 * true_tx, 16 * true_rx)
    assert gpu.counter_gaps == 0
    totals = [s.gpus[0].tx_bytes for s in snaps]
    assert totals == sorted(totals)


def test_slow_polling_undercounts_and_says_so():
    # Reading every 20th row (~200 ms) is what a scrape-time read would do.
    rows = scaled(load_fast("b_offload"), 16)
    coarse = rows[::20]
    _, _, snaps = replay(coarse)
    gpu = snaps[-1].gpus[0]
    true_tx, _ = reference_totals(rows)
    assert gpu.tx_bytes is not None and gpu.tx_bytes < true_tx
    assert gpu.counter_gaps > 0


def test_a_failed_field_read_loses_no_bytes_and_is_counted():
    rows = load_fast("b_offload")
    errors = {50: (0, TIMEOUT), 51: (0, TIMEOUT), 52: (0, TIMEOUT), 100: (TIMEOUT, 0)}
    _, _, snaps = replay(rows, field_errors=errors)
    gpu = snaps[-1].gpus[0]
    assert (gpu.tx_bytes, gpu.rx_bytes) == reference_totals(rows)
    assert gpu.read_errors == 4
    assert gpu.method == METHOD_FIELD_COUNTER


def test_counters_not_supported_fall_back_to_gpm_asking_once():
    rows = load_fast("b_offload")
    api = RecordedNvml([RecordedGpu(rows=rows, field_errors={0: (NOT_SUPPORTED, NOT_SUPPORTED)})])
    clock = FakeClock()
    poller = make_poller(api, clock)
    run_steps(poller, clock, 3, dt=1.0)
    gpu = poller.snapshot.gpus[0]
    assert gpu.method == METHOD_GPM
    assert api.calls["pcie_counters"] == 1  # probed once, never again
    tx, rx = gpm_rates_mib()
    # Baseline at init and at the first step (same instant), then two 1 s intervals.
    assert gpu.tx_bytes == round(tx * MIB) * 2
    assert gpu.rx_bytes == round(rx * MIB) * 2


def test_without_counters_or_gpm_the_throughput_api_is_integrated():
    rows = load_fast("b_offload")
    thr = load_thr("b_offload")
    api = RecordedNvml(
        [
            RecordedGpu(
                rows=rows,
                thr=thr,
                gpm_supported=False,
                field_errors={0: (NOT_SUPPORTED, NOT_SUPPORTED)},
            )
        ]
    )
    clock = FakeClock()
    poller = NvmlPoller(api, clock=clock, poll_interval=0.01, throughput_interval=0.1)
    run_steps(poller, clock, len(thr), dt=0.1)
    gpu = poller.snapshot.gpus[0]
    assert gpu.method == METHOD_THROUGHPUT
    # The first sample is the baseline; each later one covers the 0.1 s before it. "KB" is
    # 1000 bytes (measured on the H200).
    expected_tx = sum(round(tx * 1000 * 0.1) for _, tx, _ in thr[1:])
    assert gpu.tx_bytes == pytest.approx(expected_tx, abs=len(thr))
    assert api.calls["gpm_supported"] == 1


def test_no_method_at_all_exports_no_byte_totals():
    rows = load_fast("b_offload")
    api = RecordedNvml(
        [
            RecordedGpu(
                rows=rows,
                gpm_supported=False,
                field_errors={0: (NOT_SUPPORTED, NOT_SUPPORTED)},
                unsupported={"pcie_throughput"},
            )
        ]
    )
    clock = FakeClock()
    poller = make_poller(api, clock)
    run_steps(poller, clock, 5)
    gpu = poller.snapshot.gpus[0]
    assert gpu.method is None and gpu.tx_bytes is None
    assert poller.snapshot.up  # link and memory still come


def test_unsupported_slow_value_is_disabled_not_zero():
    api = RecordedNvml([RecordedGpu(rows=load_fast("a_nooffload"), unsupported={"replay_counter"})])
    clock = FakeClock()
    poller = make_poller(api, clock)
    run_steps(poller, clock, 5, dt=1.0)
    assert poller.snapshot.gpus[0].slow.replays is None
    assert poller.snapshot.gpus[0].slow.link_generation == 5
    assert api.calls["replay_counter"] == 1


def test_no_library_is_absence_not_failure():
    api = RecordedNvml([], init_errors=[LIBRARY_NOT_FOUND])
    poller = make_poller(api, FakeClock())
    poller.step()
    snap = poller.snapshot
    assert not snap.up and snap.absent
    assert "LIBRARY_NOT_FOUND" in (snap.error or "")


def test_poller_cost_bench_runs_on_the_recordings():
    from bench.nvml_poller_cost import fake_api, measure

    result = measure(fake_api(), interval=0.005, seconds=0.2)
    assert "error" not in result, result
    assert result["methods"] == ["field_counter"] and result["gpus"] == 1
    assert result["counter_reads_per_second"] > 0 and result["cpu_seconds_per_second"] >= 0


def test_auto_poll_interval_follows_the_link():
    gen5 = link_bandwidth_bytes(5, 16)
    assert gen5 is not None
    # 70% of the 68 ms a 32-bit counter needs to wrap at Gen5 x16 line rate.
    assert auto_poll_interval([gen5]) == pytest.approx(0.7 * (1 << 32) / gen5)
    assert 0.047 < auto_poll_interval([gen5]) < 0.048
    # Slower links would allow longer waits, but the wait is capped; faster ones shorten it.
    assert auto_poll_interval([link_bandwidth_bytes(4, 16)]) == 0.05
    gen6 = link_bandwidth_bytes(6, 16)
    assert gen6 is not None and auto_poll_interval([gen5, gen6]) < auto_poll_interval([gen5])
    # Unknown links: the fastest schedule.
    assert auto_poll_interval([None]) == 0.01
