"""testbed.procs.stop leaves no process of the group behind: the servers the tests and the demo
start (vLLM, Prometheus, Alertmanager, the exporter) must be gone when it returns."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from testbed.procs import group_members, start, stop

# A leader that exits on SIGTERM and a child that, like multiprocessing's resource tracker,
# ignores SIGTERM and leaves `grace` seconds after its parent is gone (negative: never).
TREE = """
import os, signal, sys, time
grace = float(sys.argv[1])
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.02)
    if grace < 0:
        while True:
            time.sleep(1)
    time.sleep(grace)
    os._exit(0)
print("ready", flush=True)
time.sleep(600)
"""


def _started(tmp_path: Path, grace: float):  # type: ignore[no-untyped-def]
    log = tmp_path / "tree.log"
    proc = start([sys.executable, "-c", TREE, str(grace)], log, env=dict(os.environ))
    deadline = time.monotonic() + 10
    while "ready" not in log.read_text() or len(group_members(proc.pid)) < 2:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    return proc


def test_stop_waits_for_a_child_that_outlives_its_leader(tmp_path: Path) -> None:
    proc = _started(tmp_path, grace=1.0)
    pgid = proc.pid
    stop(proc)
    assert group_members(pgid) == []


def test_stop_kills_a_child_that_would_never_leave(tmp_path: Path) -> None:
    proc = _started(tmp_path, grace=-1.0)
    pgid = proc.pid
    t0 = time.monotonic()
    stop(proc, linger=0.5)
    # stop() returns once its SIGKILL has landed, however long the kernel took to deliver it
    # (a CI run once found the child still alive right after a stop that did not wait).
    assert group_members(pgid) == []
    assert time.monotonic() - t0 < 10


def test_stop_of_an_exited_leader_still_clears_its_group(tmp_path: Path) -> None:
    proc = _started(tmp_path, grace=1.0)
    pgid = proc.pid
    os.kill(proc.pid, 15)  # the leader alone; its child lingers
    proc.wait(10)
    assert group_members(pgid) != []
    stop(proc)
    assert group_members(pgid) == []
