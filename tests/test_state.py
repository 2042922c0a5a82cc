"""The state file (--state-file): each engine's TTFT fit with offload off, across restarts."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

from exporter.config import Config
from exporter.logs import JsonFormatter
from exporter.model.derive.engines import CostBefore
from exporter.model.derive.fits import PrefillFit
from exporter.runtime import STATE_SAVE_INTERVAL, Exporter
from exporter.state import StateError, dump, load, parse, save
from exporter.vllm_metrics import EngineKey
from testbed.procs import free_port, start, stop
from tests.faults.common import wait_until

EK = EngineKey("qwen3-8b", "0")
# The 8B chat engine of the H200 matrix without offload, in round numbers.
CHAT = CostBefore(
    PrefillFit(0.0284, 21.5e-6, 120, 0.93, 0.65e-6, 1.1e-3, -5e-10),
    147_456.0,
    2.9,
    "GPU-1,GPU-2",
    0.93,
)
# A fit without its covariance and a model whose KV size was not known.
BARE = CostBefore(PrefillFit(0.05, 3e-6, 40, 0.5), None, None)


def test_what_is_saved_loads_back_equal_and_in_order(tmp_path: Path) -> None:
    remembered = {"b:8000": {EK: CHAT}, "a:8000": {EK: BARE, EngineKey("m", "1"): CHAT}}
    path = tmp_path / "state.json"
    save(path, remembered)
    back = load(path)
    assert back == remembered
    assert list(back) == ["b:8000", "a:8000"]  # the most recently measured target last
    assert not (tmp_path / "state.json.tmp").exists()


def test_a_missing_file_is_a_first_start() -> None:
    assert load(Path("/nonexistent/kvoe/state.json")) == {}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{", "not JSON"),
        ('{"version": 2, "targets": {}}', "version 2"),
        ("[]", "version None"),
        ('{"version": 1, "targets": []}', "targets is not an object"),
        ('{"version": 1, "targets": {"a": {}}}', "is not a list"),
        ('{"version": 1, "targets": {"a": [{"model_name": 1, "engine": "0"}]}}', "strings"),
        ('{"version": 1, "targets": {"a": [{"model_name": "m", "engine": "0"}]}}', "fit"),
    ],
)
def test_a_bad_file_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(StateError, match=says):
        parse(text)


def test_a_fit_must_be_finite_numbers() -> None:
    doc = json.loads(dump({"a": {EK: CHAT}}))
    doc["targets"]["a"][0]["fit"]["seconds_per_token"] = "fast"
    with pytest.raises(StateError, match=r"seconds_per_token: expected a finite number"):
        parse(json.dumps(doc))
    del doc["targets"]["a"][0]["fit"]["seconds_per_token"]
    with pytest.raises(StateError, match="seconds_per_token: missing"):
        parse(json.dumps(doc))
    doc = json.loads(dump({"a": {EK: CHAT}}))
    doc["targets"]["a"][0]["requests_per_second"] = True
    with pytest.raises(StateError, match="requests_per_second"):
        parse(json.dumps(doc))
    doc = json.loads(dump({"a": {EK: CHAT}}))
    doc["targets"]["a"][0]["machine"] = 7
    with pytest.raises(StateError, match="machine must be a string"):
        parse(json.dumps(doc))
    doc = json.loads(dump({"a": {EK: CHAT}}))
    doc["targets"]["a"][0]["scale"] = 0
    with pytest.raises(StateError, match="scale: must be positive"):
        parse(json.dumps(doc))


def test_a_file_without_a_scale_reads_as_no_correction() -> None:
    """The first files written had no "scale": they load with the fit as it was."""
    doc = json.loads(dump({"a": {EK: CHAT}}))
    del doc["targets"]["a"][0]["scale"]
    (back,) = parse(json.dumps(doc))["a"].values()
    assert back.scale == 1.0 and back.fit == CHAT.fit


async def test_a_restarted_exporter_remembers_what_the_last_one_measured(tmp_path: Path) -> None:
    """The sidecar case: vLLM's pod is replaced to enable offload and the exporter with it.
    What the first exporter remembered is written (at the latest when it stops) and the next
    one starts with it; changes are written at most every STATE_SAVE_INTERVAL seconds."""
    path = tmp_path / "state.json"
    cfg = Config(state_file=str(path))
    first = Exporter(cfg, [])
    assert first.pipeline.before("vllm:8000") == {}
    first.pipeline.remember_before("vllm:8000", {EK: BARE})
    await first._save_state(1000.0)
    assert load(path) == {"vllm:8000": {EK: BARE}}
    first.pipeline.remember_before("vllm:8000", {EK: CHAT})
    await first._save_state(1000.0 + STATE_SAVE_INTERVAL / 2)
    assert load(path) == {"vllm:8000": {EK: BARE}}  # too soon
    await first._save_state(1000.0 + STATE_SAVE_INTERVAL)
    assert load(path) == {"vllm:8000": {EK: CHAT}}
    first.pipeline.remember_before("other:8000", {EK: BARE})
    await first.stop()
    second = Exporter(cfg, [])
    assert second.pipeline.before("vllm:8000") == {EK: CHAT}
    assert second.pipeline.remembered() == {"vllm:8000": {EK: CHAT}, "other:8000": {EK: BARE}}


async def test_a_bad_or_unwritable_state_file_costs_the_memory_not_the_exporter(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.json"
    path.write_text("{ half a file")
    with caplog.at_level(logging.ERROR, logger="kvoe.runtime"):
        exporter = Exporter(Config(state_file=str(path)), [])
    assert exporter.pipeline.remembered() == {}
    (record,) = caplog.records
    line = json.loads(JsonFormatter().format(record))
    assert line["event"] == "state_load_failed" and "not JSON" in line["error"]
    exporter.pipeline.remember_before("vllm:8000", {EK: CHAT})
    await exporter._save_state(0.0)  # the bad file is replaced
    assert load(path) == {"vllm:8000": {EK: CHAT}}

    caplog.clear()
    gone = Exporter(Config(state_file=str(tmp_path / "no-such-dir" / "state.json")), [])
    gone.pipeline.remember_before("vllm:8000", {EK: CHAT})
    with caplog.at_level(logging.ERROR, logger="kvoe.runtime"):
        await gone._save_state(0.0)
        await gone.stop()  # tried again on the way out, still no crash
    assert caplog.text.count("state_save_failed") == 2


def test_the_served_exporter_keeps_the_file_through_sigterm(tmp_path: Path) -> None:
    """`python -m exporter` with KVOE_STATE_FILE (as docs/deploy.md sets it): a first start
    writes the file at its first cycle (an unwritable volume shows at once); the next start
    loads what the file holds, and SIGTERM leaves the file whole."""
    path = tmp_path / "kvoe" / "state.json"
    path.parent.mkdir()
    env = {**os.environ, "KVOE_STATE_FILE": str(path)}
    port = free_port()
    cmd = [sys.executable, "-m", "exporter", "--listen", f"127.0.0.1:{port}", "--interval", "0.2"]
    cmd += ["--vllm-url", "http://127.0.0.1:9", "--no-nvml", "--no-procfs", "--no-cgroup"]
    cmd += ["--no-kv-events", "--log-format", "json"]
    first = start(cmd, tmp_path / "first.log", env=env)
    try:
        wait_until("state file written", path.exists, timeout=60)
    finally:
        stop(first)
    assert first.returncode == 0, (tmp_path / "first.log").read_text()
    assert load(path) == {}
    save(path, {"vllm:8000": {EK: CHAT}})
    second = start(cmd, tmp_path / "second.log", env=env)
    try:
        wait_until(
            "state loaded", lambda: "state_loaded" in (tmp_path / "second.log").read_text(), 60
        )
    finally:
        stop(second)
    assert second.returncode == 0
    loaded = next(
        json.loads(line)
        for line in (tmp_path / "second.log").read_text().splitlines()
        if '"state_loaded"' in line
    )
    assert loaded["engines"] == 1
    assert load(path) == {"vllm:8000": {EK: CHAT}}
