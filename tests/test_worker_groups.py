"""tests/conftest.py's grouping of the suite for `./run test`'s two workers: the modules that
need vLLM together, every other module whole; a test that needs vLLM outside the list stops
collection rather than starting a second CPU server beside the first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests import conftest

REPO = Path(__file__).resolve().parent.parent


def test_the_vllm_modules_share_a_unit_and_every_other_module_is_its_own() -> None:
    assert conftest.xdist_scope("tests/test_demo.py::test_x") == "vllm"
    assert conftest.xdist_scope("tests/faults/test_soak_short.py::test_y[1-a::b]") == "vllm"
    assert conftest.xdist_scope("tests/test_config.py::test_z[p]") == "tests/test_config.py"
    assert conftest.xdist_scope("tests/test_config.py") == "tests/test_config.py"
    for module in conftest.VLLM_MODULES:
        assert (REPO / module).is_file(), module


class _Item:
    def __init__(self, nodeid: str, *, marked: bool, fixtures: tuple[str, ...] = ()) -> None:
        self.nodeid, self.fixturenames = nodeid, fixtures
        self.markers = {"vllm"} if marked else set()

    def add_marker(self, mark: Any) -> None:
        self.markers.add(mark.name)

    def get_closest_marker(self, name: str) -> Any:
        return name if name in self.markers else None


def test_a_test_that_needs_vllm_outside_the_list_stops_collection() -> None:
    listed = _Item("tests/test_demo.py::test_x", marked=True)
    plain = _Item("tests/test_config.py::test_y", marked=False)
    conftest.pytest_collection_modifyitems([listed, plain])  # type: ignore[list-item]
    assert plain.get_closest_marker("vllm") is None
    # The session's server as a fixture marks the test, and its module must be listed.
    by_fixture = _Item("tests/test_config.py::test_z", marked=False, fixtures=("vllm_server",))
    with pytest.raises(pytest.UsageError, match=r"add tests/test_config\.py to VLLM_MODULES"):
        conftest.pytest_collection_modifyitems([by_fixture])  # type: ignore[list-item]
    assert by_fixture.get_closest_marker("vllm") == "vllm"
    marked = _Item("tests/test_cli.py::test_w", marked=True)
    with pytest.raises(pytest.UsageError, match=r"tests/test_cli\.py::test_w needs vLLM"):
        conftest.pytest_collection_modifyitems([marked])  # type: ignore[list-item]
