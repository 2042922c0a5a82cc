"""Shared fixtures. Real servers (vLLM CPU, Prometheus, Alertmanager) start once per session.

Without KVOE_REQUIRE_REAL=1 a missing server binary skips its tests, so a developer can
run the unit tests alone; `./run test` (and so CI) sets it, and then a missing server
is a failure, never a silent skip.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.procs import free_port
from testbed.vllm_cpu import VLLM_PYTHON, VllmServer

FIXTURES = Path(__file__).parent / "fixtures"
H200 = FIXTURES / "vllm-0.26.0-h200"
CPU = FIXTURES / "vllm-0.32.0-cpu"
REQUIRE_REAL = os.environ.get("KVOE_REQUIRE_REAL") == "1"


def need(condition: bool, what: str) -> None:
    if condition:
        return
    if REQUIRE_REAL:
        pytest.fail(f"{what} is required (KVOE_REQUIRE_REAL=1); run ./run setup")
    pytest.skip(f"{what} not available; ./run test provides it")


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One real vLLM CPU server for the session, KV events published to a port that
    the KV-event tests bind (vLLM connects, the subscriber binds), with vLLM's replay
    ROUTER on another port (vLLM binds it)."""
    need(VLLM_PYTHON.exists(), f"vLLM CPU ({VLLM_PYTHON})")
    server = VllmServer(
        tmp_path_factory.mktemp("vllm"),
        kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def prometheus_available() -> None:
    need(shutil.which("prometheus") is not None, "prometheus (Debian package)")


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    need(path is not None, "promtool (Debian package prometheus)")
    assert path is not None
    return path
