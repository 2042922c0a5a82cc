"""The bench replays' worker pool (bench/pool.py): its workers stop when a signal kills the
process that made them, instead of replaying on as orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The parent: two workers, each reporting its pid, then both busy for a minute.
PARENT = """
import os, sys, time
from bench.pool import replay_pool

with replay_pool(2) as pool:
    busy = [pool.submit(time.sleep, 60) for _ in range(2)]
    pids = sorted(pool._processes)
    print(" ".join(map(str, pids)), flush=True)
    time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_stop_with_a_parent_killed_by_a_signal(sig: signal.Signals) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        # The workers are running their minute of sleep; killing the parent ends them.
        time.sleep(1.0)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), pids
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
