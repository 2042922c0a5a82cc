"""The bench replays' worker pool: spawned processes that stop with the process that made
them."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor

# prctl(2): the signal a process gets when the thread that created it exits.
PR_SET_PDEATHSIG = 1


def _stop_with(parent: int) -> None:
    # A parent killed by a signal never shuts its executor down, and its workers would go on
    # replaying for minutes, orphaned: Linux signals each of them when the parent dies.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the line above took effect
        os._exit(1)


def replay_pool(workers: int | None = None) -> ProcessPoolExecutor:
    """`workers` spawned processes (None: one per CPU; spawned, not forked: the caller may be a
    test process with threads of its own) that a signal killing the caller stops too."""
    return ProcessPoolExecutor(
        max_workers=None if workers is None else max(1, workers),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_stop_with,
        initargs=(os.getpid(),),
    )
