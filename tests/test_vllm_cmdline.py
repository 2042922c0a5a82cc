"""exporter/vllm_cmdline.py: the KV-transfer launch configuration from a vLLM command line
(the recorded H200 commands and every form vLLM accepts)."""

from __future__ import annotations

import json

import pytest

from bench.advice_eval import MATRIX
from bench.common import recording_metas
from exporter.vllm_cmdline import launch_config, parse_environ
from tests.helpers import GIB, recorded_cmd


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


@pytest.mark.parametrize(
    ("flags", "graphs"),
    [
        ([], True),
        (["--enforce-eager"], False),
        (["--enforce_eager"], False),
        (["--enforce-eager=true"], False),
        (["--enforce-eager=false"], True),
        (["--enforce-eager", "--no-enforce-eager"], True),
        (["--no-enforce-eager", "--enforce-eager"], False),
        (["--compilation-config", '{"cudagraph_mode": "NONE"}'], False),
        (["--compilation-config", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'], True),
        (["--compilation-config.cudagraph_mode", "NONE"], False),
        (["-cc", '{"cudagraph_mode": "none"}'], False),
        (["-cc.cudagraph_mode=NONE"], False),
        (["-cc.cudagraph_mode", "PIECEWISE"], True),
        (["--compilation-config", "not json"], True),
    ],
)
def test_cuda_graphs_off_where_the_command_line_says_so(flags: list[str], graphs: bool) -> None:
    assert launch_config(["vllm", "serve", "m", *flags]).cuda_graphs is graphs


def test_the_matrix_recordings_say_eager_or_graphs_as_their_scenarios_do() -> None:
    """Every GPU recording's meta.json: the eager ones carry --enforce-eager, the
    `-graphs-` ones (bench/gpu/scenarios/graphs.json and holdout.json) do not."""
    metas = recording_metas(MATRIX, ())
    assert len(metas) > 100
    for name, meta in metas.items():
        lc = launch_config(meta["vllm_argv"])
        assert lc.cuda_graphs is ("-graphs-" in name), name
