"""bench.beside_loaders: whom a load keeps waiting, on synthetic pairs and on the 0.6B
recordings behind docs/whatif.md's "The launch a load adds"."""

from __future__ import annotations

from typing import Any

import pytest

from bench import beside_loaders
from bench.advice_eval import MATRIX


def _req(i: int, send: float, ttft: float, cached: int = 0) -> dict[str, Any]:
    return {
        "i": i,
        "id": f"r{i}",
        "t_send": send,
        "ttft_s": ttft,
        "cached_tokens": cached,
        "status": 200,
    }


def test_requests_are_told_by_whether_their_wait_overlapped_a_loaders() -> None:
    base = [_req(0, 0.0, 0.05), _req(1, 0.01, 0.05), _req(2, 1.0, 0.05)]
    offload = [_req(0, 0.0, 0.08, cached=512), _req(1, 0.01, 0.07), _req(2, 1.0, 0.06)]
    got = beside_loaders.beside_loaders(base, offload)
    assert got["loaders"] == {"n": 1.0, "ms": pytest.approx(30.0)}
    assert got["beside"] == {"n": 1.0, "ms": pytest.approx(20.0)}
    assert got["rest"] == {"n": 1.0, "ms": pytest.approx(10.0)}
    assert beside_loaders.beside_loaders(base, base)["beside"] == {"n": 0.0, "ms": None}


def test_on_the_launch_bound_engine_only_a_bursts_requests_wait_beside_a_loader() -> None:
    """0.6B served eager: in its bursts of twelve the requests that loaded nothing but shared
    a burst with a loader came back 15-35 ms later with the tier (a step's launch there);
    where requests came one at a time (chat, RAG-Zipf) those beside a loader came back within
    10 ms of their time without offload."""
    rows = beside_loaders.table(MATRIX)
    small = {n: r for n, r in rows.items() if n.startswith("qwen3-0.6b-")}
    bursts = [r for r in small.values() if r["workload"] == "concurrent"]
    alone = [r for r in small.values() if r["workload"] in ("chat", "rag-zipf")]
    assert len(bursts) == 5 and len(alone) == 4
    assert all(15 < r["beside"]["ms"] < 40 for r in bursts)
    assert all(abs(r["beside"]["ms"]) < 10 for r in alone)


def test_the_command_prints_one_row_per_offload_run(capsys: pytest.CaptureFixture[str]) -> None:
    names = ["qwen3-0.6b-rag-zipf-cpu64k", "qwen3-0.6b-rag-zipf-none"]
    assert beside_loaders.main([str(MATRIX), *names]) == 0
    (row,) = capsys.readouterr().out.splitlines()[2:]
    assert row == (
        "| qwen3-0.6b-rag-zipf-cpu64k | qwen3-0.6b-rag-zipf-none | rag-zipf "
        "| +9.7 (96) | -4.3 (30) | +2.8 (635) |"
    )
