#!/usr/bin/env python3
"""The real-GPU matrix driver (issue 16, section 2): data-driven scenarios (bench/gpu/scenarios/),
one vLLM server per scenario, traffic from a seeded generator at its scheduled times with up to
max_inflight requests in flight, recorded as a replayable directory per run:

    metrics.jsonl.xz    {"t": unix s, "body": vLLM /metrics text}, one line per 1 s scrape
    kv_events.jsonl.xz  {"topic", "seq", "payload": [ts, [event maps], dp_rank]}, ints as hashes
                        (unpack/compact: token ids zeroed where "block_ids" name the blocks)
    requests.jsonl.xz   one line per request: i, id, slot, t_sched, t_send, t_end, ttft_s,
                        status, prompt_tokens, cached_tokens, sent_tokens, tags (a workload
                        of more than one token a request is streamed: t_first, and ttft_s
                        ends there; meta.json's traffic.ttft_definition)
    meta.json           vllm_argv, link_bandwidth_bytes_per_second, kv_bytes_per_token, the
                        scenario, the GPU, versions, the traffic window, recorder statistics,
                        model_weight_bytes (from vLLM's log)
    server_log.txt      vLLM's log: head, warnings/errors, tail
    gpu.jsonl.xz        NVML samples of the GPU every 0.25 s while the run's turn lasts
                        (gpu_sample; since batch 21; analysis only, replay ignores it)
    (meta.json's host_probe: the host's Python and kernel-launch speed before and after the
    traffic, `host-probe`; since session 42; analysis only)

No exporter runs (recordings are replayed offline). Servers of a group start together; their
turns run one at a time, so no traffic shares the GPU with another run's.

On the H200 machine (after bench/gpu/device_setup.sh), detached so that it outlives the call:
    PYTHONPATH=/tmp/kvoe-gpu/site:$PWD python3 bench/gpu/matrix.py run --runs A,B,... \
        --work /tmp/kvoe-matrix --deadline-in 1300 --detach
    python3 bench/gpu/matrix.py collect --work /tmp/kvoe-matrix --out "$OUT" --wait-s 570 \
        --grace-s 15     # exit 3 at once: no driver here (the machine went back between calls)
Here:
    .venv/bin/python bench/gpu/matrix.py plan --runs A,B,... --budget 1300
    .venv/bin/python bench/gpu/matrix.py show --runs A,B,...
    .venv/bin/python bench/gpu/matrix.py smoke          # the tiny model on the vLLM CPU server
    .venv/bin/python bench/gpu/matrix.py unpack .gpu/matrix/*/runs-*.tar \
        --dest tests/fixtures/gpu/matrix
    .venv/bin/python bench/gpu/matrix.py compact tests/fixtures/gpu/matrix  # unpack does it
    .venv/bin/python bench/gpu/matrix.py truth tests/fixtures/gpu/matrix
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import lzma
import os
import queue
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import acceptance as acc  # noqa: E402
import gpukit  # noqa: E402
import matrixkit as mk  # noqa: E402
import steplog  # noqa: E402

T0 = time.monotonic()
LOG_FH: Any = None
OUT_FILE_LIMIT = 15 * (1 << 20)


def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')} {time.monotonic() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    if LOG_FH is not None:
        with contextlib.suppress(OSError, ValueError):
            LOG_FH.write(line + "\n")
            LOG_FH.flush()


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)


# --------------------------------------------------------------------------------------------
# Client: open-loop schedule, at most max_inflight in flight
# --------------------------------------------------------------------------------------------


def post_completion(
    conn: http.client.HTTPConnection, model: str, prompt: Sequence[int], max_tokens: int
) -> tuple[int | None, dict[str, Any] | None, str | None, float | None]:
    """(status, body, error, t_first). A request of one token is not streamed: its response
    is its first token. One of more is streamed, so that its first token is timed apart from
    its decode (t_first: when the first chunk with a choice arrived; body: the id and the
    usage of the final chunk, cached tokens included; status None where a stream that began
    200 carried an error or no token, so that the request is not counted as served)."""
    stream = max_tokens > 1
    body = json.dumps(
        {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            **({"stream": True, "stream_options": {"include_usage": True}} if stream else {}),
        }
    ).encode()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if not stream or resp.status != 200:
        data = resp.read()
        try:
            parsed = json.loads(data)
        except json.JSONDecodeError:
            return resp.status, None, data[:300].decode(errors="replace"), None
        err = None if resp.status == 200 else data[:300].decode(errors="replace")
        return resp.status, parsed if isinstance(parsed, dict) else None, err, None
    return _read_stream(resp)


def _read_stream(
    resp: http.client.HTTPResponse,
) -> tuple[int | None, dict[str, Any] | None, str | None, float | None]:
    """Server-sent events of a streamed completion, read to the end so that the connection
    can be kept alive."""
    t_first: float | None = None
    out: dict[str, Any] = {}
    err: str | None = None
    while line := resp.readline():
        text = line.strip()
        if not text.startswith(b"data:"):
            continue
        data = text[5:].strip()
        if data == b"[DONE]":
            continue
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            err = err or data[:300].decode(errors="replace")
            continue
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            err = err or json.dumps(chunk["error"])[:300]
        if chunk.get("choices") and t_first is None:
            t_first = time.time()
        out.setdefault("id", chunk.get("id"))
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
    if err is None and t_first is None:
        err = "stream ended without a token"
    return (resp.status if err is None else None), out or None, err, t_first


def drive(
    port: int,
    model: str,
    reqs: Sequence[mk.Req],
    *,
    max_inflight: int,
    max_tokens: int,
    t0: float,
    hard_stop: float,
    timeout: float,
) -> tuple[list[dict[str, Any]], list[int]]:
    """Send reqs in order, each at t0 + req.t or when a slot frees, whichever is later; no new
    send after hard_stop (those are returned as unsent). Records per request."""
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    free: queue.Queue[int] = queue.Queue()
    inboxes: list[queue.Queue[tuple[mk.Req, float] | None]] = []
    for s in range(max_inflight):
        free.put(s)
        inboxes.append(queue.Queue())

    def worker(slot: int) -> None:
        conn: http.client.HTTPConnection | None = None
        while True:
            item = inboxes[slot].get()
            if item is None:
                break
            req, t_sched = item
            status: int | None = None
            body: dict[str, Any] | None = None
            err: str | None = None
            t_first: float | None = None
            retried = False
            for attempt in (0, 1):
                t_send = time.time()
                reused = conn is not None
                try:
                    if conn is None:
                        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
                    status, body, err, t_first = post_completion(
                        conn, model, req.prompt, max_tokens
                    )
                    break
                except (OSError, http.client.HTTPException) as exc:
                    err = f"{type(exc).__name__}: {exc}"
                    if conn is not None:
                        conn.close()
                    conn = None
                    # A kept-alive connection the server closed while it idled (uvicorn's
                    # keep-alive timeout is 5 s): the request never reached the server, send
                    # it again at once on a new connection. Timeouts are not retried.
                    if attempt == 0 and reused and not isinstance(exc, TimeoutError):
                        retried = True
                        continue
                    break
            t_end = time.time()
            rec = mk.request_record(
                req,
                slot=slot,
                t_sched=t_sched,
                t_send=t_send,
                t_end=t_end,
                status=status,
                body=body,
                error=err,
                t_first=t_first,
            )
            if retried:
                rec["retried"] = True
            with lock:
                records.append(rec)
            free.put(slot)
        if conn is not None:
            conn.close()

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(max_inflight)]
    for th in threads:
        th.start()
    unsent: list[int] = []
    for k, req in enumerate(reqs):
        t_sched = t0 + req.t
        delay = t_sched - time.time()
        if delay > 0:
            time.sleep(delay)
        slot = None
        while slot is None and time.time() < hard_stop:
            with contextlib.suppress(queue.Empty):
                slot = free.get(timeout=0.2)
        if slot is None or time.time() >= hard_stop:
            if slot is not None:
                free.put(slot)
            unsent = [r.i for r in reqs[k:]]
            break
        inboxes[slot].put((req, t_sched))
    for box in inboxes:
        box.put(None)
    for th in threads:
        th.join(timeout + 5)
    records.sort(key=lambda r: int(r["i"]))
    return records, unsent


# --------------------------------------------------------------------------------------------
# Device facts
# --------------------------------------------------------------------------------------------


def nvml_link() -> dict[str, Any]:
    """PCIe generation and width (current and max) of GPU 0 and the bandwidth the exporter
    would compute (from the maximum: links down-train at idle)."""
    out: dict[str, Any] = {}
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        out["name"] = name.decode() if isinstance(name, bytes) else name
        try:
            # Which physical GPU: runs of one family compare only on one machine (truth noise).
            uuid = pynvml.nvmlDeviceGetUUID(h)
            out["uuid"] = uuid.decode() if isinstance(uuid, bytes) else uuid
        except Exception as exc:
            out["uuid_error"] = str(exc)
        for key, fn in (
            ("gen_current", "nvmlDeviceGetCurrPcieLinkGeneration"),
            ("gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
            ("gen_gpu_max", "nvmlDeviceGetGpuMaxPcieLinkGeneration"),
            ("width_current", "nvmlDeviceGetCurrPcieLinkWidth"),
            ("width_max", "nvmlDeviceGetMaxPcieLinkWidth"),
        ):
            try:
                out[key] = int(getattr(pynvml, fn)(h))
            except Exception as exc:
                out[key + "_error"] = str(exc)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        out["memory_total_bytes"] = int(mem.total)
        pynvml.nvmlShutdown()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["link_bandwidth_bytes_per_second"] = mk.link_bandwidth_bytes(
        out.get("gen_max"), out.get("width_max")
    )
    return out


# What the GPU did while a run's traffic ran: whether its steps were the GPU's (busy nearly all
# of an engine's busy time) or the CPU's (kernels launched one by one, the GPU mostly idle), which
# no vLLM metric says and which decides whether a store's copies hide behind a step
# (docs/gpu-acceptance.md, "What hides a store"). Not part of the replay format: analysis only.
GPU_SAMPLE_INTERVAL_S = 0.25


def gpu_sample(nv: Any, index: int = 0) -> dict[str, Any]:
    """One NVML sample of GPU `index`: utilisation (the share of the driver's last sample
    period with a kernel running, and with device memory being read or written), the SM
    clock, power, and PCIe throughput (bytes per second over the driver's ~20 ms window,
    its "KB" being 1000 bytes: exporter/sources/nvml/library.py). A field NVML refuses is
    left out, with the first such error named once per sample."""
    h = nv.nvmlDeviceGetHandleByIndex(index)
    out: dict[str, Any] = {"t": round(time.time(), 3)}
    errors: list[str] = []

    def get(key: str, fn: Any, scale: float = 1.0) -> None:
        try:
            out[key] = round(float(fn()) * scale, 3)
        except Exception as exc:  # NVML raises its own error per field it refuses
            errors.append(f"{key}: {type(exc).__name__}: {exc}")

    util: Any = None
    try:
        util = nv.nvmlDeviceGetUtilizationRates(h)
    except Exception as exc:
        errors.append(f"utilization: {type(exc).__name__}: {exc}")
    if util is not None:
        out["gpu_util"] = int(util.gpu) / 100.0
        out["mem_util"] = int(util.memory) / 100.0
    get("sm_clock_hz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), 1e6)
    get("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h), 1e-3)
    tx, rx = nv.NVML_PCIE_UTIL_TX_BYTES, nv.NVML_PCIE_UTIL_RX_BYTES
    get("pcie_tx_bytes_per_second", lambda: nv.nvmlDeviceGetPcieThroughput(h, tx), 1e3)
    get("pcie_rx_bytes_per_second", lambda: nv.nvmlDeviceGetPcieThroughput(h, rx), 1e3)
    if errors:
        out["error"] = errors[0]
    return out


def _gpu_error_line(exc: BaseException) -> str:
    return json.dumps({"t": round(time.time(), 3), "error": f"{type(exc).__name__}: {exc}"}) + "\n"


def sample_gpu(
    out: Path,
    nv: Any,
    *,
    interval_s: float = GPU_SAMPLE_INTERVAL_S,
    max_s: float = 600.0,
    stopped: Callable[[], bool] | None = None,
) -> int:
    """Append one gpu_sample line per interval to `out` until `max_s` have passed or
    `stopped()` says so (SIGTERM from the driver); the number of lines written. An NVML that
    cannot start writes one {"t", "error"} line: the run is recorded without samples."""
    done = stopped or (lambda: False)
    end = time.monotonic() + max_s
    n = 0
    with out.open("a", encoding="utf-8") as fh:
        try:
            nv.nvmlInit()
        except Exception as exc:
            fh.write(_gpu_error_line(exc))
            return 0
        try:
            while not done() and time.monotonic() < end:
                t = time.monotonic()
                fh.write(json.dumps(gpu_sample(nv)) + "\n")
                fh.flush()
                n += 1
                time.sleep(max(0.0, interval_s - (time.monotonic() - t)))
        finally:
            with contextlib.suppress(Exception):
                nv.nvmlShutdown()
    return n


def cmd_gpu_sample(a: argparse.Namespace) -> int:
    flag = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: flag.set())
    signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        import pynvml as nv
    except ImportError as exc:
        with Path(a.out).open("a", encoding="utf-8") as fh:
            fh.write(_gpu_error_line(exc))
        return 0
    n = sample_gpu(Path(a.out), nv, interval_s=a.interval, max_s=a.max_seconds, stopped=flag.is_set)
    log(f"gpu-sample: {n} samples in {a.out}")
    return 0


# The host's own speed, apart from vLLM (since session 42). An eager engine hands every step
# over kernel by kernel from one Python thread, and that submission drifted by a quarter
# between runs of the same work on one host (docs/whatif.md, "What a step's submission
# says"); a pair's truth cannot tell that drift from the tier's cost unless the host is
# timed on its own. So each turn times, in a process of vLLM's Python while its server idles
# loaded, a fixed Python loop and a fixed run of kernel launches, before its traffic and
# after. Sizes from session 43's H100 host, each probe a fresh process: a loop of 200,000
# iterations read 46 to 98 ns an iteration alone, one of 2,000,000 48.7 to 49.5; 20,000
# launches read 6.0 to 6.3 us alone (tests/fixtures/gpu/matrix/session-2026-12-07/).
PROBE_PY_ITERATIONS = 2_000_000
PROBE_LAUNCHES = 20_000
PROBE_REPEATS = 5
PROBE_TIMEOUT_S = 60.0


def host_probe(*, cuda: bool, repeats: int = PROBE_REPEATS) -> dict[str, Any]:
    """ns a Python loop iteration and us a kernel launch (each the fastest and the median of
    `repeats`, after one unmeasured); where CUDA cannot be had, `error` says why and the
    Python loop is still timed."""

    def loop() -> float:
        t, x = time.perf_counter(), 0
        for i in range(PROBE_PY_ITERATIONS):
            x += i * i
        return (time.perf_counter() - t) / PROBE_PY_ITERATIONS

    def fastest_and_median(fn: Callable[[], float], scale: float) -> tuple[float, float]:
        fn()
        xs = sorted(fn() for _ in range(repeats))
        return round(scale * xs[0], 3), round(scale * xs[len(xs) // 2], 3)

    out: dict[str, Any] = {"t": time.time()}
    out["python_ns"], out["python_ns_median"] = fastest_and_median(loop, 1e9)
    if not cuda:
        return out
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        x = torch.zeros(1, device="cuda")

        def launches() -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(PROBE_LAUNCHES):
                x.add_(1)
            torch.cuda.synchronize()
            return (time.perf_counter() - t) / PROBE_LAUNCHES

        out["launch_us"], out["launch_us_median"] = fastest_and_median(launches, 1e6)
    except Exception as exc:  # a probe never fails a run: it says what it could not time
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def cmd_host_probe(a: argparse.Namespace) -> int:
    print(json.dumps(host_probe(cuda=not a.no_cuda)))
    return 0


def run_host_probe(python: str, kit: Path, env: Mapping[str, str], *, cuda: bool) -> dict[str, Any]:
    """`host-probe` in a child of `python` (vLLM's, for its torch): its JSON, or `error`."""
    cmd = [python, str(kit / "matrix.py"), "host-probe", *([] if cuda else ["--no-cuda"])]
    try:
        res = subprocess.run(
            cmd, env=dict(env), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
        )
        lines = res.stdout.strip().splitlines()
        if res.returncode != 0 or not lines:
            return {"error": f"exit {res.returncode}: {res.stderr.strip()[-300:]}"}
        return dict(json.loads(lines[-1]))
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    sc: mk.Scenario
    dir: Path
    port: int
    kv_port: int
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    reqs: list[mk.Req] = field(default_factory=list)
    server: acc.Child | None = None
    recorder: acc.Child | None = None
    t_start: float = 0.0
    t_ready: float | None = None
    error: str | None = None


@dataclass
class Opts:
    work: Path
    deadline: float  # unix time: everything stopped and written by then
    vllm_python: str
    kit: Path  # copy of bench/gpu for the children (the repo copy may be replaced by a call)
    settle_s: float = 3.0
    request_timeout_s: float = 120.0
    cpu_smoke: bool = False
    # Servers started together at most (plan_session); 1: each run alone on the host, none
    # idle beside it (a group's later servers wait, loaded, through its earlier turns).
    max_group: int = mk.MAX_GROUP


class Driver:
    def __init__(self, o: Opts) -> None:
        self.o = o
        self.children = acc.Children(o.work / "pids")
        self.status: dict[str, Any] = {"started": time.time(), "deadline": o.deadline, "runs": {}}
        self.link: dict[str, Any] = {}
        self.env_info: dict[str, Any] = {}
        self.finalizers: list[subprocess.Popen[bytes]] = []

    def save(self) -> None:
        self.status["updated"] = time.time()
        write_json(self.o.work / "status.json", self.status)

    def left(self) -> float:
        return self.o.deadline - time.time()

    # -- servers -------------------------------------------------------------------------------
    def prepare(self, sc: mk.Scenario) -> Run:
        d = self.o.work / "runs" / sc.name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        run = Run(sc, d, acc.free_port(), acc.free_port())
        model_dir = self.o.work / "models" / sc.shape.name
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(dict(sc.shape.model), indent=1) + "\n")
        run.cmd = mk.vllm_command(
            sc,
            python=self.o.vllm_python,
            model_dir=str(model_dir),
            port=run.port,
            kv_endpoint=f"tcp://127.0.0.1:{run.kv_port}",
        )
        if self.o.cpu_smoke:
            run.cmd = cpu_smoke_command(run.cmd)
        run.env = vllm_env(os.environ, gpu=not self.o.cpu_smoke)
        if sc.step_log:
            run.env = step_log_env(run.env, self.o.work, self.o.kit, run.dir / "steps.jsonl")
        run.reqs = mk.generate(sc)
        return run

    def start(self, run: Run) -> None:
        ready = run.dir / "kv_events.jsonl.ready"
        run.recorder = self.children.start(
            f"{run.sc.name}-kvrec",
            [
                sys.executable,
                str(self.o.kit / "acceptance.py"),
                "record-kv",
                "--bind",
                f"tcp://127.0.0.1:{run.kv_port}",
                "--out",
                str(run.dir / "kv_events.jsonl"),
                "--max-bytes",
                str(1 << 30),
            ],
            run.dir / "kv_recorder.log",
        )
        until = time.monotonic() + 15
        while not ready.exists() and time.monotonic() < until:
            time.sleep(0.05)
        if not ready.exists():
            log(f"{run.sc.name}: KV recorder not ready")
        (run.dir / "cmd.txt").write_text(
            json.dumps(run.cmd)
            + "\n\n# environment set by the driver\n"
            + "".join(
                f"{k}={run.env[k]}\n"
                for k in sorted(run.env)
                if k.startswith(
                    ("VLLM_", "PYTHONHASHSEED", "HF_", "NCCL_", "TORCH_", "OMP_", "KVOE_")
                )
                or k == "PYTHONPATH"
            )
        )
        run.t_start = time.time()
        run.server = self.children.start(run.sc.name, run.cmd, run.dir / "server.log", env=run.env)
        log(f"{run.sc.name}: vLLM pid {run.server.proc.pid} port {run.port} starting")

    def wait_ready(self, runs: list[Run], limit_s: float) -> None:
        pending = [r for r in runs if r.error is None and r.t_ready is None]
        until = time.monotonic() + limit_s
        while pending:
            for r in list(pending):
                assert r.server is not None
                if r.server.proc.poll() is not None:
                    r.error = f"vLLM exited with {r.server.proc.returncode} before ready"
                elif time.monotonic() > until or self.left() < 30:
                    r.error = "vLLM not ready in time"
                else:
                    st, _, _ = acc.http_get(f"http://127.0.0.1:{r.port}/v1/models", timeout=3)
                    if st != 200:
                        continue
                    r.t_ready = time.time()
                    log(f"{r.sc.name}: ready after {r.t_ready - r.t_start:.1f}s")
                    pending.remove(r)
                    continue
                log(f"{r.sc.name}: {r.error}; log tail:\n{acc._read(r.dir / 'server.log')[-3000:]}")
                pending.remove(r)
                self.children.stop(r.server)
                self.status["runs"][r.sc.name] = {"state": "failed", "error": r.error}
                self.save()
            time.sleep(0.5)

    # -- a turn --------------------------------------------------------------------------------
    def probe(self) -> dict[str, Any]:
        """The host's speed now (`host_probe`), while the turn's server idles; skipped where
        the deadline is near, so it never costs a run."""
        if self.left() < 45 + PROBE_TIMEOUT_S:
            return {"error": "skipped: deadline near"}
        return run_host_probe(
            self.o.vllm_python,
            self.o.kit,
            vllm_env(os.environ, gpu=not self.o.cpu_smoke),
            cuda=not self.o.cpu_smoke,
        )

    def turn(self, run: Run) -> None:
        sc = run.sc
        name = sc.name
        st: dict[str, Any] = {"state": "running", "t_turn": time.time()}
        self.status["runs"][name] = st
        self.save()
        scraper = self.children.start(
            f"{name}-scrape",
            [
                sys.executable,
                str(self.o.kit / "acceptance.py"),
                "scrape",
                "--target",
                f"vllm=http://127.0.0.1:{run.port}/metrics",
                "--outdir",
                str(run.dir / "scrape"),
                "--interval",
                "1",
                "--max-seconds",
                str(int(sc.traffic_s * sc.stretch + 300)),
            ],
            run.dir / "scrape.log",
        )
        sampler = (
            None
            if self.o.cpu_smoke
            else self.children.start(
                f"{name}-gpu",
                [
                    sys.executable,
                    str(self.o.kit / "matrix.py"),
                    "gpu-sample",
                    "--out",
                    str(run.dir / "gpu.jsonl"),
                    "--max-seconds",
                    str(int(sc.traffic_s * sc.stretch + 300)),
                ],
                run.dir / "gpu_sample.log",
            )
        )
        time.sleep(2.0)
        t_warm = time.time()
        warm: list[dict[str, Any]] = []
        conn = http.client.HTTPConnection("127.0.0.1", run.port, timeout=self.o.request_timeout_s)
        for k, prompt in enumerate(mk.warmup_prompts(sc)):
            t = time.time()
            try:
                status, _, err, _ = post_completion(conn, sc.shape.served_name, prompt, 1)
            except (OSError, http.client.HTTPException) as exc:
                status, err = None, str(exc)
            warm.append({"k": k, "status": status, "s": round(time.time() - t, 4), "error": err})
        conn.close()
        time.sleep(self.o.settle_s)
        probes = {"before": self.probe()}
        t0 = time.time() + 0.5
        hard = min(t0 + sc.traffic_s * sc.stretch, self.o.deadline - 45)
        log(f"{name}: traffic {len(run.reqs)} requests over {sc.traffic_s:.0f}s (warmup {warm})")
        records, unsent = drive(
            run.port,
            sc.shape.served_name,
            run.reqs,
            max_inflight=sc.workload.max_inflight,
            max_tokens=sc.workload.max_tokens,
            t0=t0,
            hard_stop=hard,
            timeout=self.o.request_timeout_s,
        )
        t_last = max((r["t_end"] for r in records), default=time.time())
        time.sleep(self.o.settle_s)
        self.children.stop(scraper, timeout=5)
        self.children.stop(sampler, timeout=5)
        probes["after"] = self.probe()
        totals = mk.run_totals(records)
        log(f"{name}: done {totals} unsent {len(unsent)}")
        # Server first, then the recorder: every event the server published is kept.
        self.children.stop(run.server, timeout=30)
        time.sleep(0.5)
        self.children.stop(run.recorder, timeout=10)
        with (run.dir / "requests.jsonl").open("w") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
        meta = self.meta(run, t_warm, t0, t_last, records, unsent, warm, totals)
        meta["host_probe"] = probes
        write_json(run.dir / "meta.json", meta)
        st.update({"state": "written", "totals": totals, "unsent": len(unsent)})
        self.save()
        self.finalizers.append(
            subprocess.Popen(
                [sys.executable, str(self.o.kit / "matrix.py"), "finalize", "--dir", str(run.dir)],
                stdout=(run.dir / "finalize.log").open("wb"),
                stderr=subprocess.STDOUT,
                preexec_fn=lambda: os.nice(10),  # noqa: PLW1509
            )
        )

    def meta(
        self,
        run: Run,
        t_warm: float,
        t0: float,
        t_last: float,
        records: list[dict[str, Any]],
        unsent: list[int],
        warm: list[dict[str, Any]],
        totals: Mapping[str, Any],
    ) -> dict[str, Any]:
        sc = run.sc
        kv_stats: Any = None
        with contextlib.suppress(OSError, json.JSONDecodeError):
            kv_stats = json.loads((run.dir / "kv_events.jsonl.stats.json").read_text())
        return {
            "format": "kvoe-recording/1",
            "scenario": sc.name,
            "pair": sc.pair,
            "step_log": sc.step_log,
            "vllm_argv": run.cmd,
            "link_bandwidth_bytes_per_second": self.link.get("link_bandwidth_bytes_per_second"),
            "kv_bytes_per_token": sc.shape.kv_bytes_per_token,
            "block_size": sc.shape.block_size,
            "kv_bytes_per_block": sc.shape.kv_bytes_per_block,
            "gpu_kv_cache_bytes": sc.shape.kv_cache_bytes,
            "gpu_blocks": sc.shape.gpu_blocks,
            "offload": None
            if sc.offload is None
            else {
                "size_gib": sc.offload.size_gib,
                "cpu_tokens": sc.offload.cpu_tokens,
                "cpu_blocks": mk.cpu_blocks(sc.shape, sc.offload),
                "backend": sc.offload.backend,
                "extra_config": sc.offload.extra_config,
                "tag": sc.offload.tag,
            },
            "shape": {
                "name": sc.shape.name,
                "served_name": sc.shape.served_name,
                "params": sc.shape.param_count,
                "model_config": dict(sc.shape.model),
            },
            "workload": {
                "name": sc.workload.name,
                "generator": sc.workload.generator,
                "params": dict(sc.workload.params),
                "seed": sc.workload.seed,
                "max_inflight": sc.workload.max_inflight,
                "max_tokens": sc.workload.max_tokens,
                "sequence": mk.sequence_stats(run.reqs, sc.shape.block_size),
            },
            "traffic": {
                "traffic_s": sc.traffic_s,
                "t_server_start": run.t_start,
                "t_server_ready": run.t_ready,
                "server_start_s": round((run.t_ready or 0) - run.t_start, 2),
                "t_warmup": t_warm,
                "warmup": warm,
                "t_traffic_start": t0,
                "t_last_response": t_last,
                "planned_requests": len(run.reqs),
                "sent_requests": len(records),
                "unsent_requests": len(unsent),
                "first_unsent_i": unsent[0] if unsent else None,
                "ttft_definition": mk.ttft_definition(sc.workload.max_tokens),
            },
            "totals": dict(totals),
            "kv_recorder": kv_stats,
            "gpu": self.link,
            "environment": self.env_info,
            "vllm_env": {k: v for k, v in run.env.items() if k in VLLM_ENV_KEYS},
        }

    # -- the session ---------------------------------------------------------------------------
    def run(self, scenarios: list[mk.Scenario]) -> int:
        self.children.sweep_leftovers()
        envdir = self.o.work / "env"
        self.env_info = acc.environment_snapshot(
            envdir, gpu=not self.o.cpu_smoke, vllm_python=self.o.vllm_python
        )
        self.link = {} if self.o.cpu_smoke else nvml_link()
        write_json(envdir / "nvml_link.json", self.link)
        plan = mk.plan_session(
            scenarios,
            self.left() - 30,
            gpu_capacity_bytes=mk.gpu_capacity_bytes(self.link.get("memory_total_bytes")),
            max_group=self.o.max_group,
        )
        self.status["plan"] = {
            "groups": plan.groups,
            "skipped": plan.skipped,
            "est": plan.est_total_s,
        }
        for name in plan.skipped:
            self.status["runs"][name] = {"state": "skipped", "why": "plan: no time"}
        self.save()
        log(f"plan {plan}")
        by_name = {s.name: s for s in scenarios}
        for group in plan.groups:
            runs = [self.prepare(by_name[n]) for n in group]
            for r in runs:
                self.start(r)
            est = max(r.sc.shape.est_start_s for r in runs)
            self.wait_ready(runs, limit_s=max(300.0, 2.5 * est))
            for r in runs:
                if r.error is not None:
                    continue
                need = r.sc.traffic_s + 40
                if self.left() < need:
                    log(f"{r.sc.name}: skipped, {self.left():.0f}s left < {need:.0f}s")
                    self.status["runs"][r.sc.name] = {"state": "skipped", "why": "deadline"}
                    self.save()
                    continue
                try:
                    self.turn(r)
                except Exception:
                    log(f"{r.sc.name}: turn failed:\n{traceback.format_exc()}")
                    self.status["runs"][r.sc.name] = {"state": "failed", "error": "turn"}
                    self.save()
                finally:
                    self.children.stop(r.server, timeout=20)
                    self.children.stop(r.recorder, timeout=5)
            self.children.stop_all()
        for p in self.finalizers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(5.0, self.left()))
        self.status["finished"] = time.time()
        self.save()
        (self.o.work / "DONE").write_text("done\n")
        log("all done")
        return 0


VLLM_ENV_KEYS = (
    "PYTHONHASHSEED",
    "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_NO_USAGE_STATS",
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
    "PYTHONPATH",
    "VLLM_CPU_KVCACHE_SPACE",
)


def vllm_env(base: Mapping[str, str], *, gpu: bool) -> dict[str, str]:
    env = dict(base)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    parts = [p for p in parts if Path(p).resolve() != REPO and not Path(p, "bench").is_dir()]
    if parts:
        env["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        env.pop("PYTHONPATH", None)
    env.update(
        {
            "PYTHONHASHSEED": "0",  # the same block hashes in every run of a pair
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if gpu:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    else:
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_NUM_THREADS": "1",
            }
        )
    return env


def step_log_env(env: Mapping[str, str], work: Path, kit: Path, out: Path) -> dict[str, str]:
    """env with the engine-step log on (bench/gpu/steplog.py): a sitecustomize.py that loads
    the kit's steplog.py, first on PYTHONPATH, and the file the engine writes to. Kept out of
    the run's folder, which is packed whole."""
    site = work / "steplog_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(steplog.sitecustomize(str(kit / "steplog.py")))
    parts = [str(site), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**env, "PYTHONPATH": os.pathsep.join(parts), steplog.ENV: str(out)}


def cpu_smoke_command(cmd: list[str]) -> list[str]:
    """The GPU command made fit for the vLLM CPU server (smoke test here): no GPU KV bytes,
    float32, a fixed small block count."""
    out: list[str] = []
    skip = False
    for a in cmd:
        if skip:
            skip = False
            continue
        if a in ("--kv-cache-memory-bytes", "--gpu-memory-utilization"):
            skip = True
            continue
        if a == "--enforce-eager":
            continue
        out.append(a)
    return [*out, "--dtype", "float32", "--num-gpu-blocks-override", "24", "--max-num-seqs", "4"]


# --------------------------------------------------------------------------------------------
# Finalize (compress into the recording format), collect (pack for $OUT), unpack (here)
# --------------------------------------------------------------------------------------------


def _xz_lines(src: Path, dest: Path, convert: Any) -> dict[str, int]:
    n_in = n_out = 0
    with lzma.open(dest.with_suffix(".xz.tmp"), "wt", encoding="utf-8", preset=6) as out:
        for rec in gpukit.iter_jsonl(src):
            n_in += 1
            line = convert(rec)
            if line is not None:
                out.write(line + "\n")
                n_out += 1
    dest.with_suffix(".xz.tmp").replace(dest)
    return {"in": n_in, "out": n_out}


def server_log_excerpt(text: str, head: int = 120, tail: int = 150) -> str:
    lines = text.splitlines()
    if len(lines) <= head + tail:
        return text
    mid = [
        ln
        for ln in lines[head:-tail]
        if ("WARNING" in ln or "ERROR" in ln or "Traceback" in ln)
        and "POST /v1/completions" not in ln
    ][:200]
    return "\n".join(
        [
            *lines[:head],
            f"... ({len(lines) - head - tail} lines, warnings/errors:)",
            *mid,
            "...",
            *lines[-tail:],
        ]
    )


def cmd_finalize(a: argparse.Namespace) -> int:
    d = Path(a.dir)
    counts: dict[str, Any] = {}
    scraped = d / "scrape" / "vllm.jsonl"
    if scraped.exists():
        counts["metrics"] = _xz_lines(scraped, d / "metrics.jsonl.xz", mk.metrics_line)
    if (d / "kv_events.jsonl").exists():
        counts["kv_events"] = _xz_lines(
            d / "kv_events.jsonl", d / "kv_events.jsonl.xz", mk.kv_event_line
        )
    if (d / "requests.jsonl").exists():
        counts["requests"] = _xz_lines(d / "requests.jsonl", d / "requests.jsonl.xz", json.dumps)
    if (d / "gpu.jsonl").exists():
        counts["gpu"] = _xz_lines(d / "gpu.jsonl", d / "gpu.jsonl.xz", json.dumps)
    if (d / "steps.jsonl").exists():
        counts["steps"] = _xz_lines(d / "steps.jsonl", d / "steps.jsonl.xz", json.dumps)
    weights = None
    if (d / "server.log").exists():
        log_text = acc._read(d / "server.log", 64 << 20)
        (d / "server_log.txt").write_text(server_log_excerpt(log_text))
        weights = mk.weight_bytes(log_text)
    meta_path = d / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        meta["lines"] = counts
        if weights is not None:
            meta["model_weight_bytes"] = weights
        write_json(meta_path, meta)
    for raw in ("kv_events.jsonl", "requests.jsonl", "gpu.jsonl", "steps.jsonl", "server.log"):
        (d / raw).unlink(missing_ok=True)
    shutil.rmtree(d / "scrape", ignore_errors=True)
    for marker in d.glob("*.ready"):
        marker.unlink()
    (d / "FINAL").write_text(json.dumps(counts) + "\n")
    print(json.dumps(counts))
    return 0


def _finalizing(work: Path) -> list[str]:
    """Runs the driver has written but not yet finalized (compressed)."""
    try:
        st = json.loads((work / "status.json").read_text())
    except (OSError, ValueError):
        return []
    return [
        name
        for name, r in st.get("runs", {}).items()
        if r.get("state") == "written" and not (work / "runs" / name / "FINAL").exists()
    ]


def cmd_collect(a: argparse.Namespace) -> int:
    work, out = Path(a.work), Path(a.out)
    pid_file = work / "daemon.pid"
    if not pid_file.exists():
        # No driver ever started here: on the device this means the machine that ran it went
        # back between calls and this call got a fresh one. Waiting would only burn device time
        # (session 9 lost 577 s that way), so say so at once.
        print(
            f"collect: no driver was started in {work} (a fresh machine? the one that ran it "
            "went back between calls, and its runs with it)",
            file=sys.stderr,
        )
        return 3
    out.mkdir(parents=True, exist_ok=True)
    until = time.time() + a.wait_s
    done_file = work / "collected.txt"
    k = len(list(work.glob("collect-*.stamp")))
    (work / f"collect-{k}.stamp").write_text(str(time.time()))
    # $OUT takes at most 8 files a call: status.json, daemon.log, env.tar.xz and 5 tars.
    files = 0  # tars closed (full) this call
    current: list[Path] = []  # the runs of the tar being filled, runs-<k>-<files>.tar
    current_size = 0
    no_room: set[str] = set()

    def daemon_alive() -> bool:
        try:
            return bool(acc._alive(int(pid_file.read_text().split()[0])))
        except (OSError, ValueError):
            return False

    def pack() -> None:
        """Pack every finalized run not collected yet, as soon as it is there: what this call
        already packed comes back even if the call is cut off or the machine goes back before
        the next one (session 11 lost a 32B run whose traffic ended seconds before a collect
        that packed only at its end). A run joins the tar being filled, rewritten with it, up
        to OUT_FILE_LIMIT, so the call returns as few tars as when it packed at its end; each
        tar is written aside and renamed: a call cut off mid-write leaves a `.part`, never a
        truncated `runs-*.tar`."""
        nonlocal files, current, current_size
        done = set(done_file.read_text().split()) if done_file.exists() else set()
        ready = sorted(
            p.parent for p in (work / "runs").glob("*/FINAL") if p.parent.name not in done
        )
        for p in ready:
            s = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            if current and current_size + s > OUT_FILE_LIMIT:
                files, current, current_size = files + 1, [], 0
            if files >= 5:
                if p.name not in no_room:
                    no_room.add(p.name)
                    print(f"collect: no room for {p.name} this call")
                continue
            current.append(p)
            current_size += s
            dest = out / f"runs-{k}-{files}.tar"
            part = dest.with_name(dest.name + ".part")
            with tarfile.open(part, "w") as tar:
                for q in current:
                    tar.add(q, arcname=q.name)
            part.replace(dest)
            print(f"collect: {dest.name} {dest.stat().st_size} bytes: {[q.name for q in current]}")
            with done_file.open("a") as fh:
                fh.write(p.name + "\n")

    while time.time() < until and not (work / "DONE").exists():
        if not daemon_alive() and pid_file.exists():
            print("collect: the driver is not running")
            break
        pack()
        time.sleep(2)
    # A run whose traffic is over is being compressed (state "written", no FINAL yet): wait
    # up to --grace-s for it rather than leave it to a next call, which may find a fresh
    # machine (session 9 lost a 32B run finished seconds after the pack that way).
    grace_until = time.time() + a.grace_s
    while time.time() < grace_until and _finalizing(work):
        time.sleep(1)
    pack()
    for f in ("status.json", "daemon.log"):
        if (work / f).exists():
            shutil.copy(work / f, out / f)
    if not (work / "env-collected").exists() and (work / "env").is_dir():
        with tarfile.open(out / "env.tar.xz", "w:xz") as tar:
            tar.add(work / "env", arcname="env")
        (work / "env-collected").write_text("1")
    st = json.loads((work / "status.json").read_text()) if (work / "status.json").exists() else {}
    for name, r in st.get("runs", {}).items():
        print(
            f"collect: {name}: {r.get('state')} {r.get('totals', r.get('why', r.get('error', '')))}"
        )
    print(f"collect: done={(work / 'DONE').exists()} alive={daemon_alive()}")
    return 0


XZ_BEST = 9 | lzma.PRESET_EXTREME


def _write_xz_atomic(dest: Path, data: bytes, preset: int = XZ_BEST) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(lzma.compress(data, preset=preset))
    tmp.replace(dest)


def compact_run(d: Path, scenarios: Mapping[str, mk.Scenario]) -> dict[str, Any] | None:
    """Rewrite one recording in place (mk.compact_kv_records: token ids that the workload's
    blocks imply zeroed, the blocks' ids added; kv_events and metrics at xz -9e, the same
    lines); its meta.json gets COMPACT_KEY, which makes a second call a no-op. None where
    there is nothing to do."""
    meta_path, kv = d / "meta.json", d / "kv_events.jsonl.xz"
    if not meta_path.exists() or not kv.exists():
        return None
    meta = json.loads(meta_path.read_text())
    if mk.COMPACT_KEY in meta:
        print(f"{d.name}: already compacted ({meta[mk.COMPACT_KEY].get('scheme')})")
        return None
    sc = scenarios.get(str(meta.get("scenario")))
    wl = meta.get("workload") or {}
    if sc is None or (wl.get("seed"), wl.get("params")) != (sc.workload.seed, sc.workload.params):
        print(f"{d.name}: no scenario with its workload in bench/gpu/scenarios: left as it is")
        return None
    block_size = int(meta.get("block_size") or sc.shape.block_size)
    prompts = [*(r.prompt for r in mk.generate(sc)), *mk.warmup_prompts(sc)]
    blocks = mk.workload_block_ids(prompts, block_size)
    before = {f.name: f.stat().st_size for f in (kv, d / "metrics.jsonl.xz") if f.exists()}
    records = list(gpukit.iter_jsonl(kv))
    out, stats = mk.compact_kv_records(records, blocks)
    _write_xz_atomic(kv, "".join(json.dumps(r) + "\n" for r in out).encode())
    metrics = d / "metrics.jsonl.xz"
    if metrics.exists():  # the same bytes, a dictionary large enough for the whole file
        data = lzma.decompress(metrics.read_bytes())
        if len(packed := lzma.compress(data, preset=XZ_BEST)) < metrics.stat().st_size:
            tmp = metrics.with_name(metrics.name + ".tmp")
            tmp.write_bytes(packed)
            tmp.replace(metrics)
    info = {
        "scheme": mk.COMPACT_SCHEME,
        "workload_blocks": len(blocks.tokens),
        **stats.as_json(),
        "xz": "-9e",
    }
    meta[mk.COMPACT_KEY] = info
    write_json(meta_path, meta)
    after = {name: (d / name).stat().st_size for name in before}
    print(f"{d.name}: {json.dumps(info)} bytes {before} -> {after}")
    return info


def cmd_compact(a: argparse.Namespace) -> int:
    scenarios = mk.load_scenarios(Path(a.scenarios))
    dirs = sorted({p.parent for root in map(Path, a.dirs) for p in root.glob("**/meta.json")})
    for d in dirs:
        compact_run(d, scenarios)
    return 0


def cmd_unpack(a: argparse.Namespace) -> int:
    dest = Path(a.dest)
    dest.mkdir(parents=True, exist_ok=True)
    runs: set[Path] = set()
    for src in a.tars:
        with tarfile.open(src) as tar:
            for m in tar.getmembers():
                if not m.isfile() or ".." in Path(m.name).parts or m.name.startswith("/"):
                    continue
                if Path(m.name).name in (
                    "FINAL",
                    "finalize.log",
                    "kv_recorder.log",
                    "scrape.log",
                    "gpu_sample.log",
                ):
                    continue
                if Path(m.name).name == "kv_events.jsonl.stats.json":
                    continue
                target = dest / m.name
                target.parent.mkdir(parents=True, exist_ok=True)
                fh = tar.extractfile(m)
                assert fh is not None
                target.write_bytes(fh.read())
                print(f"{target} {m.size}")
                runs.add(target.parent)
    if not a.raw:
        scenarios = mk.load_scenarios(Path(a.scenarios))
        for d in sorted(runs):
            compact_run(d, scenarios)
    return 0


def load_requests(d: Path) -> list[dict[str, Any]]:
    f = d / "requests.jsonl.xz"
    return list(gpukit.iter_jsonl(f)) if f.exists() else []


def truth_table(root: Path) -> dict[str, Any]:
    """Per recording: totals; per pair (same shape, workload, flags): the paired truth; per
    family, the difference between two of its runs that did the same work (noise); the
    offload runs without a run of their family without offload on their machine (unpaired)."""
    runs: dict[str, Any] = {}
    for m in sorted(root.glob("*/meta.json")):
        meta = json.loads(m.read_text())
        runs[m.parent.name] = {
            "meta": meta,
            "totals": mk.run_totals(load_requests(m.parent)),
        }
    metas = {n: r["meta"] for n, r in runs.items()}
    records = {n: load_requests(root / n) for n in metas}
    noise = mk.family_noise(metas, records)
    pairs: dict[str, Any] = {}
    drift: dict[str, Any] = {}
    unpaired: list[str] = []
    for name, meta in metas.items():
        base = mk.base_run(metas, name)
        if base is None:
            if meta.get("offload") is not None:
                unpaired.append(name)  # no run without offload of its family on its machine
            continue
        truth = mk.family_truth(metas, records, noise, base, name)
        if meta.get("offload") is not None:
            pairs[name] = {"base": base, **truth}
        elif mk.traffic_start(meta) > mk.traffic_start(metas[base]):
            # A control: the same sequence without offload on a later machine.
            drift[name] = {"base": base, **truth}
    return {
        "runs": {n: r["totals"] for n, r in runs.items()},
        "pairs": pairs,
        "drift": drift,
        "noise": noise,
        "unpaired": sorted(unpaired),
    }


def cmd_truth(a: argparse.Namespace) -> int:
    print(json.dumps(truth_table(Path(a.root)), indent=1))
    return 0


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _scenarios(a: argparse.Namespace) -> list[mk.Scenario]:
    return mk.resolve(a.runs, mk.load_scenarios(Path(a.scenarios)))


def cmd_run(a: argparse.Namespace) -> int:
    global LOG_FH  # noqa: PLW0603
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    deadline = a.deadline_unix or (time.time() + a.deadline_in)
    if a.detach:
        argv = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
        argv = [x for x in argv if x != "--detach"]
        argv = [*argv, "--deadline-unix", str(deadline)]
        (work / "DONE").unlink(missing_ok=True)
        with (work / "daemon.out").open("ab") as fh:
            p = subprocess.Popen(
                argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        (work / "daemon.pid").write_text(f"{p.pid} matrix.py\n")
        print(f"matrix driver detached: pid {p.pid}, deadline in {deadline - time.time():.0f}s")
        return 0
    scenarios = _scenarios(a)
    kit_copy = work / "kit"
    kit_copy.mkdir(exist_ok=True)
    for f in HERE.glob("*.py"):
        shutil.copy(f, kit_copy / f.name)
    LOG_FH = (work / "daemon.log").open("a")
    (work / "daemon.pid").write_text(f"{os.getpid()} matrix.py\n")
    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(KeyboardInterrupt()))
    opts = Opts(
        work=work,
        deadline=deadline,
        vllm_python=a.vllm_python or sys.executable,
        kit=kit_copy,
        cpu_smoke=a.cpu_smoke,
        max_group=a.max_group,
    )
    log(f"matrix run: {[s.name for s in scenarios]} deadline in {deadline - time.time():.0f}s")
    d = Driver(opts)
    try:
        return d.run(scenarios)
    except BaseException:
        log(f"driver failed:\n{traceback.format_exc()}")
        d.status["error"] = traceback.format_exc()[-2000:]
        d.save()
        (work / "DONE").write_text("failed\n")
        return 1
    finally:
        d.children.stop_all(timeout=15)


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {n}")
    return n


def cmd_plan(a: argparse.Namespace) -> int:
    scs = _scenarios(a)
    total = int(a.gpu_memory_gib * mk.GIB) if a.gpu_memory_gib else None
    plan = mk.plan_session(
        scs, a.budget, gpu_capacity_bytes=mk.gpu_capacity_bytes(total), max_group=a.max_group
    )
    print(json.dumps({"groups": plan.groups, "skipped": plan.skipped, "est_s": plan.est_total_s}))
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    for sc in _scenarios(a):
        reqs = mk.generate(sc)
        print(
            sc.name,
            json.dumps(
                {
                    "offload_gib": sc.offload.size_gib if sc.offload else None,
                    "cpu_blocks": mk.cpu_blocks(sc.shape, sc.offload),
                    "gpu_blocks": sc.shape.gpu_blocks,
                    **mk.sequence_stats(reqs, sc.shape.block_size),
                }
            ),
        )
    return 0


def cmd_smoke(a: argparse.Namespace) -> int:
    """The whole driver against the real vLLM CPU server with the tiny model (no offload)."""
    shapes = {
        "tiny": mk.ShapeSpec(
            name="tiny",
            model=gpukit.TINY_LLAMA,
            served_name="tiny-llama",
            block_size=128,
            gpu_kv_tokens=24 * 128,
            gpu_memory_utilization=0.0,
            est_gpu_bytes=0,
            est_start_s=150,
            dtype_bytes=4,
        )
    }
    wl = mk.WorkloadSpec(
        "rag-tiny",
        "rag_zipf",
        {"docs": 12, "doc_tokens": [256, 512], "question_tokens": [8, 16], "rate_per_s": 2.0},
        7,
        max_inflight=3,
    )
    base = mk.expand_matrix(
        {
            "runs": [
                {
                    "shape": "tiny",
                    "workload": "rag-tiny",
                    "offload": None,
                    "traffic_s": a.traffic,
                    "max_model_len": 2048,
                    "vllm_args": [],
                    "step_log": True,
                }
            ]
        },
        shapes,
        {"rag-tiny": wl},
    )
    scs = [replace(s, warmup_requests=1) for s in base.values()]
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    kit_copy = work / "kit"
    kit_copy.mkdir()
    for f in HERE.glob("*.py"):
        shutil.copy(f, kit_copy / f.name)
    vpy = a.vllm_python or str(REPO / ".venv-vllm" / "bin" / "python")
    opts = Opts(
        work=work,
        deadline=time.time() + a.budget,
        vllm_python=vpy,
        kit=kit_copy,
        cpu_smoke=True,
    )
    global LOG_FH  # noqa: PLW0603
    LOG_FH = (work / "daemon.log").open("a")
    d = Driver(opts)
    try:
        rc = d.run(scs)
    finally:
        d.children.stop_all(timeout=15)
    print(json.dumps(d.status["runs"], indent=1))
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def with_runs(p: argparse.ArgumentParser) -> None:
        p.add_argument("--runs", required=True, help="scenario names, comma-separated, in order")
        p.add_argument("--scenarios", default=str(mk.SCENARIO_DIR))

    def with_max_group(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--max-group",
            type=_positive_int,
            default=mk.MAX_GROUP,
            help="servers started together at most (default %(default)s); 1 runs each alone, "
            "with no loaded server idle beside it",
        )

    p = sub.add_parser("run", help="the matrix on the GPU (detachable)")
    with_runs(p)
    p.add_argument("--work", default="/tmp/kvoe-matrix")
    p.add_argument("--deadline-in", type=float, default=540.0, help="seconds from now")
    p.add_argument("--deadline-unix", type=float, default=0.0)
    p.add_argument("--detach", action="store_true", help="run in a new session, return at once")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--cpu-smoke", action="store_true")
    with_max_group(p)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("collect", help="wait, then pack finished runs into OUT")
    p.add_argument("--work", default="/tmp/kvoe-matrix")
    p.add_argument("--out", required=True)
    p.add_argument("--wait-s", type=float, default=0.0)
    p.add_argument(
        "--grace-s",
        type=float,
        default=0.0,
        help="after --wait-s, wait up to this long more for runs being compressed",
    )
    p.set_defaults(fn=cmd_collect)

    p = sub.add_parser("finalize", help="(child) compress one run into the recording format")
    p.add_argument("--dir", required=True)
    p.set_defaults(fn=cmd_finalize)

    p = sub.add_parser(
        "gpu-sample", help="(child) NVML samples of GPU 0 while a run's traffic runs"
    )
    p.add_argument("--out", required=True)
    p.add_argument("--interval", type=float, default=GPU_SAMPLE_INTERVAL_S)
    p.add_argument("--max-seconds", type=float, default=600.0)
    p.set_defaults(fn=cmd_gpu_sample)

    p = sub.add_parser("host-probe", help="(child) the host's Python and kernel-launch speed")
    p.add_argument("--no-cuda", action="store_true", help="the Python loop alone")
    p.set_defaults(fn=cmd_host_probe)

    p = sub.add_parser("plan")
    with_runs(p)
    p.add_argument("--budget", type=float, default=1300)
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="plan for a GPU of this much memory (default: an H200; on the device the driver "
        "plans for the memory NVML reports)",
    )
    with_max_group(p)
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("show", help="request-sequence statistics per scenario")
    with_runs(p)
    p.set_defaults(fn=cmd_show)

    p = sub.add_parser("smoke", help="the driver against the vLLM CPU server, here")
    p.add_argument("--work", default="/tmp/kvoe-matrix-smoke")
    p.add_argument("--traffic", type=float, default=20.0)
    p.add_argument("--budget", type=float, default=600.0)
    p.add_argument("--vllm-python", default=None)
    p.set_defaults(fn=cmd_smoke)

    p = sub.add_parser("unpack", help="collected tars -> recording directories")
    p.add_argument("tars", nargs="+")
    p.add_argument("--dest", required=True)
    p.add_argument("--raw", action="store_true", help="keep the KV events as recorded")
    p.add_argument("--scenarios", default=str(mk.SCENARIO_DIR))
    p.set_defaults(fn=cmd_unpack)

    p = sub.add_parser("compact", help="recordings in place: implied token ids zeroed, xz -9e")
    p.add_argument("dirs", nargs="+", help="run folders or folders of them")
    p.add_argument("--scenarios", default=str(mk.SCENARIO_DIR))
    p.set_defaults(fn=cmd_compact)

    p = sub.add_parser("truth", help="totals and paired truth of recordings")
    p.add_argument("root")
    p.set_defaults(fn=cmd_truth)

    a = ap.parse_args(argv)
    return int(a.fn(a))


if __name__ == "__main__":
    sys.exit(main())
