#!/usr/bin/env python3
"""Disaggregated prefill on ONE GPU (issue 17): a prefill and a decode vLLM 0.26.0 server with
NixlConnector side by side on the same H200, a client that sends each prompt to the prefill
engine (max_tokens 1, kv_transfer_params do_remote_decode) and then to the decode engine with
the kv_transfer_params the prefill engine returned (the protocol of vLLM 0.26.0's
tests/v1/kv_connector/nixl_integration/toy_proxy_server.py), both /metrics scraped every second.

    run_pd.py run   [--variants pull-ipc,pull-default] [--shape small] [--out DIR] [--dry-run]
    run_pd.py probe [--memory vram|dram] [--out DIR] [--dry-run]

`run` runs each variant (a UCX setting or connector mode, VARIANTS below) with a fresh pair of
servers; per variant it writes DIR/<variant>.tar.xz holding prefill/ and decode/ recordings in
issue 16's format (metrics.jsonl.xz lines {"t", "body"}, kv_events.jsonl.xz, meta.json),
requests.jsonl (every request's timings and the kv_transfer_params), the exporter's own
/metrics (exporter.jsonl.xz) and /advice, the server logs, and summary.json. `probe` moves
bytes between two NIXL agents in two processes on the same device, without vLLM: READ and
WRITE, one large descriptor and vLLM-sized ones, with UCX's protocol choice logged.

Never hangs: every HTTP call and wait has a timeout, SIGALRM ends the run at --budget, children
run in their own process groups and are stopped by group (SIGTERM, then SIGKILL) in `finally`,
and pid files let the next call end leftovers of a killed one. Why each setting: the section
"NIXL on one GPU" of docs/backends.md; the device calls: bench/gpu/nixl/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import lzma
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import gpukit as kit  # noqa: E402  (bench/gpu/gpukit.py: shapes, env, exposition parsing)

MARKER = "kvoe-nixl"  # in every child's command line (the model directory), for the sweep
DEFAULT_SITE = "/tmp/kvoe-gpu/site:/tmp/kvoe-gpu/nixl-site"
PREFILL_ENGINE_ID = "kvoe-prefill"
DECODE_ENGINE_ID = "kvoe-decode"

# --------------------------------------------------------------------------------------------
# Pure parts (tests/test_gpu_kit_nixl.py)
# --------------------------------------------------------------------------------------------

# Qwen3-8B's published shape: between the 0.6B (recompute nearly free) and the 32B shape, whose
# two copies (65.5 GB of weights each) would fill the H200.
QWEN3_8B: dict[str, Any] = {
    **kit.QWEN3_06B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_window_layers": 36,
    "tie_word_embeddings": False,
}

# GPU KV per engine. The prefill engine holds a request's blocks until the decode engine has
# read them (or the 30 s lease ends): more room than one 1,900-token prompt needs.
SHAPES: dict[str, kit.Shape] = {
    "small": dataclasses.replace(kit.SHAPES["small"], kv_cache_bytes=1 << 30, gpu_util=0.1),
    "mid": dataclasses.replace(
        kit.SHAPES["small"],
        name="mid",
        model=QWEN3_8B,
        served_name="qwen3-8b-dummy",
        kv_cache_bytes=2 << 30,
        gpu_util=0.2,
        est_start_s=110.0,
        est_gpu_bytes=20 * kit.GIB,
        request_timeout_s=90.0,
    ),
    "large": dataclasses.replace(
        kit.SHAPES["large"], kv_cache_bytes=kit.LARGE_KV_BYTES, gpu_util=0.45
    ),
    # vLLM's CPU build, for a smoke test of this driver where there is no GPU (variant
    # pull-host only: NIXL on the CPU platform moves DRAM).
    "tiny": kit.SHAPES["tiny"],
}


@dataclass(frozen=True)
class Variant:
    name: str
    connector: str  # NixlConnector (pull: D READs from P) or NixlPushConnector (P WRITEs to D)
    kv_buffer_device: str  # cuda: VRAM registered with NIXL; cpu: host staging buffers
    ucx_env: Mapping[str, str]
    expect: str  # what the sources and reports predict (docs/backends.md)


# UCX_PROTO_INFO=y: UCX logs the protocol it picks per operation ("remote memory read by
# ucp_get* ... cuda_ipc/cuda" or "... software emulation | tcp/..."), the evidence of the path.
_UCX_LOG = {"UCX_PROTO_INFO": "y"}
# The transports of the cuda_ipc variants: cuda_ipc carries the KV, cuda_copy the staging
# NIXL 1.5 insists on, and tcp the active messages (wire-up, notifications). Not sm: NIXL's
# UCX backend asks for peer error handling, which no shared-memory transport offers, so with
# "cuda_ipc,cuda_copy,sm,self" the agent fails on the H200 ("select.c:722 UCX ERROR no active
# messages transport to <no debug data>: self/memory - no peer failure handler, sysv/memory -
# no peer failure handler, posix/memory - no peer failure handler, ...", 2026-12-03).
IPC_TLS = "cuda_ipc,cuda_copy,tcp,self"
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "pull-ipc",
            "NixlConnector",
            "cuda",
            {
                **_UCX_LOG,
                "UCX_TLS": IPC_TLS,
                # UCX disables cuda_ipc GET (what the pull connector's READ uses) on GPUs
                # without active NVLinks; a single-GPU VM reports none.
                "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
            },
            "READ over cuda_ipc (same-device IPC copy): fastest pull path",
        ),
        Variant(
            "pull-default",
            "NixlConnector",
            "cuda",
            dict(_UCX_LOG),
            "UCX defaults: cuda_ipc GET disabled without NVLink, READ falls back to "
            "TCP software emulation (vllm#52607: ~0.5 GB/s)",
        ),
        Variant(
            "push",
            "NixlPushConnector",
            "cuda",
            {**_UCX_LOG, "UCX_TLS": IPC_TLS},
            "WRITE over cuda_ipc (put_zcopy is enabled without NVLink)",
        ),
        Variant(
            "pull-host",
            "NixlConnector",
            "cpu",
            dict(_UCX_LOG),
            "host buffers: D2H copy on P, DRAM READ over shared memory, H2D copy on D",
        ),
    )
}


def resolve_variants(names: str | Sequence[str]) -> list[Variant]:
    items = names.split(",") if isinstance(names, str) else list(names)
    out = []
    for n in (i.strip() for i in items):
        if not n:
            continue
        if n not in VARIANTS:
            raise ValueError(f"unknown variant {n!r}; known: {', '.join(VARIANTS)}")
        out.append(VARIANTS[n])
    return out


def kv_transfer_config(variant: Variant, role: str) -> dict[str, Any]:
    """--kv-transfer-config of one engine. kv_producer / kv_consumer (kv_both is deprecated for
    NixlConnector in 0.26: nixl/connector.py); fixed engine ids, which push mode needs on the
    prefill side and which make the two engines' logs and metrics easy to tell apart."""
    if role not in ("prefill", "decode"):
        raise ValueError(role)
    cfg: dict[str, Any] = {
        "kv_connector": variant.connector,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "engine_id": PREFILL_ENGINE_ID if role == "prefill" else DECODE_ENGINE_ID,
        "kv_load_failure_policy": "fail",
    }
    if variant.kv_buffer_device != "cuda":
        cfg["kv_buffer_device"] = variant.kv_buffer_device
    return cfg


@dataclass(frozen=True)
class Ports:
    prefill_http: int
    decode_http: int
    prefill_side: int  # VLLM_NIXL_SIDE_CHANNEL_PORT (+ data_parallel_index, 0 here)
    decode_side: int
    prefill_events: int  # the recorder binds, vLLM's PUB connects
    decode_events: int
    exporter: int

    def all(self) -> list[int]:
        return list(dataclasses.astuple(self))


def ports_from(numbers: Sequence[int]) -> Ports:
    if len(set(numbers)) != 7:
        raise ValueError(f"need 7 distinct ports, got {list(numbers)}")
    return Ports(*numbers)


def server_command(
    shape: kit.Shape,
    variant: Variant,
    role: str,
    *,
    python: str,
    model_dir: str,
    ports: Ports,
    eager: bool = True,
    kv_events: bool = True,
) -> list[str]:
    http = ports.prefill_http if role == "prefill" else ports.decode_http
    events = ports.prefill_events if role == "prefill" else ports.decode_events
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        shape.served_name,
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
    ]
    if shape.device == "gpu":
        cmd += [
            "--kv-cache-memory-bytes",
            str(shape.kv_cache_bytes),
            "--gpu-memory-utilization",
            str(shape.gpu_util),
        ]
    else:
        cmd += ["--dtype", "float32", "--max-num-seqs", "4"]
    cmd += [
        "--max-model-len",
        "2048",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--port",
        str(http),
        "--host",
        "127.0.0.1",
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(variant, role), separators=(",", ":")),
    ]
    if kv_events:
        endpoint = f"tcp://127.0.0.1:{events}"
        cmd += ["--kv-events-config", json.dumps(kit.kv_events_config(endpoint, None))]
    if eager and shape.device == "gpu":
        cmd.append("--enforce-eager")
    return cmd


def server_env(
    base: Mapping[str, str],
    shape: kit.Shape,
    variant: Variant,
    role: str,
    *,
    pythonpath: str | None,
    ports: Ports,
    cudart_dir: str | None = None,
) -> dict[str, str]:
    env = kit.server_env(base, shape, pythonpath)
    for key in [k for k in env if k.startswith("UCX_")]:
        del env[key]  # nothing inherited decides the transport
    env.update(variant.ucx_env)
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(
        ports.prefill_side if role == "prefill" else ports.decode_side
    )
    if cudart_dir:  # UCX's libucm_cuda links libcudart.so.13 by name
        env["LD_LIBRARY_PATH"] = ":".join(p for p in (cudart_dir, env.get("LD_LIBRARY_PATH")) if p)
    return env


def prompt_tokens(seed: int, vocab: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


@dataclass(frozen=True)
class PdRequest:
    index: int
    length: int
    pd_seed: int  # the prompt that goes prefill -> decode
    baseline_seed: int  # a fresh prompt of the same length, computed by the decode engine alone


def plan_requests(n: int, lengths: Sequence[int], seed: int = 17) -> list[PdRequest]:
    """n requests cycling through the prompt lengths; every prompt distinct (no prefix hit)."""
    if not lengths:
        raise ValueError("no prompt lengths")
    return [
        PdRequest(i, lengths[i % len(lengths)], seed * 100_003 + 2 * i, seed * 100_003 + 2 * i + 1)
        for i in range(n)
    ]


def prefill_body(model: str, tokens: Sequence[int]) -> dict[str, Any]:
    """The toy proxy's prefill leg: max_tokens 1, no streaming, do_remote_decode."""
    return {
        "model": model,
        "prompt": list(tokens),
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }


def push_decode_params(ports: Ports, request_id: str) -> dict[str, Any]:
    """vLLM 0.26.0's examples/disaggregated/disaggregated_serving/
    disagg_proxy_pushconnector_demo.py: D gets P's coordinates, no block ids."""
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": PREFILL_ENGINE_ID,
        "remote_host": "127.0.0.1",
        "remote_port": ports.prefill_side,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": request_id,
    }


def decode_body(
    model: str,
    tokens: Sequence[int],
    kv_transfer_params: Mapping[str, Any] | None,
    max_tokens: int,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(tokens),
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,  # no early stop on dummy weights
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    return body


NIXL_SERIES = (
    "vllm:nixl_xfer_time_seconds_sum",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_post_time_seconds_sum",
    "vllm:nixl_bytes_transferred_sum",
    "vllm:nixl_bytes_transferred_count",
    "vllm:nixl_num_descriptors_sum",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_num_failed_notifications_total",
    "vllm:nixl_num_kv_expired_reqs_total",
    "vllm:prompt_tokens_total",
    "vllm:request_success_total",
)


def nixl_totals(text: str) -> dict[str, float]:
    return kit.exposition_values(text, NIXL_SERIES)


def nixl_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float | None]:
    """Counter deltas and what they give: bytes per second of NIXL transfer time (what
    kvoffload_nixl_transfer_bandwidth_bytes_per_second reports), transfers, failures."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in NIXL_SERIES}
    secs = d["vllm:nixl_xfer_time_seconds_sum"]
    out: dict[str, float | None] = {
        "transfers": d["vllm:nixl_xfer_time_seconds_count"],
        "bytes": d["vllm:nixl_bytes_transferred_sum"],
        "xfer_seconds": secs,
        "post_seconds": d["vllm:nixl_post_time_seconds_sum"],
        "descriptors": d["vllm:nixl_num_descriptors_sum"],
        "failed_transfers": d["vllm:nixl_num_failed_transfers_total"],
        "failed_notifications": d["vllm:nixl_num_failed_notifications_total"],
        "kv_expired_reqs": d["vllm:nixl_num_kv_expired_reqs_total"],
    }
    transferred = d["vllm:nixl_bytes_transferred_sum"]
    out["bandwidth_bytes_per_second"] = transferred / secs if secs > 0 else None
    return out


def metrics_line(t: float, body: str) -> str:
    """One line of issue 16's metrics.jsonl: {"t": unix seconds, "body": the /metrics text}."""
    return json.dumps({"t": round(t, 3), "body": body}, separators=(",", ":")) + "\n"


def recording_meta(
    argv: Sequence[str], env: Mapping[str, str], shape: kit.Shape, role: str, variant: Variant
) -> dict[str, Any]:
    """meta.json of one server's recording (issue 16) plus what this run adds."""
    keep = ("UCX_", "VLLM_NIXL_", "NIXL_")
    return {
        "vllm_argv": list(argv),
        "kv_bytes_per_token": shape.kv_bytes_per_token,
        "environ": {k: v for k, v in sorted(env.items()) if k.startswith(keep)},
        "role": role,
        "variant": variant.name,
        "connector": variant.connector,
        "kv_buffer_device": variant.kv_buffer_device,
        "shape": shape.name,
    }


def sse_events(lines: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects of an OpenAI server-sent-event stream, until [DONE]."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        with contextlib.suppress(json.JSONDecodeError):
            yield json.loads(data)


def median(values: Sequence[float]) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def summarize_requests(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per prompt length: median decode-engine TTFT with the KV transferred (pd) and with the
    prompt recomputed there (baseline), and how many transfers returned usable params."""
    by_len: dict[int, dict[str, list[float]]] = {}
    ok = failed = 0
    for r in records:
        slot = by_len.setdefault(int(r["length"]), {"pd": [], "baseline": [], "prefill": []})
        if r.get("error"):
            failed += 1
            continue
        ok += 1
        for key, field_name in (
            ("pd", "decode_ttft_s"),
            ("baseline", "baseline_ttft_s"),
            ("prefill", "prefill_s"),
        ):
            if r.get(field_name) is not None:
                slot[key].append(float(r[field_name]))
    per_len = {}
    for length, slot in sorted(by_len.items()):
        pd, base = median(slot["pd"]), median(slot["baseline"])
        per_len[str(length)] = {
            "decode_ttft_pd_s": pd,
            "decode_ttft_recompute_s": base,
            "prefill_s": median(slot["prefill"]),
            "transfer_vs_recompute": (base / pd) if pd and base else None,
            "n": len(slot["pd"]),
        }
    return {"ok": ok, "failed": failed, "by_length": per_len}


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


class BudgetExceededError(Exception):
    pass


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _pdeathsig() -> None:
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path


@dataclass
class Children:
    piddir: Path
    items: list[Child] = field(default_factory=list)

    def sweep_leftovers(self) -> None:
        """End process groups a killed earlier call left (pid files; command line checked)."""
        self.piddir.mkdir(parents=True, exist_ok=True)
        for pf in sorted(self.piddir.glob("*.pid")):
            with contextlib.suppress(OSError, ValueError):
                pid_s, _, marker = pf.read_text().strip().partition(" ")
                pid = int(pid_s)
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                if marker and marker.encode() in cmdline:
                    log(f"ending leftover process group {pid} ({pf.stem})")
                    self._kill_group(pid, 15.0)
            pf.unlink(missing_ok=True)

    @staticmethod
    def _kill_group(pid: int, timeout: float) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)

    def start(
        self,
        name: str,
        cmd: Sequence[str],
        log_path: Path,
        env: Mapping[str, str],
        marker: str = MARKER,
    ) -> Child:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as fh:
            proc = subprocess.Popen(
                list(cmd),
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env),
                start_new_session=True,
                # run_variant starts every child before its scraper threads
                preexec_fn=_pdeathsig,  # noqa: PLW1509
            )
        # what the sweep of a later call checks in /proc/PID/cmdline before it kills the group
        (self.piddir / f"{name}.pid").write_text(f"{proc.pid} {marker}\n")
        child = Child(name, proc, log_path)
        self.items.append(child)
        return child

    def stop_all(self, timeout: float = 20.0) -> None:
        items, self.items = list(self.items), []
        for c in items:
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in items):
            time.sleep(0.2)
        for c in items:  # the group may hold children that outlive the leader (EngineCore)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(5)
            (self.piddir / f"{c.name}.pid").unlink(missing_ok=True)


def free_ports(n: int) -> list[int]:
    socks, out = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            out.append(int(s.getsockname()[1]))
    finally:
        for s in socks:
            s.close()
    return out


def find_cudart_dir(python: str) -> str | None:
    """The folder of the libcudart.so.13 torch uses (pip's nvidia runtime), or None."""
    code = (
        "import glob, os, site, sys\n"
        "roots = site.getsitepackages() + [site.getusersitepackages()]\n"
        "for r in roots:\n"
        "    for p in sorted(glob.glob(os.path.join(r, 'nvidia', '**', 'libcudart.so.13*'),"
        " recursive=True)):\n"
        "        print(os.path.dirname(p)); sys.exit(0)\n"
    )
    with contextlib.suppress(Exception):
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=30, check=False
        )
        line = out.stdout.strip().splitlines()
        return line[0] if line else None
    return None


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------


def http_get(url: str, timeout: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, ValueError):
        return 0, ""


def post_json(
    url: str, body: Mapping[str, Any], timeout: float, headers: Mapping[str, str] | None = None
) -> tuple[float, dict[str, Any]]:
    """(seconds, response JSON); raises on HTTP errors and timeouts."""
    data = json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=hdrs, method="POST")
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out = json.loads(resp.read())
    return time.perf_counter() - t0, out


def post_stream(
    url: str, body: Mapping[str, Any], timeout: float, headers: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Streaming completion: time to the first token chunk, total time, tokens, usage."""
    data = json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=hdrs, method="POST")
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    usage: dict[str, Any] | None = None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for ev in sse_events(iter(resp.readline, b"")):
            if ev.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            if ev.get("choices"):
                chunks += 1
            if ev.get("usage"):
                usage = ev["usage"]
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "chunks": chunks, "usage": usage}


def wait_ready(urls: Sequence[str], children: Sequence[Child], deadline: float) -> None:
    pending = list(urls)
    while pending:
        for c in children:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with {c.proc.returncode} (log {c.log_path})")
        pending = [u for u in pending if http_get(u + "/health", 3.0)[0] != 200]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready in time: {pending}")
        time.sleep(1.0)


# --------------------------------------------------------------------------------------------
# Recording: /metrics every second, KV events
# --------------------------------------------------------------------------------------------


class Scraper(threading.Thread):
    """GET url every `interval` s into an xz JSON-lines file; never raises, stops on an event."""

    def __init__(self, url: str, path: Path, stop: threading.Event, interval: float = 1.0):
        super().__init__(daemon=True, name=f"scrape {url}")
        self.url, self.path, self.stop_event, self.interval = url, path, stop, interval
        self.samples = 0
        self.failures = 0
        self.last_body = ""

    def run(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with lzma.open(self.path, "wt", encoding="utf-8", preset=6) as fh:
            nxt = time.monotonic()
            while not self.stop_event.is_set():
                t = time.time()
                status, body = http_get(self.url, 3.0)
                if status == 200:
                    fh.write(metrics_line(t, body))
                    self.samples += 1
                    self.last_body = body
                else:
                    self.failures += 1
                nxt += self.interval
                self.stop_event.wait(max(0.0, nxt - time.monotonic()))


class EventRecorder(threading.Thread):
    """SUB bound on 127.0.0.1:port (vLLM's PUB connects), one JSON line per message (the format
    of gpukit.decode_kv_message, block hashes as ints)."""

    def __init__(self, port: int, path: Path, stop: threading.Event):
        super().__init__(daemon=True, name=f"kv events {port}")
        self.port, self.path, self.stop_event = port, path, stop
        self.messages = 0
        self.error: str | None = None

    def run(self) -> None:
        try:
            import zmq
        except ImportError as exc:
            self.error = f"no pyzmq: {exc}"
            return
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.RCVTIMEO, 500)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"tcp://127.0.0.1:{self.port}")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with lzma.open(self.path, "wt", encoding="utf-8", preset=6) as fh:
                while not self.stop_event.is_set():
                    try:
                        frames = sock.recv_multipart()
                    except zmq.Again:
                        continue
                    rec = kit.decode_kv_message(frames)
                    fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
                    self.messages += 1
        except Exception as exc:  # the recorder never takes the run down
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            sock.close(0)
            ctx.term()


# --------------------------------------------------------------------------------------------
# One variant
# --------------------------------------------------------------------------------------------


@dataclass
class RunCtx:
    args: argparse.Namespace
    shape: kit.Shape
    python: str
    pythonpath: str | None
    model_dir: Path
    out: Path
    work: Path
    children: Children
    cudart_dir: str | None


def write_model(model_dir: Path, shape: kit.Shape) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(kit.model_config_json(shape))


def plan_variant(ctx: RunCtx, variant: Variant, ports: Ports) -> dict[str, Any]:
    """Commands and environments of one variant (what --dry-run prints)."""
    plan: dict[str, Any] = {"variant": variant.name, "expect": variant.expect, "ports": ports}
    for role in ("prefill", "decode"):
        cmd = server_command(
            ctx.shape,
            variant,
            role,
            python=ctx.python,
            model_dir=str(ctx.model_dir),
            ports=ports,
            eager=not ctx.args.cuda_graphs,
            kv_events=not ctx.args.no_kv_events,
        )
        env = server_env(
            os.environ,
            ctx.shape,
            variant,
            role,
            pythonpath=ctx.pythonpath,
            ports=ports,
            cudart_dir=ctx.cudart_dir,
        )
        plan[role] = {"cmd": cmd, "env": env}
    plan["exporter"] = None
    if not ctx.args.no_exporter:
        plan["exporter"] = [
            ctx.python,
            "-m",
            "exporter",
            "--vllm-url",
            f"http://127.0.0.1:{ports.prefill_http}",
            "--vllm-url",
            f"http://127.0.0.1:{ports.decode_http}",
            "--listen",
            f"127.0.0.1:{ports.exporter}",
            "--interval",
            "1",
            "--kv-bytes-per-token",
            str(ctx.shape.kv_bytes_per_token),
        ]
    return plan


def _env_diff(env: Mapping[str, str]) -> str:
    keys = sorted(k for k in env if os.environ.get(k) != env[k])
    return " ".join(f"{k}={shlex.quote(env[k])}" for k in keys)


def print_plan(plan: Mapping[str, Any]) -> None:
    print(f"# variant {plan['variant']}: {plan['expect']}")
    for role in ("prefill", "decode"):
        r = plan[role]
        print(f"{role}: {_env_diff(r['env'])} \\\n  {shlex.join(r['cmd'])}")
    if plan["exporter"]:
        print(f"exporter: {shlex.join(plan['exporter'])}")
    print()


def one_request(
    ctx: RunCtx, variant: Variant, ports: Ports, req: PdRequest, timeout: float
) -> dict[str, Any]:
    model = ctx.shape.served_name
    p_url = f"http://127.0.0.1:{ports.prefill_http}/v1/completions"
    d_url = f"http://127.0.0.1:{ports.decode_http}/v1/completions"
    pd_tokens = prompt_tokens(req.pd_seed, ctx.shape.vocab, req.length)
    base_tokens = prompt_tokens(req.baseline_seed, ctx.shape.vocab, req.length)
    rid = str(uuid.uuid4())
    headers = {"X-Request-Id": rid}
    rec: dict[str, Any] = {"index": req.index, "length": req.length, "request_id": rid}
    try:
        # Baseline first: the decode engine computes a fresh prompt of the same length itself.
        base = post_stream(
            d_url, decode_body(model, base_tokens, None, ctx.args.max_tokens), timeout
        )
        rec["baseline_ttft_s"] = base["ttft_s"]
        rec["baseline_usage"] = base["usage"]
        time.sleep(ctx.args.pause)
        t_start = time.time()
        secs, p_resp = post_json(p_url, prefill_body(model, pd_tokens), timeout, headers)
        rec["prefill_s"] = secs
        params = p_resp.get("kv_transfer_params")
        rec["prefill_kv_transfer_params"] = params
        if variant.connector == "NixlPushConnector":
            params = push_decode_params(ports, rid)
        if not params:
            rec["error"] = "prefill engine returned no kv_transfer_params"
            return rec
        dec = post_stream(
            d_url, decode_body(model, pd_tokens, params, ctx.args.max_tokens), timeout, headers
        )
        rec["decode_ttft_s"] = dec["ttft_s"]
        rec["decode_total_s"] = dec["total_s"]
        rec["decode_usage"] = dec["usage"]
        rec["decode_chunks"] = dec["chunks"]
        rec["t_start"] = t_start
        rec["t_end"] = time.time()
    except (OSError, ValueError, urllib.error.URLError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


_UCX_PREFIX = re.compile(r"^\[[0-9.]+\]\s+\[[^\]]*\]\s+")
_UCX_ROW = re.compile(
    r"^\|\s*([0-9.]+[KMG]?\.\.[0-9a-z.]+[KMG]?)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|"
)
_UCX_NOTES = (
    "software emulation",
    "get zcopy disabled",
    "UCX  ERROR",
    "UCX  WARN",
    "NIXL compatibility",
    "Transfer plan",
    "Invalid UCX_TLS",
)


def ucx_paths(lines: Iterable[str]) -> dict[str, Any]:
    """What UCX_PROTO_INFO=y says about remote reads and writes: for each protocol table whose
    title is "remote memory read ..." or "remote memory write ...", its title and the
    (range, description, transport) rows, deduplicated; plus notable lines (errors, warnings,
    the cuda_ipc GET switch, vLLM's NIXL handshake lines)."""
    tables: dict[str, list[list[str]]] = {}
    notes: list[str] = []
    title: str | None = None
    for raw in lines:
        line = _UCX_PREFIX.sub("", raw.rstrip())
        body = line.strip()
        if any(k in line for k in _UCX_NOTES):
            note = body[:300]
            if note not in notes and len(notes) < 30:
                notes.append(note)
        if body.startswith("| remote memory read") or body.startswith("| remote memory write"):
            title = body.strip("| ").strip()
            tables.setdefault(title, [])
            continue
        if title is None:
            continue
        m = _UCX_ROW.match(body)
        if m:
            row = [m.group(1), m.group(2), m.group(3)]
            if row not in tables[title]:
                tables[title].append(row)
        elif body.startswith("+") or body.startswith("| Range"):
            continue
        else:
            title = None
    transports: dict[str, list[str]] = {"read": [], "write": []}
    for t, rows in tables.items():
        kind = "read" if "remote memory read" in t else "write"
        for _, _, tl in rows:
            if tl not in transports[kind]:
                transports[kind].append(tl)
    return {"tables": tables, "transports": transports, "notes": notes}


def ucx_evidence(log_path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError), log_path.open("rb") as fh:
        return ucx_paths(raw.decode("utf-8", errors="replace") for raw in fh)
    return {"tables": {}, "transports": {"read": [], "write": []}, "notes": []}


def _tail(path: Path, n: int = 40) -> list[str]:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace").splitlines()[-n:]
    return []


def _trim_log(path: Path, keep: int = 6 << 20) -> None:
    """Logs over `keep` bytes keep their first and last halves (UCX_PROTO_INFO is verbose)."""
    with contextlib.suppress(OSError):
        size = path.stat().st_size
        if size <= keep:
            return
        with path.open("rb") as fh:
            head = fh.read(keep // 2)
            fh.seek(size - keep // 2)
            tail = fh.read()
        path.write_bytes(head + b"\n[... trimmed by run_pd.py ...]\n" + tail)


def run_variant(ctx: RunCtx, variant: Variant, deadline: float) -> dict[str, Any]:
    vdir = ctx.work / variant.name
    if vdir.exists():
        subprocess.run(["rm", "-rf", str(vdir)], check=False, timeout=60)
    vdir.mkdir(parents=True)
    ports = ports_from(free_ports(7))
    plan = plan_variant(ctx, variant, ports)
    summary: dict[str, Any] = {
        "variant": variant.name,
        "expect": variant.expect,
        "connector": variant.connector,
        "kv_buffer_device": variant.kv_buffer_device,
        "ucx_env": dict(variant.ucx_env),
        "ports": dataclasses.asdict(ports),
        "shape": ctx.shape.name,
    }
    stop = threading.Event()
    threads: list[threading.Thread] = []
    scrapers: dict[str, Scraper] = {}
    recorders: dict[str, EventRecorder] = {}
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        servers = []
        for role in ("prefill", "decode"):
            r = plan[role]
            (vdir / role).mkdir(parents=True, exist_ok=True)
            meta = recording_meta(r["cmd"], r["env"], ctx.shape, role, variant)
            (vdir / role / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            servers.append(ctx.children.start(role, r["cmd"], vdir / f"{role}.log", r["env"]))
        exporter = None
        if plan["exporter"]:
            env = dict(os.environ)
            env["PYTHONPATH"] = ":".join(p for p in (ctx.pythonpath, str(Path.cwd())) if p)
            exporter = ctx.children.start(
                "exporter",
                plan["exporter"],
                vdir / "exporter.log",
                env,
                marker=f"exporter --vllm-url http://127.0.0.1:{ports.prefill_http}",
            )
        # Threads only now (no preexec_fn after this point).
        for role, port in (("prefill", ports.prefill_events), ("decode", ports.decode_events)):
            if not ctx.args.no_kv_events:
                recorder = EventRecorder(port, vdir / role / "kv_events.jsonl.xz", stop)
                recorder.start()
                recorders[role] = recorder
                threads.append(recorder)
        start_deadline = min(deadline, time.monotonic() + ctx.args.start_timeout)
        urls = [f"http://127.0.0.1:{p}" for p in (ports.prefill_http, ports.decode_http)]
        wait_ready(urls, servers, start_deadline)
        summary["start_s"] = round(time.monotonic() - t0, 1)
        log(f"{variant.name}: both servers ready in {summary['start_s']} s")
        for role, url in zip(("prefill", "decode"), urls, strict=True):
            sc = Scraper(url + "/metrics", vdir / role / "metrics.jsonl.xz", stop)
            sc.start()
            scrapers[role] = sc
            threads.append(sc)
        if exporter is not None:
            sc = Scraper(
                f"http://127.0.0.1:{ports.exporter}/metrics", vdir / "exporter.jsonl.xz", stop
            )
            sc.start()
            scrapers["exporter"] = sc
            threads.append(sc)
        # Warm-up: one short plain request per engine (first-request compile/alloc costs).
        warm = prompt_tokens(1, ctx.shape.vocab, 64)
        for url in urls:
            with contextlib.suppress(Exception):
                post_json(
                    url + "/v1/completions",
                    {**prefill_body(ctx.shape.served_name, warm), "kv_transfer_params": None},
                    ctx.shape.request_timeout_s,
                )
        before = nixl_totals(http_get(urls[1] + "/metrics", 5.0)[1])
        before_p = nixl_totals(http_get(urls[0] + "/metrics", 5.0)[1])
        failures_in_row = 0
        with (vdir / "requests.jsonl").open("w") as fh:
            for req in plan_requests(ctx.args.requests, ctx.args.lengths, ctx.args.seed):
                if time.monotonic() > deadline - 30:
                    summary["stopped_early"] = "budget"
                    break
                rec = one_request(ctx, variant, ports, req, ctx.shape.request_timeout_s)
                records.append(rec)
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
                failures_in_row = failures_in_row + 1 if rec.get("error") else 0
                log(
                    f"{variant.name} #{req.index} len {req.length}: "
                    + (
                        f"ERROR {rec['error']}"
                        if rec.get("error")
                        else f"pd ttft {rec.get('decode_ttft_s') or 0:.4f} s, "
                        f"recompute ttft {rec.get('baseline_ttft_s') or 0:.4f} s"
                    )
                )
                if failures_in_row >= 3:
                    summary["stopped_early"] = "3 failed requests in a row"
                    break
                time.sleep(ctx.args.pause)
        time.sleep(2.5)  # one more scrape after the last transfer
        after = nixl_totals(http_get(urls[1] + "/metrics", 5.0)[1])
        after_p = nixl_totals(http_get(urls[0] + "/metrics", 5.0)[1])
        summary["nixl_decode"] = nixl_delta(before, after)
        summary["nixl_prefill"] = nixl_delta(before_p, after_p)
        summary["requests"] = summarize_requests(records)
        if exporter is not None:
            summary["exporter_advice"] = http_get(f"http://127.0.0.1:{ports.exporter}/advice", 5.0)[
                1
            ][:20000]
            summary["exporter_nixl"] = [
                line
                for line in scrapers["exporter"].last_body.splitlines()
                if line.startswith(("kvoffload_nixl", "kvoffload_offload_config_info"))
            ][:40]
    except BudgetExceededError:
        summary["stopped_early"] = "budget (alarm)"
        raise
    except (RuntimeError, TimeoutError, OSError) as exc:
        summary["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{variant.name}: {summary['error']}")
    finally:
        stop.set()
        ctx.children.stop_all()
        for th in threads:
            th.join(10.0)
        summary["scrapes"] = {k: [s.samples, s.failures] for k, s in scrapers.items()}
        summary["kv_events"] = {k: [r.messages, r.error] for k, r in recorders.items()}
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        for role in ("prefill", "decode"):
            lp = vdir / f"{role}.log"
            summary[f"ucx_{role}"] = ucx_evidence(lp)
            if summary.get("error"):
                summary[f"log_tail_{role}"] = _tail(lp)
            _trim_log(lp)
        (vdir / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        size = kit.pack_dir(vdir, ctx.out / f"{variant.name}.tar.xz")
        log(f"{variant.name}: packed {size} bytes")
    return summary


# --------------------------------------------------------------------------------------------
# probe: two NIXL agents in two processes on one device, no vLLM
# --------------------------------------------------------------------------------------------


def _probe_peer(args: argparse.Namespace) -> int:
    """One side of the probe. The target owns a buffer holding a pattern; the initiator READs
    it (checked), WRITEs it back, per descriptor size, then WRITEs the inverted pattern with a
    "done" notification, which the target checks."""
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    rdv = Path(args.rendezvous)
    n = args.bytes
    expected = np.resize(np.arange(251, dtype=np.uint8), n)
    buf: Any
    if args.memory == "vram":
        import torch

        torch.cuda.set_device(0)
        buf = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
        addr, mem = buf.data_ptr(), "VRAM"

        def put(values: Any) -> None:
            buf.copy_(torch.from_numpy(values).to("cuda:0"))
            torch.cuda.synchronize()

        def get() -> Any:
            torch.cuda.synchronize()
            return buf.cpu().numpy()

    else:
        buf = np.zeros(n, dtype=np.uint8)
        addr, mem = buf.ctypes.data, "DRAM"

        def put(values: Any) -> None:
            buf[:] = values

        def get() -> Any:
            return buf.copy()

    if args.role == "target":
        put(expected)
    agent = nixl_agent(args.role, nixl_agent_config(num_threads=4, capture_telemetry=True))
    agent.register_memory([(addr, n, 0, "")], mem_type=mem)
    tmp = rdv / f"{args.role}.tmp"
    tmp.write_bytes(
        json.dumps({"addr": addr, "n": n}).encode() + b"\n" + agent.get_agent_metadata()
    )
    tmp.replace(rdv / f"{args.role}.meta")
    peer = "initiator" if args.role == "target" else "target"
    deadline = time.monotonic() + args.timeout
    while not (rdv / f"{peer}.meta").exists():
        if time.monotonic() > deadline:
            print(json.dumps({"role": args.role, "error": "peer metadata never came"}))
            return 3
        time.sleep(0.05)
    head, peer_md = (rdv / f"{peer}.meta").read_bytes().split(b"\n", 1)
    peer_name = agent.add_remote_agent(peer_md)
    if args.role == "target":
        while time.monotonic() < deadline:
            notifs = agent.get_new_notifs()
            if any(b"done" in m for msgs in notifs.values() for m in msgs):
                ok = bool((get() == 255 - expected).all())
                print(json.dumps({"role": "target", "write_verified": ok}))
                return 0 if ok else 5
            time.sleep(0.01)
        print(json.dumps({"role": "target", "error": "no done notification"}))
        return 3

    raddr = int(json.loads(head)["addr"])

    def xfer(op: str, local: Any, remote: Any, notif: bytes = b"") -> tuple[str, float, Any]:
        h = agent.initialize_xfer(op, local, remote, peer_name, notif)
        t0 = time.perf_counter()
        state = agent.transfer(h)
        while state == "PROC":
            if time.monotonic() > deadline:
                return "TIMEOUT", time.perf_counter() - t0, None
            state = agent.check_xfer_state(h)
        dt = time.perf_counter() - t0
        tele = None
        if state == "DONE":
            t = agent.get_xfer_telemetry(h)
            tele = {
                "xfer_us": t.xferDuration,
                "post_us": t.postDuration,
                "bytes": t.totalBytes,
                "descs": t.descCount,
            }
        agent.release_xfer_handle(h)
        return state, dt, tele

    results: list[dict[str, Any]] = []
    for desc_bytes in args.desc_bytes:
        count = max(1, n // desc_bytes)
        moved = count * desc_bytes
        local = agent.get_xfer_descs(
            [(addr + i * desc_bytes, desc_bytes, 0) for i in range(count)], mem
        )
        remote = agent.get_xfer_descs(
            [(raddr + i * desc_bytes, desc_bytes, 0) for i in range(count)], mem
        )
        for op in ("READ", "WRITE"):  # WRITE sends the pattern back: the target is unchanged
            if op == "READ":
                put(np.zeros(n, dtype=np.uint8))
            times, tele, state = [], None, "DONE"
            for _ in range(args.iters):
                state, dt, tele = xfer(op, local, remote)
                if state != "DONE":
                    break
                times.append(dt)
            row: dict[str, Any] = {"op": op, "desc_bytes": desc_bytes, "descs": count}
            row["state"] = state
            if times:
                best = min(times[1:] or times)
                row.update(
                    bytes=moved,
                    best_s=best,
                    gbps_best=moved / best / 1e9,
                    median_s=median(times),
                    telemetry=tele,
                )
            if op == "READ" and state == "DONE":
                row["verified"] = bool((get()[:moved] == expected[:moved]).all())
            results.append(row)
            if state != "DONE":
                break
    put(255 - expected)
    full_l = agent.get_xfer_descs([(addr, n, 0)], mem)
    full_r = agent.get_xfer_descs([(raddr, n, 0)], mem)
    state, _, _ = xfer("WRITE", full_l, full_r, b"done")
    out = {"role": "initiator", "memory": args.memory, "results": results, "final_write": state}
    print(json.dumps(out))
    return 0 if state == "DONE" else 4


def run_probe(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    python = args.python or sys.executable
    pythonpath = ":".join(p for p in (args.site, os.environ.get("PYTHONPATH")) if p)
    cudart = None if args.dry_run else find_cudart_dir(python)
    report: dict[str, Any] = {"memory": args.memory, "settings": {}}
    settings = {
        "ucx-default": dict(_UCX_LOG),
        "ipc-get-on": {
            **_UCX_LOG,
            "UCX_TLS": IPC_TLS,
            "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
        },
    }
    if args.memory == "dram":
        settings = {"ucx-default": dict(_UCX_LOG)}
    for name, ucx in settings.items():
        rdv = Path(args.work) / f"probe-{name}"
        cmds = {}
        for role in ("target", "initiator"):
            cmds[role] = [
                python,
                str(Path(__file__).resolve()),
                "probe-peer",
                "--role",
                role,
                "--rendezvous",
                str(rdv),
                "--memory",
                args.memory,
                "--bytes",
                str(args.bytes),
                "--iters",
                str(args.iters),
                "--timeout",
                str(args.timeout),
                "--desc-bytes",
                *[str(b) for b in args.desc_bytes],
            ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
        env.update(ucx)
        env["PYTHONPATH"] = pythonpath
        env["PYTHONUNBUFFERED"] = "1"
        if cudart:
            env["LD_LIBRARY_PATH"] = ":".join(p for p in (cudart, env.get("LD_LIBRARY_PATH")) if p)
        if args.dry_run:
            for role, cmd in cmds.items():
                print(f"probe {name} {role}: {_env_diff(env)} \\\n  {shlex.join(cmd)}")
            continue
        subprocess.run(["rm", "-rf", str(rdv)], check=False, timeout=30)
        rdv.mkdir(parents=True)
        procs = {}
        for role, cmd in cmds.items():
            fh = (out / f"probe-{name}-{role}.log").open("wb")
            procs[role] = (
                subprocess.Popen(
                    cmd,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_pdeathsig,  # noqa: PLW1509 (no threads in `probe`)
                ),
                fh,
            )
        res: dict[str, Any] = {"env": ucx}
        for role, (p, fh) in procs.items():
            try:
                res[f"{role}_rc"] = p.wait(args.timeout + 30)
            except subprocess.TimeoutExpired:
                res[f"{role}_rc"] = "timeout"
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            fh.close()
            lines = (out / f"probe-{name}-{role}.log").read_text(errors="replace").splitlines()
            for line in reversed(lines):
                if line.startswith("{"):
                    with contextlib.suppress(json.JSONDecodeError):
                        res[role] = json.loads(line)
                        break
            res[f"ucx_{role}"] = ucx_evidence(out / f"probe-{name}-{role}.log")
            _trim_log(out / f"probe-{name}-{role}.log", 2 << 20)
        report["settings"][name] = res
        log(f"probe {name}: {json.dumps(res.get('initiator', {}).get('results', res))[:600]}")
    if not args.dry_run:
        (out / "probe.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def _on_alarm(signum: int, frame: Any) -> None:
    raise BudgetExceededError("time budget reached")


def run(args: argparse.Namespace) -> int:
    shape = SHAPES[args.shape]
    variants = resolve_variants(args.variants)
    out = Path(args.out)
    work = Path(args.work)
    python = args.python or sys.executable
    pythonpath = ":".join(p for p in (args.site, os.environ.get("PYTHONPATH")) if p) or None
    ctx = RunCtx(
        args=args,
        shape=shape,
        python=python,
        pythonpath=pythonpath,
        model_dir=work / f"{MARKER}-model-{shape.name}",
        out=out,
        work=work,
        children=Children(work / "pids"),
        cudart_dir=None if args.dry_run else find_cudart_dir(python),
    )
    if args.dry_run:
        print(
            f"# shape {shape.name}: {shape.kv_bytes_per_token} B of KV per token, "
            f"--kv-cache-memory-bytes {shape.kv_cache_bytes}, "
            f"weights ~{shape.weight_bytes / 1e9:.1f} GB x 2"
        )
        for v in variants:
            print_plan(plan_variant(ctx, v, ports_from([8100, 8200, 5600, 5601, 5557, 5558, 9400])))
        req = plan_requests(1, args.lengths, args.seed)[0]
        body = prefill_body(shape.served_name, [0] * 3)
        print("prefill leg: POST /v1/completions", json.dumps(body))
        print(
            "decode leg:  POST /v1/completions",
            json.dumps(
                decode_body(
                    shape.served_name,
                    [0] * 3,
                    {"<kv_transfer_params>": "from the prefill response"},
                    args.max_tokens,
                )
            ),
        )
        print(f"requests: {args.requests} x lengths {args.lengths} (first: {req})")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    write_model(ctx.model_dir, shape)
    ctx.children.sweep_leftovers()
    t_start = time.monotonic()
    deadline = t_start + args.budget
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(max(1, int(args.budget - 15)))
    summaries: list[dict[str, Any]] = []
    env_info: dict[str, Any] = {"cudart_dir": ctx.cudart_dir, "pythonpath": pythonpath}
    with contextlib.suppress(Exception):
        env_info["nvidia_smi"] = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,memory.used,driver_version",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        ).stdout.strip()
    try:
        for v in variants:
            left = deadline - time.monotonic()
            if left < shape.est_start_s + 60:
                summaries.append({"variant": v.name, "skipped": f"{left:.0f} s left"})
                continue
            log(f"variant {v.name}: {v.expect}")
            summaries.append(run_variant(ctx, v, deadline))
    except (BudgetExceededError, KeyboardInterrupt) as exc:
        log(f"stopping: {exc}")
    finally:
        signal.alarm(0)
        ctx.children.stop_all()
        brief = [
            {
                k: s.get(k)
                for k in (
                    "variant",
                    "skipped",
                    "error",
                    "stopped_early",
                    "start_s",
                    "nixl_decode",
                    "requests",
                    "wall_s",
                )
            }
            for s in summaries
        ]
        (out / "summary.json").write_text(
            json.dumps({"env": env_info, "variants": brief}, indent=1, default=str) + "\n"
        )
        print(json.dumps(brief, indent=1, default=str))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    out_default = os.environ.get("OUT") or "/tmp/kvoe-nixl/out"

    r = sub.add_parser("run", help="prefill + decode servers on one GPU, per variant")
    r.add_argument(
        "--variants", default="pull-ipc,pull-default", help=f"comma list of {', '.join(VARIANTS)}"
    )
    r.add_argument("--shape", default="small", choices=sorted(SHAPES))
    r.add_argument("--requests", type=int, default=12)
    r.add_argument(
        "--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024, 1600, 1900]
    )
    r.add_argument("--max-tokens", type=int, default=4)
    r.add_argument("--pause", type=float, default=0.2)
    r.add_argument("--seed", type=int, default=17)
    r.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run")
    r.add_argument("--start-timeout", type=float, default=300.0)
    r.add_argument("--cuda-graphs", action="store_true", help="no --enforce-eager")
    r.add_argument("--no-exporter", action="store_true")
    r.add_argument("--no-kv-events", action="store_true")

    p = sub.add_parser("probe", help="NIXL READ/WRITE between two processes on one device")
    p.add_argument("--memory", choices=("vram", "dram"), default="vram")
    p.add_argument("--bytes", type=int, default=256 << 20)
    p.add_argument("--desc-bytes", type=int, nargs="+", default=[256 << 20, 32 << 10])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout", type=float, default=90.0)

    for sp in (r, p):
        sp.add_argument("--out", default=out_default)
        sp.add_argument("--work", default="/tmp/kvoe-nixl/work")
        sp.add_argument("--site", default=DEFAULT_SITE, help="prepended to PYTHONPATH")
        sp.add_argument("--python", default=None)
        sp.add_argument("--dry-run", action="store_true", help="print the commands, start nothing")

    pp = sub.add_parser("probe-peer")  # internal: one side of `probe`
    pp.add_argument("--role", choices=("target", "initiator"), required=True)
    pp.add_argument("--rendezvous", required=True)
    pp.add_argument("--memory", choices=("vram", "dram"), default="vram")
    pp.add_argument("--bytes", type=int, default=256 << 20)
    pp.add_argument("--desc-bytes", type=int, nargs="+", default=[256 << 20])
    pp.add_argument("--iters", type=int, default=5)
    pp.add_argument("--timeout", type=float, default=90.0)

    args = ap.parse_args(argv)
    if args.cmd == "run":
        return run(args)
    if args.cmd == "probe":
        return run_probe(args)
    return _probe_peer(args)


if __name__ == "__main__":
    sys.exit(main())
