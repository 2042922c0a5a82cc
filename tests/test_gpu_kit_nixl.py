"""Pure parts of the one-GPU NIXL driver (bench/gpu/nixl/run_pd.py, issue 17): the server
commands and environments, the request protocol of vLLM 0.26.0's toy proxy, the recording
format, and the reading of UCX's protocol tables. No vLLM, GPU or NIXL needed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "gpu" / "nixl"))

import run_pd  # noqa: E402

PORTS = run_pd.ports_from([8100, 8200, 5600, 5601, 5557, 5558, 9400])


def test_roles_are_producer_and_consumer_with_fixed_engine_ids():
    v = run_pd.VARIANTS["pull-ipc"]
    p = run_pd.kv_transfer_config(v, "prefill")
    d = run_pd.kv_transfer_config(v, "decode")
    assert p["kv_role"] == "kv_producer" and d["kv_role"] == "kv_consumer"
    assert p["kv_connector"] == d["kv_connector"] == "NixlConnector"
    assert p["engine_id"] != d["engine_id"]
    assert "kv_buffer_device" not in p  # cuda is vLLM's default
    host = run_pd.kv_transfer_config(run_pd.VARIANTS["pull-host"], "decode")
    assert host["kv_buffer_device"] == "cpu"
    assert run_pd.kv_transfer_config(run_pd.VARIANTS["push"], "prefill")["kv_connector"] == (
        "NixlPushConnector"
    )
    with pytest.raises(ValueError):
        run_pd.kv_transfer_config(v, "both")


def test_variants_resolve_and_reject_unknown_names():
    assert [v.name for v in run_pd.resolve_variants("pull-ipc, push,")] == ["pull-ipc", "push"]
    with pytest.raises(ValueError, match="unknown variant"):
        run_pd.resolve_variants("pull-ipc,nvlink")


def test_ports_must_be_distinct():
    assert PORTS.all() == [8100, 8200, 5600, 5601, 5557, 5558, 9400]
    with pytest.raises(ValueError):
        run_pd.ports_from([1, 2, 3, 4, 5, 6, 6])


def test_server_commands_share_the_model_and_differ_in_port_role_and_side_channel():
    shape = run_pd.SHAPES["small"]
    v = run_pd.VARIANTS["pull-ipc"]
    cmds = {
        role: run_pd.server_command(
            shape, v, role, python="python3", model_dir="/m/kvoe-nixl-model-small", ports=PORTS
        )
        for role in ("prefill", "decode")
    }
    for role, cmd in cmds.items():
        # the compatibility hash includes the model path: both engines must name the same one
        assert cmd[cmd.index("--model") + 1] == "/m/kvoe-nixl-model-small"
        assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)
        assert "--enforce-eager" in cmd
        cfg = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert cfg["kv_role"] == ("kv_producer" if role == "prefill" else "kv_consumer")
        events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
        want = PORTS.prefill_events if role == "prefill" else PORTS.decode_events
        assert events["endpoint"] == f"tcp://127.0.0.1:{want}"
    assert cmds["prefill"][cmds["prefill"].index("--port") + 1] == "8100"
    assert cmds["decode"][cmds["decode"].index("--port") + 1] == "8200"
    tiny = run_pd.server_command(
        run_pd.SHAPES["tiny"],
        run_pd.VARIANTS["pull-host"],
        "decode",
        python="p",
        model_dir="/m",
        ports=PORTS,
        kv_events=False,
    )
    assert "--kv-cache-memory-bytes" not in tiny and "--kv-events-config" not in tiny


def test_server_env_sets_the_side_channel_and_only_the_variants_ucx_settings():
    base = {"PATH": "/bin", "UCX_TLS": "rc", "UCX_NET_DEVICES": "mlx5_0:1", "PYTHONPATH": "/x"}
    shape = run_pd.SHAPES["small"]
    envs = {
        role: run_pd.server_env(
            base,
            shape,
            run_pd.VARIANTS["pull-ipc"],
            role,
            pythonpath="/site",
            ports=PORTS,
            cudart_dir="/cudart",
        )
        for role in ("prefill", "decode")
    }
    assert envs["prefill"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert envs["decode"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"  # 5600 for both would clash
    for env in envs.values():
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert env["UCX_TLS"] == "cuda_ipc,cuda_copy,tcp,self"  # sm: no peer failure handler
        assert env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
        assert "UCX_NET_DEVICES" not in env  # inherited UCX settings are dropped
        assert env["PYTHONPATH"] == "/site"
        assert env["LD_LIBRARY_PATH"].startswith("/cudart")
        assert env["NCCL_NVLS_ENABLE"] == "0"  # the device README's multicast rule
    default = run_pd.server_env(
        base, shape, run_pd.VARIANTS["pull-default"], "decode", pythonpath=None, ports=PORTS
    )
    assert "UCX_TLS" not in default and default["UCX_PROTO_INFO"] == "y"


def test_requests_cycle_lengths_with_distinct_prompts():
    reqs = run_pd.plan_requests(8, [512, 1900])
    assert [r.length for r in reqs] == [512, 1900] * 4
    seeds = [s for r in reqs for s in (r.pd_seed, r.baseline_seed)]
    assert len(set(seeds)) == len(seeds)
    a = run_pd.prompt_tokens(reqs[0].pd_seed, 151936, 512)
    assert a == run_pd.prompt_tokens(reqs[0].pd_seed, 151936, 512)
    assert len(a) == 512 and min(a) >= 100 and max(a) < 151936 - 100
    with pytest.raises(ValueError):
        run_pd.plan_requests(1, [])


def test_request_bodies_follow_the_toy_proxy():
    p = run_pd.prefill_body("m", [1, 2, 3])
    assert p["max_tokens"] == 1 and p["stream"] is False
    assert p["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    returned = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_port": 5600}
    d = run_pd.decode_body("m", [1, 2, 3], returned, 4)
    assert d["kv_transfer_params"] == returned and d["kv_transfer_params"] is not returned
    assert d["stream"] is True and d["max_tokens"] == 4
    assert "kv_transfer_params" not in run_pd.decode_body("m", [1], None, 4)
    push = run_pd.push_decode_params(PORTS, "rid-1")
    assert push["do_remote_prefill"] is True and "remote_block_ids" not in push
    assert push["remote_engine_id"] == run_pd.PREFILL_ENGINE_ID
    assert push["remote_port"] == PORTS.prefill_side


EXPOSITION = """# HELP vllm:nixl_xfer_time_seconds Histogram
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} {xfer}
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} {n}
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} {bytes}
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0
"""


def _expo(xfer: float, n: int, nbytes: float) -> str:
    return (
        EXPOSITION.replace("{xfer}", str(xfer))
        .replace("{n}", str(n))
        .replace("{bytes}", str(nbytes))
    )


def test_nixl_delta_gives_bandwidth_per_second_of_transfer_time():
    before = run_pd.nixl_totals(_expo(0.5, 10, 1e9))
    after = run_pd.nixl_totals(_expo(0.75, 14, 3e9))
    d = run_pd.nixl_delta(before, after)
    assert d["transfers"] == 4 and d["bytes"] == 2e9
    assert d["bandwidth_bytes_per_second"] == pytest.approx(8e9)
    assert d["failed_transfers"] == 0
    assert run_pd.nixl_delta(before, before)["bandwidth_bytes_per_second"] is None


def test_metrics_line_is_issue_16s_format():
    rec = json.loads(run_pd.metrics_line(1796138269.53612, "a 1\n"))
    assert rec == {"t": 1796138269.536, "body": "a 1\n"}


def test_recording_meta_keeps_argv_kv_bytes_and_transport_settings():
    shape = run_pd.SHAPES["small"]
    env = {"UCX_TLS": "cuda_ipc", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600", "HOME": "/root"}
    meta = run_pd.recording_meta(
        ["python3", "-m", "x"], env, shape, "decode", run_pd.VARIANTS["pull-ipc"]
    )
    assert meta["vllm_argv"] == ["python3", "-m", "x"]
    assert meta["kv_bytes_per_token"] == 114688
    assert meta["environ"] == {"UCX_TLS": "cuda_ipc", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}


def test_sse_events_stop_at_done_and_skip_noise():
    lines = [
        b": ping\n",
        b'data: {"choices": [{"text": "a"}]}\n',
        b"\n",
        b"data: not json\n",
        b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n',
        b"data: [DONE]\n",
        b'data: {"after": 1}\n',
    ]
    evs = list(run_pd.sse_events(iter(lines)))
    assert evs == [{"choices": [{"text": "a"}]}, {"choices": [], "usage": {"prompt_tokens": 3}}]


def test_summarize_requests_compares_transfer_with_recompute_per_length():
    recs = [
        {"length": 512, "decode_ttft_s": 0.010, "baseline_ttft_s": 0.020, "prefill_s": 0.03},
        {"length": 512, "decode_ttft_s": 0.030, "baseline_ttft_s": 0.040, "prefill_s": 0.05},
        {"length": 1900, "error": "timeout"},
    ]
    s = run_pd.summarize_requests(recs)
    assert s["ok"] == 2 and s["failed"] == 1
    row = s["by_length"]["512"]
    assert row["decode_ttft_pd_s"] == pytest.approx(0.02)
    assert row["decode_ttft_recompute_s"] == pytest.approx(0.03)
    assert row["transfer_vs_recompute"] == pytest.approx(1.5)
    assert s["by_length"]["1900"]["n"] == 0
    assert run_pd.median([]) is None


# UCX_PROTO_INFO=y output, as UCX 1.23 (nixl-cu13 1.5.1) printed it in the CPU smoke run, and a
# GPU table of the form vllm#52607 reports for the TCP fallback of a GET.
_TS = "[1796138271.085028] [vm:1497 :0]   "
_RULE = "+--------+-------------+------------------------------+"
UCX_LOG = [
    _TS + _RULE,
    _TS + "| 0f8435b8-6da5-4999-9efc-4299dc5 intra-node cfg#1 |",
    _TS + "| remote memory read by ucp_get*(multi) into host memory from host |",
    _TS + _RULE,
    _TS + "| Range  | Description |                  Config      |",
    _TS + _RULE,
    _TS + "| 0..inf | zero-copy   | cma/memory                   |",
    _TS + _RULE,
    _TS + "| active message by ucp_am_send*(egr) from host memory |",
    _TS + "|          0 | short              | tcp/lo             |",
    _TS + "| remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/GPU0 |",
    _TS + "| Range  | Description |                  Config      |",
    _TS + "| 0..8K  | software emulation | tcp/lo                |",
    _TS + "| 8K..inf | software emulation | tcp/lo               |",
    _TS + "cuda_ipc_iface.c:253  UCX  DEBUG cuda-ipc get zcopy disabled as no nvlinks detected",
    "(Worker pid=1497) INFO [base_worker.py:1093] NIXL compatibility check passed (hash: a3)",
]


def test_ucx_paths_reads_the_transport_of_remote_reads_and_writes():
    out = run_pd.ucx_paths(UCX_LOG)
    assert out["transports"]["read"] == ["cma/memory", "tcp/lo"]
    assert out["transports"]["write"] == []
    gpu = "remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/GPU0"
    assert out["tables"][gpu] == [
        ["0..8K", "software emulation", "tcp/lo"],
        ["8K..inf", "software emulation", "tcp/lo"],
    ]
    assert any("get zcopy disabled" in n for n in out["notes"])
    assert any("NIXL compatibility check passed" in n for n in out["notes"])
    # the active-message table is not a remote read or write
    assert all("active message" not in t for t in out["tables"])


def test_dry_run_prints_both_servers_per_variant(capsys):
    rc = run_pd.main(["run", "--dry-run", "--variants", "pull-ipc,pull-host", "--no-exporter"])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.count("vllm.entrypoints.openai.api_server") == 4
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in text
    assert '"kv_buffer_device":"cpu"' in text
    assert "do_remote_decode" in text
