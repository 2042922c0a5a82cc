"""Fault matrix: a real vLLM CPU server killed (SIGKILL, whole process group) mid-run and
a new one started on the same port, so the exporter process sees a counter reset.

Checked against vLLM's own counters, read directly while the server is idle:
- /metrics answers 200 throughout; while vLLM is gone the target is down with reason
  `connect`, and once its data is stale no windowed value is exported for it;
- the restart is counted once in kvoffload_target_resets_total and logged once;
- re-exported totals never decrease and end at (work before the kill) + (work after
  the restart), as Prometheus' increase() would count it;
- the windowed hit ratio is exactly the one over the good intervals before and after:
  the interval holding the reset contributes nothing; every unit ratio stays in [0, 1].
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from exporter import expfmt
from exporter.vllm_metrics import WANTED, EngineKey, normalise
from testbed.exporter_proc import ExporterProcess
from testbed.procs import http_get
from testbed.vllm_cpu import MODEL_NAME, VLLM_PYTHON, VllmServer, seed_workload
from tests.conftest import need
from tests.faults.common import (
    Recorder,
    monotonic_violations,
    ratio_violations,
    scrape,
    status_json,
    value,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
EK = EngineKey(MODEL_NAME, "0")
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def raw_counters(url: str) -> dict[str, float]:
    status, body = http_get(url + "/metrics")
    assert status == 200
    return dict(normalise(expfmt.parse(body.decode(), WANTED), 0).engines[EK].counters)


@dataclass
class Run:
    target: str
    r0: dict[str, float]  # first server, before the workload
    r1: dict[str, float]  # first server, after it (then killed)
    r2: dict[str, float]  # second server, before its workload
    r3: dict[str, float]  # second server, after it
    down: list[dict]  # exporter scrapes while vLLM was gone
    recorder: Recorder
    final: dict
    log: Path


def _cycles(exporter: ExporterProcess) -> int:
    return int(status_json(exporter.url)["cycles"])


def _wait_cycles(exporter: ExporterProcess, n: int) -> None:
    start = _cycles(exporter)
    wait_until(f"{n} exporter cycles", lambda: _cycles(exporter) >= start + n, timeout=60)


@pytest.fixture(scope="module")
def restart_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    need(VLLM_PYTHON.exists(), f"vLLM CPU ({VLLM_PYTHON})")
    work = tmp_path_factory.mktemp("restart")
    first = VllmServer(work / "a").start(timeout=600)
    port = first.port
    second = None
    exporter = ExporterProcess(
        work,
        ["--vllm-url", first.url, "--interval", "1", "--window", "900", "--log-format", "json"],
    )
    recorder = None
    try:
        exporter.start()
        recorder = Recorder(exporter.url, period=0.5).start()
        target = first.url.removeprefix("http://")

        def up(want: float) -> bool:
            return value(scrape(exporter.url)[1], "kvoffload_target_up", target=target) == want

        wait_until("target up", lambda: up(1.0))
        _wait_cycles(exporter, 2)
        r0 = raw_counters(first.url)
        seed_workload(first.url, batches=2, seed=301, pause=0.1)
        r1 = raw_counters(first.url)
        _wait_cycles(exporter, 3)

        assert first.proc is not None
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
        first.proc = None
        wait_until("target down", lambda: up(0.0))
        mark = len(recorder.history)
        # Long enough for the last good scrape to be stale (> 2 intervals + timeout).
        _wait_cycles(exporter, 6)
        down = [*recorder.history[mark:], scrape(exporter.url)[1]]

        second = VllmServer(work / "b", port=port).start(timeout=600)
        wait_until("target up again", lambda: up(1.0), timeout=60)
        _wait_cycles(exporter, 2)
        r2 = raw_counters(second.url)
        seed_workload(second.url, batches=2, seed=302, pause=0.1)
        r3 = raw_counters(second.url)
        _wait_cycles(exporter, 3)
        recorder.stop()
        _, final = scrape(exporter.url)
        yield Run(target, r0, r1, r2, r3, down, recorder, final, exporter.log_path)
    finally:
        if recorder is not None:
            recorder.stop()
        exporter.stop()
        first.stop()
        if second is not None:
            second.stop()


def _lab(run: Run) -> dict[str, str]:
    return {"target": run.target, "model_name": MODEL_NAME, "engine": "0"}


def test_metrics_answered_throughout_the_restart(restart_run: Run) -> None:
    rec = restart_run.recorder
    assert rec.errors == [] and set(rec.statuses) == {200}
    assert len(rec.history) >= 20


def test_vllm_gone_is_a_connect_failure_and_derives_nothing(restart_run: Run) -> None:
    run = restart_run
    assert run.down, "no scrape while vLLM was gone"
    last = run.down[-1]
    assert value(last, "kvoffload_target_up", target=run.target) == 0.0
    before = value(
        run.down[0], "kvoffload_target_scrape_failures_total", target=run.target, reason="connect"
    )
    after = value(
        last, "kvoffload_target_scrape_failures_total", target=run.target, reason="connect"
    )
    # A failure per cycle while it was gone (the last scrape is 6 cycles after the first).
    assert before is not None and after is not None and after >= before + 4
    # Stale by now: no windowed value and no gauge, but the totals are still there.
    for name in (
        "kvoffload_gpu_prefix_hit_ratio",
        "kvoffload_kv_cache_usage_ratio",
        "kvoffload_prefill_average_tokens_per_second",
        "kvoffload_recompute_tokens_per_second",
    ):
        assert value(last, name, **_lab(run)) is None, name
    for src in SOURCES:
        total = value(last, "kvoffload_prompt_tokens_total", source=src, **_lab(run))
        assert total == run.r1[f"prompt_by_source:{src}"]


def test_restart_counted_once_and_totals_add_up(restart_run: Run) -> None:
    run, m = restart_run, restart_run.final
    assert value(m, "kvoffload_target_up", target=run.target) == 1.0
    assert value(m, "kvoffload_target_resets_total", target=run.target) == 1.0
    for src in SOURCES:
        key = f"prompt_by_source:{src}"
        total = value(m, "kvoffload_prompt_tokens_total", source=src, **_lab(run))
        assert total == run.r1[key] + run.r3[key], src
    assert run.r3["prompt_by_source:local_compute"] < run.r1["prompt_by_source:local_compute"] * 2
    events = [
        json.loads(line)
        for line in run.log.read_text().splitlines()
        if line.startswith("{") and '"counter_reset"' in line
    ]
    assert len(events) == 1


def test_window_leaves_the_reset_interval_out(restart_run: Run) -> None:
    run, m = restart_run, restart_run.final
    d_hits = (run.r1["prefix_hits"] - run.r0["prefix_hits"]) + (
        run.r3["prefix_hits"] - run.r2["prefix_hits"]
    )
    d_queries = (run.r1["prefix_queries"] - run.r0["prefix_queries"]) + (
        run.r3["prefix_queries"] - run.r2["prefix_queries"]
    )
    assert 0 < d_hits < d_queries
    ratio = value(m, "kvoffload_gpu_prefix_hit_ratio", **_lab(run))
    assert ratio == pytest.approx(d_hits / d_queries, rel=1e-12)


def test_counters_monotonic_and_ratios_bounded_across_the_restart(restart_run: Run) -> None:
    history = restart_run.recorder.history
    assert monotonic_violations(history) == []
    assert ratio_violations(history) == []
