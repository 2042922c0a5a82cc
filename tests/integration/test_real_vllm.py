"""The exporter against a real vLLM CPU server, scraped by a real Prometheus."""

from __future__ import annotations

import subprocess
import time

import pytest

from exporter import expfmt
from exporter.vllm_metrics import WANTED, EngineKey, normalise
from testbed.exporter_proc import ExporterProcess
from testbed.procs import http_get
from testbed.prometheus import Prometheus
from testbed.vllm_cpu import MODEL_NAME, seed_workload
from tests.exporter_harness import sample_value

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
EK = EngineKey(MODEL_NAME, "0")


def raw_counters(url: str) -> dict[str, float]:
    status, body = http_get(url + "/metrics")
    assert status == 200
    return dict(normalise(expfmt.parse(body.decode(), WANTED), 0).engines[EK].counters)


def wait_cycles(exporter: ExporterProcess, n: int = 3) -> None:
    start = _cycles(exporter)
    deadline = time.monotonic() + 30
    while _cycles(exporter) < start + n:
        assert time.monotonic() < deadline, "exporter stopped cycling"
        time.sleep(0.2)


def _cycles(exporter: ExporterProcess) -> int:
    import json

    _, body = http_get(exporter.url + "/api/v1/status")
    return int(json.loads(body)["cycles"])


def test_seed_workload_derived_values_match_raw_vllm_and_prometheus(
    vllm_server, prometheus_available, promtool, tmp_path
):
    exporter = ExporterProcess(
        tmp_path, ["--vllm-url", vllm_server.url, "--interval", "1", "--window", "300"]
    ).start()
    prom = Prometheus(tmp_path / "prom", scrape_targets=[exporter.address]).start()
    try:
        wait_cycles(exporter, 1)
        before = raw_counters(vllm_server.url)
        records = seed_workload(vllm_server.url, batches=5, seed=101, pause=0.15)
        assert len(records) == 25
        after = raw_counters(vllm_server.url)
        wait_cycles(exporter, 3)
        text = exporter.metrics()
        target = vllm_server.url.removeprefix("http://")
        up = prom.wait_for("kvoffload_target_up == 1")
        assert up[0]["metric"]["target"] == target
        res = prom.wait_for(
            f'kvoffload_prompt_tokens_total{{source="local_cache_hit",target="{target}"}}'
            f" == {after['prompt_by_source:local_cache_hit']}"
        )
        assert res
    finally:
        exporter.stop()
        prom.stop()

    lab = {"target": target, "model_name": MODEL_NAME, "engine": "0"}
    d = {k: after[k] - before.get(k, 0.0) for k in after}

    # A's re-send after B and C is recomputed in full: per batch 1600 (A cold) + 64 (the
    # partial block of the GPU hit) + 1600 (B) + 1600 (C) + 1600 (A after eviction).
    assert d["prompt_by_source:local_compute"] == 5 * (1600 + 64 + 1600 + 1600 + 1600)
    assert d["prompt_by_source:local_cache_hit"] == 5 * 1536
    assert d["prompt_by_source:external_kv_transfer"] == 0

    # Re-exported totals equal vLLM's own counters.
    for src in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        assert (
            sample_value(text, "kvoffload_prompt_tokens_total", source=src, **lab)
            == after[f"prompt_by_source:{src}"]
        )
    # Windowed ratio equals what the raw counter deltas imply.
    assert sample_value(text, "kvoffload_gpu_prefix_hit_ratio", **lab) == pytest.approx(
        d["prefix_hits"] / d["prefix_queries"]
    )
    assert sample_value(text, "kvoffload_offload_enabled", **lab) == 0.0
    assert sample_value(text, "kvoffload_offload_hit_ratio", **lab) is None
    assert sample_value(text, "kvoffload_gpu_kv_cache_capacity_tokens", **lab) == 20 * 128
    assert sample_value(text, "kvoffload_target_up", target=target) == 1.0
    assert sample_value(
        text, "kvoffload_prefill_average_tokens_per_second", **lab
    ) == pytest.approx(d["computed_tokens"] / d["prefill_seconds"], rel=1e-6)

    check = subprocess.run(
        [promtool, "check", "metrics"], input=text.encode(), capture_output=True, check=False
    )
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
