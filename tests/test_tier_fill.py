"""bench/tier_fill.py: whether what the loads cost a burst follows the CPU tier's filling
(docs/whatif.md, "What batch 30 measured")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench import tier_fill
from bench.advice_eval import MATRIX

RUNS = (
    "qwen3-4b-concurrent-cpu64k",
    "qwen3-4b-concurrent-cpu16g",
    "qwen3-0.6b-concurrent-cpu64k",
    "qwen3-0.6b-concurrent-cpu192k",
)


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    return tier_fill.table(MATRIX, RUNS)


def test_every_request_is_placed_once_on_each_split(rows: dict[str, dict[str, Any]]) -> None:
    """The bursts send 732 requests: before and after the fill, and early and late, each
    split holds every one of them, and a tier that never filled leaves "after" empty."""
    for name, r in rows.items():
        for a, b in (("before_full", "after_full"), ("early", "late")):
            assert r[a]["requests"] + r[b]["requests"] == 732, name
    small, big = rows["qwen3-0.6b-concurrent-cpu64k"], rows["qwen3-0.6b-concurrent-cpu192k"]
    assert small["tier_full_s"] is not None and big["tier_full_s"] is None
    assert big["after_full"] == {"requests": 0, "loaders": 0, "loaders_ms": None, "others_ms": None}


def test_a_full_tier_is_not_what_the_loads_cost(rows: dict[str, dict[str, Any]]) -> None:
    """Where loads cost the bursts (their loaders came back later with the tier), they cost
    before the tier first evicted as after it: the cost is not the filling. 0.6B's 21 GiB
    tier never filled and its loaders paid as its 7 GiB tier's did after filling; 4B's
    9 GiB loaders paid as much before their tier filled as after it."""
    nine = rows["qwen3-4b-concurrent-cpu64k"]
    before, after = nine["before_full"]["loaders_ms"], nine["after_full"]["loaders_ms"]
    assert after > 0 and before > 0.5 * after
    full = rows["qwen3-0.6b-concurrent-cpu64k"]["after_full"]["loaders_ms"]
    never = rows["qwen3-0.6b-concurrent-cpu192k"]["before_full"]["loaders_ms"]
    assert full > 0 and never > 0.5 * full
    # 4B at 16 GiB (another host): its loaders paid in the first seconds, hardly after.
    sixteen = rows["qwen3-4b-concurrent-cpu16g"]
    assert sixteen["early"]["loaders_ms"] > 2 * sixteen["late"]["loaders_ms"]
    assert sixteen["late"]["loaders_ms"] < 0.25 * nine["late"]["loaders_ms"]


def test_the_command_prints_a_row_per_offload_run_of_the_bursts(capsys) -> None:  # type: ignore[no-untyped-def]
    assert tier_fill.main([str(MATRIX), *RUNS[:2], "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert set(rows) == set(RUNS[:2])
    assert rows["qwen3-4b-concurrent-cpu16g"]["base"] == "qwen3-4b-concurrent-none-ctl"
    assert tier_fill.main([str(MATRIX), RUNS[0]]) == 0
    assert capsys.readouterr().out.startswith("| offload run | base | tier full after s |")
