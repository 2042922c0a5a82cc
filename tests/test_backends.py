"""KV transfer backends: tiering, ARC/threshold, simple offload, LMCache, NIXL (docs/backends.md).

Real data: the H200 runs with vLLM 0.26.0 (tests/fixtures/gpu/: small-tier = 0.25 GiB CPU
primary + fs secondary tier, small-arc = ARC at 0.25 GiB, small-thr2 = store_threshold 2 at
0.5 GiB, small-a = the same prompts without offload), their recorded command lines, 1 s
/metrics sequences and KV events.

Synthesized data (tests/fixtures/backends/, every file marked "# SYNTHESIZED"): vLLM 0.32's
per-tier tiering counters, SimpleCPUOffloadConnector and NIXL series rendered by vLLM
0.32.0's own metric classes (synthesize.py), LMCache's series rendered from its
observability.py definitions (synthesize_lmcache.py). Expected values are computed from
the expositions with prometheus_client's parser, or are the scenario's scripted inputs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shlex
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.whatif_vs_observed import observed, open_text, read_text, windowed_hits
from exporter import expfmt
from exporter.catalogue import CATALOGUE, Family
from exporter.kvevents_codec import Message, decode_payload, read_records
from exporter.lmcache import lmcache_samples
from exporter.model.advisor.rules import evaluate
from exporter.model.advisor.types import Action, AdvisorInput, PolicyPoint, WhatIfPoint, WhatIfState
from exporter.model.derive.backends import nixl_link_type
from exporter.model.derive.engines import DeriveSettings, EngineDerived, derive_engine
from exporter.model.derive.peers import with_peer_recompute
from exporter.model.whatif.engine import POLICY_COMBOS, EngineSim, SimConfig, WhatIf, WhatIfSettings
from exporter.model.whatif.plan import sim_config
from exporter.model.whatif.simulator import blocks_for_bytes
from exporter.model.whatif.view import engine_rank, policy_points, whatif_state
from exporter.options import TargetConfig
from exporter.render.backends import backend_families
from exporter.render.whatif import whatif_families
from exporter.sources.kv_events.source import StreamItem
from exporter.sources.vllm_http import VllmTarget
from exporter.thresholds import DEFAULT
from exporter.vllm_cmdline import LaunchConfig, launch_config, parse_environ
from exporter.vllm_metrics import WANTED, EngineKey, normalise
from testbed import backfill
from testbed.replay import ReplayServer, Reply
from tests.test_advisor import base as advisor_derived

REPO = Path(__file__).resolve().parent.parent
GPU = REPO / "tests" / "fixtures" / "gpu"
SYNTH = REPO / "tests" / "fixtures" / "backends"
GIB = 1 << 30
MODEL = "qwen3-dummy"
E0 = EngineKey(MODEL, "0")
E1 = EngineKey(MODEL, "1")
KV_BYTES_PER_TOKEN = 114_688  # the small shape: 28 layers x 8 KV heads x 128 x 2 x 2 bytes
CHUNK = 16 * KV_BYTES_PER_TOKEN
LARGE = EngineKey("qwen3-32b-dummy", "0")  # the large shape (NIXL scenarios)
KV_BYTES_PER_TOKEN_32B = 262_144


# --- readers independent of the exporter --------------------------------------------------


def raw(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels` (prometheus_client)."""
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def recorded_cmd(config: str) -> tuple[list[str], dict[str, str]]:
    """argv and environment of a recorded cmd.txt (first line, then KEY=VALUE lines)."""
    lines = (GPU / config / "cmd.txt").read_text().splitlines()
    env = dict(ln.split("=", 1) for ln in lines[1:] if "=" in ln and not ln.startswith("#"))
    return shlex.split(lines[0]), env


def gpu_metrics(config: str, when: str, wl: str) -> str:
    return read_text(GPU / config / f"metrics_{when}_{wl}.prom")


def synth(name: str, step: str) -> str:
    text = (SYNTH / f"{name}.{step}.prom").read_text()
    assert text.startswith("# SYNTHESIZED"), name
    return text


def window_derived(
    before: str,
    after: str,
    ek: EngineKey,
    *,
    launch: LaunchConfig | None = None,
    kv_bytes_per_token: float | None = None,
) -> EngineDerived:
    from exporter.window import TargetWindow

    win = TargetWindow(300.0)
    for ts, text in ((0.0, before), (10.0, after)):
        win.add(normalise(lmcache_samples(expfmt.parse(text, WANTED)), ts))
    d = derive_engine(
        win,
        ek,
        10.0,
        DeriveSettings(stale_after=30.0, launch=launch, kv_bytes_per_token=kv_bytes_per_token),
    )
    assert d is not None
    return d


# --- the command line ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "spec", "policy", "threshold", "tiers", "size"),
    [
        ("small-tier", "TieringOffloadingSpec", "lru", 0, ("fs",), 0.25),
        ("small-arc", "CPUOffloadingSpec", "arc", 0, (), 0.25),
        ("small-thr2", "CPUOffloadingSpec", "lru", 2, (), 0.5),
        ("small-b", "CPUOffloadingSpec", "lru", 0, (), 0.5),
    ],
)
def test_launch_config_of_the_recorded_h200_commands(
    config: str, spec: str, policy: str, threshold: int, tiers: tuple[str, ...], size: float
) -> None:
    argv, env = recorded_cmd(config)
    lc = launch_config(argv, env)
    assert lc.connector == "OffloadingConnector"
    assert (lc.spec, lc.eviction_policy, lc.store_threshold, lc.tiers) == (
        spec,
        policy,
        threshold,
        tiers,
    )
    assert lc.offloading_size_gib == size and lc.offloading_backend == "native"
    assert lc.cpu_bytes_to_use == size * GIB and lc.kv_role == "kv_both"
    assert lc.environ_read and lc.ucx_tls is None


def test_launch_config_without_offload_and_tier_labels() -> None:
    argv, env = recorded_cmd("small-a")
    lc = launch_config(argv, env)
    assert lc.connector == "" and lc.spec == "" and lc.eviction_policy == ""
    tier = launch_config(*recorded_cmd("small-tier"))
    assert tier.tiers_label == "0:primary,1:fs"
    assert launch_config(*recorded_cmd("small-thr2")).threshold_active == 2


def test_launch_config_forms_vllm_accepts() -> None:
    base = ["vllm", "serve", "m"]
    simple = launch_config([*base, "--kv-offloading-size=8"], {"VLLM_USE_SIMPLE_KV_OFFLOAD": "1"})
    assert simple.connector == "SimpleCPUOffloadConnector" and simple.spec == ""
    unknown_env = launch_config([*base, "--kv-offloading-size", "8"], None)
    assert unknown_env.connector == "OffloadingConnector" and not unknown_env.environ_read
    lmc = launch_config([*base, "--kv_offloading_size", "4", "--kv-offloading-backend", "lmcache"])
    assert lmc.connector == "LMCacheMPConnector" and lmc.offloading_backend == "lmcache"
    nixl = launch_config(
        [*base, "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'],
        {"UCX_TLS": "rc,cuda_copy"},
    )
    assert (nixl.connector, nixl.kv_role, nixl.ucx_tls) == (
        "NixlConnector",
        "kv_both",
        "rc,cuda_copy",
    )
    dotted = launch_config([*base, "--kv-transfer-config.kv_connector", "LMCacheConnectorV1"])
    assert dotted.connector == "LMCacheConnectorV1"
    explicit = launch_config(
        [
            *base,
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_connector_extra_config": {
                        "cpu_bytes_to_use": 1 << 30,
                        "eviction_policy": "ARC",
                        "store_threshold": "3",
                        "spec_name": "TieringOffloadingSpec",
                        "secondary_tiers": [
                            {"type": "fs"},
                            {"type": "my.pkg.FancyTier"},
                            {"type": "x" * 40},
                            {"root_dir": "no type"},
                            {"type": "obj"},
                            {"type": "p2p"},
                            {"type": "kvcr"},
                        ],
                    },
                }
            ),
        ]
    )
    assert (explicit.eviction_policy, explicit.store_threshold) == ("arc", 3)
    assert explicit.tiers == ("fs", "FancyTier", "other", "obj")  # bounded: 4 tiers at most
    assert explicit.offloading_size_gib is None and explicit.cpu_bytes_to_use == 1 << 30
    odd = launch_config(
        [
            *base,
            "--kv-transfer-config",
            '{"kv_connector":"SomethingNew"}',
            "--kv-offloading-size",
            "x",
        ]
    )
    assert odd.connector == "other" and odd.offloading_size_gib is None
    broken = launch_config([*base, "--kv-transfer-config", "{not json"])
    assert broken.connector == ""
    assert parse_environ(b"A=1\0B=x=y\0\0junk\0") == {"A": "1", "B": "x=y"}


# --- recorded vLLM 0.26 runs --------------------------------------------------------------


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


def test_tiering_run_writes_to_the_fs_tier_in_kv_events() -> None:
    """0.26's fs tier publishes hash-only BlockStored events with medium "FS" (0.32: STORAGE)."""
    media: dict[tuple[str, str], int] = {}
    with open_text(GPU / "small-tier" / "kv_events.jsonl") as fh:
        for msg in read_records(fh):
            for ev in msg.raw[1]:
                key = (str(ev["type"]), str(ev.get("medium")))
                media[key] = media.get(key, 0) + 1
    assert media[("BlockStored", "FS")] > 0 and ("BlockRemoved", "FS") not in media
    assert not any(m == "STORAGE" for _, m in media)


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
    fams = {f.definition.name: f for f in backend_families([("t", [d])])}
    ((labels, value),) = fams["kvoffload_offload_config_info"].samples
    assert value == 1.0 and labels[3:] == (
        "OffloadingConnector",
        "CPUOffloadingSpec",
        policy,
        threshold,
        "none",
    )


# --- synthesized vLLM 0.32 expositions ----------------------------------------------------


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


def test_lmcache_series_map_onto_the_served_model_engine_0() -> None:
    before, after = synth("lmcache-v1-tp2", "before"), synth("lmcache-v1-tp2", "after")
    mapped = lmcache_samples(expfmt.parse(after, WANTED))
    hits = [s for s in mapped if s.name == "lmcache:num_hit_tokens_total"]
    # two TP workers count the same tokens: the maximum, not the sum
    assert len(hits) == 1 and hits[0].labels == (("engine", "0"), ("model_name", MODEL))
    assert hits[0].value == raw(after, "lmcache:num_hit_tokens_total", worker_id="0")
    (usage,) = [s for s in mapped if s.name == "lmcache:local_cache_usage"]
    assert usage.value == raw(after, "lmcache:local_cache_usage")  # bytes held: summed
    (lookups,) = [s for s in mapped if s.name == "lmcache:num_lookup_tokens_total"]
    assert lookups.value == raw(after, "lmcache:num_lookup_tokens_total", role="scheduler")
    passthrough = [s for s in mapped if s.name == "vllm:prompt_tokens_total"]
    assert passthrough == [s for s in expfmt.parse(after, WANTED) if s.name == passthrough[0].name]

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


def test_lmcache_mapping_leaves_other_scrapes_alone() -> None:
    text = gpu_metrics("small-b", "after", "W1")
    samples = expfmt.parse(text, WANTED)
    assert lmcache_samples(samples) == samples


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
    assert nixl_link_type("tcp,cuda_copy") == "unknown"  # cuda_copy is not a network path
    assert nixl_link_type("tcp") == "tcp"
    assert nixl_link_type("tcp,self,sm") == "tcp"
    assert nixl_link_type("cuda_ipc,cuda_copy") == "cuda_ipc"
    assert nixl_link_type("^rc") == "unknown"
    assert nixl_link_type("all") == "unknown"
    assert nixl_link_type(None, nvlink_active=True) == "nvlink"


# --- NIXL against recompute: a real prefill engine and a synthesized decode engine ---------


def _scrapes(config: str) -> list[dict[str, Any]]:
    with open_text(GPU / config / "vllm_metrics.jsonl") as fh:
        return [s for s in map(json.loads, fh) if s.get("status") == 200]


def _engine_after_run(config: str, ek: EngineKey, kv_bytes_per_token: float) -> EngineDerived:
    """A real no-offload H200 run's engine after both workloads (its 1 s scrapes)."""
    from exporter.window import TargetWindow

    win = TargetWindow(300.0)
    scrapes = _scrapes(config)
    for s in scrapes:
        win.add(normalise(expfmt.parse(s["body"], WANTED), float(s["t"])))
    d = derive_engine(
        win,
        ek,
        float(scrapes[-1]["t"]),
        DeriveSettings(stale_after=3.0, kv_bytes_per_token=kv_bytes_per_token),
    )
    assert d is not None
    return d


@pytest.fixture(scope="module")
def prefill_engine() -> EngineDerived:
    """The 32B shape without offload: its marginal recompute rate is measured."""
    d = _engine_after_run("large-a", LARGE, KV_BYTES_PER_TOKEN_32B)
    assert d.recompute_tokens_per_second is not None
    return d


@pytest.mark.parametrize(
    ("name", "faster"), [("vllm-0.32-nixl-rdma", True), ("vllm-0.32-nixl-tcp", False)]
)
def test_nixl_speedup_uses_the_prefill_engines_recompute_rate(
    prefill_engine: EngineDerived, name: str, faster: bool
) -> None:
    """A real prefill engine (large-a, H200) beside a synthesized decode engine of the same
    model: the decode engine's transfer speed against the prefill engine's recompute."""
    decode = window_derived(
        synth(name, "before"),
        synth(name, "after"),
        LARGE,
        kv_bytes_per_token=KV_BYTES_PER_TOKEN_32B,
    )
    filled = with_peer_recompute({"prefill": [prefill_engine], "decode": [decode]})
    (d,) = filled["decode"]
    assert filled["prefill"] == [prefill_engine]
    assert d.backend is not None and decode.backend is not None
    tokens = decode.backend.nixl_tokens_per_second
    recompute = prefill_engine.recompute_tokens_per_second
    assert tokens is not None and recompute is not None
    assert d.backend.nixl_speedup == pytest.approx(tokens / recompute)
    assert d.backend.recompute_from_peer
    assert (d.backend.nixl_speedup > 1.0) is faster
    # an engine of another model gets nothing
    other = replace(decode, key=EngineKey("other", "0"))
    (o,) = with_peer_recompute({"p": [prefill_engine], "d": [other]})["d"]
    assert o.backend is not None and o.backend.nixl_speedup is None
    # recompute free at the margin (no measurable per-token cost): no transfer can win
    free = replace(prefill_engine, recompute_tokens_per_second=None, recompute_negligible=True)
    (z,) = with_peer_recompute({"p": [free], "d": [decode]})["d"]
    assert z.backend is not None and z.backend.nixl_speedup == 0.0


# --- the what-if for policies against the real ARC and threshold runs -----------------------


def _events(config: str) -> list[Message]:
    with open_text(GPU / config / "kv_events.jsonl") as fh:
        return list(read_records(fh))


@pytest.fixture(scope="module")
def small_a_events() -> list[Message]:
    return _events("small-a")


def _count_window(wl: str) -> tuple[float, float]:
    doc = json.loads((GPU / f"small-eager-{wl}" / "run.json").read_text())
    (nooffload,) = [r for r in doc["runs"] if r["dir"] == "nooffload"]
    return float(nooffload["count"][0]), float(nooffload["count"][1])


@pytest.mark.parametrize("wl", ["W1", "W2"])
@pytest.mark.parametrize(
    ("run", "size", "combo"),
    [
        ("offload-0.25GiB-arc", 0.25, ("arc", 0)),
        ("offload-0.5GiB-thr2", 0.5, ("lru", 2)),
        ("offload-0.25GiB", 0.25, ("lru", 0)),
        ("offload-0.5GiB", 0.5, ("lru", 0)),
    ],
)
def test_policy_whatif_predicts_the_real_arc_and_threshold_runs(
    small_a_events: list[Message], wl: str, run: str, size: float, combo: tuple[str, int]
) -> None:
    """The exporter's policy simulators on the no-offload events vs the offload runs' own
    external_kv_transfer share (the prompts are identical: fixed seeds)."""
    blocks = blocks_for_bytes(int(size * GIB), CHUNK)
    sim = EngineSim(0, WhatIfSettings(sizes_bytes=(int(size * GIB),)))
    sim.configure(SimConfig((blocks,), None, policy_blocks=blocks))
    for msg in small_a_events:
        sim.process(msg)
    t0, t1 = _count_window(wl)
    i = POLICY_COMBOS.index(combo)
    hits = sum(b.hits[i] for b in sim.snapshot().policy_buckets if t0 <= b.start < t1)
    ext, prompt = observed(GPU / f"small-eager-{wl}" / run)
    assert abs(hits / prompt - ext / prompt) <= 0.01, (hits / prompt, ext / prompt)
    # and the same hits as the offline what-if's own replay of the same window
    (offline,) = windowed_hits(
        small_a_events, [blocks], (t0, t1), policy=combo[0], store_threshold=combo[1]
    )
    assert hits == offline


class _Whatif:
    """One target's what-if as the exporter's pipeline steps, plans and reads it."""

    def __init__(self, target: VllmTarget, settings: WhatIfSettings, recommended: float | None):
        self.target = target
        self.label = target.config.label
        self.sim = WhatIf(settings)
        self.recommended = recommended

    def plan(self, d: EngineDerived) -> None:
        rank = engine_rank(d.key)
        cfg = sim_config(d, self.sim.settings, self.recommended)
        if rank is not None and cfg is not None:
            self.sim.configure(rank, cfg)  # applied by the next step

    def policy_points(self, d: EngineDerived) -> tuple[PolicyPoint, ...]:
        rank = engine_rank(d.key)
        assert rank is not None
        es = self.sim.snapshots().get(rank)
        planned = self.sim.planned(rank)
        return policy_points(es, self.target.window, d, planned, self.recommended)

    def whatif_families(self, d: EngineDerived) -> list[Family]:
        """The rendered what-if, planned first as the pipeline does before rendering."""
        self.plan(d)
        rank = engine_rank(d.key)
        es = self.sim.snapshots().get(rank) if rank is not None else None
        state = whatif_state(es, self.target.window, d, self.sim.settings.sizes_bytes)
        return whatif_families(self.label, [(d.key, state, self.policy_points(d))])


async def _replay_exporter(
    config: str, launch: LaunchConfig | None, recommended: float | None
) -> tuple[VllmTarget, _Whatif, EngineDerived]:
    """The recorded 1 s scrapes and KV events through VllmTarget, derive and the what-if."""
    scrapes = _scrapes(config)
    msgs = _events(config)
    now = [0.0]
    server = ReplayServer(replies=[Reply(body=s["body"].encode()) for s in scrapes])
    target = VllmTarget(
        TargetConfig(url=server.url, name=config, kv_bytes_per_token=KV_BYTES_PER_TOKEN),
        window_seconds=300.0,
        timeout=5.0,
        max_body_bytes=1 << 24,
        clock=lambda: now[0],
    )
    source = _Whatif(target, WhatIfSettings(sizes_bytes=(GIB // 4, GIB // 2)), recommended)
    enc = msgspec.msgpack.Encoder()
    fed = 0
    d: EngineDerived | None = None
    with server:
        await target.start()
        try:
            for s in scrapes:
                t = float(s["t"])
                items: list[StreamItem] = []
                while fed < len(msgs) and msgs[fed].batch.ts <= t:
                    m = msgs[fed]
                    payload = enc.encode([m.batch.ts, m.raw[1], m.batch.dp_rank or 0])
                    batch, _ = decode_payload(payload)  # as KvEventsSource decodes it
                    items.append(StreamItem(0, Message(m.topic, m.seq, batch, None)))
                    fed += 1
                source.sim.step(items)  # the config planned last cycle first
                now[0] = t
                await target.collect()
                ds = DeriveSettings(
                    stale_after=3.0, kv_bytes_per_token=KV_BYTES_PER_TOKEN, launch=launch
                )
                d = derive_engine(target.window, E0, t, ds)
                assert d is not None
                source.plan(d)
        finally:
            await target.stop()
    assert d is not None
    return target, source, d


def _policy_ratios(source: _Whatif, d: EngineDerived) -> dict[tuple[str, str], float]:
    fams = {f.definition.name: f for f in source.whatif_families(d)}
    return {
        (labels[3], labels[4]): v for labels, v in fams["kvoffload_whatif_policy_hit_ratio"].samples
    }


def test_exporter_policy_whatif_on_the_real_arc_run() -> None:
    """small-arc replayed through the exporter: its ARC is the configured point and wins.

    With offload on, the GPU event stream already carries the CPU tier's effect (loaded
    blocks re-enter the GPU cache), which the request rebuild follows less exactly than a
    no-offload stream: on these runs the configured-size simulation lands within 0.02 of
    what vLLM observed (0.0725 against 0.0551 for ARC; docs/backends.md has all four).
    """
    launch = launch_config(*recorded_cmd("small-arc"))
    _, source, d = asyncio.run(_replay_exporter("small-arc", launch, None))
    points = source.policy_points(d)
    assert [(p.policy, p.store_threshold) for p in points] == list(POLICY_COMBOS)
    (configured,) = [p for p in points if p.configured]
    assert (configured.policy, configured.store_threshold) == ("arc", 0)
    assert configured.cpu_buffer_bytes == 0.25 * GIB
    assert d.offload_hit_ratio is not None
    assert abs(configured.hit_ratio - d.offload_hit_ratio) <= 0.02
    ratios = _policy_ratios(source, d)
    assert ratios[("arc", "0")] == configured.hit_ratio
    assert ratios[("arc", "0")] > ratios[("lru", "0")] + DEFAULT.whatif_gain_material
    # the configured-size simulation uses the engine's own policy, not --whatif-policy (lru)
    fams = {f.definition.name: f for f in source.whatif_families(d)}
    ((_, conf),) = fams["kvoffload_whatif_configured_hit_ratio"].samples
    assert conf == pytest.approx(configured.hit_ratio)


def test_exporter_policy_whatif_without_offload_at_the_recommended_size() -> None:
    """small-a (offload off) with a recommendation of 0.25 GiB: ARC at 0.25 GiB predicts
    what the real ARC run of the same prompts observed, LRU what the LRU run observed."""
    _, source, d = asyncio.run(_replay_exporter("small-a", None, 0.25 * GIB))
    ratios = _policy_ratios(source, d)
    assert set(ratios) == {(p, str(t)) for p, t in POLICY_COMBOS}
    assert all(not p.configured for p in source.policy_points(d))

    def share(config: str) -> float:
        first, last = gpu_metrics(config, "before", "W1"), gpu_metrics(config, "after", "W2")
        ext = "vllm:prompt_tokens_by_source_total"
        num = raw(last, ext, source="external_kv_transfer") - raw(
            first, ext, source="external_kv_transfer"
        )
        return num / (
            raw(last, "vllm:prompt_tokens_total") - raw(first, "vllm:prompt_tokens_total")
        )

    assert abs(ratios[("arc", "0")] - share("small-arc")) <= 0.01
    assert abs(ratios[("lru", "0")] - share("small-c025")) <= 0.01
    assert ratios[("arc", "0")] > ratios[("lru", "0")] + DEFAULT.whatif_gain_material


# --- the advisor's policy sentence ----------------------------------------------------------


def _inp(points: tuple[PolicyPoint, ...], **over: Any) -> AdvisorInput:
    return AdvisorInput(
        derived=advisor_derived(**over), covered_seconds=600.0, policy_alternatives=points
    )


def test_advisor_names_a_better_policy_without_changing_the_action() -> None:
    size = 0.25 * GIB
    points = (
        PolicyPoint("lru", 0, size, 0.002, configured=True),
        PolicyPoint("arc", 0, size, 0.094),
        PolicyPoint("lru", 2, size, 0.0),
        PolicyPoint("arc", 2, size, 0.01),
    )
    base = _inp((), offload_enabled=True, offload_buffer_bytes=size, offload_hit_ratio=0.002)
    plain = evaluate(base)
    noted = evaluate(
        _inp(points, offload_enabled=True, offload_buffer_bytes=size, offload_hit_ratio=0.002)
    )
    assert noted.action == plain.action and noted.reason == plain.reason
    assert noted.explanation.startswith(plain.explanation)
    assert (
        "serves 9.4% of prompt tokens with eviction_policy arc against 0.2% with the "
        "configured eviction_policy lru" in noted.explanation
    )
    assert '{"eviction_policy": "arc"}' in noted.explanation
    assert noted.numbers["whatif_best_policy_hit_ratio"] == 0.094
    close = tuple(
        PolicyPoint(
            p.policy,
            p.store_threshold,
            size,
            0.002 + (0.01 if p.policy == "arc" else 0),
            p.configured,
        )
        for p in points
    )
    quiet = evaluate(
        _inp(close, offload_enabled=True, offload_buffer_bytes=size, offload_hit_ratio=0.002)
    )
    assert quiet.explanation == plain.explanation  # a gain below whatif_gain_material


def test_advisor_policy_sentence_when_offload_is_recommended() -> None:
    """Offload off: the sentence compares against vLLM's default, only with enable_offload."""
    size = 0.5 * GIB
    points = (
        PolicyPoint("lru", 0, size, 0.10),
        PolicyPoint("arc", 0, size, 0.20),
        PolicyPoint("lru", 2, size, 0.0),
        PolicyPoint("arc", 2, size, 0.0),
    )
    curve = (WhatIfPoint(0.25 * GIB, 0.10), WhatIfPoint(size, 0.17), WhatIfPoint(GIB, 0.18))
    whatif = WhatIfState(curve, recomputed_after_eviction_tokens=70_000.0)
    a = evaluate(AdvisorInput(advisor_derived(), 300.0, whatif=whatif, policy_alternatives=points))
    assert a.action == Action.ENABLE_OFFLOAD
    assert "vLLM's default eviction_policy lru" in a.explanation
    assert '{"eviction_policy": "arc"}' in a.explanation
    # the same points with no pressure: no_action, and no sentence about policies
    calm = advisor_derived(kv_usage=0.3, window={"prompt_tokens": 400_000.0})
    b = evaluate(AdvisorInput(calm, 300.0, policy_alternatives=points))
    assert b.action == Action.NO_ACTION and "eviction_policy" not in b.explanation


# --- the whole exporter on every backend: catalogue, exposition, promtool -------------------


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


def test_synthesized_lmcache_fixture_is_what_its_script_writes() -> None:
    """Regenerated here (prometheus_client only); the vLLM 0.32 ones need .venv-vllm."""
    spec = importlib.util.spec_from_file_location(
        "synthesize_lmcache", SYNTH / "synthesize_lmcache.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for step in ("before", "after"):
        assert module.document(step) == (SYNTH / f"lmcache-v1-tp2.{step}.prom").read_text()


# --- wiring: /proc -> launch config -> derive ------------------------------------------------




def test_dashboard_backend_series_appear_in_the_backend_fixtures() -> None:
    """The conditional vLLM series the dashboards query (exporter/vllm_metrics.py SERIES),
    found where test_dashboards cannot look."""
    import re

    from dashboards.build import vllm_series
    from exporter.vllm_metrics import SERIES

    conditional = {n for n in vllm_series() if SERIES[n].condition}
    assert conditional, "no conditional series: the selection is broken"

    texts = "".join(
        [synth(n, "after") for n in ("vllm-0.32-tiering", "vllm-0.32-simple")]
        + [gpu_metrics(c, "after", "W2") for c in ("small-tier", "small-thr2")]
    )
    for name in conditional:
        assert re.search(re.escape(name) + r"[ {_]", texts), name
