"""Check the exporter's GPU and pinned-memory collectors against known traffic on a real GPU.

Starts the real NVML collector (exporter.sources.nvml.source.NvmlSource with PynvmlApi), pins a
host buffer with torch, copies a known number of bytes host->device and device->host,
and checks:

- the exported RX total grew by the H2D payload and TX by the D2H payload, times the
  PCIe protocol overhead (~1.078 and ~1.094 measured on an H200 by a standalone script);
- no poll came too late to be wrap-safe (kvoffload_gpu_pcie_poll_gaps_total stays 0);
- kvoffload_process_pinned_bytes of this process (exporter.sources.procfs.source) grew by the
  pinned allocation rounded up to a power of two (PyTorch's host allocator);
- what the poller thread costs in CPU.

It prints one JSON report and writes it to $OUT/gpu_probe.json when $OUT is set. Exit
status: 0 all checks passed, 1 a check failed, 2 no GPU/torch here (skipped), 3 the
watchdog fired. It never runs longer than --deadline seconds (default 85).

    PYTHONPATH=. python3 bench/gpu_probe.py [--gib 20] [--buffer-mib 1536]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from exporter.render.nvml import nvml_families  # noqa: E402
from exporter.sources.nvml.library import PynvmlApi  # noqa: E402
from exporter.sources.nvml.poller import GpuSnapshot  # noqa: E402
from exporter.sources.nvml.source import NvmlSource  # noqa: E402
from exporter.sources.procfs.source import ProcfsSource  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
# Counted bytes / payload, from tests/fixtures/h200/nvml-fieldcounter-poll-probe.json.
EXPECTED_OVERHEAD = {"h2d": 1.078, "d2h": 1.094}
OVERHEAD_RANGE = (1.0, 1.2)
# A copy in one direction also moves some bytes the other way (read requests, completion
# headers): 0.30e9 TX for a 3 GiB H2D copy on the H200, ~9 %.
CROSS_TRAFFIC_MAX = 0.2
PINNED_SLACK = 4 * MIB


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def evaluate(report: dict[str, Any]) -> dict[str, bool]:
    """Pass/fail per check from the measured numbers; adds the ratios it computes to the
    report. No GPU needed: tested on the H200 recordings."""
    checks: dict[str, bool] = {}
    lo, hi = OVERHEAD_RANGE
    for direction, main, cross in (("h2d", "rx", "tx"), ("d2h", "tx", "rx")):
        d = report.get(direction)
        if not d:
            continue
        ratio = d[f"{main}_bytes"] / d["payload_bytes"]
        d[f"{main}_over_payload"] = round(ratio, 4)
        checks[f"{direction}_{main}_over_payload_in_{lo}_{hi}"] = lo <= ratio <= hi
        checks[f"{direction}_{cross}_small"] = (
            d[f"{cross}_bytes"] / d["payload_bytes"] <= CROSS_TRAFFIC_MAX
        )
        checks[f"{direction}_no_poll_gaps"] = d.get("poll_gaps", 0) == 0
    pinned = report.get("pinned")
    if pinned:
        expected = next_pow2(pinned["requested_bytes"])
        pinned["expected_growth_bytes"] = expected
        growth = pinned["after_bytes"] - pinned["before_bytes"]
        pinned["growth_bytes"] = growth
        checks["pinned_growth_is_power_of_two_rounded"] = abs(growth - expected) <= PINNED_SLACK
        checks["pinned_not_in_vmlck"] = pinned.get("locked_after_bytes", 0) == 0
    if "method" in report:
        checks["method_is_field_counter"] = report["method"] == "field_counter"
    return checks


class Probe:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.report: dict[str, Any] = {"phase": "start", "started_unix": time.time()}
        self.out = Path(os.environ["OUT"]) / "gpu_probe.json" if os.environ.get("OUT") else None
        self.lock = threading.Lock()
        self.done = False

    def emit(self, status: str) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
            self.report["status"] = status
            self.report["elapsed_s"] = round(time.time() - self.report["started_unix"], 2)
            text = json.dumps(self.report, indent=2, default=str)
            print(text, flush=True)
            if self.out is not None:
                self.out.parent.mkdir(parents=True, exist_ok=True)
                self.out.write_text(text + "\n")

    def phase(self, name: str) -> None:
        self.report["phase"] = name
        print(f"[gpu_probe] {name}", file=sys.stderr, flush=True)


def _gpu(src: NvmlSource, uuid: str | None) -> GpuSnapshot:
    gpus = src.poller.snapshot.gpus
    for g in gpus:
        if uuid and g.identity.uuid == uuid:
            return g
    return gpus[0]


def _settle(src: NvmlSource, interval: float) -> None:
    """Wait until the poller has read the counters after the copies finished."""
    target = src.poller.counter_reads + 3
    deadline = time.monotonic() + max(1.0, 20 * interval)
    while src.poller.counter_reads < target and time.monotonic() < deadline:
        time.sleep(interval / 2)


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    return ",".join(f'{n}="{v}"' for n, v in zip(names, values, strict=True))


def _own_memory(pid: int) -> tuple[int | None, int | None, int | None]:
    snap = ProcfsSource("gpu_probe", port=None, pid=pid).read()
    me = next(p for p in snap.processes if p.pid == pid)
    return me.pinned, me.shmem, me.locked


def run(probe: Probe) -> int:
    args = probe.args
    rep = probe.report
    probe.phase("import torch")
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        rep["skipped"] = f"torch not importable: {exc}"
        probe.emit("skipped")
        return 2
    if not torch.cuda.is_available():
        rep["skipped"] = "torch sees no CUDA device"
        probe.emit("skipped")
        return 2
    rep["torch"] = torch.__version__

    probe.phase("start NVML collector")
    src = NvmlSource(PynvmlApi(), poll_interval=args.poll_interval)
    asyncio.run(src.start())
    deadline = time.monotonic() + 30
    while not src.poller.snapshot.up:
        if time.monotonic() > deadline:
            rep["error"] = src.poller.snapshot.error or "NVML did not come up in 30 s"
            asyncio.run(src.stop())
            probe.emit("failed")
            return 1
        time.sleep(0.05)
    thread = src._thread
    assert thread is not None and thread.ident is not None
    cpu_clock = time.pthread_getcpuclockid(thread.ident)

    probe.phase("CUDA init")
    dev_index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev_index)
    uuid = f"GPU-{props.uuid}" if getattr(props, "uuid", None) else None
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    gpu = _gpu(src, uuid)
    rep["gpu"] = {
        "name": gpu.identity.name,
        "uuid": gpu.identity.uuid,
        "matched_torch_uuid": gpu.identity.uuid == uuid,
        "pci_bus_id": gpu.identity.pci_bus_id,
        "driver": src.poller.snapshot.driver_version,
        "link_generation": gpu.slow.link_generation,
        "link_generation_max": gpu.slow.link_generation_max,
        "link_width": gpu.slow.link_width,
        "link_width_max": gpu.slow.link_width_max,
        "link_bandwidth_bytes_per_second": gpu.slow.bandwidth,
    }
    rep["method"] = gpu.method

    probe.phase("pin host buffer")
    pid = os.getpid()
    size = args.buffer_mib * MIB
    before, shmem_before, _ = _own_memory(pid)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    after, shmem_after, locked = _own_memory(pid)
    rep["pinned"] = {
        "requested_bytes": size,
        "before_bytes": before,
        "after_bytes": after,
        "rss_shmem_before_bytes": shmem_before,
        "rss_shmem_after_bytes": shmem_after,
        "locked_after_bytes": locked,
    }
    device = torch.empty(size, dtype=torch.uint8, device="cuda")

    cpu0, wall0 = time.clock_gettime(cpu_clock), time.monotonic()
    reads0 = src.poller.counter_reads
    for direction in ("h2d", "d2h"):
        probe.phase(f"copy {direction}")
        n = max(1, math.ceil(args.gib * GIB / size))
        _settle(src, args.poll_interval)
        g0 = _gpu(src, uuid)
        t0 = time.monotonic()
        for i in range(n):
            if direction == "h2d":
                device.copy_(host, non_blocking=True)
            else:
                host.copy_(device, non_blocking=True)
            if i % 4 == 3:
                torch.cuda.synchronize()
                if time.monotonic() - t0 > args.copy_timeout:
                    break  # stay clear of the watchdog: report what was copied
        torch.cuda.synchronize()
        copy_s = time.monotonic() - t0
        _settle(src, args.poll_interval)
        g1 = _gpu(src, uuid)
        payload = (i + 1) * size
        assert g0.tx_bytes is not None and g1.tx_bytes is not None
        assert g0.rx_bytes is not None and g1.rx_bytes is not None
        rep[direction] = {
            "payload_bytes": payload,
            "copies": i + 1,
            "copy_seconds": round(copy_s, 4),
            "payload_gb_per_second": round(payload / copy_s / 1e9, 2),
            "tx_bytes": g1.tx_bytes - g0.tx_bytes,
            "rx_bytes": g1.rx_bytes - g0.rx_bytes,
            "poll_gaps": g1.counter_gaps - g0.counter_gaps,
            "expected_overhead": EXPECTED_OVERHEAD[direction],
        }
    cpu1, wall1 = time.clock_gettime(cpu_clock), time.monotonic()
    reads = src.poller.counter_reads - reads0
    rep["poller"] = {
        "poll_interval_s": args.poll_interval,
        "cpu_seconds_per_second": round((cpu1 - cpu0) / (wall1 - wall0), 5),
        "counter_reads_per_second": round(reads / (wall1 - wall0), 1),
        "cpu_us_per_counter_read": round((cpu1 - cpu0) / reads * 1e6, 1) if reads else None,
    }

    probe.phase("exporter families")
    asyncio.run(src.collect())
    rep["exposition"] = [
        f"{fam.definition.name}{{{_labels(fam.definition.labels, labels)}}} {value:g}"
        for fam in nvml_families(src.snapshot())
        for labels, value in fam.samples
        if fam.definition.name.startswith("kvoffload_gpu_pcie")
    ]
    asyncio.run(src.stop())
    del host, device

    probe.phase("done")
    checks = evaluate(rep)
    rep["checks"] = checks
    ok = all(checks.values())
    probe.emit("passed" if ok else "failed")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gib", type=float, default=20.0, help="GiB to copy each way")
    parser.add_argument("--buffer-mib", type=int, default=1536, help="pinned buffer size")
    parser.add_argument("--poll-interval", type=float, default=0.01)
    parser.add_argument("--copy-timeout", type=float, default=20.0, help="per direction")
    parser.add_argument("--deadline", type=float, default=85.0, help="watchdog, seconds")
    args = parser.parse_args(argv)
    probe = Probe(args)

    def watchdog() -> None:
        probe.report["error"] = f"watchdog: still in phase {probe.report['phase']!r}"
        probe.emit("timeout")
        os._exit(3)

    timer = threading.Timer(args.deadline, watchdog)
    timer.daemon = True
    timer.start()
    try:
        return run(probe)
    except Exception as exc:  # report whatever broke instead of a bare traceback
        probe.report["error"] = f"{type(exc).__name__}: {exc}"
        probe.emit("failed")
        return 1
    finally:
        timer.cancel()


if __name__ == "__main__":
    raise SystemExit(main())
