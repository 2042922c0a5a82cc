"""exporter/model/derive/backends.py: what each KV transfer backend's series derive to
(tiering, ARC/threshold, simple offload, LMCache, NIXL; docs/backends.md), on the recorded
H200 runs of vLLM 0.26.0 and the synthesized vLLM 0.32 and LMCache expositions (the data:
tests/helpers.py)."""

from __future__ import annotations

import pytest

from exporter.model.derive.backends import nixl_link_type
from exporter.vllm_cmdline import launch_config
from exporter.vllm_metrics import EngineKey
from tests.helpers import (
    CHUNK,
    E0,
    E1,
    KV_BYTES_PER_TOKEN_32B,
    LARGE,
    MODEL,
    gpu_metrics,
    raw,
    recorded_cmd,
    synth,
    window_derived,
)


@pytest.mark.parametrize("wl", ["W1", "W2"])
def test_tiering_run_on_vllm_026(wl: str) -> None:
    """0.26 exports no per-tier counters: the spec is known from the command line only."""
    before, after = gpu_metrics("small-tier", "before", wl), gpu_metrics("small-tier", "after", wl)
    launch = launch_config(*recorded_cmd("small-tier"))
    d = window_derived(before, after, E0, launch=launch)
    ext = raw(after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - raw(
        before, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    prompt = raw(after, "vllm:prompt_tokens_total") - raw(before, "vllm:prompt_tokens_total")
    assert d.offload_enabled and d.offload_hit_ratio == pytest.approx(ext / prompt)
    assert d.backend is not None
    cfg = d.backend.config
    assert (cfg.connector, cfg.spec, cfg.tiers, cfg.source) == (
        "OffloadingConnector",
        "TieringOffloadingSpec",
        "0:primary,1:fs",
        "cmdline",
    )
    assert d.backend.tiers == ()  # nothing per tier before vLLM 0.32
    assert "vllm:kv_offload_tiering_lookup_sync_delay_seconds_count" in after
    blind = window_derived(before, after, E0).backend
    assert blind is not None and (blind.config.spec, blind.config.tiers) == ("unknown", "unknown")


@pytest.mark.parametrize(
    ("config", "policy", "threshold"), [("small-arc", "arc", "0"), ("small-thr2", "lru", "2")]
)
def test_policy_and_threshold_runs_on_vllm_026(config: str, policy: str, threshold: str) -> None:
    before, after = gpu_metrics(config, "before", "W1"), gpu_metrics(config, "after", "W2")
    d = window_derived(before, after, E0, launch=launch_config(*recorded_cmd(config)))
    assert d.backend is not None
    assert (d.backend.config.eviction_policy, d.backend.config.store_threshold) == (
        policy,
        threshold,
    )
    skipped = raw(after, "vllm:kv_offload_stores_skipped_total")
    if threshold == "2":
        assert skipped > 0 and d.totals["stores_skipped"] == skipped
    else:
        assert "stores_skipped" not in d.totals and skipped == 0


def test_tiering_per_tier_values_on_vllm_032_definitions() -> None:
    before, after = synth("vllm-0.32-tiering", "before"), synth("vllm-0.32-tiering", "after")
    for ek in (E0, E1):
        d = window_derived(before, after, ek)
        assert d.backend is not None and d.offload_enabled
        cfg = d.backend.config
        assert (cfg.connector, cfg.spec, cfg.tiers) == (
            "OffloadingConnector",
            "TieringOffloadingSpec",
            "0:primary,1:fs",
        )
        tiers = {t.tier: t for t in d.backend.tiers}
        assert set(tiers) == {"0:primary", "1:fs"}

        def delta(name: str, tier: str, ek: EngineKey = ek) -> float:
            lab = {"engine": ek.engine, "tier": tier}
            return raw(after, name, **lab) - raw(before, name, **lab)

        q = "vllm:kv_offload_tiering_chunk_queries_total"
        h = "vllm:kv_offload_tiering_chunk_hits_total"
        assert tiers["0:primary"].hit_ratio == pytest.approx(
            delta(h, "0:primary") / delta(q, "0:primary")
        )
        fs = tiers["1:fs"]
        wb = delta("vllm:kv_offload_tiering_write_bytes_total", "1:fs")
        wt = delta("vllm:kv_offload_tiering_write_time_total", "1:fs")
        assert fs.write_bandwidth == pytest.approx(wb / wt)
        assert fs.write_bytes_total == raw(
            after, "vllm:kv_offload_tiering_write_bytes_total", engine=ek.engine, tier="1:fs"
        )
        if ek == E0:  # the scripted scenario: 240 of 300 fs lookups hit, 240 chunks promoted
            assert fs.hit_ratio == pytest.approx(0.8)
            rb = delta("vllm:kv_offload_tiering_read_bytes_total", "1:fs")
            rt = delta("vllm:kv_offload_tiering_read_time_total", "1:fs")
            assert rb == 240 * CHUNK and fs.read_bandwidth == pytest.approx(rb / rt)
        else:  # written to, never hit: vLLM never created the tier's hit counter
            assert f'engine="1",model_name="{MODEL}",tier="1:fs"' not in "".join(
                ln for ln in after.splitlines() if ln.startswith(h)
            )
            assert fs.hit_ratio == 0.0 and fs.read_bandwidth is None


def test_simple_offload_outcomes_on_vllm_032_definitions() -> None:
    before, after = synth("vllm-0.32-simple", "before"), synth("vllm-0.32-simple", "after")
    d0 = window_derived(before, after, E0)
    d1 = window_derived(before, after, E1)
    assert d0.offload_enabled and d0.backend is not None
    assert d0.backend.config.connector == "SimpleCPUOffloadConnector"
    name = "vllm:simple_kv_offload_save_outcomes_total"

    def delta(outcome: str) -> float:
        return raw(after, name, engine="0", outcome=outcome) - raw(
            before, name, engine="0", outcome=outcome
        )

    total = raw(after, name, engine="0") - raw(before, name, engine="0")
    dropped = sum(delta(o) for o in ("dropped_cpu_full", "dropped_request_gone"))
    assert d0.backend.simple_stored_ratio == pytest.approx(delta("stored") / total) == 0.5
    assert d0.backend.simple_dropped_ratio == pytest.approx(dropped / total) == 0.2
    assert d1.backend is not None
    assert (d1.backend.simple_stored_ratio, d1.backend.simple_dropped_ratio) == (1.0, 0.0)


def test_lmcache_run_derives_offload_ratios_and_lmcache_rates() -> None:
    before, after = synth("lmcache-v1-tp2", "before"), synth("lmcache-v1-tp2", "after")
    d = window_derived(before, after, E0)
    assert d.offload_enabled and d.backend is not None
    assert d.backend.config.connector == "LMCacheConnectorV1"

    def delta(name: str, **labels: str) -> float:
        return raw(after, name, **labels) - raw(before, name, **labels)

    w0 = {"worker_id": "0"}
    ext = delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert d.offload_hit_ratio == pytest.approx(ext / delta("vllm:prompt_tokens_total")) == 0.24
    hit_ratio = delta("lmcache:num_hit_tokens_total", **w0) / delta(
        "lmcache:num_requested_tokens_total", **w0
    )
    assert d.offload_lookup_hit_ratio == pytest.approx(hit_ratio) == 0.6
    retrieve = delta("lmcache:num_hit_tokens_total", **w0) / delta(
        "lmcache:time_to_retrieve_sum", **w0
    )
    assert d.backend.lmcache_retrieve_tokens_per_second == pytest.approx(retrieve)
    assert d.transfer_tokens_per_second == pytest.approx(retrieve) and not d.transfer_estimated
    store = delta("lmcache:num_stored_tokens_total", **w0) / delta(
        "lmcache:time_to_store_sum", **w0
    )
    assert d.backend.lmcache_store_tokens_per_second == pytest.approx(store) == pytest.approx(16000)


@pytest.mark.parametrize(
    ("name", "bandwidth"), [("vllm-0.32-nixl-rdma", 22e9), ("vllm-0.32-nixl-tcp", 1.1e9)]
)
def test_nixl_bandwidth_and_failures_on_vllm_032_definitions(name: str, bandwidth: float) -> None:
    before, after = synth(name, "before"), synth(name, "after")
    d = window_derived(before, after, LARGE, kv_bytes_per_token=KV_BYTES_PER_TOKEN_32B)
    b = d.backend
    assert b is not None and b.nixl_in_use and b.config.connector == "NixlConnector"
    assert not d.offload_enabled  # disaggregation is not offload
    nb = raw(after, "vllm:nixl_bytes_transferred_sum") - raw(
        before, "vllm:nixl_bytes_transferred_sum"
    )
    nt = raw(after, "vllm:nixl_xfer_time_seconds_sum") - raw(
        before, "vllm:nixl_xfer_time_seconds_sum"
    )
    assert b.nixl_bandwidth == pytest.approx(nb / nt) == pytest.approx(bandwidth)
    assert b.nixl_tokens_per_second == pytest.approx(nb / nt / KV_BYTES_PER_TOKEN_32B)
    assert b.nixl_failed_total == raw(after, "vllm:nixl_num_failed_transfers_total") == 3
    assert b.nixl_speedup is None  # a decode engine: no prefill, no recompute rate of its own
    assert b.nixl_link == "unknown"


def test_nixl_link_type() -> None:
    assert nixl_link_type(None) == "unknown"
    assert nixl_link_type("rc,cuda_copy,cuda_ipc") == "rdma"
    assert nixl_link_type("dc_x") == "rdma"
    # cuda_copy is a staging copy, not a path: NIXL 1.5 refuses a UCX_TLS without it.
    assert nixl_link_type("tcp,cuda_copy") == "tcp"
    # With tcp allowed beside cuda_ipc UCX picks per operation (reads went tcp on an H200).
    assert nixl_link_type("cuda_ipc,cuda_copy,tcp,self") == "unknown"
    assert nixl_link_type("tcp") == "tcp"
    assert nixl_link_type("tcp,self,sm") == "tcp"
    assert nixl_link_type("cuda_ipc,cuda_copy") == "cuda_ipc"
    assert nixl_link_type("^rc") == "unknown"
    assert nixl_link_type("all") == "unknown"
    assert nixl_link_type(None, nvlink_active=True) == "nvlink"
