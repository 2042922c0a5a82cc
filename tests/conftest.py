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
from typing import Any

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


# `./run test` runs two workers (pytest-xdist, `--dist loadscope`, scheduled as below). The
# modules with a test that needs vLLM run on one worker, one after another: the session's
# `vllm_server` starts once, and no two CPU servers share the two cores. Every other module
# runs whole on either worker, so its module fixtures (Prometheus, a replayed matrix) start
# once. The vLLM tests mostly wait on a server and the rest mostly compute, so side by side
# they take about the time of the longer, not of both. The grouping must be known from a test
# id alone (the controller never collects), hence a list, which collection checks below.
VLLM_MODULES = frozenset(
    {
        "tests/faults/test_soak_short.py",
        "tests/faults/test_vllm_restart.py",
        "tests/integration/test_compose_stack.py",
        "tests/integration/test_dashboard_queries.py",
        "tests/integration/test_kv_events_real.py",
        "tests/integration/test_matrix_client_real.py",
        "tests/integration/test_real_vllm.py",
        "tests/test_demo.py",
        "tests/test_deploy.py",
        "tests/test_steplog.py",
    }
)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def xdist_scope(nodeid: str) -> str:
    """The worker's unit a test belongs to: "vllm", or its module."""
    module = _module(nodeid)
    return "vllm" if module in VLLM_MODULES else module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "vllm_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)
        if item.get_closest_marker("vllm") and _module(item.nodeid) not in VLLM_MODULES:
            raise pytest.UsageError(
                f"{item.nodeid} needs vLLM: add {_module(item.nodeid)} to VLLM_MODULES "
                "in tests/conftest.py"
            )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class VllmApart(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return VllmApart(config, log)
