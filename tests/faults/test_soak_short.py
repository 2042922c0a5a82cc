"""The soak's CI variant: 2 minutes of bench/soak.py against the session's real vLLM CPU
server (KV events on), the exporter as a process and a steady workload.

Asserts what the soak measures: /metrics always answered, and resident memory, open
fds, threads, asyncio tasks and KV-event queue depth flat within 5% (one unit of slack
for the small counts) between the first and last thirds after the warm-up. No latency
is asserted.
"""

from __future__ import annotations

import pytest

from bench.soak import report, run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_soak_two_minutes_is_flat(vllm_server, tmp_path) -> None:
    result = run(
        duration=120.0,
        warmup=60.0,
        sample_interval=10.0,
        attach=vllm_server.url,
        kv_events_endpoint=vllm_server.kv_events_endpoint,
        workdir=tmp_path,
        interval=1.0,
        window=30.0,
        log=False,
    )
    text = report(result)
    print(text)
    assert len(result.samples) >= 12, text
    assert result.requests > 0, text
    assert result.metrics_failures == 0, text
    assert result.cycles >= 20, text  # the loop kept cycling (liveness, not speed)
    for v in result.verdicts:
        assert v.flat, text
