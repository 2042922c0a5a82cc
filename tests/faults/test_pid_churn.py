"""Fault matrix: processes vanishing between the /proc listing and the reads of their files.

A real process listens on a port (as vLLM's API server does) and forks short-lived
children as fast as it can, so the procfs collector, reading the real /proc, keeps
finding pids whose files are gone by the time it reads them. Every collection must still
succeed with the listener found and no error counted; once the listener itself is gone
the collector is down as absent (no error counted), and nothing of it is exported.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from exporter.render.procfs import procfs_families
from exporter.sources import ErrorKind, execute
from exporter.sources.procfs import discovery
from exporter.sources.procfs.source import ProcfsSource
from testbed.procs import free_port

CHURN = textwrap.dedent(
    """
    import os, socket, sys, time
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(sys.argv[1])))
    s.listen()
    print("listening", flush=True)
    deadline = time.monotonic() + float(sys.argv[2])
    forked = 0
    while time.monotonic() < deadline:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        forked += 1
        while True:  # reap whatever has exited, leave the rest as zombies for a moment
            try:
                done, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if done == 0:
                break
    print("forked", forked, flush=True)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the real /proc")
async def test_children_vanishing_mid_read_never_fail_a_collection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(discovery, "TREE_REFRESH", 0.0)  # rescan the tree every collection
    port = free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before any await
        [sys.executable, "-c", CHURN, str(port), "60"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: the forked children go with it
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "listening"
        src = ProcfsSource("churn", port=port)
        await src.start()
        pids_seen: set[int] = set()
        for _ in range(150):
            assert await execute(src, 10.0), (src.health.error_kind, src.health.error)
            snap = src.snapshot()
            assert snap is not None and snap.root_pid == proc.pid
            pids_seen |= {p.pid for p in snap.processes}
            if len(pids_seen) > 20:
                break
        assert src.health.errors_total == {}
        # Children were really listed (and most were gone a moment later).
        assert len(pids_seen - {proc.pid}) >= 1, "no child ever listed: the race was not run"
        assert procfs_families(src.target, src.snapshot())
    finally:
        # Children forked a moment ago still hold the listening socket: kill the group.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for _ in range(200):  # bounded: until every member of the group is gone
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            await asyncio.sleep(0.05)
    # The listener is gone too: absence, not an error, and nothing exported for it.
    assert not await execute(src, 10.0)
    assert src.health.error_kind == ErrorKind.UNAVAILABLE
    assert src.health.errors_total == {}
    assert src.snapshot() is None
    assert [f for f in procfs_families(src.target, src.snapshot()) if len(f)] == []
    await src.stop()
