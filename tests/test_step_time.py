"""bench.step_time: an eager engine's step time from the kit's step log, from vLLM's own
inter-token latency and from the client, on the recorded run whose requests decode
(tests/fixtures/gpu/decode, batch 38's run without offload, session 44)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import step_time
from bench.advice_eval import MATRIX, _meta, _requests
from exporter.recording import RecordingError

RUN = "qwen3-4b-bursts-decode-none-probe"


def test_vllms_inter_token_latency_times_the_step_the_step_log_does() -> None:
    """Every request decoded 32 tokens, so vLLM counted 31 gaps each; its mean gap is the
    client's to within a few per cent, and the step log's decode steps (the kit's, which a
    live exporter does not have) take what a token took the client: what a live exporter
    reads of an eager engine's step time is that step time."""
    (row,) = step_time.table(step_time.DECODE).values()
    meta = _meta(step_time.DECODE / RUN)
    assert meta["traffic"]["ttft_definition"].startswith("streamed")
    served = [r for r in _requests(step_time.DECODE / RUN) if r["status"] == 200]
    assert row["max_tokens"] == 32 and row["eager"]
    itl, steps, client = row["inter_token_ms"], row["decode_step_ms"], row["client_token_ms"]
    assert itl["tokens"] == len(served) * 31 == client["requests"] * 31
    assert itl["mean_ms"] == pytest.approx(client["mean_ms"], rel=0.05)
    assert steps["median_ms"] == pytest.approx(client["median_ms"], rel=0.05)
    # The streamed usage carried vLLM's cached tokens (the truth pairs runs by them): about
    # as many as the same prompts found cached without decoding (batch 37).
    one = sum(r["cached_tokens"] for r in _requests(MATRIX / "qwen3-4b-concurrent-none-probe"))
    cached = sum(r["cached_tokens"] for r in served)
    assert all(r["cached_tokens"] is not None for r in served)
    assert cached == pytest.approx(one, rel=0.05)
    # A streamed request's TTFT ends at its first token, before its decode.
    assert all(r["t_send"] < r["t_first"] < r["t_end"] for r in served)
    assert all(r["ttft_s"] == pytest.approx(r["t_first"] - r["t_send"], abs=2e-6) for r in served)


def test_a_run_of_one_token_requests_has_no_step_time_to_read() -> None:
    one = "qwen3-4b-concurrent-none-probe"
    assert step_time.table(MATRIX, [one]) == {}
    assert step_time.inter_token(MATRIX / one) is None
    assert "| run |" in step_time.markdown({})


def test_decode_steps_skip_the_idle_gaps_and_steps_that_prefill(tmp_path: Path) -> None:
    def step(t: float, **r: int) -> dict[str, object]:
        return {"t0": t, "r": r}

    lines = [
        step(0.0, a=900),  # a prefill: not a decode step
        step(0.05, a=1, b=1),
        step(0.07, a=1, b=1),
        step(0.09, a=1),
        step(3.0, c=1),  # after the idle gap to the next burst
        step(3.02, c=1),
    ]
    assert step_time.decode_steps(lines) == {"steps": 3, "median_ms": 20.0, "mean_ms": 20.0}
    assert step_time.decode_steps(lines[:1]) is None
    with pytest.raises(RecordingError, match=r"no metrics\.jsonl"):
        step_time.inter_token(tmp_path)
