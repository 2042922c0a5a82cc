"""bench/queue_replay.py: a one-server queue replayed over a pair's arrivals, to see what a
shorter prefill saves the requests behind it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import queue_replay
from bench.advice_eval import MATRIX


def test_requests_far_apart_save_only_their_own_tokens() -> None:
    arrivals = [0.0, 10.0, 20.0]
    assert queue_replay.replay(arrivals, [100, 200, 300], 0.01, 1e-3) == pytest.approx(0.63)
    saved = queue_replay.replay(arrivals, [100, 200, 300], 0.01, 1e-3) - queue_replay.replay(
        arrivals, [100, 0, 300], 0.01, 1e-3
    )
    assert saved == pytest.approx(0.2)


def test_a_shorter_service_saves_every_request_queued_behind_it() -> None:
    # Three requests at once: the first one's 0.2 s less reaches the two behind it too.
    arrivals = [0.0, 0.0, 0.0]
    before = queue_replay.replay(arrivals, [300, 100, 100], 0.0, 1e-3)
    after = queue_replay.replay(arrivals, [100, 100, 100], 0.0, 1e-3)
    assert before == pytest.approx(0.3 + 0.4 + 0.5)
    assert before - after == pytest.approx(3 * 0.2)


def test_the_per_token_service_is_found_from_the_summed_ttft() -> None:
    arrivals = [0.0, 0.05, 0.1, 3.0]
    tokens = [1000.0, 500.0, 2000.0, 100.0]
    summed = queue_replay.replay(arrivals, tokens, 0.02, 1.5e-4)
    assert queue_replay.fit_c1(arrivals, tokens, 0.02, summed) == pytest.approx(1.5e-4, rel=1e-6)
    # Below what c0 alone takes, or beyond what 2 ms a token takes: no service fits.
    assert queue_replay.fit_c1(arrivals, tokens, 0.02, 0.01) is None
    assert queue_replay.fit_c1(arrivals, tokens, 0.02, 1e3) is None


def test_a_request_s_cost_is_told_from_a_token_s_by_each_second() -> None:
    # Requests of mixed sizes, some queued: what c0 = 30 ms, c1 = 100 us gives each second.
    arrivals = [0.1 * k + (0.05 if k % 3 else 0.0) for k in range(60)]
    tokens = [float(200 + 700 * (k % 4)) for k in range(60)]
    ttfts = queue_replay.replay_each(arrivals, tokens, 0.03, 1e-4)
    firsts = [a + t for a, t in zip(arrivals, ttfts, strict=True)]
    c0, c1 = queue_replay.fit_service(arrivals, tokens, firsts, ttfts) or (None, None)
    assert c0 == 0.03 and c1 == pytest.approx(1e-4, rel=1e-6)
    # Any c0 of the grid matches the sum; only the right one matches every second.
    other = queue_replay.fit_c1(arrivals, tokens, 0.0, sum(ttfts))
    assert other is not None and other > 1e-4
    assert queue_replay.fit_service([], [], [], []) is None


def test_arrivals_come_from_the_mean_ttft_of_each_interval() -> None:
    firsts = [10.2, 10.7, 11.5]
    ttfts = [0.2, 0.4, 1.0]
    assert queue_replay.arrivals_from_interval_means(firsts, ttfts) == pytest.approx(
        [9.9, 10.4, 10.5]
    )
    assert queue_replay.arrivals_from_interval_means([], []) == []


def test_a_pair_of_the_matrix_is_replayed(tmp_path: Path) -> None:
    for name in ("qwen3-32b-chat-graphs-none", "qwen3-32b-chat-graphs-cpu64k"):
        shutil.copytree(MATRIX / name, tmp_path / name)
    rows = queue_replay.table(tmp_path, c0=0.02)
    assert list(rows) == ["qwen3-32b-chat-graphs-cpu64k"]  # only offload runs have a pair
    row = rows["qwen3-32b-chat-graphs-cpu64k"]
    assert row is not None and row["base"] == "qwen3-32b-chat-graphs-none"
    assert row["requests"] == 526 and row["loaded_tokens"] > 0
    # Where the engine was busy (session 24), the queue multiplies what the hits save alone.
    assert row["queue_replay_saved_s"] > 2 * row["hits_alone_s"] > 0
    assert row["measured_saved_s"] > 0
    table = queue_replay.markdown(rows)
    assert table.splitlines()[0] == (
        "| run | base | c0 ms | c1 us | hits alone s | queue replay s | measured s |"
    )
    with pytest.raises(SystemExit, match="no recording named nope"):
        queue_replay.table(tmp_path, ["nope"])
    with pytest.raises(SystemExit, match="qwen3-32b-chat-graphs-none has no run without"):
        queue_replay.table(tmp_path, ["qwen3-32b-chat-graphs-none"])


def test_the_command_prints_json_or_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    run = "qwen3-32b-chat-graphs-cpu32g"
    assert queue_replay.main([str(MATRIX), run, "--c0-ms", "20", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert list(rows) == [run] and rows[run]["c0_s"] == pytest.approx(0.02)
    # Without --c0-ms it is fitted, from the grid.
    assert queue_replay.main([str(MATRIX), run, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[run]["c0_s"] in queue_replay.C0_GRID
    assert queue_replay.main([str(MATRIX), run]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[2].startswith(f"| {run} | qwen3-32b-chat-graphs-none-ctl |")
