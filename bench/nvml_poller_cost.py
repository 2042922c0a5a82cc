"""CPU cost of the NVML PCIe poller thread at a given poll interval.

Runs the real collector's poller (exporter.sources.nvml.poller.NvmlPoller) on its own thread
for a while and reads that thread's CPU clock: CPU seconds per wall second, CPU per poll,
achieved polls per second and the longest gap between counter reads.

    python bench/nvml_poller_cost.py                 # real NVML (on a GPU machine)
    python bench/nvml_poller_cost.py --fake          # H200 recordings, no GPU needed
    python bench/nvml_poller_cost.py --interval 0.005 --seconds 10 --json

With --fake the NVML calls are the recorded-sequence fake from tests/nvml_doubles.py, so the
number is the Python side only (a real field-value call also spends ~0.36 ms in the
driver on an H200). A benchmark, not a test: it prints numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from exporter.sources.nvml.library import NvmlApi, PynvmlApi  # noqa: E402
from exporter.sources.nvml.poller import NvmlPoller, max_poll_gap  # noqa: E402


def fake_api() -> NvmlApi:
    from tests.nvml_doubles import RecordedGpu, RecordedNvml, load_fast

    return RecordedNvml([RecordedGpu(rows=load_fast("b_offload"))])


def measure(
    api: NvmlApi, interval: float, seconds: float, init_timeout: float = 30.0
) -> dict[str, Any]:
    poller = NvmlPoller(api, poll_interval=interval)
    stop = threading.Event()
    thread = threading.Thread(target=poller.run, args=(stop,), name="nvml-poller", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + init_timeout
        while not poller.snapshot.up:
            if time.monotonic() > deadline or not thread.is_alive():
                return {"error": poller.snapshot.error or "NVML did not come up"}
            time.sleep(0.01)
        assert thread.ident is not None
        clock = time.pthread_getcpuclockid(thread.ident)
        gaps: list[float] = []
        last_at: float | None = None
        cpu0, wall0, polls0 = time.clock_gettime(clock), time.monotonic(), poller.counter_reads
        end = wall0 + seconds
        while time.monotonic() < end:
            gpus = poller.snapshot.gpus
            at = gpus[0].counted_at if gpus else None
            if at is not None and at != last_at:
                if last_at is not None:
                    gaps.append(at - last_at)
                last_at = at
            time.sleep(interval / 4)
        cpu1, wall1, polls1 = time.clock_gettime(clock), time.monotonic(), poller.counter_reads
    finally:
        stop.set()
        thread.join(5.0)
    snap = poller.snapshot
    wall, cpu, polls = wall1 - wall0, cpu1 - cpu0, polls1 - polls0
    bandwidth = snap.gpus[0].slow.bandwidth_max if snap.gpus else None
    return {
        "interval_s": interval,
        "seconds": round(wall, 3),
        "gpus": len(snap.gpus),
        "methods": sorted({str(g.method) for g in snap.gpus}),
        "cpu_seconds_per_second": round(cpu / wall, 5),
        "cpu_us_per_counter_read": round(cpu / polls * 1e6, 1) if polls else None,
        "counter_reads_per_second": round(polls / wall, 1),
        "max_gap_between_counter_reads_ms": round(max(gaps) * 1e3, 2) if gaps else None,
        "wrap_safe_gap_ms": round(max_poll_gap(bandwidth) * 1e3, 1),
        "poll_gaps_counted": sum(g.counter_gaps for g in snap.gpus),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--interval", type=float, default=0.01, help="poll interval, seconds")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to measure")
    parser.add_argument("--fake", action="store_true", help="replay H200 recordings")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = measure(fake_api() if args.fake else PynvmlApi(), args.interval, args.seconds)
    result["nvml"] = "fake (H200 recordings)" if args.fake else "real"
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:36} {value}")
    return 1 if "error" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())
