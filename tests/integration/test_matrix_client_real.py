"""The GPU matrix driver's client (bench/gpu/matrix.py `drive`) against the real vLLM CPU
server: a request of one token is timed to its response, one that decodes more is streamed,
timed to its first token and keeps the usage of its final chunk. (The cached tokens in that
usage, which the truth pairs runs by, need `--enable-prompt-tokens-details`, which the test
server does not pass: tests/test_step_time.py checks them in a stream recorded on the GPU.)"""

from __future__ import annotations

import http.client
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))

import matrix
import matrixkit as mk

from testbed.vllm_cpu import MODEL_NAME, VllmServer

DECODE = 24


def _drive(server: VllmServer, reqs: list[mk.Req], max_tokens: int) -> list[dict[str, object]]:
    records, unsent = matrix.drive(
        server.port,
        MODEL_NAME,
        reqs,
        max_inflight=2,
        max_tokens=max_tokens,
        t0=time.time(),
        hard_stop=time.time() + 120,
        timeout=120,
    )
    assert unsent == []
    return sorted(records, key=lambda r: int(str(r["i"])))


def test_a_streamed_request_is_timed_to_its_first_token(vllm_server: VllmServer) -> None:
    # Token ids above the tiny model's specials, a pair of prompts per mode, each sent twice.
    def reqs(first: int) -> list[mk.Req]:
        prompts = [tuple(range(first + 200 * k, first + 200 * k + 150)) for k in range(2)]
        return [mk.Req(i, 0.0, prompts[i % 2]) for i in range(4)]

    one = _drive(vllm_server, reqs(300), 1)
    many = _drive(vllm_server, reqs(800), DECODE)
    for r in one:
        assert r["status"] == 200 and "t_first" not in r, r
        assert r["ttft_s"] == pytest.approx(float(r["t_end"]) - float(r["t_send"]), abs=2e-6)  # type: ignore[arg-type]
    for r in many:
        assert r["status"] == 200 and r["prompt_tokens"] == 150, r
        t_send, t_first, t_end = (float(r[k]) for k in ("t_send", "t_first", "t_end"))  # type: ignore[arg-type]
        assert t_send < t_first < t_end, r
        assert r["ttft_s"] == pytest.approx(t_first - t_send, abs=2e-6), r
    # The streamed usage arrives in the final chunk, as the plain response's does.
    conn = http.client.HTTPConnection("127.0.0.1", vllm_server.port, timeout=120)
    try:
        status, body, err, t_first = matrix.post_completion(
            conn, MODEL_NAME, list(range(1200, 1300)), DECODE
        )
    finally:
        conn.close()
    assert (status, err) == (200, None) and t_first is not None and body is not None
    assert body["usage"]["prompt_tokens"] == 100
    assert body["usage"]["completion_tokens"] == DECODE
    assert mk.ttft_definition(DECODE).startswith("streamed")
    assert mk.ttft_definition(1).startswith("non-streamed")
