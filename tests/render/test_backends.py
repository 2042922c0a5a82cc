"""exporter/render/backends.py: the backend families, from recorded and synthesized
derivations and from hand-built values, and the whole exporter's exposition per backend."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.catalogue import CATALOGUE
from exporter.model.derive.backends import BackendConfig, BackendDerived, TierDerived
from exporter.model.derive.engines import EngineDerived
from exporter.render.backends import backend_families
from exporter.vllm_cmdline import launch_config
from exporter.vllm_metrics import EngineKey
from testbed import backfill
from tests.helpers import (
    E0,
    KV_BYTES_PER_TOKEN_32B,
    gpu_metrics,
    recorded_cmd,
    synth,
    window_derived,
)
from tests.model.advisor.common import base
from tests.render.common import by_name, series


@pytest.mark.parametrize(
    ("config", "policy", "threshold"), [("small-arc", "arc", "0"), ("small-thr2", "lru", "2")]
)
def test_backend_families_config_info_of_the_policy_and_threshold_runs(
    config: str, policy: str, threshold: str
) -> None:
    before, after = gpu_metrics(config, "before", "W1"), gpu_metrics(config, "after", "W2")
    d = window_derived(before, after, E0, launch=launch_config(*recorded_cmd(config)))
    fams = {f.definition.name: f for f in backend_families([("t", [d])])}
    ((labels, value),) = fams["kvoffload_offload_config_info"].samples
    assert value == 1.0 and labels[3:] == (
        "OffloadingConnector",
        "CPUOffloadingSpec",
        policy,
        threshold,
        "none",
    )


SCENARIOS = {
    "vllm-0.32-tiering": None,
    "vllm-0.32-simple": None,
    "vllm-0.32-nixl-rdma": KV_BYTES_PER_TOKEN_32B,
    "lmcache-v1-tp2": None,
}


def backend_recording(
    name: str, end: float, step: float = 15.0, steps: int = 8
) -> backfill.Recording:
    texts = backfill.interpolate(synth(name, "before"), synth(name, "after"), steps)
    return backfill.Recording(
        f"{name}:8000", backfill.evenly(texts, end, step), kv_bytes_per_token=SCENARIOS[name]
    )


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_exporter_exposition_for_each_backend_passes_promtool(promtool: str, name: str) -> None:
    """The real exporter (backfill.run_exporter) on each backend's expositions; one target
    per exporter (several targets in one exporter repeat HELP lines: reported separately)."""
    series = backfill.run_exporter([backend_recording(name, 1_800_000_000.0)], interval=15.0)
    text = series.scrapes[-1][1]
    fams = _families(text)
    expected = {
        "vllm-0.32-tiering": {
            "kvoffload_tier_hit_ratio",
            "kvoffload_tier_read_bandwidth_bytes_per_second",
            "kvoffload_tier_write_bandwidth_bytes_per_second",
            "kvoffload_tier_read_bytes",
            "kvoffload_tier_write_bytes",
        },
        "vllm-0.32-simple": {
            "kvoffload_simple_offload_stored_ratio",
            "kvoffload_simple_offload_dropped_ratio",
        },
        "vllm-0.32-nixl-rdma": {
            "kvoffload_nixl_transfer_bandwidth_bytes_per_second",
            "kvoffload_nixl_failed_transfers",
            "kvoffload_nixl_link_info",  # info: a gauge named *_info in the text format
        },
        "lmcache-v1-tp2": {
            "kvoffload_lmcache_retrieve_tokens_per_second",
            "kvoffload_lmcache_store_tokens_per_second",
            "kvoffload_offload_hit_ratio",
        },
    }[name]
    assert expected <= set(fams), expected - set(fams)
    connector = {
        "vllm-0.32-tiering": "OffloadingConnector",
        "vllm-0.32-simple": "SimpleCPUOffloadConnector",
        "vllm-0.32-nixl-rdma": "NixlConnector",
        "lmcache-v1-tp2": "LMCacheConnectorV1",
    }[name]
    info = [s.labels for s in fams["kvoffload_offload_config_info"].samples]
    assert info and all(i["connector"] == connector for i in info)
    if name == "lmcache-v1-tp2":
        (hit,) = fams["kvoffload_offload_hit_ratio"].samples
        assert hit.value == pytest.approx(0.24)
    for fam in fams.values():
        if fam.name.startswith("kvoffload_"):
            assert fam.name in CATALOGUE or f"{fam.name}_total" in CATALOGUE, fam.name
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- hand-built derivations ---------------------------------------------------------------


def _with(backend: BackendDerived | None, key: EngineKey = E0) -> EngineDerived:
    return replace(base(key=key), backend=backend)


CONFIG = BackendConfig(
    "OffloadingConnector", "TieringOffloadingSpec", "lru", "0", "0:primary,1:fs", "cmdline"
)


def test_backend_families_every_family_in_order_and_nothing_without_a_backend() -> None:
    fams = backend_families([("t", [_with(None)])])
    assert [f.definition.name for f in fams] == [
        "kvoffload_offload_config_info",
        "kvoffload_tier_hit_ratio",
        "kvoffload_tier_read_bandwidth_bytes_per_second",
        "kvoffload_tier_write_bandwidth_bytes_per_second",
        "kvoffload_tier_read_bytes_total",
        "kvoffload_tier_write_bytes_total",
        "kvoffload_simple_offload_stored_ratio",
        "kvoffload_simple_offload_dropped_ratio",
        "kvoffload_lmcache_retrieve_tokens_per_second",
        "kvoffload_lmcache_store_tokens_per_second",
        "kvoffload_nixl_transfer_bandwidth_bytes_per_second",
        "kvoffload_nixl_transfer_speedup_ratio",
        "kvoffload_nixl_failed_transfers_total",
        "kvoffload_nixl_link_info",
    ]
    assert all(len(f) == 0 for f in fams)


def test_backend_families_tiers_by_label_unknown_values_absent() -> None:
    tiers = (
        TierDerived("0:primary", 0.5, None, None, None, None),
        TierDerived("1:fs", 0.0, None, 2e9, None, 4e9),
    )
    f = by_name(backend_families([("t", [_with(BackendDerived(CONFIG, tiers))])]))
    labels = ("t", E0.model_name, E0.engine)
    assert series(f["kvoffload_offload_config_info"]) == {
        (*labels, "OffloadingConnector", "TieringOffloadingSpec", "lru", "0", "0:primary,1:fs"): 1.0
    }
    assert series(f["kvoffload_tier_hit_ratio"]) == {
        (*labels, "0:primary"): 0.5,
        (*labels, "1:fs"): 0.0,  # measured zero stays
    }
    assert series(f["kvoffload_tier_read_bandwidth_bytes_per_second"]) == {}
    assert series(f["kvoffload_tier_write_bandwidth_bytes_per_second"]) == {(*labels, "1:fs"): 2e9}
    assert series(f["kvoffload_tier_write_bytes_total"]) == {(*labels, "1:fs"): 4e9}
    for name in ("simple_offload_stored_ratio", "nixl_transfer_speedup_ratio", "nixl_link_info"):
        assert len(f[f"kvoffload_{name}"]) == 0, name


def test_backend_families_nixl_link_only_while_nixl_is_in_use() -> None:
    nixl = BackendConfig("NixlConnector", "", "", "", "", "cmdline")
    used = BackendDerived(
        nixl, nixl_in_use=True, nixl_bandwidth=2.2e10, nixl_speedup=0.0, nixl_link="rdma"
    )
    idle = BackendDerived(nixl, nixl_link="tcp")
    e1 = EngineKey(E0.model_name, "1")
    f = by_name(backend_families([("t", [_with(used), _with(idle, e1)])]))
    assert series(f["kvoffload_nixl_link_info"]) == {("t", E0.model_name, "0", "rdma"): 1.0}
    assert series(f["kvoffload_nixl_transfer_bandwidth_bytes_per_second"]) == {
        ("t", E0.model_name, "0"): 2.2e10
    }
    assert series(f["kvoffload_nixl_transfer_speedup_ratio"]) == {("t", E0.model_name, "0"): 0.0}
    assert len(f["kvoffload_offload_config_info"]) == 2  # both engines say their connector
