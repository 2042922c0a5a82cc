"""Pure parts of the GPU acceptance kit: model shapes, server configurations, workloads,
time-budget planning, exporter flag selection, KV-event decoding, result summaries, packing.

Standard library only (msgspec is imported lazily where a payload is decoded), so the CI
machine tests all of it without vLLM or a GPU (tests/test_gpu_kit.py). The driver that uses it
is bench/gpu/acceptance.py; the numbers and the reasons behind them are in bench/gpu/README.md.
"""

from __future__ import annotations

import base64
import gzip
import io
import itertools
import json
import lzma
import math
import random
import re
import statistics
import tarfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

GIB = 1 << 30
MIB = 1 << 20

# --------------------------------------------------------------------------------------------
# Model shapes (config-only directories served with --load-format dummy --skip-tokenizer-init)
# --------------------------------------------------------------------------------------------

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "use_cache": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

# The published model's shape (../shared/notes/h200-vllm-recipe.md step 5).
QWEN3_06B: dict[str, Any] = {
    **_QWEN3_COMMON,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "tie_word_embeddings": True,
}

# A large dense GQA shape where recompute per token is expensive: Qwen3-32B's published shape.
QWEN3_32B: dict[str, Any] = {
    **_QWEN3_COMMON,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "max_window_layers": 64,
    "tie_word_embeddings": False,
}

# The CPU smoke model: testbed/vllm_cpu.py's tiny Llama (float32, CPU block size 128), copied
# because the kit runs as a standalone script; tests/test_gpu_kit.py keeps the two equal.
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def kv_bytes_per_token(cfg: Mapping[str, Any], dtype_bytes: int = 2) -> int:
    """K and V, per layer, per KV head, per head dim."""
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    return (
        2 * int(cfg["num_hidden_layers"]) * int(cfg["num_key_value_heads"]) * head_dim * dtype_bytes
    )


def param_count(cfg: Mapping[str, Any]) -> int:
    """Parameters of a Llama/Qwen3-style dense decoder (norms included, biases none)."""
    h = int(cfg["hidden_size"])
    inter = int(cfg["intermediate_size"])
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or h // heads)
    vocab = int(cfg["vocab_size"])
    attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    mlp = 3 * h * inter
    norms = 2 * h + (2 * head_dim if cfg.get("model_type") == "qwen3" else 0)
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * (attn + mlp + norms) + embed + h


@dataclass(frozen=True)
class Shape:
    name: str
    model: Mapping[str, Any]
    served_name: str
    block_size: int  # tokens per KV block (FlashAttention 3 on Hopper: 16; vLLM CPU: 128)
    kv_cache_bytes: int | None  # --kv-cache-memory-bytes (GPU); None on CPU
    gpu_util: float  # only gates vLLM's start-up free-memory check when kv bytes are given
    est_start_s: float  # planning estimate: process start to /health 200
    est_work_s: float  # planning estimate: exporter start, W1, W2, settles, snapshots, stop
    est_gpu_bytes: int  # planning estimate: GPU memory held once started
    request_timeout_s: float
    dtype_bytes: int = 2
    num_gpu_blocks_override: int | None = None  # CPU smoke only
    device: str = "gpu"

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model, self.dtype_bytes)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def gpu_blocks(self) -> int:
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        assert self.kv_cache_bytes is not None
        return self.kv_cache_bytes // self.kv_bytes_per_block

    @property
    def vocab(self) -> int:
        return int(self.model["vocab_size"])

    @property
    def weight_bytes(self) -> int:
        return param_count(self.model) * self.dtype_bytes


SMALL_KV_BYTES = 268435456  # published: 256 MiB of GPU KV for the 0.6B shape
SMALL_BPT = kv_bytes_per_token(QWEN3_06B)  # 114,688
LARGE_BPT = kv_bytes_per_token(QWEN3_32B)  # 262,144
# The large shape keeps the published ratios to the 1600-token prompts: the same number of GPU
# blocks (146 = 2336 tokens) and the same CPU pool sizes in blocks, so every byte size is scaled
# by the ratio of KV bytes per token (262144 / 114688 = 16/7).
LARGE_SCALE = LARGE_BPT / SMALL_BPT
LARGE_KV_BYTES = round(SMALL_KV_BYTES * LARGE_SCALE)  # 613,566,757 B = 585.1 MiB

SHAPES: dict[str, Shape] = {
    "small": Shape(
        name="small",
        model=QWEN3_06B,
        served_name="qwen3-dummy",
        block_size=16,
        kv_cache_bytes=SMALL_KV_BYTES,
        gpu_util=0.1,
        est_start_s=75.0,
        est_work_s=45.0,
        est_gpu_bytes=6 * GIB,
        request_timeout_s=60.0,
    ),
    "large": Shape(
        name="large",
        model=QWEN3_32B,
        served_name="qwen3-32b-dummy",
        block_size=16,
        kv_cache_bytes=LARGE_KV_BYTES,
        gpu_util=0.55,
        est_start_s=150.0,
        est_work_s=70.0,
        est_gpu_bytes=72 * GIB,
        request_timeout_s=120.0,
    ),
    "tiny": Shape(
        name="tiny",
        model=TINY_LLAMA,
        served_name="tiny-llama",
        block_size=128,
        kv_cache_bytes=None,
        gpu_util=0.0,
        est_start_s=150.0,  # vLLM CPU on 2 shared cores: 40 s idle, 200 s+ on a loaded machine
        est_work_s=60.0,
        est_gpu_bytes=0,
        request_timeout_s=120.0,
        dtype_bytes=4,
        num_gpu_blocks_override=20,
        device="cpu",
    ),
}


def model_config_json(shape: Shape) -> str:
    return json.dumps(dict(shape.model), indent=2) + "\n"


@dataclass(frozen=True)
class ServerConfig:
    name: str
    shape: Shape
    offload_gib: float | None = None  # --kv-offloading-size (GiB); None: no offload
    # kv_connector_extra_config beyond the size: eviction policy, store threshold, tiering
    # (issue 11). vLLM 0.26 keeps user extra config next to --kv-offloading-size.
    extra_config: Mapping[str, Any] | None = None

    @property
    def cpu_blocks(self) -> int:
        """CPU pool in blocks as vLLM's CPUOffloadingSpec computes it (blocks_per_chunk 1)."""
        if not self.offload_gib:
            return 0
        per_block = -(-self.shape.kv_bytes_per_block // 4096) * 4096  # rounded up to a page
        return int(self.offload_gib * GIB) // per_block


def _large_gib(small_gib: float) -> float:
    return round(small_gib * LARGE_SCALE, 6)


def _configs() -> dict[str, ServerConfig]:
    s, big, tiny = SHAPES["small"], SHAPES["large"], SHAPES["tiny"]
    out = [
        ServerConfig("small-a", s),
        ServerConfig("small-b", s, 0.5),
        ServerConfig("small-c025", s, 0.25),
        ServerConfig("small-c1", s, 1.0),
        ServerConfig("small-arc", s, 0.25, {"eviction_policy": "arc"}),
        ServerConfig("small-thr2", s, 0.5, {"store_threshold": 2}),
        ServerConfig(
            "small-tier",
            s,
            0.25,
            {
                "spec_name": "TieringOffloadingSpec",
                "secondary_tiers": [
                    {"type": "fs", "root_dir": "/tmp/kvoe-gpu/fs-tier", "enable_kv_events": True}
                ],
            },
        ),
        ServerConfig("large-a", big),
        ServerConfig("large-b", big, _large_gib(0.5)),
        ServerConfig("large-c025", big, _large_gib(0.25)),
        ServerConfig("large-c1", big, _large_gib(1.0)),
        ServerConfig("tiny-a", tiny),
        ServerConfig("tiny-a2", tiny),
    ]
    return {c.name: c for c in out}


CONFIGS: dict[str, ServerConfig] = _configs()


def resolve_configs(names: str | Sequence[str]) -> list[ServerConfig]:
    items = names.split(",") if isinstance(names, str) else list(names)
    unknown = [n for n in items if n.strip() and n.strip() not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    return [CONFIGS[n.strip()] for n in items if n.strip()]


# --------------------------------------------------------------------------------------------
# vLLM command line and environment
# --------------------------------------------------------------------------------------------


def kv_events_config(endpoint: str, replay_endpoint: str | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": "kv",
    }
    if replay_endpoint:
        cfg["replay_endpoint"] = replay_endpoint
    return cfg


def server_command(
    cfg: ServerConfig,
    *,
    python: str,
    model_dir: str,
    port: int,
    kv_endpoint: str,
    replay_endpoint: str | None = None,
    eager: bool = True,
    extra: Sequence[str] = (),
) -> list[str]:
    """The recipe's command (../shared/notes/h200-vllm-recipe.md step 6), KV events in connect
    mode (vLLM's PUB connects to the recorder, which binds 127.0.0.1)."""
    shape = cfg.shape
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        shape.served_name,
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
    ]
    if shape.device == "gpu":
        assert shape.kv_cache_bytes is not None
        cmd += ["--kv-cache-memory-bytes", str(shape.kv_cache_bytes)]
    cmd += ["--max-model-len", "2048", "--enable-prefix-caching"]
    if shape.device == "gpu":
        cmd += ["--gpu-memory-utilization", str(shape.gpu_util)]
    else:
        cmd += [
            "--dtype",
            "float32",
            "--num-gpu-blocks-override",
            str(shape.num_gpu_blocks_override),
            "--max-num-seqs",
            "4",
        ]
    cmd += [
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps(kv_events_config(kv_endpoint, replay_endpoint)),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
    ]
    if eager and shape.device == "gpu":
        cmd.append("--enforce-eager")
    if cfg.offload_gib:
        cmd += ["--kv-offloading-size", f"{cfg.offload_gib:g}", "--kv-offloading-backend", "native"]
        if cfg.extra_config:
            transfer = {"kv_connector_extra_config": dict(cfg.extra_config)}
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
    return cmd + list(extra)


def server_env(base: Mapping[str, str], shape: Shape, pythonpath: str | None) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env.update(
        {
            # Reproducible block hashes across servers (vllm/v1/core/kv_cache_utils.py
            # init_none_hash): runs (a), (b), (c) publish the same hashes for the same prompts.
            "PYTHONHASHSEED": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if shape.device == "gpu":
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"  # flashinfer is not carried (recipe step 4)
        # The device's README: keep NVLink multicast off, also in programs with their own env.
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    else:
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_NUM_THREADS": "1",
            }
        )
    return env


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------

PROMPT_TOKENS = 1600
W1_SEQUENCE = (
    ("A_cold", "A"),
    ("A_gpu_hit", "A"),
    ("B", "B"),
    ("C", "C"),
    ("A_after_evict", "A"),
)


@dataclass(frozen=True)
class Request:
    workload: str  # "W1" | "W2"
    batch: int  # W1: batch; W2: round
    name: str  # W1: A_cold...; W2: doc name
    doc: str  # key into the workload's documents


@dataclass
class Workload:
    name: str
    docs: dict[str, list[int]]
    requests: list[Request]
    pause_s: float = 0.05

    @property
    def unique_tokens(self) -> int:
        return sum(len(d) for d in self.docs.values())


def _doc(rng: random.Random, vocab: int, tokens: int) -> list[int]:
    # Avoid the first and last ids (special tokens in real vocabularies).
    return [rng.randrange(100, vocab - 100) for _ in range(tokens)]


def workload_w1(
    vocab: int, *, batches: int = 5, prompt_tokens: int = PROMPT_TOKENS, seed: int = 8001
) -> Workload:
    """The published pattern: per batch fresh A, B, C sent as A, A, B, C, A."""
    rng = random.Random(seed)
    docs: dict[str, list[int]] = {}
    reqs: list[Request] = []
    for b in range(batches):
        for key in "ABC":
            docs[f"b{b}{key}"] = _doc(rng, vocab, prompt_tokens)
        reqs += [Request("W1", b, name, f"b{b}{key}") for name, key in W1_SEQUENCE]
    return Workload("W1", docs, reqs)


def w2_doc_count(shape: Shape, largest_cpu_blocks: int, prompt_tokens: int = PROMPT_TOKENS) -> int:
    """More documents than the largest CPU pool plus the GPU pool hold, with a margin."""
    per_doc = prompt_tokens // shape.block_size
    need = (largest_cpu_blocks + shape.gpu_blocks) / max(per_doc, 1)
    return max(4, math.floor(need) + 2)


def workload_w2(
    vocab: int,
    *,
    docs: int,
    rounds: int = 4,
    prompt_tokens: int = PROMPT_TOKENS,
    seed: int = 9001,
) -> Workload:
    """N documents, each round a fresh random permutation of all of them (the first round cold).

    A fixed cyclic order would give an LRU tier of fewer than N documents no hit at all at every
    size; shuffled rounds spread the reuse distances from 1 to 2N-1 documents, so the hit ratio
    grows with the CPU buffer and the what-if curve has a shape to check.
    """
    rng = random.Random(seed)
    names = [f"d{i:02d}" for i in range(docs)]
    doc_map = {n: _doc(rng, vocab, prompt_tokens) for n in names}
    order = random.Random(seed + 1)
    reqs: list[Request] = []
    for r in range(rounds):
        perm = names[:]
        order.shuffle(perm)
        reqs += [Request("W2", r, n, n) for n in perm]
    return Workload("W2", doc_map, reqs)


def workloads_for(
    shape: Shape, largest_cpu_blocks: int, *, w1_batches: int = 5, w2_rounds: int = 4
) -> list[Workload]:
    """The same token ids for every server of a shape (so runs (a), (b), (c) see one stream)."""
    n = w2_doc_count(shape, largest_cpu_blocks)
    return [
        workload_w1(shape.vocab, batches=w1_batches),
        workload_w2(shape.vocab, docs=n, rounds=w2_rounds),
    ]


def largest_cpu_blocks(shape: Shape) -> int:
    sizes = [c.cpu_blocks for c in CONFIGS.values() if c.shape.name == shape.name]
    return max(sizes, default=0)


# --------------------------------------------------------------------------------------------
# Time-budget planning
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """Servers started together; their workloads then run one after the other while the rest
    of the group is idle (idle servers launch no GPU work)."""

    configs: tuple[str, ...]
    est_s: float


@dataclass(frozen=True)
class Plan:
    groups: tuple[Group, ...]
    skipped: tuple[str, ...]
    est_total_s: float


def group_estimate(cfgs: Sequence[ServerConfig], est: Mapping[str, Mapping[str, float]]) -> float:
    def get(c: ServerConfig, key: str) -> float:
        return est.get(c.shape.name, {}).get(key, getattr(c.shape, key))

    if not cfgs:
        return 0.0
    return max(get(c, "est_start_s") for c in cfgs) + sum(get(c, "est_work_s") for c in cfgs)


def plan_groups(
    cfgs: Sequence[ServerConfig],
    budget_s: float,
    *,
    estimates: Mapping[str, Mapping[str, float]] | None = None,
    gpu_capacity_bytes: int = 125 * 10**9,
    max_group: int = 5,
    reserve_s: float = 30.0,
) -> Plan:
    """Greedy, in the given order: a config joins the open group while the group's GPU memory
    fits, it has fewer than max_group servers and the whole plan still fits the budget (minus a
    reserve for packing); a config that fits nowhere is skipped, later ones may still fit."""
    est = estimates or {}
    groups: list[list[ServerConfig]] = []
    skipped: list[str] = []
    avail = budget_s - reserve_s

    def total(gs: list[list[ServerConfig]]) -> float:
        return sum(group_estimate(g, est) for g in gs)

    for c in cfgs:
        if groups:
            g = groups[-1]
            mem = sum(x.shape.est_gpu_bytes for x in g) + c.shape.est_gpu_bytes
            if len(g) < max_group and mem <= gpu_capacity_bytes:
                trial = [*groups[:-1], [*g, c]]
                if total(trial) <= avail:
                    groups = trial
                    continue
        trial = [*groups, [c]]
        if c.shape.est_gpu_bytes <= gpu_capacity_bytes and total(trial) <= avail:
            groups = trial
        else:
            skipped.append(c.name)
    out = tuple(Group(tuple(c.name for c in g), group_estimate(g, est)) for g in groups)
    return Plan(out, tuple(skipped), sum(g.est_s for g in out))


# --------------------------------------------------------------------------------------------
# Exporter flags: pass only what the installed exporter accepts
# --------------------------------------------------------------------------------------------

_FLAG_RE = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9.-]*)(?:[ =]([A-Z][A-Z0-9_]*))?")


def parse_help_flags(text: str) -> dict[str, str]:
    """{--flag: METAVAR or ''} from argparse --help output."""
    out: dict[str, str] = {}
    for m in _FLAG_RE.finditer(text):
        flag, metavar = m.group(1), m.group(2) or ""
        if flag not in out or (metavar and not out[flag]):
            out[flag] = metavar
    return out


@dataclass(frozen=True)
class FlagWish:
    purpose: str
    candidates: tuple[str, ...]
    value: str | None  # None: a switch without a value


def exporter_wishes(ctx: Mapping[str, Any]) -> list[FlagWish]:
    """What the driver would like to tell the exporter, with the flag names it might have.

    ctx keys: kv_forward (endpoint the exporter connects to), kv_replay, events_file,
    vllm_pid, nvml_interval_s, sizes (list of byte sizes), kv_bytes_per_block, min_window_s,
    window_s.
    """
    wishes: list[FlagWish] = []
    if ctx.get("kv_forward"):
        wishes.append(
            FlagWish(
                "kv_events",
                (
                    "--kv-events-endpoint",
                    "--kv-events",
                    "--kv-events-url",
                    "--kv-event-endpoint",
                    "--kv-events-connect",
                ),
                str(ctx["kv_forward"]),
            )
        )
    if ctx.get("kv_replay"):
        wishes.append(
            FlagWish(
                "kv_replay",
                (
                    "--kv-events-replay-endpoint",
                    "--kv-events-replay",
                    "--kv-replay-endpoint",
                    "--replay-endpoint",
                ),
                str(ctx["kv_replay"]),
            )
        )
    if ctx.get("events_file"):
        wishes.append(
            FlagWish("record_events", ("--record-events", "--kv-events-record"), ctx["events_file"])
        )
    if ctx.get("vllm_pid"):
        wishes.append(FlagWish("vllm_pid", ("--vllm-pid", "--pid"), str(ctx["vllm_pid"])))
    if ctx.get("nvml_interval_s"):
        wishes.append(
            FlagWish(
                "nvml_interval",
                (
                    "--nvml-poll-interval",
                    "--pcie-poll-interval",
                    "--nvml-interval",
                    "--nvml-poll",
                ),
                str(ctx["nvml_interval_s"]),
            )
        )
    if ctx.get("sizes"):
        sizes = ",".join(str(int(s)) for s in ctx["sizes"])
        wishes.append(
            FlagWish(
                "whatif_sizes",
                (
                    "--whatif-sizes",
                    "--what-if-sizes",
                    "--whatif-buffer-sizes",
                    "--cpu-buffer-sizes",
                ),
                sizes,
            )
        )
    if ctx.get("kv_bytes_per_block"):
        wishes.append(
            FlagWish(
                "kv_bytes_per_block", ("--kv-bytes-per-block",), str(ctx["kv_bytes_per_block"])
            )
        )
    if ctx.get("min_window_s"):
        # The advisor answers insufficient_data below min_window_seconds (120 s by default);
        # one server's turn here is ~30-60 s of data.
        wishes.append(
            FlagWish(
                "advisor_min_window",
                ("--threshold",),
                f"min_window_seconds={ctx['min_window_s']:g}",
            )
        )
    if ctx.get("window_s"):
        wishes.append(FlagWish("window", ("--window",), str(ctx["window_s"])))
    return wishes


def choose_exporter_flags(
    available: Mapping[str, str], wishes: Iterable[FlagWish], drop: Iterable[str] = ()
) -> tuple[list[list[str]], dict[str, str], list[str]]:
    """([[flag, value] or [flag], ...], {purpose: flag used}, [purposes with no such flag])."""
    dropped = set(drop)
    groups: list[list[str]] = []
    used: dict[str, str] = {}
    missing: list[str] = []
    for w in wishes:
        flag = next((c for c in w.candidates if c in available and c not in dropped), None)
        if flag is None:
            missing.append(w.purpose)
            continue
        value = w.value
        if w.purpose == "nvml_interval" and value is not None:
            mv = available.get(flag, "").upper()
            if mv in ("MS", "MILLISECONDS"):
                value = f"{float(value) * 1000:g}"
        groups.append([flag] if value is None else [flag, value])
        used[w.purpose] = flag
    return groups, used, missing


def flags_named_in(text: str, argv: Sequence[str]) -> list[str]:
    """Flags of argv that an error message mentions (to drop them and retry)."""
    return [a for a in argv if a.startswith("--") and a in text]


# --------------------------------------------------------------------------------------------
# KV events: decode one ZMQ message into the recorded JSON-lines form
# --------------------------------------------------------------------------------------------


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, bytes | bytearray | memoryview):
        return {"bytes_hex": bytes(obj).hex()}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj


def decode_kv_message(frames: Sequence[bytes]) -> dict[str, Any]:
    """{"nframes", "topic", "seq", "payload": [ts, [event maps], dp_rank]} as msgspec decodes
    the payload (block hashes stay ints); bytes (non-int hashes) become {"bytes_hex": ...}.
    A message that cannot be decoded keeps its raw payload in base64 and an "error"."""
    import msgspec

    rec: dict[str, Any] = {"nframes": len(frames)}
    topic = frames[0] if frames else b""
    rec["topic"] = topic.decode("utf-8", errors="replace")
    seq_b = frames[1] if len(frames) > 1 else b""
    rec["seq"] = int.from_bytes(seq_b, "big") if len(seq_b) == 8 else -1
    payload = frames[2] if len(frames) > 2 else b""
    try:
        rec["payload"] = _jsonable(msgspec.msgpack.decode(payload))
    except Exception as exc:  # keep the bytes; the recorder never stops on bad input
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["payload_b64"] = base64.b64encode(payload).decode()
    return rec


def event_counts(lines: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """{"<type>/<medium>": events, "<type>/<medium>:blocks": hashes, "messages", "gaps"}."""
    out: dict[str, int] = {"messages": 0, "gaps": 0, "decode_errors": 0}
    last: int | None = None
    for rec in lines:
        out["messages"] += 1
        seq = int(rec.get("seq", -1))
        if last is not None and seq != last + 1:
            out["gaps"] += 1
        last = seq
        payload = rec.get("payload")
        if not isinstance(payload, list) or len(payload) < 2:
            out["decode_errors"] += 1
            continue
        for ev in payload[1]:
            if isinstance(ev, dict):
                typ, medium, hashes = ev.get("type"), ev.get("medium"), ev.get("block_hashes")
            elif isinstance(ev, list) and ev:  # legacy array layout: tag first
                typ, medium, hashes = ev[0], None, ev[1] if len(ev) > 1 else None
            else:
                continue
            key = f"{typ}/{medium or '-'}"
            out[key] = out.get(key, 0) + 1
            out[key + ":blocks"] = out.get(key + ":blocks", 0) + len(hashes or [])
    return out


# --------------------------------------------------------------------------------------------
# Results: exposition samples, latency medians, NVML accumulation
# --------------------------------------------------------------------------------------------

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def exposition_values(text: str, names: Iterable[str]) -> dict[str, float]:
    """Sum of all samples of each wanted name (across labels); absent names are left out."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE_RE.match(line)
        if not m or m.group(1) not in wanted:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def exposition_labelled(text: str, name: str) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            m = _SAMPLE_RE.match(line)
            if m and m.group(1) == name:
                try:
                    out.append((m.group(2) or "", float(m.group(3))))
                except ValueError:
                    continue
    return out


OFFLOAD_SERIES = (
    "vllm:kv_offload_store_bytes_total",
    "vllm:kv_offload_load_bytes_total",
    "vllm:kv_offload_store_time_total",
    "vllm:kv_offload_load_time_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:kv_offload_allocation_failure_total",
)


def latency_medians(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """{workload: {request name: median ms}} over successful requests; W2 by round kind
    (round 0 = cold, later rounds = reuse)."""
    groups: dict[str, dict[str, list[float]]] = {}
    for r in records:
        if r.get("status") != 200 or r.get("ms") is None:
            continue
        wl = str(r["workload"])
        key = str(r["req"]) if wl == "W1" else ("cold" if r["batch"] == 0 else "reuse")
        groups.setdefault(wl, {}).setdefault(key, []).append(float(r["ms"]))
    return {
        wl: {k: round(statistics.median(v), 3) for k, v in cols.items()}
        for wl, cols in groups.items()
    }


def cached_token_totals(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in records:
        d = out.setdefault(str(r["workload"]), {"prompt_tokens": 0, "cached_tokens": 0})
        d["prompt_tokens"] += int(r.get("prompt_tokens") or 0)
        d["cached_tokens"] += int(r.get("cached_tokens") or 0)
    return out


@dataclass(frozen=True)
class NvmlRow:
    t: float
    tx: int
    rx: int
    rc_tx: int
    rc_rx: int


def read_nvml_csv(lines: Iterable[str]) -> list[NvmlRow]:
    rows: list[NvmlRow] = []
    for line in lines:
        parts = line.strip().split(",")
        if len(parts) != 5 or parts[0] == "t":
            continue
        try:
            rows.append(
                NvmlRow(float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), int(parts[4]))
            )
        except ValueError:
            continue
    return rows


def accumulate_pcie(rows: Sequence[NvmlRow], t0: float, t1: float) -> tuple[int, int] | None:
    """(tx, rx) bytes between t0 and t1 from raw 32-bit counters: (cur - prev) mod 2**32 over
    consecutive rows whose own nvmlReturn is 0. None if fewer than two good rows in range."""
    sel = [r for r in rows if t0 <= r.t <= t1 and r.rc_tx == 0 and r.rc_rx == 0]
    if len(sel) < 2:
        return None
    tx = sum((b.tx - a.tx) % (1 << 32) for a, b in itertools.pairwise(sel))
    rx = sum((b.rx - a.rx) % (1 << 32) for a, b in itertools.pairwise(sel))
    return tx, rx


def max_gap_s(rows: Sequence[NvmlRow], t0: float, t1: float) -> float | None:
    ts = [r.t for r in rows if t0 <= r.t <= t1]
    if len(ts) < 2:
        return None
    return max(b - a for a, b in itertools.pairwise(ts))


# --------------------------------------------------------------------------------------------
# Packing (results leave the device as at most 8 files of at most 16 MiB)
# --------------------------------------------------------------------------------------------

OUT_FILE_LIMIT = 16 * MIB - 64 * 1024
OUT_MAX_FILES = 8
XzPreset = Literal[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # lzma presets
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def safe_name(name: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    assert _SAFE_NAME.match(cleaned)
    return cleaned


def pack_dir(src: Path, dest: Path, *, preset: XzPreset = 6) -> int:
    """tar.xz of src (as a folder named src.name); returns the file size."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(dest.suffix + ".tmp")
    with tarfile.open(tmp, "w:xz", preset=preset) as tar:
        tar.add(src, arcname=src.name)
    tmp.replace(dest)
    return dest.stat().st_size


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """JSON lines from a plain, .gz or .xz file; a torn last line (killed writer) is skipped."""
    opener: Any = open
    if path.suffix == ".gz":
        opener = gzip.open
    elif path.suffix == ".xz":
        opener = lzma.open
    with opener(path, "rt", encoding="utf-8") as fh:
        for raw in fh:
            line = raw.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def thin_samples(
    samples: Sequence[Mapping[str, Any]],
    windows: Sequence[tuple[float, float]],
    *,
    margin_s: float = 5.0,
    idle_every_s: float = 0.0,
) -> list[Mapping[str, Any]]:
    """Keep every sample inside a window widened by margin_s (consecutive 1 s samples around the
    workloads), the first and the last sample, and outside windows one sample per idle_every_s
    (0: none)."""
    kept: list[Mapping[str, Any]] = []
    last_idle = -math.inf
    for i, s in enumerate(samples):
        t = float(s.get("t", 0.0))
        inside = any(a - margin_s <= t <= b + margin_s for a, b in windows)
        edge = i in (0, len(samples) - 1)
        idle_ok = idle_every_s > 0 and t - last_idle >= idle_every_s
        if inside or edge or idle_ok:
            kept.append(s)
            if not inside:
                last_idle = t
    return kept


def thin_nvml(
    rows: Sequence[NvmlRow], windows: Sequence[tuple[float, float]], *, margin_s: float = 1.0
) -> list[NvmlRow]:
    """All rows inside the widened windows; outside, one row per second. Safe for the 32-bit
    counters as long as idle traffic stays far below 4 GiB/s (it is ~MB/s)."""
    kept: list[NvmlRow] = []
    last = -math.inf
    for i, r in enumerate(rows):
        inside = any(a - margin_s <= r.t <= b + margin_s for a, b in windows)
        if inside or i in (0, len(rows) - 1) or r.t - last >= 1.0:
            kept.append(r)
            last = r.t
    return kept


def nvml_csv(rows: Iterable[NvmlRow]) -> str:
    buf = io.StringIO()
    buf.write("t,tx_raw,rx_raw,rc_tx,rc_rx\n")
    for r in rows:
        buf.write(f"{r.t:.4f},{r.tx},{r.rx},{r.rc_tx},{r.rc_rx}\n")
    return buf.getvalue()


@dataclass
class Timer:
    """Phase durations for the log and summary.json."""

    phases: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = round(self.phases.get(name, 0.0) + seconds, 3)
