"""bench.fit_repeat on recorded pairs of runs that did the same work (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from bench import fit_repeat
from bench.advice_eval import MATRIX

GRAPHS = ("qwen3-4b-concurrent-graphs-none", "qwen3-4b-concurrent-graphs-none-rep")
CHAT = ("qwen3-32b-chat-none", "qwen3-32b-chat-none-rep")


@pytest.fixture(scope="module")
def doc() -> dict[str, object]:
    # An offload run among the names is not a run without offload: no pair takes it.
    return fit_repeat.table(MATRIX, [*GRAPHS, *CHAT, "qwen3-4b-concurrent-graphs-cpu16g"])


def test_pairs_are_the_runs_without_offload_that_did_the_same_work() -> None:
    assert fit_repeat.replicate_pairs(
        MATRIX, [*GRAPHS, *CHAT, "qwen3-4b-concurrent-graphs-cpu16g", "qwen3-8b-chat-none"]
    ) == [CHAT, GRAPHS]


def test_the_ttft_fit_moves_between_identical_runs_more_than_the_prefill_fit(doc) -> None:  # type: ignore[no-untyped-def]
    """Batch 33's two runs without offload repeat to 0.01 % of summed TTFT; the TTFT fit's
    prices of a computed token are further apart than the engine's own prefill fit's, and
    than its standard errors say (docs/whatif.md, "What batch 33 measured")."""
    pairs = doc["pairs"]
    graphs = pairs[" / ".join(GRAPHS)]
    base, pre = graphs["ttft_fit"]["apart"], graphs["prefill_fit"]["apart"]
    assert base > 2 * pre > 0
    assert graphs["baseline_sigmas_apart"] > 1.5
    chat = pairs[" / ".join(CHAT)]
    assert chat["baseline_sigmas_apart"] < 1.0  # two chat runs agree within their errors
    for row in pairs.values():
        for est in fit_repeat.ESTIMATORS:
            a, b = row[est]["seconds_per_token"]
            assert 0 < a < 1e-2 and 0 < b < 1e-2, (row["runs"], est)
    s = doc["summary"]
    assert s["pairs"] == 2
    assert s[fit_repeat.BASELINE]["median_vs_baseline"] == pytest.approx(1.0)
    assert s["prefill_fit"]["max_apart"] == pytest.approx(pre)


def test_command_line_prints_the_table_and_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert fit_repeat.main([str(MATRIX), *CHAT]) == 0
    out = capsys.readouterr().out
    assert " / ".join(CHAT) in out and "x ttft_fit" in out
    assert fit_repeat.main([str(MATRIX), *CHAT, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["pairs"] == 1
    with pytest.raises(SystemExit, match="no recording named nope"):
        fit_repeat.main([str(MATRIX), "nope"])
