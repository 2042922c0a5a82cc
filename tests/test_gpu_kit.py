"""The GPU acceptance kit (bench/gpu/) without vLLM or a GPU, so it cannot rot before the lead
spends device time on it: configurations, time-budget planning, exporter flag selection, the
KV-event recorder on the recorded CPU stream, NVML accumulation, packing and fixture conversion."""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import lzma
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import msgspec
import pytest
import zmq

REPO = Path(__file__).resolve().parent.parent
KIT = REPO / "bench" / "gpu"
sys.path.insert(0, str(KIT))

import acceptance  # noqa: E402
import gpukit as kit  # noqa: E402
import to_fixtures  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures"
CPU_EVENTS = FIXTURES / "vllm-0.32.0-cpu" / "kv-events.jsonl"
H200 = FIXTURES / "vllm-0.26.0-h200"
DRIVER = [sys.executable, str(KIT / "acceptance.py")]


def free_port() -> int:
    return acceptance.free_port()


# --- shapes and configurations -----------------------------------------------------------------


def test_the_cpu_smoke_shape_is_the_test_suites_tiny_model() -> None:
    """The kit runs as a standalone script on the device, so it keeps its own copy."""
    from testbed.vllm_cpu import BLOCK_SIZE, MODEL_NAME, TINY_MODEL

    assert kit.TINY_LLAMA == TINY_MODEL
    assert (kit.SHAPES["tiny"].served_name, kit.SHAPES["tiny"].block_size) == (
        MODEL_NAME,
        BLOCK_SIZE,
    )


def test_shapes_match_the_published_and_the_large_model() -> None:
    small, large = kit.SHAPES["small"], kit.SHAPES["large"]
    assert small.kv_bytes_per_token == 114_688  # fixtures/vllm-0.26.0-h200 README
    assert small.kv_bytes_per_block == 1_835_008  # 1.75 MiB per 16-token block
    assert small.gpu_blocks == 146  # 2336 tokens, as vLLM reported
    assert round(kit.param_count(small.model) / 1e9, 2) == 0.6
    assert large.kv_bytes_per_token == 262_144
    assert large.gpu_blocks == small.gpu_blocks  # same ratio to the 1600-token prompts
    assert 60e9 < large.weight_bytes < 70e9  # ~64 GB of bf16 weights
    assert large.weight_bytes + large.kv_cache_bytes + 8e9 < 141e9  # fits one H200
    cfg = json.loads(kit.model_config_json(large))
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (
        5120,
        64,
        64,
    )
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (8, 128, 151936)


def test_cpu_pools_keep_the_same_blocks_across_shapes() -> None:
    c = kit.CONFIGS
    assert c["small-b"].cpu_blocks == 292  # the first H200 run's CPU pool for 0.5 GiB
    assert c["small-c025"].cpu_blocks == 146
    assert c["small-c1"].cpu_blocks == 585
    for suffix in ("b", "c025", "c1"):
        assert c[f"large-{suffix}"].cpu_blocks == c[f"small-{suffix}"].cpu_blocks
    assert c["small-a"].cpu_blocks == 0
    with pytest.raises(ValueError, match="unknown"):
        kit.resolve_configs("small-a,nope")


def test_server_command_is_the_recipe() -> None:
    cmd = kit.server_command(
        kit.CONFIGS["small-b"],
        python="python3",
        model_dir="/m",
        port=8000,
        kv_endpoint="tcp://127.0.0.1:5557",
        replay_endpoint="tcp://127.0.0.1:5558",
    )
    text = " ".join(cmd)
    for part in (
        "-m vllm.entrypoints.openai.api_server --model /m --served-model-name qwen3-dummy",
        "--load-format dummy --skip-tokenizer-init --kv-cache-memory-bytes 268435456",
        "--max-model-len 2048 --enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--host 127.0.0.1",
        "--enforce-eager",
        "--kv-offloading-size 0.5 --kv-offloading-backend native",
    ):
        assert part in text
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://127.0.0.1:5557"  # vLLM connects, the recorder binds
    assert events["enable_kv_cache_events"] is True
    assert events["replay_endpoint"] == "tcp://127.0.0.1:5558"
    a = kit.server_command(
        kit.CONFIGS["small-a"], python="p", model_dir="/m", port=1, kv_endpoint="tcp://x:1"
    )
    assert "--kv-offloading-size" not in a
    large = kit.server_command(
        kit.CONFIGS["large-c1"], python="p", model_dir="/m", port=1, kv_endpoint="tcp://x:1"
    )
    assert large[large.index("--kv-cache-memory-bytes") + 1] == str(kit.LARGE_KV_BYTES)
    assert large[large.index("--kv-offloading-size") + 1] == "2.28571"
    tiny = kit.server_command(
        kit.CONFIGS["tiny-a"], python="p", model_dir="/m", port=1, kv_endpoint="tcp://x:1"
    )
    assert "--gpu-memory-utilization" not in tiny and "--num-gpu-blocks-override" in tiny
    assert "--enforce-eager" not in tiny


def test_server_env() -> None:
    env = kit.server_env({"PATH": "/bin", "PYTHONPATH": "/x"}, kit.SHAPES["small"], "/site")
    assert env["PYTHONHASHSEED"] == "0"  # the same block hashes in every run
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["PYTHONPATH"] == "/site"
    cpu = kit.server_env({}, kit.SHAPES["tiny"], None)
    assert "PYTHONPATH" not in cpu and cpu["VLLM_CPU_KVCACHE_SPACE"] == "1"


# --- workloads --------------------------------------------------------------------------------


def test_w1_is_the_published_pattern_and_deterministic() -> None:
    w = kit.workload_w1(151936)
    assert [r.name for r in w.requests[:5]] == [
        "A_cold",
        "A_gpu_hit",
        "B",
        "C",
        "A_after_evict",
    ]
    assert len(w.requests) == 25 and len(w.docs) == 15
    assert {len(d) for d in w.docs.values()} == {1600}
    assert all(100 <= t < 151936 - 100 for d in w.docs.values() for t in d)
    assert w.requests[0].doc == w.requests[1].doc == w.requests[4].doc
    assert kit.workload_w1(151936).docs == w.docs  # every server sees the same token ids


def test_w2_exceeds_the_largest_buffer_and_shuffles_rounds() -> None:
    for shape_name in ("small", "large"):
        shape = kit.SHAPES[shape_name]
        largest = kit.largest_cpu_blocks(shape)
        assert largest == 585
        w1, w2 = kit.workloads_for(shape, largest)
        per_doc = 1600 // shape.block_size
        assert len(w2.docs) * per_doc > largest + shape.gpu_blocks
        rounds = [[r.doc for r in w2.requests if r.batch == b] for b in range(4)]
        assert all(sorted(r) == sorted(w2.docs) for r in rounds)
        assert rounds[1] != rounds[2]  # not a fixed cycle (LRU would never hit)
        assert not set(w1.docs) & set(w2.docs)
        assert not {tuple(d) for d in w1.docs.values()} & {tuple(d) for d in w2.docs.values()}


# --- time-budget planning ------------------------------------------------------------------------


def test_plan_groups_by_memory_and_budget() -> None:
    cfgs = kit.resolve_configs("small-a,small-b,small-c025,small-c1,large-a")
    plan = kit.plan_groups(cfgs, 540)
    assert [g.configs for g in plan.groups] == [
        ("small-a", "small-b", "small-c025", "small-c1", "large-a")
    ]
    large = kit.resolve_configs("large-b,large-c1,large-c025")
    plan = kit.plan_groups(large, 560)
    assert all(len(g.configs) == 1 for g in plan.groups)  # two large ones do not fit the GPU
    assert plan.skipped == ("large-c025",)
    assert plan.est_total_s <= 560 - 30
    fast = kit.plan_groups(large, 560, estimates={"large": {"est_start_s": 60, "est_work_s": 60}})
    assert not fast.skipped
    assert kit.plan_groups(cfgs, 60).groups == ()
    assert len(kit.plan_groups(cfgs, 900, max_group=2).groups) == 3


# --- exporter flags ------------------------------------------------------------------------------

HELP = """usage: kv-offload-exporter [-h] [--vllm-url URL] [--nvml-poll-interval SECONDS]
  --kv-events-endpoint ENDPOINT
  --kv-events-replay-endpoint ENDPOINT
  --record-events FILE  append every message
  --vllm-pid PID        pid of the vLLM API server
  --threshold NAME=VALUE
  --whatif-sizes SIZES
"""


def test_exporter_flags_only_those_offered() -> None:
    flags = kit.parse_help_flags(HELP)
    assert flags["--nvml-poll-interval"] == "SECONDS"
    ctx = {
        "kv_forward": "tcp://127.0.0.1:1",
        "kv_replay": "tcp://127.0.0.1:2",
        "events_file": "/e.jsonl",
        "vllm_pid": 42,
        "nvml_interval_s": 0.01,
        "sizes": [1, 2],
        "kv_bytes_per_block": 7,
        "min_window_s": 15,
    }
    groups, used, missing = kit.choose_exporter_flags(flags, kit.exporter_wishes(ctx))
    assert ["--kv-events-endpoint", "tcp://127.0.0.1:1"] in groups
    assert ["--nvml-poll-interval", "0.01"] in groups
    assert ["--threshold", "min_window_seconds=15"] in groups
    assert ["--whatif-sizes", "1,2"] in groups
    assert missing == ["kv_bytes_per_block"]
    assert used["vllm_pid"] == "--vllm-pid"
    ms = kit.choose_exporter_flags(
        {"--nvml-interval": "MS"}, kit.exporter_wishes({"nvml_interval_s": 0.01})
    )
    assert ms[0] == [["--nvml-interval", "10"]]
    assert kit.flags_named_in("error: --whatif-sizes: bad", ["--whatif-sizes", "1"]) == [
        "--whatif-sizes"
    ]


def test_exporter_flags_of_the_real_exporter() -> None:
    """The installed exporter's --help parses and every chosen flag is one it offers."""
    info = acceptance.probe_exporter(sys.executable)
    assert not info.error, info.error
    assert "--vllm-url" in info.flags and "--listen" in info.flags
    groups, _, _ = kit.choose_exporter_flags(
        info.flags, kit.exporter_wishes({"vllm_pid": 1, "kv_forward": "tcp://127.0.0.1:1"})
    )
    assert all(g[0] in info.flags for g in groups)


# --- KV events: the recorder's decoding on the recorded CPU stream ------------------------------


def _frames_of(rec: dict) -> list[bytes]:
    payload = msgspec.msgpack.encode(rec["payload"])
    return [rec["topic"].encode(), int(rec["seq"]).to_bytes(8, "big"), payload]


def test_decode_round_trips_the_cpu_fixture() -> None:
    lines = [json.loads(ln) for ln in CPU_EVENTS.read_text().splitlines()]
    for rec in lines:
        assert kit.decode_kv_message(_frames_of(rec)) == rec
    counts = kit.event_counts(lines)
    assert counts["messages"] == 20 and counts["gaps"] == 0
    assert counts["BlockStored/GPU:blocks"] == 240  # README: 240 full blocks
    assert counts["BlockRemoved/GPU:blocks"] == 222


def test_decode_bad_and_bytes_payloads() -> None:
    bad = kit.decode_kv_message([b"kv", b"\x00" * 7 + b"\x05", b"\xc1garbage"])
    assert bad["seq"] == 5 and "error" in bad and bad["payload_b64"]
    raw = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [b"\x01\x02"]}], 0]
    )
    rec = kit.decode_kv_message([b"kv", (7).to_bytes(8, "big"), raw])
    assert rec["payload"][1][0]["block_hashes"] == [{"bytes_hex": "0102"}]
    json.dumps(rec)  # always JSON-serialisable
    legacy = kit.event_counts([{"seq": 0, "payload": [1.0, [["BlockStored", [1, 2]]], 0]}])
    assert legacy["BlockStored/-:blocks"] == 2


def test_recorder_process_records_and_forwards(tmp_path: Path) -> None:
    """vLLM's PUB connects to the recorder's SUB; the exporter's SUB connects to the forward."""
    bind, fwd = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    out = tmp_path / "kv.jsonl"
    child = subprocess.Popen(
        [*DRIVER, "record-kv", "--bind", bind, "--forward", fwd, "--out", str(out)],
        start_new_session=True,
    )
    ctx = zmq.Context()
    try:
        deadline = time.monotonic() + 20
        while not Path(str(out) + ".ready").exists():
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.05)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(fwd)
        pub = ctx.socket(zmq.PUB)
        pub.connect(bind)
        # Until a warm-up message makes it through both hops, PUB may drop (no subscriber yet).
        warm = [b"warmup", (0).to_bytes(8, "big"), msgspec.msgpack.encode([0.0, [], 0])]
        deadline = time.monotonic() + 20
        while True:
            assert time.monotonic() < deadline
            pub.send_multipart(warm)
            if sub.poll(100):
                break
        lines = [json.loads(ln) for ln in CPU_EVENTS.read_text().splitlines()]
        for rec in lines:
            pub.send_multipart(_frames_of(rec))
        got = []
        while len(got) < len(lines) and sub.poll(5000):
            frames = sub.recv_multipart()
            if frames[0] != b"warmup":
                got.append(frames)
        assert [int.from_bytes(f[1], "big") for f in got] == [r["seq"] for r in lines]
        time.sleep(0.3)
    finally:
        child.send_signal(signal.SIGTERM)
        child.wait(15)
        ctx.destroy(linger=0)
    recorded = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r for r in recorded if r["topic"] != "warmup"] == lines
    stats = json.loads(Path(str(out) + ".stats.json").read_text())
    assert stats["messages"] == 20 + sum(r["topic"] == "warmup" for r in recorded)
    assert stats["decode_errors"] == 0


# --- results: expositions, latencies, NVML --------------------------------------------------


def test_exposition_values_and_deltas_on_the_h200_fixture() -> None:
    after = (H200 / "b_offload" / "metrics_after.txt").read_text()
    before = (H200 / "b_offload" / "metrics_before.txt").read_text()
    v = kit.exposition_values(after, kit.OFFLOAD_SERIES)
    assert v["vllm:kv_offload_store_bytes_total"] == pytest.approx(2.826e9, rel=1e-3)
    assert v["vllm:kv_offload_load_bytes_total"] == pytest.approx(0.844e9, rel=1e-3)
    d = acceptance.metric_deltas(before, after)
    assert d["prompt_tokens_by_source:external_kv_transfer"] == 7360
    assert d["prompt_tokens_by_source:local_cache_hit"] == 7920


def test_latency_medians() -> None:
    recs = [
        {"workload": "W1", "batch": b, "req": "A_cold", "ms": ms, "status": 200}
        for b, ms in enumerate([30.0, 40.0, 35.0])
    ]
    recs += [
        {"workload": "W2", "batch": 0, "req": "d00", "ms": 50.0, "status": 200},
        {"workload": "W2", "batch": 1, "req": "d00", "ms": 20.0, "status": 200},
        {"workload": "W2", "batch": 1, "req": "d01", "ms": None, "status": None},
    ]
    assert kit.latency_medians(recs) == {
        "W1": {"A_cold": 35.0},
        "W2": {"cold": 50.0, "reuse": 20.0},
    }


def test_pcie_accumulation_on_the_h200_fixture() -> None:
    lines = (H200 / "b_offload" / "nvml_fast.csv").read_text().splitlines()
    rows = kit.read_nvml_csv(lines)
    tx, rx = kit.accumulate_pcie(rows, rows[0].t, rows[-1].t)
    assert tx == pytest.approx(3.18e9, rel=0.01)  # fixture README: TX 3.18e9, RX 0.95e9
    assert rx == pytest.approx(0.95e9, rel=0.01)
    lat = json.loads((H200 / "b_offload" / "latency.json").read_text())
    r = lat[4]  # A after eviction: the reload
    got = kit.accumulate_pcie(rows, r["t_start"] - 0.005, r["t_end"] + 0.02)
    assert got is not None and got[1] > 150e6
    mid = rows[len(rows) // 2].t
    thin = kit.thin_nvml(rows, [(mid, mid + 0.5)])
    assert len(thin) < len(rows)
    assert kit.accumulate_pcie(thin, mid - 0.9, mid + 1.4) == kit.accumulate_pcie(
        rows, thin[0].t if thin[0].t >= mid - 0.9 else mid - 0.9, mid + 1.4
    )


def test_pcie_wraps_and_per_field_errors() -> None:
    rows = [
        kit.NvmlRow(0.00, 2**32 - 100, 0, 0, 0),
        kit.NvmlRow(0.01, 50, 10, 0, 0),  # wrapped: +150
        kit.NvmlRow(0.02, 0, 0, 3, 3),  # per-field error: skipped
        kit.NvmlRow(0.03, 250, 30, 0, 0),
    ]
    assert kit.accumulate_pcie(rows, 0, 1) == (350, 30)
    assert kit.accumulate_pcie(rows[:1], 0, 1) is None
    assert kit.max_gap_s(rows, 0, 1) == pytest.approx(0.01)
    assert kit.read_nvml_csv(kit.nvml_csv(rows).splitlines()) == rows


def test_fake_nvml_poller(tmp_path: Path) -> None:
    out = tmp_path / "n.csv"
    r = subprocess.run(
        [
            *DRIVER,
            "poll-nvml",
            "--fake",
            *("--out", str(out), "--out-thr", str(tmp_path / "t.csv")),
            *("--interval", "0.01", "--max-seconds", "1.5"),
        ],
        timeout=30,
        check=True,
    )
    assert r.returncode == 0
    rows = kit.read_nvml_csv(out.read_text().splitlines())
    assert len(rows) > 50
    tx, _ = kit.accumulate_pcie(rows, 0, 1e12)
    assert tx == pytest.approx(1.5e9 * (rows[-1].t - rows[0].t), rel=0.05)  # across wraps
    assert json.loads((tmp_path / "n.csv.status.json").read_text())["ok"] is True


# --- packing and fixture conversion ----------------------------------------------------------


def test_thin_samples_keeps_consecutive_seconds_around_windows() -> None:
    samples = [{"t": float(t)} for t in range(100)]
    kept = kit.thin_samples(samples, [(40.0, 45.0)], margin_s=5)
    assert [s["t"] for s in kept] == [0.0, *[float(t) for t in range(35, 51)], 99.0]
    idle = kit.thin_samples(samples, [(40.0, 45.0)], margin_s=0, idle_every_s=30)
    assert {0.0, 30.0, 60.0, 90.0, 99.0} <= {s["t"] for s in idle}


def test_iter_jsonl_formats_and_torn_lines(tmp_path: Path) -> None:
    body = '{"a": 1}\n{"a": 2}\n{"a": 3'
    (tmp_path / "p.jsonl").write_text(body)
    with gzip.open(tmp_path / "p.jsonl.gz", "wt") as fh:
        fh.write(body)
    with lzma.open(tmp_path / "p.jsonl.xz", "wt") as fh:
        fh.write(body)
    for name in ("p.jsonl", "p.jsonl.gz", "p.jsonl.xz"):
        assert list(kit.iter_jsonl(tmp_path / name)) == [{"a": 1}, {"a": 2}]


def _fake_run(work: Path, name: str) -> Path:
    """A config folder as the driver leaves it, from the CPU fixture's events."""
    d = work / name
    (d / "scrape").mkdir(parents=True)
    (d / "proc").mkdir()
    (d / "sys").mkdir()
    lines = CPU_EVENTS.read_text().splitlines()
    (d / "kv_events.jsonl").write_text("\n".join(lines) + "\n")
    (d / "exporter_kv_events.jsonl").write_text("\n".join(lines) + "\n")
    t0 = json.loads(lines[0])["payload"][0]
    t1 = json.loads(lines[-1])["payload"][0]
    run = {"config": name, "windows": {"W1": [t0, t1]}}
    (d / "run.json").write_text(json.dumps(run))
    (d / "cmd.txt").write_text(
        f"python3 -m vllm.entrypoints.openai.api_server --model {work}/models/tiny\n"
    )
    (d / "latency.json").write_text("[]\n")
    (d / "advice_W1.json").write_text('{"advice": []}')
    (d / "metrics_before_W1.txt").write_text(
        (H200 / "b_offload" / "metrics_before.txt").read_text()
    )
    body = (H200 / "b_offload" / "metrics_after.txt").read_text()
    with (d / "scrape" / "vllm_metrics.jsonl").open("w") as fh:
        for k in range(-30, int(t1 - t0) + 30):
            fh.write(json.dumps({"t": t0 + k, "status": 200, "body": body}) + "\n")
    rows = [kit.NvmlRow(t0 - 20 + i * 0.01, i * 1000 % 2**32, i, 0, 0) for i in range(8000)]
    (d / "nvml_fast.csv").write_text(kit.nvml_csv(rows))
    (d / "proc" / "ready_engine_status.txt").write_text("VmRSS: 1 kB\n")
    (d / "server.log").write_text("\n".join(f"INFO line {i}" for i in range(1000)) + "\nERROR x\n")
    return d


def test_pack_and_to_fixtures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    d = _fake_run(tmp_path / "work", "tiny-a")
    size = kit.pack_dir(d, out / "tiny-a.tar.xz")
    assert 0 < size < kit.OUT_FILE_LIMIT
    with tarfile.open(out / "tiny-a.tar.xz") as tar:
        assert "tiny-a/run.json" in tar.getnames()
    env = tmp_path / "work" / "env"
    env.mkdir()
    (env / "environment.json").write_text("{}")
    kit.pack_dir(env, out / "env.tar.xz")
    (out / "summary.json").write_text(
        json.dumps({"configs": {"tiny-a": {"config": "tiny-a", "server_log_tail": "x"}}})
    )
    dest = tmp_path / "fixtures"
    assert to_fixtures.main([str(out), "--dest", str(dest)]) == 0
    fx = dest / "tiny-a"
    assert (fx / "run.json").exists() and (fx / "latency.json").exists()
    with gzip.open(fx / "kv_events.jsonl.gz", "rt") as fh:
        assert fh.read().splitlines() == CPU_EVENTS.read_text().splitlines()
    assert "<work>" in (fx / "cmd.txt").read_text()
    samples = list(kit.iter_jsonl(fx / "vllm_metrics.jsonl.xz"))
    ts = [s["t"] for s in samples]
    assert len(ts) < 60 + int(ts[-1] - ts[0])  # thinned
    inner = ts[1:-1]
    assert all(b - a == pytest.approx(1.0) for a, b in itertools.pairwise(inner))
    with gzip.open(fx / "nvml_fast.csv.gz", "rt") as fh:
        nv = kit.read_nvml_csv(fh.read().splitlines())
    assert 0 < len(nv) < 8000
    index = json.loads((dest / "INDEX.json").read_text())
    assert index["configs"]["tiny-a"]["exporter_events_identical"] is True
    assert (dest / "env" / "0" / "environment.json").exists()
    summary = json.loads((dest / "summary.json").read_text())
    assert "server_log_tail" not in summary["configs"]["tiny-a"]
    assert "ERROR x" in (fx / "server_log_excerpt.txt").read_text()
    assert index["total_bytes"] < to_fixtures.TARGET_BYTES


# --- driver helpers ---------------------------------------------------------------------------


def test_whatif_blocks_and_sizes() -> None:
    small = kit.SHAPES["small"]
    blocks = acceptance.whatif_blocks(small)
    assert {146, 292, 585} <= set(blocks) and 0 not in blocks
    sizes = acceptance.whatif_sizes(kit.SHAPES["large"])
    assert int(kit.CONFIGS["large-b"].offload_gib * kit.GIB) in sizes


def test_advice_parsing() -> None:
    doc = {"advice": [{"target": "t", "action": "keep", "numbers": {}, "reason": "r"}]}
    body = json.dumps(doc).encode()
    assert acceptance._advice_actions(body) == ["keep"]
    assert acceptance._advice_summary(body.decode()) == [
        {"target": "t", "action": "keep", "reason": "r"}
    ]
    assert acceptance._advice_actions(b"not json") == []


def test_children_stop_the_whole_group_and_sweep(tmp_path: Path) -> None:
    kids = acceptance.Children(tmp_path / "pids")
    child = kids.start("sleeper", ["sh", "-c", "sleep 60 & sleep 60"], tmp_path / "s.log")
    time.sleep(0.3)
    inner = acceptance.descendants(child.proc.pid)
    assert inner
    kids.stop(child, timeout=5)
    time.sleep(0.2)
    for pid in inner:
        with contextlib.suppress(FileNotFoundError):
            assert "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert not list((tmp_path / "pids").glob("*.pid"))
    # A leftover from a killed run (its pid file survives) is ended by the next run's sweep.
    left = subprocess.Popen(["sleep", "60"], start_new_session=True)
    (tmp_path / "pids" / "old.pid").write_text(f"{left.pid} sleep\n")
    acceptance.Children(tmp_path / "pids").sweep_leftovers()
    assert left.wait(30) is not None


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"vllm:x 1\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_scraper_process(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        subprocess.run(
            [
                *DRIVER,
                "scrape",
                *("--target", f"m={url}", "--outdir", str(tmp_path)),
                *("--interval", "0.5", "--max-seconds", "2.2"),
            ],
            timeout=30,
            check=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        server.shutdown()
    samples = list(kit.iter_jsonl(tmp_path / "m.jsonl"))
    assert len(samples) >= 3
    assert all(s["status"] == 200 and s["body"] == "vllm:x 1\n" for s in samples)
    # On one clock: every gap a whole number of 0.5 s slots (a slot is skipped when behind).
    for a, b in itertools.pairwise(samples):
        gap = b["t"] - a["t"]
        assert round(gap / 0.5) >= 1 and abs(gap - 0.5 * round(gap / 0.5)) < 0.2


def test_derived_numbers_on_the_h200_fixture() -> None:
    before = (H200 / "b_offload" / "metrics_before.txt").read_text()
    after = (H200 / "b_offload" / "metrics_after.txt").read_text()
    res = {
        "vllm_deltas": {"W1": acceptance.metric_deltas(before, after)},
        "pcie": {"W1": {"tx_bytes": 3.18e9, "rx_bytes": 0.95e9}},
        "proc": [
            {
                "engine_pinned_mappings": {"mappings": 28, "size_kb": 28 * 32 * 1024, "rss_kb": 1},
                "RssShmem": "950532 kB",
            }
        ],
    }
    d = acceptance.derived_numbers(kit.CONFIGS["small-b"], res)
    assert d["W1"]["external_hit_ratio"] == pytest.approx(7360 / 32080)
    assert d["W1"]["load_bytes_per_s"] == pytest.approx(0.844e9 / 0.0248, rel=0.01)  # ~34 GB/s
    assert d["W1"]["vllm_store_bytes"] == pytest.approx(2.826e9, rel=1e-3)
    assert d["pinned"]["ratio"] == pytest.approx(1.75)  # 896 MiB for 0.5 GiB
    assert "small-b" in acceptance.phase_table({"configs": {"small-b": {"phases_s": {}}}})


# --- the real-GPU matrix (issue 16 section 2): scenarios as data, generators, truth ----------

import matrix  # noqa: E402
import matrixkit as mk  # noqa: E402

SCENARIOS = mk.load_scenarios()


def test_matrix_scenarios_are_data() -> None:
    """3 shapes x 5 workloads x {none, 2 buffers}, every one resolvable without code, and
    the held-out shape's 2 workloads x {none, 2 buffers} (holdout.json); holdout.json's second
    batch (29, staged in session 32): the bursts on 1.7B, 4B and 14B x {none, 1 buffer}, and
    its third (30, staged in session 33): 4B and 14B at the 16 GiB their advice named."""
    shapes = {s.shape.name for s in SCENARIOS.values()}
    workloads = {s.workload.name for s in SCENARIOS.values()}
    assert shapes == {"qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"}
    assert {"rag-zipf", "chat", "unique", "long-context", "concurrent"} <= workloads
    # With CUDA graphs, each beside its eager twin (batches 39 and 41's decoding bursts apart,
    # below).
    graphs = [
        n
        for n in SCENARIOS
        if "-graphs-" in n and not SCENARIOS[n].workload.name.startswith("bursts-decode")
    ]
    idle = [n for n in SCENARIOS if "-unique-idle-" in n]
    # stores.json (batch 23, staged in session 28): 14B on the unique prompts, at the
    # matrix's rate and at idle.json's.
    stores = [n for n in SCENARIOS if n.startswith("qwen3-14b-unique-")]
    matrix = [
        n
        for n in SCENARIOS
        if n.rsplit("-", 1)[1] in ("none", "cpu64k", "cpu192k")
        and n not in graphs + idle + stores
        and not SCENARIOS[n].workload.name.startswith("bursts-decode")
    ]
    held_out = [n for n in matrix if SCENARIOS[n].shape.name == "qwen3-14b"]
    bursts = [n for n in matrix if SCENARIOS[n].shape.name in ("qwen3-1.7b", "qwen3-4b")]
    assert len(matrix) == 45 + 6 + 6 and len(held_out) == 6 + 2 and len(bursts) == 4
    assert all(SCENARIOS[n].step_log for n in bursts)
    # graphs.json: the same workloads as vLLM serves by default (CUDA graphs), its own pair
    # family, so that its runs are never compared with the matrix's eager ones.
    # Session 22: six recorded; session 23: two closing their loop and 32B chat's pair;
    # session 24 its 32 GiB loop; session 27 8B and 0.6B unique (batch 21, what hides a store).
    # steps.json (batch 28, staged in session 31): the 8B bursts with graphs, step-logged.
    # holdout.json's batch 33 (staged in session 35, recorded in session 36, each server
    # alone): 4B's bursts with graphs, the 16 GiB pair
    # twice, interleaved, step-logged: whether the cost batches 31 and 32 found in every eager
    # step with the tier on is the CPU's. Its batch 35 (staged in session 37): the 8B bursts
    # with graphs, the same way, each server alone: whether two runs of the same work that
    # repeat also predict alike (bench.fit_repeat).
    # Batch 40 (staged in session 46, `-host`): the 8B one-token bursts with graphs again
    # beside the decoding ones on one host.
    host8 = [n for n in graphs if n.endswith("-host")]
    assert host8 == [
        "qwen3-8b-concurrent-graphs-none-host",
        "qwen3-8b-concurrent-graphs-cpu16g-host",
    ]
    assert len(graphs) == 18 + 4 + 4 + 2
    alone8 = [n for n in graphs if n.startswith("qwen3-8b-") and re.search(r"-alone2?$", n)]
    first8 = SCENARIOS["qwen3-8b-concurrent-graphs-cpu16g"]
    assert alone8 == [
        "qwen3-8b-concurrent-graphs-none-alone",
        "qwen3-8b-concurrent-graphs-cpu16g-alone",
        "qwen3-8b-concurrent-graphs-none-alone2",
        "qwen3-8b-concurrent-graphs-cpu16g-alone2",
    ]
    assert set(alone8) <= set(mk.load_scenarios(files=("holdout.json",)))
    for n in alone8:
        sc = SCENARIOS[n]
        assert sc.step_log and (sc.vllm_args, sc.pair) == (first8.vllm_args, first8.pair)
        assert (sc.workload, sc.shape) == (first8.workload, first8.shape)
        assert sc.offload in (None, first8.offload)
    four = [n for n in graphs if n.startswith("qwen3-4b-")]
    assert four == [
        "qwen3-4b-concurrent-graphs-none",
        "qwen3-4b-concurrent-graphs-cpu16g",
        "qwen3-4b-concurrent-graphs-none-rep",
        "qwen3-4b-concurrent-graphs-cpu16g-rep",
    ]
    assert set(four) <= set(mk.load_scenarios(files=("holdout.json",)))
    eager = SCENARIOS["qwen3-4b-concurrent-cpu16g"]
    for n in four:
        sc = SCENARIOS[n]
        assert sc.step_log and sc.vllm_args == () and sc.pair == "qwen3-4b-concurrent"
        assert sc.workload == eager.workload and sc.shape == eager.shape
        assert sc.offload in (None, eager.offload)
    # idle.json (batch 22), stores.json's idle pair (batch 23) and machine.json's (batch 24,
    # 8B on batch 23's H100 host): unique prompts at a quarter of the rate, each its own pair
    # family, so that an engine's load is told from its shape.
    assert sorted(idle) == [
        "qwen3-14b-unique-idle-cpu64k",
        "qwen3-14b-unique-idle-none",
        "qwen3-32b-unique-idle-cpu64k",
        "qwen3-32b-unique-idle-none",
        "qwen3-8b-unique-idle-cpu64k",
        "qwen3-8b-unique-idle-none",
    ]
    assert sorted(set(stores) - set(idle)) == ["qwen3-14b-unique-cpu64k", "qwen3-14b-unique-none"]
    assert (
        SCENARIOS["qwen3-14b-unique-none"].workload == SCENARIOS["qwen3-32b-unique-none"].workload
    )
    # machine.json's batch 25: batch 21's 8B pair again, for whichever host runs it.
    for n in ("qwen3-8b-unique-none", "qwen3-8b-unique-cpu64k"):
        sc, rep = SCENARIOS[n], SCENARIOS[n + "-rep"]
        assert (rep.workload, rep.vllm_args, rep.offload, rep.pair) == (
            sc.workload,
            sc.vllm_args,
            sc.offload,
            sc.pair,
        )
    # controls.json's batches 26 and 27: the eager 8B bursts' 16 GiB pair and the eager 0.6B
    # bursts' 7 GiB pair again, each on one host.
    for rep_name, none_rep, first in (
        (
            "qwen3-8b-concurrent-cpu16g-rep",
            "qwen3-8b-concurrent-none-rep2",
            "qwen3-8b-concurrent-cpu16g",
        ),
        (
            "qwen3-0.6b-concurrent-cpu64k-rep",
            "qwen3-0.6b-concurrent-none-rep",
            "qwen3-0.6b-concurrent-cpu64k",
        ),
    ):
        rep = SCENARIOS[rep_name]
        assert rep.pair == SCENARIOS[none_rep].pair == SCENARIOS[first].pair
        assert (rep.offload, rep.workload, rep.vllm_args) == (
            SCENARIOS[first].offload,
            SCENARIOS[first].workload,
            SCENARIOS[first].vllm_args,
        )
    # steps.json's batch 28: three burst pairs again with the engine-step log, nothing else
    # changed (the log is bench evidence: the same pair family, the same work).
    steps = [n for n in SCENARIOS if n.endswith("-steps")]
    assert len(steps) == 6 and all(SCENARIOS[n].step_log for n in steps)
    # Besides them only holdout.json's second batch logs its steps (its bursts on 1.7B, 4B, 14B),
    # its third, batch 30: the 16 GiB its advice named on 4B and 14B, beside a control each,
    # and batches 31 and 32 (session 35): 4B without offload, at 9 and at 16 GiB, twice on one
    # host.
    # Batch 34 (staged in session 36): the eager 4B bursts without offload and at 16 GiB,
    # twice, each server alone (`-alone`, `-alone2`): batch 33 without its CUDA graphs; batch
    # 36 (staged in session 40) the same on 8B: batch 35 without its CUDA graphs. Batch 37
    # (staged in session 42, `-probe`, `-probe2`): batch 34's four again, the host timed too.
    # Batch 38 (staged in session 44, `bursts-decode`): batch 37's pair, each request decoding
    # 32 tokens, its own pair family: the same prompts at the same times, streamed; its run
    # without offload again (`-none-probe2`), the first having been recorded alone. Batch 39
    # (staged in session 45): the same decoding bursts on 8B with CUDA graphs, a pair of its
    # own, served as batch 35's 8B bursts with graphs were. Batch 40 (staged in session 46):
    # batch 39's pair again, on one host with the one-token pair (`host8`). Batch 42 (staged in
    # session 50): batch 38's pair again on another host (`-none-probe3`, `-cpu16g-probe2`).
    decode = [n for n in SCENARIOS if SCENARIOS[n].workload.name == "bursts-decode"]
    assert decode == [
        "qwen3-4b-bursts-decode-none-probe",
        "qwen3-4b-bursts-decode-cpu16g-probe",
        "qwen3-4b-bursts-decode-none-probe2",
        "qwen3-4b-bursts-decode-none-probe3",
        "qwen3-4b-bursts-decode-cpu16g-probe2",
        "qwen3-8b-bursts-decode-graphs-none",
        "qwen3-8b-bursts-decode-graphs-cpu16g",
        "qwen3-8b-bursts-decode-graphs-none-host",
        "qwen3-8b-bursts-decode-graphs-cpu16g-host",
    ]
    assert set(decode + host8) <= set(mk.load_scenarios(files=("holdout.json",)))
    bursts4 = SCENARIOS["qwen3-4b-concurrent-cpu16g-probe"]
    graphs8 = SCENARIOS["qwen3-8b-concurrent-graphs-cpu16g-alone"]
    assert SCENARIOS[decode[5]].pair == SCENARIOS[decode[6]].pair != SCENARIOS[decode[0]].pair
    assert SCENARIOS[decode[7]].pair == SCENARIOS[decode[5]].pair
    assert {SCENARIOS[n].pair for n in decode[:5]} == {SCENARIOS[decode[0]].pair}
    for n in decode:
        sc = SCENARIOS[n]
        like = graphs8 if "-graphs-" in n else bursts4
        assert (
            sc.step_log
            and sc.shape == like.shape
            and sc.vllm_args == like.vllm_args
            and sc.offload in (None, like.offload)
        )
        assert sc.pair != like.pair and sc.workload.max_tokens == 32
        assert (sc.workload.generator, sc.workload.params, sc.workload.seed) == (
            bursts4.workload.generator,
            bursts4.workload.params,
            bursts4.workload.seed,
        )
        assert [r.prompt for r in mk.generate(sc)] == [r.prompt for r in mk.generate(bursts4)]
    # Batch 41 (staged in session 47, `bursts-decode256`): batch 39's pair decoding 256 tokens
    # a request, the same prompts at the same times.
    long_decode = [n for n in SCENARIOS if SCENARIOS[n].workload.name == "bursts-decode256"]
    assert long_decode == [
        "qwen3-8b-bursts-decode256-graphs-none",
        "qwen3-8b-bursts-decode256-graphs-cpu16g",
    ]
    assert set(long_decode) <= set(mk.load_scenarios(files=("holdout.json",)))
    for n, short in zip(long_decode, decode[5:7], strict=True):
        sc, like = SCENARIOS[n], SCENARIOS[short]
        assert (sc.shape, sc.vllm_args, sc.offload, sc.step_log) == (
            like.shape,
            like.vllm_args,
            like.offload,
            like.step_log,
        )
        assert sc.workload.max_tokens == 256 and sc.pair not in (like.pair, graphs8.pair)
        assert [r.prompt for r in mk.generate(sc)] == [r.prompt for r in mk.generate(like)]
    logged = {
        n
        for n, s in SCENARIOS.items()
        if s.step_log and n not in steps + four + alone8 + decode + host8 + long_decode
    }
    loops = {f"qwen3-{m}-concurrent-{t}" for m in ("4b", "14b") for t in ("none-ctl", "cpu16g")}
    again = (
        {
            f"qwen3-4b-concurrent-{t}-{r}"
            for t in ("none", "cpu64k", "cpu16g")
            for r in ("rep", "rep2")
        }
        | {
            f"qwen3-{m}-concurrent-{t}-{r}"
            for m in ("4b", "8b")
            for t in ("none", "cpu16g")
            for r in ("alone", "alone2")
        }
        | {f"qwen3-4b-concurrent-{t}-{r}" for t in ("none", "cpu16g") for r in ("probe", "probe2")}
    )
    assert logged == loops | again | {
        f"qwen3-{m}-concurrent-{t}" for m in ("1.7b", "4b", "14b") for t in ("none", "cpu64k")
    }
    assert again <= set(mk.load_scenarios(files=("holdout.json",)))
    for n in loops:
        sc, first = SCENARIOS[n], SCENARIOS[n.split("-concurrent-")[0] + "-concurrent-none"]
        assert (sc.pair, sc.workload, sc.vllm_args) == (first.pair, first.workload, first.vllm_args)
        assert n in mk.load_scenarios(files=("holdout.json",))
        assert sc.offload is None or sc.offload.size_gib == 16.0
    # A `-steps` or `-rep` run is the same work as the run it repeats.
    for n in [*steps, *again, *host8, *decode[5:]]:
        sc, first = SCENARIOS[n], SCENARIOS[re.sub(r"-(steps|rep2?|alone2?|probe2?|host)$", "", n)]
        assert (sc.workload, sc.vllm_args, sc.offload, sc.pair) == (
            first.workload,
            first.vllm_args,
            first.offload,
            first.pair,
        )
    for n in idle:
        sc, busy = SCENARIOS[n], SCENARIOS[n.replace("-idle", "")]
        assert sc.workload.params["rate_per_s"] == busy.workload.params["rate_per_s"] / 4
        assert sc.workload.seed == busy.workload.seed and sc.vllm_args == busy.vllm_args
        assert sc.pair != busy.pair and sc.offload == busy.offload
    for n in graphs:
        sc = SCENARIOS[n]
        eager = SCENARIOS[f"{sc.shape.name}-{sc.workload.name}-none"]
        assert sc.vllm_args == () and eager.vllm_args == ("--enforce-eager",)
        assert sc.pair != eager.pair and sc.workload == eager.workload
        assert n.split("-graphs-")[1].split("-")[0] == (sc.offload.tag if sc.offload else "none")
    assert (
        SCENARIOS["qwen3-8b-concurrent-graphs-cpu64k"].offload
        == SCENARIOS["qwen3-8b-concurrent-cpu64k"].offload
    )
    assert {SCENARIOS[n].workload.name for n in held_out} == {"chat", "rag-zipf", "concurrent"}
    shapes -= {"qwen3-14b", "qwen3-1.7b", "qwen3-4b"}
    # The second held-out batch's shapes: their KV per token, their parameters.
    small, mid = SCENARIOS["qwen3-1.7b-concurrent-cpu64k"], SCENARIOS["qwen3-4b-concurrent-cpu64k"]
    assert (small.shape.kv_bytes_per_token, mid.shape.kv_bytes_per_token) == (114_688, 147_456)
    assert small.shape.param_count == pytest.approx(1.7e9, rel=0.03)
    assert mid.shape.param_count == pytest.approx(4.0e9, rel=0.03)
    assert (small.offload.size_gib, mid.offload.size_gib) == (7.0, 9.0)  # type: ignore[union-attr]
    # close-the-loop.json: the sizes the advisor recommended on replay, as scenarios too.
    assert SCENARIOS["qwen3-8b-long-context-cpu16g"].offload is not None
    assert (
        SCENARIOS["qwen3-8b-long-context-cpu16g"].pair
        == SCENARIOS["qwen3-8b-long-context-none"].pair
    )
    assert all(s.traffic_s >= 180 for s in SCENARIOS.values())
    bpt = {n: SCENARIOS[f"{n}-chat-none"].shape.kv_bytes_per_token for n in shapes}
    assert bpt == {"qwen3-0.6b": 114_688, "qwen3-8b": 147_456, "qwen3-32b": 262_144}
    assert bpt["qwen3-0.6b"] == kit.SMALL_BPT and bpt["qwen3-32b"] == kit.LARGE_BPT
    eight = SCENARIOS["qwen3-8b-rag-zipf-cpu64k"]
    assert eight.shape.param_count == pytest.approx(8.19e9, rel=0.01)
    fourteen = SCENARIOS["qwen3-14b-chat-cpu64k"]
    assert fourteen.shape.kv_bytes_per_token == 163_840
    assert fourteen.shape.param_count == pytest.approx(14.8e9, rel=0.01)
    assert fourteen.offload is not None and fourteen.offload.size_gib == 10.0
    assert eight.shape.kv_cache_bytes == 32768 * 147_456  # 2048 blocks of 16 tokens
    assert eight.shape.gpu_blocks == 2048
    assert eight.offload is not None and eight.offload.size_gib == 9.0  # 64 Ki tokens of KV
    assert mk.cpu_blocks(eight.shape, eight.offload) == 4096
    # The same buffer in tokens on every shape.
    for sh in shapes:
        sc = SCENARIOS[f"{sh}-unique-cpu192k"]
        assert sc.offload is not None and sc.offload.cpu_tokens == 196_608
        assert mk.cpu_blocks(sc.shape, sc.offload) == 196_608 // 16
    # Pairs: the same shape, workload and flags; only the offload differs.
    assert SCENARIOS["qwen3-8b-chat-none"].pair == SCENARIOS["qwen3-8b-chat-cpu64k"].pair
    assert SCENARIOS["qwen3-8b-chat-none"].pair != SCENARIOS["qwen3-0.6b-chat-none"].pair


def test_matrix_new_scenario_needs_no_code(tmp_path: Path) -> None:
    for f in ("shapes.json", "workloads.json"):
        (tmp_path / f).write_text((mk.SCENARIO_DIR / f).read_text())
    (tmp_path / "mine.json").write_text(
        json.dumps(
            {
                "defaults": {"traffic_s": 200, "max_model_len": 4096, "vllm_args": []},
                "runs": [
                    {"shape": "qwen3-0.6b", "workload": "unique", "offload": {"size_gib": 2}},
                    {"name": "x", "shape": "qwen3-8b", "workload": "abca", "offload": None},
                ],
            }
        )
    )
    scs = mk.load_scenarios(tmp_path)
    assert set(scs) == {"qwen3-0.6b-unique-2gib", "x"}
    assert scs["x"].workload.generator == "abca" and scs["x"].traffic_s == 200
    with pytest.raises(ValueError, match="unknown scenarios"):
        mk.resolve("x,nope", scs)
    bad = {"workloads": {"w": {"generator": "nope"}}}
    with pytest.raises(ValueError, match="unknown generator"):
        mk.load_workloads(bad)


def test_matrix_vllm_command() -> None:
    none = SCENARIOS["qwen3-8b-chat-none"]
    off = SCENARIOS["qwen3-8b-chat-cpu64k"]
    kw = {"python": "py", "model_dir": "/m", "port": 8000, "kv_endpoint": "tcp://127.0.0.1:5"}
    a, b = mk.vllm_command(none, **kw), mk.vllm_command(off, **kw)
    assert a[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-prefix-caching", "--skip-tokenizer-init", "--enforce-eager"):
        assert flag in a
    assert a[a.index("--kv-cache-memory-bytes") + 1] == str(32768 * 147_456)
    assert a[a.index("--max-model-len") + 1] == "16384"
    assert json.loads(a[a.index("--kv-events-config") + 1])["endpoint"] == "tcp://127.0.0.1:5"
    assert "--kv-offloading-size" not in a
    assert b[b.index("--kv-offloading-size") + 1] == "9"
    assert b[b.index("--kv-offloading-backend") + 1] == "native"
    # Nothing else differs between the halves of a pair.
    extra = ["--kv-offloading-size", "9", "--kv-offloading-backend", "native"]
    assert [x for x in b if x not in extra] == a
    smoke = matrix.cpu_smoke_command(a)
    assert "--kv-cache-memory-bytes" not in smoke and "--enforce-eager" not in smoke
    env = matrix.vllm_env({"PYTHONPATH": f"/site:{REPO}"}, gpu=True)
    assert env["PYTHONPATH"] == "/site" and env["PYTHONHASHSEED"] == "0"
    assert env["NCCL_NVLS_ENABLE"] == "0"


def _gen(name: str) -> list[mk.Req]:
    return mk.generate(SCENARIOS[name])


@pytest.mark.parametrize("workload", ["rag-zipf", "chat", "unique", "long-context", "concurrent"])
def test_matrix_generators_are_deterministic_and_pair_identical(workload: str) -> None:
    a = _gen(f"qwen3-8b-{workload}-none")
    assert a == _gen(f"qwen3-8b-{workload}-none")  # same sequence on every call
    assert a == _gen(f"qwen3-8b-{workload}-cpu64k") == _gen(f"qwen3-8b-{workload}-cpu192k")
    # The 0.6B and 32B shapes share the vocabulary, so they get the very same token ids.
    assert a == _gen(f"qwen3-0.6b-{workload}-none") == _gen(f"qwen3-32b-{workload}-none")
    assert [r.i for r in a] == list(range(len(a)))
    times = [r.t for r in a]
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 180
    assert all(100 <= tok < 151936 - 100 for r in a[:50] for tok in r.prompt)
    assert max(len(r.prompt) for r in a) <= 16384 - 1
    assert len(a) >= 50


def test_matrix_generators_lengths_and_reuse() -> None:
    rag = _gen("qwen3-8b-rag-zipf-none")
    p = SCENARIOS["qwen3-8b-rag-zipf-none"].workload.params
    assert all(768 + 32 <= len(r.prompt) <= 1280 + 96 for r in rag)
    docs = [r.tags["doc"] for r in rag]
    counts = sorted((docs.count(d) for d in set(docs)), reverse=True)
    assert counts[0] >= 8 * len(rag) / p["docs"]  # Zipf: the top document far above the mean
    same = [r for r in rag if r.tags["doc"] == docs[0]]
    n_doc = len(same[0].prompt) - min(len(r.prompt) for r in same) + 32
    assert all(r.prompt[:700] == same[0].prompt[:700] for r in same) and n_doc > 0
    assert len(rag) == pytest.approx(4.0 * 180, rel=0.15)

    uniq = _gen("qwen3-8b-unique-none")
    firsts = {r.prompt[:16] for r in uniq}
    assert len(firsts) == len(uniq)  # no block shared by two requests
    assert mk.sequence_stats(uniq, 16)["ideal_hit_ratio"] == 0.0
    assert all(768 <= len(r.prompt) <= 1280 for r in uniq)

    long = _gen("qwen3-8b-long-context-none")
    assert min(len(r.prompt) for r in long) >= 8192 + 32
    with pytest.raises(ValueError, match="8192"):
        mk.gen_long_context(
            {"docs": 2, "doc_tokens": 4000, "question_tokens": 8, "rate_per_s": 1.0}, 1, 1000, 10
        )

    conc = _gen("qwen3-8b-concurrent-none")
    wl = SCENARIOS["qwen3-8b-concurrent-none"].workload
    assert wl.max_inflight == 16
    bursts: dict[int, list[mk.Req]] = {}
    for r in conc:
        bursts.setdefault(r.tags["burst"], []).append(r)
    assert all(len(b) == 12 and len({r.t for r in b}) == 1 for b in bursts.values())


def test_matrix_chat_conversations_grow() -> None:
    chat = _gen("qwen3-8b-chat-none")
    params = SCENARIOS["qwen3-8b-chat-none"].workload.params
    convs: dict[int, list[mk.Req]] = {}
    for r in chat:
        convs.setdefault(r.tags["conv"], []).append(r)
    assert len(convs) >= 30 and max(len(v) for v in convs.values()) >= 4
    system = chat[0].prompt[:512]
    for turns in convs.values():
        assert [r.tags["turn"] for r in turns] == list(range(len(turns)))
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.prompt[: len(prev.prompt)] == prev.prompt  # the history is the prefix
            grown = len(nxt.prompt) - len(prev.prompt)
            assert 80 + 30 <= grown <= 400 + 200
            assert nxt.t - prev.t >= 6
        assert turns[0].prompt[:512] == system
        assert 512 + 200 <= len(turns[0].prompt) <= 512 + 800
    assert max(len(r.prompt) for r in chat) <= params["max_context_tokens"]


def test_matrix_legacy_workloads_as_generators() -> None:
    abca = mk.gen_abca({"prompt_tokens": 32, "interval_s": 1.0}, 8001, 1000, 12)
    assert [r.tags["doc"] for r in abca[:5]] == list("AABCA")
    assert abca[0].prompt == abca[1].prompt == abca[4].prompt != abca[2].prompt
    assert len(abca) == 12
    w2 = mk.gen_shuffled_docs({"docs": 4, "doc_tokens": 16, "interval_s": 1.0}, 9, 1000, 8)
    assert sorted(r.tags["doc"] for r in w2[:4]) == [0, 1, 2, 3]
    assert len({r.prompt for r in w2}) == 4


def test_matrix_plan_session() -> None:
    names = [
        "qwen3-8b-rag-zipf-none",
        "qwen3-8b-rag-zipf-cpu64k",
        "qwen3-8b-chat-none",
        "qwen3-8b-chat-cpu64k",
        "qwen3-0.6b-rag-zipf-none",
        "qwen3-0.6b-rag-zipf-cpu64k",
    ]
    scs = mk.resolve(names, SCENARIOS)
    plan = mk.plan_session(scs, 1400)
    assert plan.groups == (tuple(names),) and plan.skipped == ()
    # The group starts together: its slowest start (shapes.json), then one turn each.
    start = max(sc.shape.est_start_s for sc in scs)
    assert start == SCENARIOS["qwen3-8b-chat-none"].shape.est_start_s
    assert plan.est_total_s == start + 6 * (180 + mk.TURN_OVERHEAD_S)
    short = mk.plan_session(scs, start + 3 * (180 + mk.TURN_OVERHEAD_S) + 10)  # three turns
    assert short.groups == (tuple(names[:3]),) and short.skipped == tuple(names[3:])
    big = mk.resolve(
        ["qwen3-32b-chat-none", "qwen3-32b-chat-cpu64k", "qwen3-8b-chat-none"], SCENARIOS
    )
    plan = mk.plan_session(big, 3000)  # two 32B servers do not fit the GPU together
    assert plan.groups == (
        ("qwen3-32b-chat-none",),
        ("qwen3-32b-chat-cpu64k", "qwen3-8b-chat-none"),
    )


def test_matrix_plan_with_each_server_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """`--max-group 1` (session 35): each server starts after the one before it stopped, so
    no loaded server sits idle beside a run (in a group the later servers wait through the
    earlier turns: batches 31 and 32's two runs without offload, two servers beside the
    first and none beside the last, differed by 9 %). Each start is then paid once a run."""
    names = [
        "qwen3-4b-concurrent-graphs-none",
        "qwen3-4b-concurrent-graphs-cpu16g",
        "qwen3-4b-concurrent-graphs-none-rep",
        "qwen3-4b-concurrent-graphs-cpu16g-rep",
    ]
    scs = mk.resolve(names, SCENARIOS)
    together = mk.plan_session(scs, 1450)
    alone = mk.plan_session(scs, 1450, max_group=1)
    assert together.groups == (tuple(names),)
    assert alone.groups == tuple((n,) for n in names) and alone.skipped == ()
    start = scs[0].shape.est_start_s
    assert alone.est_total_s == together.est_total_s + 3 * start
    assert mk.plan_session(scs, 1450, max_group=2).groups == (tuple(names[:2]), tuple(names[2:]))
    assert (
        matrix.main(["plan", "--runs", ",".join(names), "--budget", "1450", "--max-group", "1"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["groups"] == [[n] for n in names]
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit) as e:
            matrix.main(["plan", "--runs", names[0], "--max-group", bad])
        assert e.value.code == 2


def test_matrix_plan_fits_the_card_it_runs_on() -> None:
    """The driver plans for the memory NVML reports: batch 23's three 14B servers shared the
    H200, and on an H100 (session 29) each starts alone. The H200's plan is the one every
    session before used."""
    h200, h100 = 150754820096, 85520809984  # NVML's totals (env/nvml_link.json)
    assert mk.gpu_capacity_bytes(None) == mk.gpu_capacity_bytes(h200) == 125 * 10**9
    names = [
        "qwen3-14b-unique-idle-none",
        "qwen3-14b-unique-idle-cpu64k",
        "qwen3-14b-unique-none",
        "qwen3-14b-unique-cpu64k",
    ]
    scs = mk.resolve(names, SCENARIOS)
    on_h200 = mk.plan_session(scs, 1500, gpu_capacity_bytes=mk.gpu_capacity_bytes(h200))
    assert on_h200.groups == (tuple(names[:3]), tuple(names[3:]))
    on_h100 = mk.plan_session(scs, 1500, gpu_capacity_bytes=mk.gpu_capacity_bytes(h100))
    assert on_h100.groups == tuple((n,) for n in names)
    # Two 8B servers (24 GiB each) still share the smaller card.
    pair = mk.resolve(["qwen3-8b-unique-idle-none", "qwen3-8b-unique-idle-cpu64k"], SCENARIOS)
    assert (
        len(mk.plan_session(pair, 600, gpu_capacity_bytes=mk.gpu_capacity_bytes(h100)).groups) == 1
    )


def test_matrix_recording_lines() -> None:
    assert mk.link_bandwidth_bytes(5, 16) == pytest.approx(32e9 * 128 / 130 * 2)
    assert mk.link_bandwidth_bytes(None, 16) is None
    good = {"t": 1.5, "ms": 3, "status": 200, "error": None, "body": "vllm:x 1\n"}
    assert json.loads(mk.metrics_line(good) or "") == {"t": 1.5, "body": "vllm:x 1\n"}
    assert mk.metrics_line({**good, "status": None, "body": ""}) is None
    ev = {"nframes": 3, "topic": "kv", "seq": 4, "payload": [1.0, [{"type": "BlockStored"}], 0]}
    assert json.loads(mk.kv_event_line(ev) or "") == {
        "topic": "kv",
        "seq": 4,
        "payload": [1.0, [{"type": "BlockStored"}], 0],
    }
    assert mk.kv_event_line({**ev, "error": "x"}) is None
    req = mk.Req(3, 0.5, (1, 2, 3), {"doc": 1})
    body = {
        "id": "cmpl-1",
        "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}},
    }
    rec = mk.request_record(
        req, slot=2, t_sched=10.5, t_send=10.6, t_end=10.9, status=200, body=body
    )
    assert rec["ttft_s"] == pytest.approx(0.3) and rec["cached_tokens"] == 0 and rec["slot"] == 2
    assert rec["id"] == "cmpl-1" and rec["i"] == 3 and rec["tags"] == {"doc": 1}


def _recs(ttfts: list[float], cached: int = 0, start: float = 100.0) -> list[dict[str, object]]:
    return [
        {
            "i": i,
            "status": 200,
            "t_send": start + i,
            "t_end": start + i + t,
            "ttft_s": t,
            "prompt_tokens": 100,
            "cached_tokens": cached,
        }
        for i, t in enumerate(ttfts)
    ]


def test_matrix_paired_truth() -> None:
    base = _recs([0.1] * 10)
    assert mk.paired_truth(base, _recs([0.09] * 10, 64))["verdict"] == "pays"
    assert mk.paired_truth(base, _recs([0.0975] * 10))["verdict"] == "neutral"
    assert mk.paired_truth(base, _recs([0.103] * 10))["verdict"] == "costs"
    t = mk.paired_truth(base, _recs([0.05] * 8))  # the offload run sent only 8
    assert t["matched"] == 8 and t["only_base"] == 2
    assert t["relative_change"] == pytest.approx(-0.5)
    assert t["cached_tokens_offload"] == 0
    failed = [{**r, "status": 500} if r["i"] == 0 else r for r in _recs([0.1] * 3)]
    assert mk.paired_truth(failed, _recs([0.1] * 3))["matched"] == 2
    assert mk.verdict(-0.03) == "pays" and mk.verdict(0.0299) == "neutral"
    assert mk.run_totals(_recs([0.5, 0.5, 0.5]))["max_inflight_seen"] == 1
    overlapping = [{**r, "t_end": float(r["t_send"]) + 5} for r in _recs([5.0] * 3)]
    assert mk.max_inflight(overlapping) == 3


def test_matrix_an_offload_run_pairs_only_on_its_own_machine() -> None:
    """Session 11: the 21 GiB run landed on a fresh machine after the one that held its run
    without offload went back. It pairs with nothing, though a run without offload of its
    family exists; the run on its machine, when there is one, wins over a nearer one
    elsewhere; runs without offload still compare across machines (the drift)."""

    def meta(start: float, uuid: str, offload: object = None) -> dict[str, object]:
        return {
            "pair": "f",
            "offload": offload,
            "gpu": {"uuid": uuid},
            "traffic": {"t_traffic_start": start},
        }

    metas = {
        "none": meta(0, "GPU-1"),
        "cpu64k": meta(200, "GPU-1", {"size_gib": 7}),
        "cpu192k": meta(1500, "GPU-3", {"size_gib": 21}),
    }
    assert mk.base_run(metas, "cpu64k") == "none"
    assert mk.base_run(metas, "cpu192k") is None
    metas["none-ctl"] = meta(9000, "GPU-3")
    metas["none-far"] = meta(1400, "GPU-2")  # nearer in time, another machine
    assert mk.base_run(metas, "cpu192k") == "none-ctl"
    assert mk.base_run(metas, "none-ctl") == "none-far"


def test_matrix_noise_band_from_two_runs_of_the_same_work_on_one_gpu() -> None:
    """Two offload runs of a family that served the same cached tokens on one GPU differ by
    10 %: a +5 % change of the family is neutral, +12 % costs. The same pair on two GPUs (or
    with other cached tokens) sets no band."""

    def meta(start: float, uuid: str | None, offload: object = None) -> dict[str, object]:
        gpu = {"uuid": uuid} if uuid else {}
        return {"pair": "f", "offload": offload, "gpu": gpu, "traffic": {"t_traffic_start": start}}

    runs = {"a": _recs([0.10] * 10, 64), "b": _recs([0.11] * 10, 64)}
    on_one = {"a": meta(0, "GPU-1", {"size_gib": 9}), "b": meta(9000, "GPU-1", {"size_gib": 27})}
    noise = mk.family_noise(on_one, runs)
    assert noise["f"]["relative_difference"] == pytest.approx(0.1)
    band = mk.truth_threshold(noise["f"])
    base = _recs([0.1] * 10)
    assert mk.paired_truth(base, _recs([0.105] * 10), threshold=band)["verdict"] == "neutral"
    assert mk.paired_truth(base, _recs([0.112] * 10), threshold=band)["verdict"] == "costs"
    two_gpus = {"a": on_one["a"], "b": meta(0, "GPU-2", {"size_gib": 27})}
    assert mk.family_noise(two_gpus, runs) == {}
    # Without a UUID, traffic within one device session counts as one machine.
    assert mk.family_noise({"a": meta(0, None, 9), "b": meta(600, None, 27)}, runs) != {}
    assert mk.family_noise({"a": meta(0, None, 9), "b": meta(9000, None, 27)}, runs) == {}
    other_work = {"a": runs["a"], "b": _recs([0.11] * 10, 32)}
    assert mk.family_noise(on_one, other_work) == {}
    assert mk.truth_threshold(None) == mk.TRUTH_THRESHOLD


def test_concurrent_requests_trading_prefix_hits_still_did_the_same_work() -> None:
    """Two runs of 100 requests where 4 pairs of requests swapped their cached tokens (the
    order concurrent requests were scheduled in decides who hits): the same tokens computed in
    all, so their difference is a noise band; a run that computed 8 % more did other work."""
    a = _recs([0.10] * 100, 64)
    b = _recs([0.11] * 100, 64)
    for i in range(0, 8, 2):
        b[i]["cached_tokens"], b[i + 1]["cached_tokens"] = 96, 32
    assert mk.same_work(a, b)
    metas = {k: {"pair": "f", "offload": None, "gpu": {"uuid": "GPU-1"}} for k in "ab"}
    assert mk.family_noise(metas, {"a": a, "b": b})["f"]["relative_difference"] == pytest.approx(
        0.1
    )
    more = _recs([0.11] * 100, 64)
    for i in range(0, 8, 2):
        more[i]["cached_tokens"], more[i + 1]["cached_tokens"] = 64 - 36, 64 - 36
    assert not mk.same_work(a, more)  # 288 more of 3600 computed tokens: 8 %


class _FakeVllm(BaseHTTPRequestHandler):
    seen: ClassVar[list[int]] = []

    def do_POST(self) -> None:
        n = int(self.headers["Content-Length"])
        req = json.loads(self.rfile.read(n))
        self.seen.append(len(req["prompt"]))
        body = json.dumps(
            {
                "id": f"c{len(self.seen)}",
                "usage": {
                    "prompt_tokens": len(req["prompt"]),
                    "prompt_tokens_details": {"cached_tokens": 16},
                },
            }
        )
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *a: object) -> None:
        pass


def test_matrix_client_sends_the_sequence_in_order_with_slots() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reqs = [mk.Req(i, 0.0, tuple(range(10 + i))) for i in range(12)]
        recs, unsent = matrix.drive(
            server.server_address[1],
            "m",
            reqs,
            max_inflight=3,
            max_tokens=1,
            t0=time.time(),
            hard_stop=time.time() + 60,
            timeout=10,
        )
        assert unsent == [] and [r["i"] for r in recs] == list(range(12))
        assert {r["slot"] for r in recs} <= {0, 1, 2}
        assert all(r["status"] == 200 and r["cached_tokens"] == 16 for r in recs)
        assert [r["prompt_tokens"] for r in recs] == [10 + i for i in range(12)]
        # Past the hard stop nothing more is sent.
        recs, unsent = matrix.drive(
            server.server_address[1],
            "m",
            reqs,
            max_inflight=2,
            max_tokens=1,
            t0=time.time(),
            hard_stop=time.time() - 1,
            timeout=10,
        )
        assert recs == [] and unsent == list(range(12))
    finally:
        server.shutdown()


class _ClosingVllm(_FakeVllm):
    """Keep-alive promised (HTTP/1.1, no Connection: close), then the socket is closed: what
    uvicorn does to a connection idle past its keep-alive timeout."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        super().do_POST()
        self.close_connection = True


def test_matrix_client_resends_on_a_connection_the_server_closed() -> None:
    """Session 1 lost ~4% of the chat requests to BrokenPipeError on stale connections."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ClosingVllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reqs = [mk.Req(i, 0.0, (1, 2, 3)) for i in range(6)]
        recs, unsent = matrix.drive(
            server.server_address[1],
            "m",
            reqs,
            max_inflight=1,
            max_tokens=1,
            t0=time.time(),
            hard_stop=time.time() + 60,
            timeout=10,
        )
        assert unsent == [] and all(r["status"] == 200 for r in recs)
        assert len(recs) == 6 and any(r.get("retried") for r in recs)
    finally:
        server.shutdown()


class _BrokenStreamVllm(_FakeVllm):
    """A stream that begins 200 and then carries an error, or ends without a token: what a
    vLLM that fails a request mid-generation sends (the real server's streams are tested in
    tests/integration/test_matrix_client_real.py)."""

    protocol_version = "HTTP/1.1"
    events: ClassVar[list[bytes]] = []

    def do_POST(self) -> None:
        n = int(self.headers["Content-Length"])
        assert json.loads(self.rfile.read(n))["stream"] is True
        body = b"".join(b"data: " + e + b"\n\n" for e in self.events)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize(
    ("events", "error"),
    [
        ([b'{"id": "c1", "error": {"message": "boom"}}', b"[DONE]"], "boom"),
        ([b'{"id": "c1", "choices": [], "usage": {"prompt_tokens": 3}}', b"[DONE]"], "without"),
        ([b"not json", b"[DONE]"], "not json"),
    ],
)
def test_a_broken_stream_is_not_a_served_request(events: list[bytes], error: str) -> None:
    _BrokenStreamVllm.events = events
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BrokenStreamVllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        recs, unsent = matrix.drive(
            server.server_address[1],
            "m",
            [mk.Req(0, 0.0, (1, 2, 3))],
            max_inflight=1,
            max_tokens=4,
            t0=time.time(),
            hard_stop=time.time() + 60,
            timeout=10,
        )
        (rec,) = recs
        assert unsent == [] and rec["status"] is None and error in rec["error"]
        assert "t_first" not in rec
        assert mk._ok(recs) == {}
    finally:
        server.shutdown()


def test_matrix_finalize_collect_unpack_truth(tmp_path: Path) -> None:
    work = tmp_path / "work"
    for name, ttft, off in (("s-w-none", 0.2, None), ("s-w-cpu1k", 0.1, {"size_gib": 1})):
        d = work / "runs" / name
        (d / "scrape").mkdir(parents=True)
        (d / "scrape" / "vllm.jsonl").write_text(
            json.dumps({"t": 1.0, "ms": 1, "status": 200, "error": None, "body": "a 1\n"})
            + "\n"
            + json.dumps({"t": 2.0, "ms": 1, "status": None, "error": "x", "body": ""})
            + "\n"
        )
        (d / "kv_events.jsonl").write_text(
            json.dumps({"nframes": 3, "topic": "kv", "seq": 0, "payload": [1.0, [], 0]}) + "\n"
        )
        (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _recs([ttft] * 4)))
        (d / "server.log").write_text("\n".join(f"line {k}" for k in range(400)))
        (d / "meta.json").write_text(json.dumps({"pair": "s-w", "offload": off, "vllm_argv": []}))
        sampled = off is not None  # a run recorded before batch 21 has no GPU samples
        if sampled:
            (d / "gpu.jsonl").write_text(json.dumps({"t": 1.0, "gpu_util": 0.97}) + "\n")
        assert matrix.main(["finalize", "--dir", str(d)]) == 0
        assert sorted(p.name for p in d.iterdir()) == sorted(
            [
                "FINAL",
                "kv_events.jsonl.xz",
                "meta.json",
                "metrics.jsonl.xz",
                "requests.jsonl.xz",
                "server_log.txt",
                *(["gpu.jsonl.xz"] if sampled else []),
            ]
        )
        meta = json.loads((d / "meta.json").read_text())
        assert ("gpu" in meta["lines"]) == sampled
        with lzma.open(d / "metrics.jsonl.xz", "rt") as fh:
            assert [json.loads(x) for x in fh] == [{"t": 1.0, "body": "a 1\n"}]
    (work / "DONE").write_text("done\n")
    (work / "status.json").write_text("{}")
    (work / "daemon.pid").write_text(f"{os.getpid()} matrix.py\n")
    out = tmp_path / "out"
    assert matrix.main(["collect", "--work", str(work), "--out", str(out)]) == 0
    tars = sorted(out.glob("runs-*.tar"))
    assert len(tars) == 1
    assert matrix.main(["collect", "--work", str(work), "--out", str(tmp_path / "o2")]) == 0
    assert not list((tmp_path / "o2").glob("runs-*.tar"))  # each run is collected once
    dest = tmp_path / "fixtures"
    assert matrix.main(["unpack", *map(str, tars), "--dest", str(dest)]) == 0
    assert not (dest / "s-w-none" / "FINAL").exists()
    with lzma.open(dest / "s-w-cpu1k" / "gpu.jsonl.xz", "rt") as fh:
        assert [json.loads(x) for x in fh] == [{"t": 1.0, "gpu_util": 0.97}]
    table = matrix.truth_table(dest)
    assert table["pairs"]["s-w-cpu1k"]["verdict"] == "pays"
    assert table["pairs"]["s-w-cpu1k"]["base"] == "s-w-none"
    assert table["runs"]["s-w-none"]["summed_ttft_s"] == pytest.approx(0.8)


class _Util:
    gpu, memory = 97, 41


class _FakeNvml:
    """NVML on the H200 as far as recorded: PCIe throughput in KB/s mid-copy of 1 GiB
    pinned host->device (tests/fixtures/h200/nvml-fieldcounter-poll-probe.json, "h2d");
    utilisation, clock and power are not recorded there and are plain numbers."""

    NVML_CLOCK_SM = 1
    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1

    def __init__(self, *, init_error: Exception | None = None) -> None:
        probe = json.loads((FIXTURES / "h200" / "nvml-fieldcounter-poll-probe.json").read_text())
        self.tx_rx = probe["h2d"]["mid_thr_KBps"]
        self.init_error = init_error
        self.shut = False

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int) -> _Util:
        return _Util()

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:
        return 1980

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        raise RuntimeError("Not Supported")

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        return int(self.tx_rx[counter])


def test_gpu_samples_while_a_turn_runs(tmp_path: Path) -> None:
    """The driver's NVML sampler (batch 21 on): base units and 0..1 ratios, a field NVML
    refuses left out and named, a stop request ends it, an NVML that cannot start is one
    error line and no samples (the run is still recorded)."""
    nv = _FakeNvml()
    out = tmp_path / "gpu.jsonl"
    calls = iter(range(10))
    n = matrix.sample_gpu(out, nv, interval_s=0.0, max_s=60.0, stopped=lambda: next(calls) >= 3)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert n == len(lines) == 3 and nv.shut
    first = lines[0]
    assert first["gpu_util"] == 0.97 and first["mem_util"] == 0.41
    assert first["sm_clock_hz"] == 1.98e9
    # NVML's "KB" is 1000 bytes: 59.6 GB/s received while 54.7 GB/s of pinned memory moved.
    assert first["pcie_rx_bytes_per_second"] == pytest.approx(59.58e9, rel=1e-3)
    assert first["pcie_tx_bytes_per_second"] == pytest.approx(5.19e9, rel=1e-3)
    assert "power_w" not in first and first["error"] == "power_w: RuntimeError: Not Supported"
    down = tmp_path / "down.jsonl"
    assert matrix.sample_gpu(down, _FakeNvml(init_error=OSError("no driver"))) == 0
    (line,) = down.read_text().splitlines()
    assert json.loads(line)["error"] == "OSError: no driver"


def test_the_host_probe_times_python_and_says_why_it_timed_no_launch(tmp_path: Path) -> None:
    """The turn's host probe (session 42): ns a Python loop iteration, fastest first; where
    torch or a CUDA device is missing (here: the project's virtualenv has no torch) the
    launches are not timed and `error` says why; a probe that cannot run is an error, never
    an exception; near the deadline the driver skips it."""
    cpu = matrix.host_probe(cuda=False, repeats=3)
    assert 0 < cpu["python_ns"] <= cpu["python_ns_median"] and "error" not in cpu
    assert "launch_us" not in cpu
    gpu = matrix.host_probe(cuda=True, repeats=1)
    assert gpu["python_ns"] > 0 and "launch_us" not in gpu
    assert gpu["error"].startswith(("ModuleNotFoundError", "RuntimeError: torch sees no CUDA"))
    child = matrix.run_host_probe(sys.executable, KIT, dict(os.environ), cuda=False)
    assert child["python_ns"] > 0 and "error" not in child
    broken = matrix.run_host_probe(sys.executable, tmp_path, dict(os.environ), cuda=False)
    assert broken["error"].startswith("exit 2:")  # no matrix.py there
    missing = matrix.run_host_probe(str(tmp_path / "nopython"), KIT, {}, cuda=False)
    assert missing["error"].startswith("FileNotFoundError")
    opts = matrix.Opts(
        work=tmp_path, deadline=time.time() + 30, vllm_python=sys.executable, kit=KIT
    )
    assert matrix.Driver(opts).probe() == {"error": "skipped: deadline near"}


MATRIX = FIXTURES / "gpu" / "matrix"


def test_matrix_recordings_have_the_replay_format() -> None:
    """The committed H200 runs: issue 16's recording format and the paired truth they give."""
    runs = sorted(p.parent for p in MATRIX.glob("*/meta.json"))
    assert len(runs) >= 6

    def sequence(d: Path) -> str:
        """What mk.generate and mk.warmup_prompts depend on (a family's runs share it)."""
        sc = SCENARIOS[d.name]  # every recording is a scenario of the data
        wl = sc.workload
        return json.dumps(
            [
                *(wl.generator, wl.params, wl.seed, wl.max_tokens, sc.shape.vocab),
                *(sc.traffic_s, sc.max_model_len, sc.warmup_requests),
            ],
            sort_keys=True,
        )

    # Generating a sequence is most of this test's time: each once, not once per run.
    last: tuple[str, list[tuple[int, ...]], mk.BlockIds] | None = None
    for d in sorted(runs, key=sequence):
        meta = json.loads((d / "meta.json").read_text())
        sc = SCENARIOS[d.name]
        assert meta["scenario"] == d.name and meta["pair"] == sc.pair
        assert meta["kv_bytes_per_token"] == sc.shape.kv_bytes_per_token
        assert meta["link_bandwidth_bytes_per_second"] == pytest.approx(63.015e9, rel=1e-3)
        argv = meta["vllm_argv"]
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        assert ("--kv-offloading-size" in argv) == (sc.offload is not None)
        assert meta["traffic"]["traffic_s"] >= 180 and meta["traffic"]["unsent_requests"] == 0
        with lzma.open(d / "metrics.jsonl.xz", "rt") as fh:
            lines = [json.loads(x) for x in fh]
        assert all(set(x) == {"t", "body"} for x in lines)
        assert lines[-1]["t"] - lines[0]["t"] >= 180
        assert all(b["t"] > a["t"] for a, b in itertools.pairwise(lines))
        assert "vllm:prompt_tokens_total" in lines[-1]["body"]
        with lzma.open(d / "kv_events.jsonl.xz", "rt") as fh:
            first = json.loads(fh.readline())
        assert set(first) == {"topic", "seq", "payload"} and len(first["payload"]) == 3
        stored = next(e for e in first["payload"][1] if e.get("type") == "BlockStored")
        assert all(isinstance(h, int) for h in stored["block_hashes"])
        # compacted (matrix.py compact): the token ids are the sequence's blocks, by block id;
        # a block that holds decoded tokens is no block of the sequence and keeps its tokens
        compact = meta[mk.COMPACT_KEY]
        if sc.workload.max_tokens == 1:
            assert compact["identified"] == compact["hashes"]
        else:
            unique = meta["workload"]["sequence"]["unique_blocks"]
            assert unique <= compact["identified"] < compact["hashes"]
        assert not any(stored["token_ids"]) and len(stored["block_ids"]) == len(
            stored["block_hashes"]
        )
        if last is None or last[0] != sequence(d):
            prompts = [r.prompt for r in mk.generate(sc)]
            last = (
                sequence(d),
                prompts,
                mk.workload_block_ids([*prompts, *mk.warmup_prompts(sc)], 16),
            )
        _, prompts, blocks = last
        toks = mk.restore_token_ids(first, blocks)["payload"][1][0]["token_ids"]
        assert toks == mk.warmup_prompts(sc)[0][: len(toks)]  # vLLM's first store: the warmup
        reqs = matrix.load_requests(d)
        assert [r["i"] for r in reqs] == list(range(meta["traffic"]["planned_requests"]))
        assert [r["sent_tokens"] for r in reqs] == [len(p) for p in prompts]
    pairs = matrix.truth_table(MATRIX)["pairs"]
    session1 = ("qwen3-8b-rag-zipf-cpu64k", "qwen3-8b-chat-cpu64k", "qwen3-0.6b-rag-zipf-cpu64k")
    assert [pairs[n]["verdict"] for n in session1] == ["costs", "neutral", "costs"]
    assert pairs["qwen3-8b-rag-zipf-cpu64k"]["matched"] == 761


def _stored(hashes: list[int], parent: int | None, toks: list[int], medium: str = "GPU") -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": toks,
        "block_size": 4 if toks else 0,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "extra_keys": [None] * len(hashes) if toks else None,
        "group_idx": 0,
    }


def _rec(seq: int, *events: dict) -> dict:
    return {"topic": "kv", "seq": seq, "payload": [1000.0 + seq, list(events), 0]}


def test_compact_kv_records_keeps_every_decoded_value_and_the_block_identity() -> None:
    """Token ids of the workload's blocks go (zeros of the same length, their ids as
    block_ids); hashes and everything the codec decodes stay; two runs of one workload name
    each block alike whatever order they store it in; a compacted run comes back unchanged."""
    from exporter.kvevents_codec import decode_record

    doc_a, doc_b, tail = [101, 102, 103, 104], [105, 106, 107, 108], [109, 110, 111, 112]
    blocks = mk.workload_block_ids([doc_a + doc_b + [1, 2], doc_a + tail], 4)
    assert len(blocks.tokens) == 3 and blocks.tokens[2] == tuple(tail)
    ha, hb, ht, hx = 17290714723464915149, 5350521962767892701, 13959774257468459107, 99
    run1 = [
        _rec(0, _stored([ha, hb], None, doc_a + doc_b)),
        _rec(1, _stored([ht], ha, tail), {"type": "BlockRemoved", "block_hashes": [hb]}),
        _rec(2, _stored([hx], ht, [200, 201, 202, 203])),  # not the workload's: left alone
        _rec(3, _stored([ha], None, [], medium="CPU"), {"type": "AllBlocksCleared"}),
    ]
    run2 = [_rec(0, _stored([ha], None, doc_a)), _rec(1, _stored([ht], ha, tail))]
    out1, st1 = mk.compact_kv_records(run1, blocks)
    out2, _ = mk.compact_kv_records(run2, blocks)
    assert st1 == mk.CompactStats(hashes=4, identified=3, zeroed_events=2)
    ev = out1[0]["payload"][1][0]
    assert ev["token_ids"] == [0] * 8 and ev["block_ids"] == [1, 2]
    assert ev["block_hashes"] == [ha, hb]  # the simulator reads hash values, not just identity
    assert out1[1]["payload"][1][0]["block_ids"] == out2[1]["payload"][1][0]["block_ids"] == [3]
    assert out2[0]["payload"][1][0]["block_ids"] == [1]
    assert out1[2] == run1[2] and out1[3] == run1[3]
    for a, b in zip(run1, out1, strict=True):
        assert decode_record(json.dumps(a)).batch == decode_record(json.dumps(b)).batch
        assert mk.restore_token_ids(b, blocks) == a
    assert mk.compact_kv_records(out1, blocks) == (out1, mk.CompactStats(4, 0, 0))
    clash = [_rec(0, _stored([ha], None, doc_a)), _rec(1, _stored([ha], None, doc_b))]
    blocks2 = mk.workload_block_ids([doc_a, doc_b], 4)
    with pytest.raises(ValueError, match="one to one"):
        mk.compact_kv_records(clash, blocks2)


def test_matrix_compact_rewrites_a_run_once(tmp_path: Path) -> None:
    """`matrix.py compact`: the scenario's own prompts name the blocks; the marker in meta.json
    makes a second call a no-op; metrics keep their lines."""
    sc = SCENARIOS["qwen3-8b-long-context-none"]
    prompt = list(mk.generate(sc)[0].prompt[:48])
    d = tmp_path / sc.name
    d.mkdir()
    wl = {"seed": sc.workload.seed, "params": sc.workload.params}
    (d / "meta.json").write_text(
        json.dumps({"scenario": sc.name, "workload": wl, "block_size": 16})
    )
    ev = {**_stored([7 << 40, 8 << 40, 9 << 40], None, prompt), "block_size": 16}
    lines = [
        json.dumps(_rec(0, ev)),
        json.dumps(_rec(1, {"type": "BlockRemoved", "block_hashes": [9 << 40]})),
    ]
    (d / "kv_events.jsonl.xz").write_bytes(lzma.compress(("\n".join(lines) + "\n").encode()))
    metrics = "".join(json.dumps({"t": float(t), "body": "a 1\n"}) + "\n" for t in range(50))
    (d / "metrics.jsonl.xz").write_bytes(lzma.compress(metrics.encode(), preset=0))
    assert matrix.main(["compact", str(tmp_path)]) == 0
    meta = json.loads((d / "meta.json").read_text())
    assert meta[mk.COMPACT_KEY]["scheme"] == mk.COMPACT_SCHEME
    assert meta[mk.COMPACT_KEY]["identified"] == 3
    with lzma.open(d / "kv_events.jsonl.xz", "rt") as fh:
        got = [json.loads(x) for x in fh]
    assert got[0]["payload"][1][0]["token_ids"] == [0] * 48
    assert got[0]["payload"][1][0]["block_ids"] == [1, 2, 3]  # the sequence's first blocks
    assert json.dumps(got[1]) == lines[1]
    assert lzma.decompress((d / "metrics.jsonl.xz").read_bytes()).decode() == metrics
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    assert matrix.main(["compact", str(d)]) == 0
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


@pytest.mark.parametrize("made", [False, True])
def test_matrix_collect_without_a_driver_says_so_at_once(
    tmp_path: Path, made: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """A collect call on a fresh machine (the one that ran the driver went back between calls)
    finds no work folder, or one no driver started in: it must stop with a clear error, not wait
    out its --wait-s (session 9 lost 577 s of device time to that wait, then a traceback)."""
    work = tmp_path / "kvoe-matrix"
    if made:
        (work / "runs").mkdir(parents=True)
    out = tmp_path / "out"
    rc = matrix.main(["collect", "--work", str(work), "--out", str(out), "--wait-s", "0.5"])
    assert rc == 3
    assert "no driver was started" in capsys.readouterr().err
    assert not out.exists()


def test_matrix_collect_packs_each_run_as_it_finishes(tmp_path: Path) -> None:
    """A run finalized while a collect call waits is in that call's output before the wait is
    over, so a call cut off at its limit, or a machine that goes back before the next call,
    keeps it (session 11 lost a 32B run whose traffic ended seconds before the end of a
    collect that packed only when it returned)."""
    work = tmp_path / "kvoe-matrix"
    run = work / "runs" / "s-w-cpu192k"
    run.mkdir(parents=True)
    (run / "meta.json").write_text("{}")
    (work / "daemon.pid").write_text(f"{os.getpid()} matrix.py\n")  # alive, never DONE
    (work / "status.json").write_text(json.dumps({"runs": {run.name: {"state": "written"}}}))
    out = tmp_path / "out"
    collect = threading.Thread(
        target=matrix.main,
        args=(["collect", "--work", str(work), "--out", str(out), "--wait-s", "12"],),
    )
    collect.start()
    try:
        time.sleep(0.5)
        assert not list(out.glob("runs-*"))
        (run / "FINAL").write_text("{}\n")
        deadline = time.monotonic() + 6
        while not list(out.glob("runs-*.tar")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert collect.is_alive()  # still waiting, and the run is already out
        tars = list(out.glob("runs-*"))
        assert [t.name for t in tars] == ["runs-0-0.tar"]
        with tarfile.open(tars[0]) as tar:
            assert "s-w-cpu192k/FINAL" in tar.getnames()
        # A second run joins the same tar: $OUT takes 8 files a call, so runs are not one tar
        # each.
        later = work / "runs" / "s-w-none"
        later.mkdir()
        (later / "FINAL").write_text("{}\n")
        deadline = time.monotonic() + 6
        names: list[str] = []
        while "s-w-none/FINAL" not in names and time.monotonic() < deadline:
            time.sleep(0.2)
            with tarfile.open(out / "runs-0-0.tar") as tar:
                names = tar.getnames()
        assert "s-w-none/FINAL" in names and collect.is_alive()
    finally:
        collect.join()
    assert [t.name for t in out.glob("runs-*")] == ["runs-0-0.tar"]  # no `.part` left
    with tarfile.open(out / "runs-0-0.tar") as tar:
        assert {"s-w-cpu192k/FINAL", "s-w-none/FINAL"} <= set(tar.getnames())
    collected = (work / "collected.txt").read_text().split()
    assert sorted(collected) == ["s-w-cpu192k", "s-w-none"]  # each run once


@pytest.mark.parametrize("grace", [0.0, 60.0])
def test_matrix_collect_waits_for_a_run_being_compressed(tmp_path: Path, grace: float) -> None:
    """A run whose traffic ended as the wait ran out (state "written", FINAL not yet there)
    goes into this call's tar when --grace-s allows, instead of into a next call that may find
    a fresh machine; with no grace it is left for the next collect."""
    work = tmp_path / "kvoe-matrix"
    run = work / "runs" / "s-w-cpu64k"
    run.mkdir(parents=True)
    (run / "meta.json").write_text("{}")
    (work / "daemon.pid").write_text(f"{os.getpid()} matrix.py\n")
    (work / "DONE").write_text("done\n")
    (work / "status.json").write_text(json.dumps({"runs": {run.name: {"state": "written"}}}))
    finalizer = threading.Timer(1.5, lambda: (run / "FINAL").write_text("{}\n"))
    finalizer.start()
    out = tmp_path / "out"
    args = ["collect", "--work", str(work), "--out", str(out), "--grace-s", str(grace)]
    try:
        assert matrix.main(args) == 0
    finally:
        finalizer.join()
    names: list[str] = []
    for t in sorted(out.glob("runs-*.tar")):
        with tarfile.open(t) as tar:
            names += tar.getnames()
    assert ("s-w-cpu64k/FINAL" in names) == (grace > 0)
