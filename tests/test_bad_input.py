"""Bad input never crashes the exporter and never yields silently wrong numbers."""

from __future__ import annotations

import logging

import pytest

from testbed.procs import free_port
from testbed.replay import ReplayServer, Reply, text
from tests.conftest import CPU
from tests.exporter_harness import config, running, sample_value

GOOD = (CPU / "metrics-after.prom").read_bytes()


def _target(url: str) -> str:
    return url.removeprefix("http://")


CASES = {
    "http_500": (Reply(body=b"oops", status=500), "http_status"),
    "html_page": (text("<html><body>Bad Gateway</body></html>"), "parse"),
    "not_vllm": (text("# HELP up x\nnode_load1 0.5\n"), "parse"),
    "fifty_megabytes": (Reply(stream_bytes=50 * 1024 * 1024), "too_large"),
    "truncated": (Reply(body=GOOD[:20000], truncate=True), "truncated"),
    "duplicate_series": (
        text(
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 2\n'
        ),
        "parse",
    ),
    "binary": (Reply(body=b"\x89PNG\r\n\x1a\n\x00\x00"), "parse"),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_bad_body_marks_target_down_with_reason(case, caplog):
    reply, reason = CASES[case]
    with ReplayServer([Reply(body=GOOD), reply]) as srv:
        async with running(config(srv.url, max_body_bytes=16 << 20)) as (exp, client):
            await exp.run_cycle()
            with caplog.at_level(logging.WARNING, logger="kvoe"):
                for _ in range(3):
                    await exp.run_cycle()
            resp = await client.get("/metrics")
            assert resp.status == 200
            body = await resp.text()
    t = _target(srv.url)
    assert sample_value(body, "kvoffload_target_up", target=t) == 0.0
    assert (
        sample_value(body, "kvoffload_target_scrape_failures_total", target=t, reason=reason) == 3.0
    )
    # One log line for the state change, not one per failed scrape.
    assert len([r for r in caplog.records if r.getMessage() == "source_down"]) == 1
    # The engine's totals are still served; nothing was invented for the bad scrapes.
    assert (
        sample_value(body, "kvoffload_prompt_tokens_total", target=t, source="local_cache_hit")
        == 7680.0
    )


async def test_dead_target_is_a_connect_failure():
    url = f"http://127.0.0.1:{free_port()}"
    async with running(config(url)) as (exp, client):
        await exp.run_cycle()
        body = await (await client.get("/metrics")).text()
    assert sample_value(body, "kvoffload_target_up", target=_target(url)) == 0.0
    assert (
        sample_value(
            body, "kvoffload_target_scrape_failures_total", target=_target(url), reason="connect"
        )
        == 1.0
    )


async def test_nan_and_inf_values_are_dropped_and_counted():
    bad = GOOD.replace(
        b'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 7680.0',
        b'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} NaN',
    )
    assert bad != GOOD
    with ReplayServer([Reply(body=GOOD), Reply(body=bad)]) as srv:
        async with running(config(srv.url)) as (exp, client):
            await exp.run_cycle()
            await exp.run_cycle()
            body = await (await client.get("/metrics")).text()
    t = _target(srv.url)
    assert sample_value(body, "kvoffload_target_up", target=t) == 1.0
    assert (
        sample_value(
            body, "kvoffload_target_scrape_failures_total", target=t, reason="invalid_value"
        )
        == 1.0
    )
    # The hit ratio needs prefix hits in both scrapes; with NaN it is unknown, not 0.
    assert sample_value(body, "kvoffload_gpu_prefix_hit_ratio", target=t) is None


async def test_target_recovers_after_failure():
    with ReplayServer([Reply(status=503), Reply(body=GOOD)]) as srv:
        async with running(config(srv.url)) as (exp, client):
            await exp.run_cycle()
            await exp.run_cycle()
            body = await (await client.get("/metrics")).text()
    t = _target(srv.url)
    assert sample_value(body, "kvoffload_target_up", target=t) == 1.0
    assert (
        sample_value(body, "kvoffload_target_scrape_failures_total", target=t, reason="http_status")
        == 1.0
    )
