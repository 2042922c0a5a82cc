"""Fault matrix, NVML, at the exporter level: the GPU collector failing or missing must not
touch the vLLM target or /metrics. The NVML side runs the NVML collector's recorded H200
sequence fake (tests/nvml_doubles.py) in its real poller thread; the exporter serves over a
real 127.0.0.1 socket and scrapes a real HTTP endpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from exporter.runtime import Exporter
from exporter.server import make_app
from exporter.sources.nvml.library import GPU_IS_LOST, LIBRARY_NOT_FOUND
from exporter.sources.nvml.source import NvmlSource
from exporter.sources.vllm_http import VllmTarget
from testbed.replay import ReplayServer, Reply
from tests.conftest import CPU
from tests.exporter_harness import config, sample_value
from tests.nvml_doubles import RecordedGpu, RecordedNvml, load_fast

GOOD = (CPU / "metrics-after.prom").read_bytes()


async def _serve_cycles(
    api: RecordedNvml, until: Callable[[NvmlSource], bool]
) -> tuple[str, str, NvmlSource]:
    """Cycle the exporter (checking /metrics each time) until `until`, then once more."""
    from aiohttp.test_utils import TestClient, TestServer

    with ReplayServer([Reply(body=GOOD)]) as srv:
        cfg = config(srv.url)
        (tc,) = cfg.targets
        nvml = NvmlSource(api, poll_interval=0.001, reinit_interval=3600.0)
        target = VllmTarget(tc, window_seconds=cfg.window, timeout=2.0, max_body_bytes=1 << 20)
        exp = Exporter(cfg, [target, nvml])
        async with TestClient(TestServer(make_app(exp, run_loop=False))) as client:
            for _ in range(600):  # bounded: 30 s at most
                await exp.run_cycle()
                resp = await client.get("/metrics")
                assert resp.status == 200
                if until(nvml):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the NVML fault never happened")
            await exp.run_cycle()
            body = await (await client.get("/metrics")).text()
        return body, srv.url.removeprefix("http://"), nvml


async def test_gpu_lost_for_good_leaves_the_target_and_metrics_alone() -> None:
    rows = load_fast("b_offload")
    api = RecordedNvml([RecordedGpu(rows=rows, errors={("pcie_counters", 100): GPU_IS_LOST})])
    body, target, nvml = await _serve_cycles(
        api, lambda src: api.calls["pcie_counters"] >= 100 and not src.poller.snapshot.up
    )
    assert sample_value(body, "kvoffload_target_up", target=target) == 1.0
    assert sample_value(body, "kvoffload_collector_up", collector="nvml") == 0.0
    assert (
        sample_value(body, "kvoffload_collector_errors_total", collector="nvml", kind="unavailable")
        >= 1
    )
    assert "GPU_IS_LOST" in (nvml.health.error or "")
    # Nothing of the lost GPU is exported: no stale byte counters, no link state.
    assert "kvoffload_gpu_pcie_tx_bytes_total{" not in body
    assert "kvoffload_gpu_info{" not in body
    # The vLLM side is derived as usual.
    assert (
        sample_value(body, "kvoffload_prompt_tokens_total", target=target, source="local_cache_hit")
        == 7680.0
    )


async def test_no_nvml_library_is_absence_not_an_error() -> None:
    api = RecordedNvml([], init_errors=[LIBRARY_NOT_FOUND])
    body, target, _ = await _serve_cycles(api, lambda src: api.calls["init"] >= 1)
    assert sample_value(body, "kvoffload_target_up", target=target) == 1.0
    assert sample_value(body, "kvoffload_collector_up", collector="nvml") == 0.0
    errors = [
        sample_value(body, "kvoffload_collector_errors_total", collector="nvml", kind=k)
        for k in ("unavailable", "internal", "timeout")
    ]
    assert errors == [0.0, 0.0, 0.0]
