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
import signal
import subprocess
import sys
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

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
