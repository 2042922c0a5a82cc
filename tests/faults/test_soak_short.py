"""The soak's CI variant: 2 minutes of bench/soak.py against the session's real vLLM CPU
server (KV events on), the exporter as a process and a steady workload.

Asserts what the soak measures: /metrics always answered, and resident memory, open
fds, threads, asyncio tasks and the KV-event backlog (the queue left after each cycle's
drain) not growing by more than 5% (one unit
of slack for the small counts) between the first and last thirds after the warm-up. No
latency is asserted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bench.soak import Sample, backlog, judge, report, run
from testbed.procs import children, free_port, group_members
from tests.helpers import REPO


def _samples(depths: list[float]) -> list[Sample]:
    return [
        Sample(float(t), 50e6, 16.0, 7.0, 5.0, d, t, 200) for t, d in enumerate(depths, start=1)
    ]


def test_backlog_reads_the_queue_left_after_each_drain() -> None:
    """The soak's queue depth is the exporter's own gauge, summed over targets; without a
    KV-event consumer there is none."""
    body = (
        "# TYPE kvoffload_kv_event_queue_depth gauge\n"
        'kvoffload_kv_event_queue_depth{target="a"} 2\n'
        'kvoffload_kv_event_queue_depth{target="b"} 3\n'
        "kvoffload_kv_events_dropped_total 9\n"
    )
    assert backlog(body) == 5.0
    assert backlog("kvoffload_up 1\n") == 0.0


def test_judge_flags_growth_not_a_drop() -> None:
    """A leak is growth: a queue that drains or memory that is returned is flat."""
    by_name = {v.quantity: v for v in judge(_samples([3, 3, 2, 2, 1, 1]), 0.0, 0.05)}
    assert by_name["queue_depth"].flat and by_name["rss_bytes"].flat
    grown = {v.quantity: v for v in judge(_samples([1, 1, 2, 3, 4, 5]), 0.0, 0.05)}
    assert not grown["queue_depth"].flat


@pytest.mark.vllm
@pytest.mark.slow
def test_soak_two_minutes_is_flat(vllm_server, tmp_path) -> None:
    result = run(
        duration=120.0,
        warmup=60.0,
        sample_interval=10.0,
        attach=vllm_server.url,
        kv_events_endpoint=vllm_server.kv_events_endpoint,
        workdir=tmp_path,
        interval=1.0,
        window=30.0,
        log=False,
    )
    text = report(result)
    print(text)
    assert len(result.samples) >= 12, text
    assert result.requests > 0, text
    assert result.metrics_failures == 0, text
    assert result.cycles >= 20, text  # the loop kept cycling (liveness, not speed)
    for v in result.verdicts:
        assert v.flat, text


def test_a_sigterm_stops_the_soak_and_the_exporter_it_started(tmp_path) -> None:
    """The soak starts the exporter in a session of its own, which a signal to the soak
    does not reach: a SIGTERM must unwind the soak like ^C so that it stops the exporter
    too (it was left running, an orphan). Against a dead vLLM URL: the exporter runs and
    reports the target down, the workload's requests fail, neither matters here."""
    dead = f"http://127.0.0.1:{free_port()}"
    args = ["--attach", dead, "--duration", "120", "--warmup", "10", "--window", "10"]
    soak = subprocess.Popen(
        [sys.executable, "-m", "bench.soak", *args, "--workdir", str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not (exporters := children(soak.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert exporters, "the soak started no exporter within 60 s"
        time.sleep(2.0)  # past the exporter's start, into the sampling loop
        soak.send_signal(signal.SIGTERM)
        out, _ = soak.communicate(timeout=60)
    finally:
        soak.kill()
    # The exporter leads a process group of its own: none of it may be left.
    alive = [p for e in exporters for p in group_members(e)]
    for pid in alive:  # the test leaves no orphan either when it fails
        os.kill(pid, signal.SIGKILL)
    assert not alive, out.decode(errors="replace")
