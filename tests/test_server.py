from __future__ import annotations

import gzip
import subprocess

import pytest

from testbed.replay import ReplayServer, files
from tests.conftest import H200
from tests.exporter_harness import config, running, sample_value

B = H200 / "b_offload"
LABELS = {"target": None, "model_name": "qwen3-dummy", "engine": "0"}


@pytest.fixture
def offload_replay():
    with ReplayServer(files([B / "metrics_before.txt", B / "metrics_after.txt"])) as srv:
        yield srv


async def test_metrics_from_recorded_offload_run(offload_replay):
    async with running(config(offload_replay.url)) as (exp, client):
        await exp.run_cycle()
        await exp.run_cycle()
        text = await (await client.get("/metrics")).text()
    target = offload_replay.url.removeprefix("http://")
    lab = dict(LABELS, target=target)
    assert sample_value(text, "kvoffload_target_up", target=target) == 1.0
    assert sample_value(text, "kvoffload_offload_enabled", **lab) == 1.0
    assert sample_value(text, "kvoffload_offload_buffer_bytes", **lab) == 0.5 * 2**30
    assert sample_value(text, "kvoffload_offload_hit_ratio", **lab) == pytest.approx(7360 / 40000)
    assert (
        sample_value(text, "kvoffload_prompt_tokens_total", source="external_kv_transfer", **lab)
        == 7360
    )
    assert sample_value(text, "kvoffload_offload_load_bytes_total", **lab) == 8.4410368e08
    assert sample_value(text, "kvoffload_kv_bytes_per_token", **lab) == 114688
    assert sample_value(text, "kvoffload_target_info", target=target) == 1.0
    assert 'vllm_version="0.26.0"' in text


async def test_metrics_pass_promtool_check_metrics(offload_replay, promtool):
    async with running(config(offload_replay.url)) as (exp, client):
        await exp.run_cycle()
        await exp.run_cycle()
        body = await (await client.get("/metrics")).read()
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, check=False
    )
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


async def test_openmetrics_and_gzip_negotiation(offload_replay):
    async with running(config(offload_replay.url)) as (exp, client):
        await exp.run_cycle()
        om = await client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
        assert om.headers["Content-Type"].startswith("application/openmetrics-text")
        assert (await om.text()).rstrip().endswith("# EOF")
        gz = await client.get(
            "/metrics", headers={"Accept-Encoding": "gzip"}, auto_decompress=False
        )
        assert gz.headers["Content-Encoding"] == "gzip"
        assert b"kvoffload_target_up" in gzip.decompress(await gz.read())


async def test_health_ready_status_and_index(offload_replay):
    async with running(config(offload_replay.url)) as (exp, client):
        assert (await client.get("/healthz")).status == 200
        assert (await client.get("/readyz")).status == 503
        await exp.run_cycle()
        assert (await client.get("/readyz")).status == 200
        status = await (await client.get("/api/v1/status")).json()
        assert status["targets"][0]["up"] is True
        assert status["targets"][0]["engines"][0]["model_name"] == "qwen3-dummy"
        page = await (await client.get("/")).text()
        assert "qwen3-dummy" in page and "/metrics" in page


async def test_metrics_never_waits_on_a_slow_target():
    import asyncio

    from testbed.replay import Reply

    with ReplayServer([Reply(body=b"", delay=3.0)]) as srv:
        async with running(config(srv.url, scrape_timeout=2.0)) as (exp, client):
            cycle = asyncio.create_task(exp.run_cycle())
            await asyncio.sleep(0.2)
            resp = await client.get("/metrics")
            # Served from the cache while the collection is still stuck on the target.
            assert resp.status == 200 and not cycle.done()
            await cycle
            text = await (await client.get("/metrics")).text()
            target = srv.url.removeprefix("http://")
            assert sample_value(text, "kvoffload_target_up", target=target) == 0.0
            assert (
                sample_value(
                    text, "kvoffload_target_scrape_failures_total", target=target, reason="timeout"
                )
                == 1.0
            )


async def test_two_targets_share_one_help_and_type_block(offload_replay, promtool):
    with ReplayServer(files([B / "metrics_before.txt", B / "metrics_after.txt"])) as other:
        async with running(config(offload_replay.url, other.url)) as (exp, client):
            await exp.run_cycle()
            await exp.run_cycle()
            body = await (await client.get("/metrics")).read()
    text = body.decode()
    assert text.count("# TYPE kvoffload_target_up gauge") == 1
    assert text.count("kvoffload_target_up{") == 2
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, check=False
    )
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
