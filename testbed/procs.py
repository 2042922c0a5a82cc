"""Process helpers: free ports, waiting for HTTP readiness, stopping process groups."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_http(
    url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
            raise RuntimeError(
                f"process exited with {proc.returncode} before {url} was ready\n{tail}"
            )
        try:
            status, _ = http_get(url, timeout=2.0)
            if status == 200:
                return
            last = f"HTTP {status}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s ({last})\n{tail}")


def start(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    fh = log.open("wb")
    return subprocess.Popen(
        cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
    )


def _live_processes() -> Iterator[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every live process (zombies are dead already:
    their parent or init reaps them)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            state, ppid, pgrp = (d / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if state != "Z":
            yield int(d.name), int(ppid), int(pgrp)


def group_members(pgid: int) -> list[int]:
    """The live processes of a process group."""
    return [pid for pid, _, pgrp in _live_processes() if pgrp == pgid]


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    return [child for child, ppid, _ in _live_processes() if ppid == pid]


KILL_WAIT = 5.0  # seconds stop() waits for a group it has sent SIGKILL to


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 20.0, linger: float = 10.0) -> None:
    """SIGTERM the whole process group (vLLM forks an engine core), then SIGKILL, and return
    only once no process of the group is alive. The leader exiting is not enough: Python's
    multiprocessing resource tracker, which vLLM starts, ignores SIGTERM and leaves once its
    clients are gone, a moment after them (a demo test once found it still running); what
    is left after `linger` seconds is killed."""
    if proc is None:
        return
    pgid = proc.pid
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            proc.wait(5)
    deadline = time.monotonic() + linger
    killed = False
    while group_members(pgid):
        if time.monotonic() >= deadline:
            if killed:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            # A SIGKILL lands when the kernel next schedules its target: on a loaded machine
            # that is not at once, and returning before would leave the group alive.
            killed, deadline = True, time.monotonic() + KILL_WAIT
        time.sleep(0.05)
