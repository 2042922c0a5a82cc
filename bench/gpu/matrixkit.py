"""Pure parts of the real-GPU matrix (issue 16, section 2): scenarios as data, seeded workload
generators, the session plan, the recording format, and the paired ground truth.

A scenario is data (bench/gpu/scenarios/): a model shape (config.json of a dummy-weight model,
GPU KV in tokens), vLLM flags, an offload buffer (in tokens of KV, or GiB) or none, a workload
(generator name + parameters + seed + client concurrency) and the seconds of traffic. A new
scenario, shape or workload needs an edit of the JSON files only.

Standard library only, so the CI machine tests all of it (tests/test_gpu_kit.py). The device
driver is bench/gpu/matrix.py; bench/gpu/README.md ("The real-GPU matrix") has the calls.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 1 << 30
PAGE = 4096
# vLLM's log line when it has loaded the weights, per worker (GPU).
LOADING = re.compile(r"Model loading took ([0-9.]+) GiB")
SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"


def weight_bytes(server_log: str) -> float | None:
    """The model's weights per GPU as vLLM logged them when it loaded the model (meta.json's
    model_weight_bytes: with the GPU's peak, a computed token's floor)."""
    m = LOADING.search(server_log)
    return float(m.group(1)) * GIB if m else None


# Offload pays when it cuts the summed TTFT of the identical request sequence by at least 3%,
# costs when it adds 3% or more; in between it is neutral (issue 16). A family whose runs
# differ by more than that when they did the same work on one machine (`family_noise`) needs
# a change larger than that difference (docs/advisor.md, "Ground truth").
TRUTH_THRESHOLD = 0.03
# Runs whose traffic started this close ran on one machine when their meta does not name the
# GPU (meta "gpu" "uuid", recorded from session 4 on): a device session holds its machine for
# at most 30 minutes, and sessions were hours apart.
SAME_MACHINE_S = 1800.0
# Two runs did the same work when this share of their requests had the same cached tokens,
# or when their summed computed tokens are this close: concurrent requests trade prefix hits
# by the order they happen to be scheduled in (8B, 12 at once: 96 % of the requests alike,
# the summed computed tokens 0.8 % apart), which moves no work between the runs.
SAME_WORK_SHARE = 0.99
SAME_WORK_TOKENS = 0.01

# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShapeSpec:
    name: str
    model: Mapping[str, Any]  # the config.json of the dummy-weight model
    served_name: str
    block_size: int  # tokens per KV block (FlashAttention 3 on Hopper: 16)
    gpu_kv_tokens: int  # GPU KV cache in tokens -> --kv-cache-memory-bytes
    gpu_memory_utilization: float  # only vLLM's start-up free-memory check
    est_gpu_bytes: int  # planning: GPU memory once started
    est_start_s: float  # planning: process start to /v1/models 200
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        m = self.model
        head_dim = int(m.get("head_dim") or m["hidden_size"] // m["num_attention_heads"])
        return (
            2
            * int(m["num_hidden_layers"])
            * int(m["num_key_value_heads"])
            * head_dim
            * self.dtype_bytes
        )

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def gpu_blocks(self) -> int:
        return self.gpu_kv_tokens // self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.gpu_blocks * self.kv_bytes_per_block

    @property
    def vocab(self) -> int:
        return int(self.model["vocab_size"])

    @property
    def param_count(self) -> int:
        m = self.model
        h, inter = int(m["hidden_size"]), int(m["intermediate_size"])
        heads, kv_heads = int(m["num_attention_heads"]), int(m["num_key_value_heads"])
        head_dim = int(m.get("head_dim") or h // heads)
        attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
        norms = 2 * h + (2 * head_dim if m.get("model_type") == "qwen3" else 0)
        embed = int(m["vocab_size"]) * h * (1 if m.get("tie_word_embeddings") else 2)
        return int(m["num_hidden_layers"]) * (attn + 3 * h * inter + norms) + embed + h


def load_shapes(data: Mapping[str, Any]) -> dict[str, ShapeSpec]:
    """shapes.json: {"bases": {name: config}, "shapes": {name: {"base", "model", ...}}}."""
    bases = data.get("bases", {})
    out: dict[str, ShapeSpec] = {}
    for name, spec in data["shapes"].items():
        model = {**bases.get(spec.get("base", ""), {}), **spec["model"]}
        out[name] = ShapeSpec(
            name=name,
            model=model,
            served_name=spec.get("served_name", f"{name}-dummy"),
            block_size=int(spec.get("block_size", 16)),
            gpu_kv_tokens=int(spec["gpu_kv_tokens"]),
            gpu_memory_utilization=float(spec.get("gpu_memory_utilization", 0.1)),
            est_gpu_bytes=int(float(spec["est_gpu_gib"]) * GIB),
            est_start_s=float(spec.get("est_start_s", 90.0)),
            dtype_bytes=int(spec.get("dtype_bytes", 2)),
        )
    return out


# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OffloadSpec:
    size_gib: float  # --kv-offloading-size
    cpu_tokens: int | None = None  # what the size was derived from, if given in tokens
    backend: str = "native"
    extra_config: Mapping[str, Any] | None = None  # kv_connector_extra_config
    tag: str = ""


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    generator: str
    params: Mapping[str, Any]
    seed: int
    max_inflight: int = 1  # client slots: requests in flight at most
    max_tokens: int = 1


@dataclass(frozen=True)
class Scenario:
    name: str
    shape: ShapeSpec
    workload: WorkloadSpec
    offload: OffloadSpec | None
    traffic_s: float
    max_model_len: int
    vllm_args: tuple[str, ...] = ()
    # Sending stops at traffic_s * stretch (a server that cannot keep up): the requests not sent
    # are listed, and the paired truth compares the common prefix of both runs.
    stretch: float = 1.5
    warmup_requests: int = 2
    pair: str = ""  # scenarios of one pair share it: same shape, workload, flags but offload
    # The engine-step timeline (bench/gpu/steplog.py, steps.jsonl.xz): bench evidence only, so
    # it leaves the pair as it is; a pair logs both its runs or neither.
    step_log: bool = False

    @property
    def offload_tag(self) -> str:
        return self.offload.tag if self.offload else "none"


def offload_spec(shape: ShapeSpec, raw: Mapping[str, Any] | None) -> OffloadSpec | None:
    """{"cpu_tokens": N} (the same buffer in tokens on every shape) or {"size_gib": G}."""
    if not raw:
        return None
    extra = raw.get("extra_config")
    backend = str(raw.get("backend", "native"))
    if "cpu_tokens" in raw:
        tokens = int(raw["cpu_tokens"])
        gib = round(tokens * shape.kv_bytes_per_token / GIB, 4)
        tag = raw.get("tag") or f"cpu{tokens // 1024}k"
        return OffloadSpec(gib, tokens, backend, extra, str(tag))
    gib = float(raw["size_gib"])
    return OffloadSpec(gib, None, backend, extra, str(raw.get("tag") or f"{gib:g}gib"))


def cpu_blocks(shape: ShapeSpec, off: OffloadSpec | None) -> int:
    """CPU pool in blocks as vLLM's CPUOffloadingSpec computes it (a block rounded to a page)."""
    if off is None:
        return 0
    per_block = -(-shape.kv_bytes_per_block // PAGE) * PAGE
    return int(off.size_gib * GIB) // per_block


def load_workloads(data: Mapping[str, Any]) -> dict[str, WorkloadSpec]:
    out: dict[str, WorkloadSpec] = {}
    for name, spec in data["workloads"].items():
        if spec["generator"] not in GENERATORS:
            raise ValueError(f"workload {name}: unknown generator {spec['generator']!r}")
        out[name] = WorkloadSpec(
            name=name,
            generator=str(spec["generator"]),
            params=dict(spec.get("params", {})),
            seed=int(spec.get("seed", 1)),
            max_inflight=int(spec.get("max_inflight", 1)),
            max_tokens=int(spec.get("max_tokens", 1)),
        )
    return out


def scenario_name(shape: str, workload: str, tag: str) -> str:
    return f"{shape}-{workload}-{tag}"


def expand_matrix(
    data: Mapping[str, Any], shapes: Mapping[str, ShapeSpec], workloads: Mapping[str, WorkloadSpec]
) -> dict[str, Scenario]:
    """matrix.json: "defaults", then "runs" (explicit) and/or "matrix" (a cross product of
    shapes x workloads x offload). Each entry may override any default."""
    defaults = dict(data.get("defaults", {}))
    entries: list[dict[str, Any]] = [dict(r) for r in data.get("runs", [])]
    for block in data.get("matrix", []):
        for sh in block["shapes"]:
            for wl in block["workloads"]:
                for off in block["offload"]:
                    e = {k: v for k, v in block.items() if k not in ("shapes", "workloads")}
                    e.update({"shape": sh, "workload": wl, "offload": off})
                    entries.append(e)
    out: dict[str, Scenario] = {}
    for e in entries:
        merged = {**defaults, **e}
        shape = shapes[merged["shape"]]
        wl = workloads[merged["workload"]]
        off = offload_spec(shape, merged.get("offload"))
        tag = off.tag if off else "none"
        name = merged.get("name") or scenario_name(shape.name, wl.name, tag)
        extra_args = tuple(str(a) for a in merged.get("vllm_args", ()))
        sc = Scenario(
            name=name,
            shape=shape,
            workload=wl,
            offload=off,
            traffic_s=float(merged["traffic_s"]),
            max_model_len=int(merged["max_model_len"]),
            vllm_args=extra_args,
            stretch=float(merged.get("stretch", 1.5)),
            warmup_requests=int(merged.get("warmup_requests", 2)),
            pair=f"{shape.name}-{wl.name}"
            + ("" if not extra_args else "-" + _args_tag(extra_args)),
            step_log=bool(merged.get("step_log", False)),
        )
        if name in out and out[name] != sc:
            raise ValueError(f"two different scenarios named {name}")
        out[name] = sc
    return out


def _args_tag(args: Sequence[str]) -> str:
    if list(args) == ["--enforce-eager"]:
        return "eager"
    return hashlib.sha256("\0".join(args).encode()).hexdigest()[:8]


def load_scenarios(
    directory: Path = SCENARIO_DIR, files: Sequence[str] | None = None
) -> dict[str, Scenario]:
    """The scenarios of every scenario file in directory, or of `files` (names) only."""
    shapes = load_shapes(json.loads((directory / "shapes.json").read_text()))
    workloads = load_workloads(json.loads((directory / "workloads.json").read_text()))
    out: dict[str, Scenario] = {}
    for f in sorted(directory.glob("*.json")):
        if f.name in ("shapes.json", "workloads.json") or (
            files is not None and f.name not in files
        ):
            continue
        out.update(expand_matrix(json.loads(f.read_text()), shapes, workloads))
    return out


def resolve(names: str | Sequence[str], scenarios: Mapping[str, Scenario]) -> list[Scenario]:
    items = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)]
    unknown = [n for n in items if n and n not in scenarios]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; known: {', '.join(sorted(scenarios))}")
    return [scenarios[n] for n in items if n]


# --------------------------------------------------------------------------------------------
# vLLM command line
# --------------------------------------------------------------------------------------------


def vllm_command(
    sc: Scenario, *, python: str, model_dir: str, port: int, kv_endpoint: str
) -> list[str]:
    """The recipe's server (../shared/notes/h200-vllm-recipe.md): dummy weights, token-id
    prompts, prefix caching, cached_tokens in usage, KV events to the recorder (which binds)."""
    shape = sc.shape
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": kv_endpoint,
        "topic": "kv",
    }
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
        "--kv-cache-memory-bytes",
        str(shape.kv_cache_bytes),
        "--max-model-len",
        str(sc.max_model_len),
        "--enable-prefix-caching",
        "--gpu-memory-utilization",
        f"{shape.gpu_memory_utilization:g}",
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps(events),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
    ]
    if sc.offload is not None:
        cmd += [
            "--kv-offloading-size",
            f"{sc.offload.size_gib:g}",
            "--kv-offloading-backend",
            sc.offload.backend,
        ]
        if sc.offload.extra_config:
            transfer = {"kv_connector_extra_config": dict(sc.offload.extra_config)}
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
    return cmd + list(sc.vllm_args)


# --------------------------------------------------------------------------------------------
# Workload generators: pure, seeded, deterministic token ids
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    i: int  # position in the sequence (the pairing key)
    t: float  # scheduled send time, seconds after traffic start
    prompt: tuple[int, ...]
    tags: Mapping[str, Any] = field(default_factory=dict)


def tokens(seed: int, key: str, n: int, vocab: int) -> list[int]:
    """n token ids from a generator keyed by (seed, key); avoids the first and last 100 ids
    (special tokens in real vocabularies). String seeds are hashed with sha512 by random, so
    the ids do not depend on PYTHONHASHSEED."""
    rng = random.Random(f"{seed}:{key}")
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def _span(value: Any, rng: random.Random) -> int:
    """An int, or [lo, hi] drawn uniformly (inclusive)."""
    if isinstance(value, list | tuple):
        return rng.randint(int(value[0]), int(value[1]))
    return int(value)


def _uspan(value: Any, rng: random.Random) -> float:
    if isinstance(value, list | tuple):
        return rng.uniform(float(value[0]), float(value[1]))
    return float(value)


def arrivals(rate_per_s: float, traffic_s: float, rng: random.Random, kind: str) -> list[float]:
    """Send times in [0, traffic_s): "poisson" (exponential gaps) or "uniform" (fixed gaps)."""
    out: list[float] = []
    if rate_per_s <= 0:
        return out
    if kind == "uniform":
        gap = 1.0 / rate_per_s
        n = math.ceil(traffic_s * rate_per_s)
        return [round(k * gap, 6) for k in range(n) if k * gap < traffic_s]
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= traffic_s:
            return out
        out.append(round(t, 6))


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def gen_unique(p: Mapping[str, Any], seed: int, vocab: int, traffic_s: float) -> list[Req]:
    """Every prompt fresh: no reuse at all (offload can only cost: stores that never load)."""
    rng = random.Random(seed)
    times = arrivals(float(p["rate_per_s"]), traffic_s, rng, p.get("arrival", "poisson"))
    out = []
    for i, t in enumerate(times):
        n = _span(p["prompt_tokens"], rng)
        out.append(Req(i, t, tuple(tokens(seed, f"u{i}", n, vocab)), {"kind": "unique"}))
    return out


def _docs(p: Mapping[str, Any], seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed * 7919 + 1)
    return [tokens(seed, f"doc{d}", _span(p["doc_tokens"], rng), vocab) for d in range(p["docs"])]


def gen_rag_zipf(p: Mapping[str, Any], seed: int, vocab: int, traffic_s: float) -> list[Req]:
    """RAG over a corpus: each request = one document (shared prefix) + a fresh question;
    documents drawn with Zipf(s) popularity over a seeded permutation of the corpus."""
    rng = random.Random(seed)
    docs = _docs(p, seed, vocab)
    rank = list(range(len(docs)))
    rng.shuffle(rank)  # rank k -> document rank[k]
    weights = zipf_weights(len(docs), float(p.get("zipf_s", 1.0)))
    times = arrivals(float(p["rate_per_s"]), traffic_s, rng, p.get("arrival", "poisson"))
    out = []
    for i, t in enumerate(times):
        d = rank[rng.choices(range(len(docs)), weights)[0]]
        q = tokens(seed, f"q{i}", _span(p["question_tokens"], rng), vocab)
        out.append(Req(i, t, tuple(docs[d] + q), {"doc": d}))
    return out


def gen_long_context(p: Mapping[str, Any], seed: int, vocab: int, traffic_s: float) -> list[Req]:
    """A few long documents (8k+ tokens each) asked about again and again, uniform popularity
    unless zipf_s is given: few requests, each a large prefill and a large reload."""
    lo = p["doc_tokens"][0] if isinstance(p["doc_tokens"], list | tuple) else p["doc_tokens"]
    if int(lo) < 8192:
        raise ValueError("long_context: doc_tokens must be at least 8192")
    return gen_rag_zipf({"zipf_s": 0.0, **p}, seed, vocab, traffic_s)


def gen_concurrent(p: Mapping[str, Any], seed: int, vocab: int, traffic_s: float) -> list[Req]:
    """Bursts of `burst` requests at the same instant (every burst_interval_s, jittered), each a
    Zipf-popular document + fresh question: several in flight, batched prefill."""
    rng = random.Random(seed)
    docs = _docs(p, seed, vocab)
    weights = zipf_weights(len(docs), float(p.get("zipf_s", 1.0)))
    burst, every = int(p["burst"]), float(p["burst_interval_s"])
    out: list[Req] = []
    t, b = 0.0, 0
    while t < traffic_s:
        for _ in range(burst):
            d = rng.choices(range(len(docs)), weights)[0]
            q = tokens(seed, f"q{len(out)}", _span(p["question_tokens"], rng), vocab)
            out.append(Req(len(out), round(t, 6), tuple(docs[d] + q), {"doc": d, "burst": b}))
        b += 1
        t += every * rng.uniform(0.5, 1.5)
    return out


def gen_multi_turn_chat(p: Mapping[str, Any], seed: int, vocab: int, traffic_s: float) -> list[Req]:
    """Growing conversations: a shared system prompt, then per conversation turns of user
    message + (synthetic, seeded) assistant reply; turn k's prompt is turn k-1's prompt + the
    reply to it + the next user message. Conversations start as a Poisson process; a user
    thinks think_s between turns, so many conversations interleave and their prefixes leave the
    GPU cache between turns. A conversation ends after its turns or at max_context_tokens."""
    rng = random.Random(seed)
    system = tokens(seed, "system", int(p["system_tokens"]), vocab)
    starts = arrivals(1.0 / float(p["conv_interval_s"]), traffic_s, rng, "poisson")
    max_ctx = int(p["max_context_tokens"])
    pending: list[tuple[float, int, int, tuple[int, ...]]] = []
    for c, t0 in enumerate(starts):
        turns = _span(p["turns"], rng)
        ctx = list(system)
        t = t0
        for k in range(turns):
            n_user = _span(p["first_user_tokens"] if k == 0 else p["user_tokens"], rng)
            if k > 0:
                ctx += tokens(seed, f"c{c}r{k - 1}", _span(p["reply_tokens"], rng), vocab)
                t += _uspan(p["think_s"], rng)
            user = tokens(seed, f"c{c}u{k}", n_user, vocab)
            if len(ctx) + len(user) > max_ctx or t >= traffic_s:
                break
            ctx += user
            pending.append((t, c, k, tuple(ctx)))
    pending.sort(key=lambda x: (x[0], x[1]))
    return [
        Req(i, round(t, 6), prompt, {"conv": c, "turn": k})
        for i, (t, c, k, prompt) in enumerate(pending)
    ]


def gen_abca(p: Mapping[str, Any], seed: int, vocab: int, traffic_s: float) -> list[Req]:
    """The published A/B/C/A pattern (acceptance kit W1) paced at interval_s, as many batches
    as fit: per batch fresh A, B, C sent as A, A, B, C, A."""
    out: list[Req] = []
    gap = float(p["interval_s"])
    n = int(p["prompt_tokens"])
    b = 0
    while True:
        docs = {k: tokens(seed, f"b{b}{k}", n, vocab) for k in "ABC"}
        for key in "AABCA":
            t = len(out) * gap
            if t >= traffic_s:
                return out
            out.append(Req(len(out), round(t, 6), tuple(docs[key]), {"batch": b, "doc": key}))
        b += 1


def gen_shuffled_docs(p: Mapping[str, Any], seed: int, vocab: int, traffic_s: float) -> list[Req]:
    """The acceptance kit's W2: N documents, each round a fresh permutation, interval_s apart."""
    rng = random.Random(seed)
    docs = _docs(p, seed, vocab)
    gap = float(p["interval_s"])
    out: list[Req] = []
    r = 0
    while True:
        perm = list(range(len(docs)))
        rng.shuffle(perm)
        for d in perm:
            t = len(out) * gap
            if t >= traffic_s:
                return out
            out.append(Req(len(out), round(t, 6), tuple(docs[d]), {"round": r, "doc": d}))
        r += 1


GENERATORS = {
    "unique": gen_unique,
    "rag_zipf": gen_rag_zipf,
    "long_context": gen_long_context,
    "concurrent": gen_concurrent,
    "multi_turn_chat": gen_multi_turn_chat,
    "abca": gen_abca,
    "shuffled_docs": gen_shuffled_docs,
}


def generate(sc: Scenario) -> list[Req]:
    """The scenario's request sequence; depends on the workload, the vocabulary and the traffic
    seconds only (never on the offload setting), so both halves of a pair send the same."""
    wl = sc.workload
    reqs = GENERATORS[wl.generator](wl.params, wl.seed, sc.shape.vocab, sc.traffic_s)
    limit = sc.max_model_len - wl.max_tokens
    too_long = [r.i for r in reqs if len(r.prompt) > limit]
    if too_long:
        raise ValueError(f"{sc.name}: {len(too_long)} prompts longer than {limit} tokens")
    return reqs


def warmup_prompts(sc: Scenario) -> list[list[int]]:
    """Requests before the traffic (kernels, allocator): short, fresh, the same in both runs."""
    return [
        tokens(sc.workload.seed, f"warmup{k}", 256, sc.shape.vocab)
        for k in range(sc.warmup_requests)
    ]


def sequence_stats(reqs: Sequence[Req], block_size: int) -> dict[str, Any]:
    """What a sequence asks of the cache: requests, prompt tokens, unique full blocks (by
    prefix), and the share of prompt blocks that an unbounded prefix cache would hit."""
    seen: set[int] = set()
    blocks = hit = 0
    for r in reqs:
        h = 0
        for b in range(len(r.prompt) // block_size):
            # A block's identity is its whole prefix: chain the hashes as vLLM does.
            h = hash((h, r.prompt[b * block_size : (b + 1) * block_size]))
            blocks += 1
            if h in seen:
                hit += 1
            else:
                seen.add(h)
    n = len(reqs)
    span = (reqs[-1].t - reqs[0].t) if n > 1 else 0.0
    return {
        "requests": n,
        "prompt_tokens": sum(len(r.prompt) for r in reqs),
        "max_prompt_tokens": max((len(r.prompt) for r in reqs), default=0),
        "unique_blocks": len(seen),
        "full_blocks": blocks,
        "ideal_hit_ratio": round(hit / blocks, 4) if blocks else 0.0,
        "rate_per_s": round(n / span, 3) if span > 0 else None,
    }


# --------------------------------------------------------------------------------------------
# Session plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    groups: tuple[tuple[str, ...], ...]  # servers started together, turns one after the other
    skipped: tuple[str, ...]
    est_total_s: float


# Warmup, drain, settle, stop, write (15 s), and the two host probes (matrix.py, ~7 s each).
TURN_OVERHEAD_S = 30.0

# What the servers of one group may take of the GPU together: 125 GB of the H200's 150.75 (the
# rest is CUDA contexts, graphs and activations beyond shapes.json's estimates, which held on
# every H200 session), and the same share of a smaller card (session 29 was offered an H100,
# 85.5 GB, on which three 14B servers of 38 GiB would not start).
GPU_CAPACITY_BYTES = 125 * 10**9
GPU_CAPACITY_SHARE = 0.83
MAX_GROUP = 8  # servers started together at most


def gpu_capacity_bytes(memory_total_bytes: int | None) -> int:
    """Planning capacity for a GPU of this much memory (NVML's total; None: the H200's)."""
    if not memory_total_bytes:
        return GPU_CAPACITY_BYTES
    return min(GPU_CAPACITY_BYTES, int(memory_total_bytes * GPU_CAPACITY_SHARE))


def turn_estimate(sc: Scenario) -> float:
    return sc.traffic_s + TURN_OVERHEAD_S


def plan_session(
    scenarios: Sequence[Scenario],
    budget_s: float,
    *,
    gpu_capacity_bytes: int = GPU_CAPACITY_BYTES,
    host_pinned_limit_bytes: int = 80 * GIB,
    max_group: int = MAX_GROUP,
) -> Plan:
    """Greedy, in the given order: a scenario joins the open group while GPU memory and pinned
    host memory fit, the group has fewer than `max_group` servers and the plan still fits the
    budget; else a new group starts (its servers start together, one wait); what fits nowhere
    is skipped. Turns run one at a time so no run shares the GPU with another's traffic, but
    a group's later servers sit loaded and idle beside its earlier turns (`max_group` 1: none
    does, each server starts after the one before it stopped)."""
    groups: list[list[Scenario]] = []
    skipped: list[str] = []

    def est(g: Sequence[Scenario]) -> float:
        return max(s.shape.est_start_s for s in g) + sum(turn_estimate(s) for s in g)

    def fits(g: Sequence[Scenario]) -> bool:
        gpu = sum(s.shape.est_gpu_bytes for s in g)
        pinned = sum(int(s.offload.size_gib * GIB) for s in g if s.offload)
        return (
            len(g) <= max_group and gpu <= gpu_capacity_bytes and pinned <= host_pinned_limit_bytes
        )

    for sc in scenarios:
        if groups and fits([*groups[-1], sc]):
            trial = [*groups[:-1], [*groups[-1], sc]]
        else:
            trial = [*groups, [sc]]
        if fits(trial[-1]) and sum(est(g) for g in trial) <= budget_s:
            groups = trial
        else:
            skipped.append(sc.name)
    return Plan(
        tuple(tuple(s.name for s in g) for g in groups),
        tuple(skipped),
        round(sum(est(g) for g in groups), 1),
    )


# --------------------------------------------------------------------------------------------
# Recording format (issue 16 section 1)
# --------------------------------------------------------------------------------------------

_TRANSFERS_PER_LANE = {1: 2.5e9, 2: 5e9, 3: 8e9, 4: 16e9, 5: 32e9, 6: 64e9}


def link_bandwidth_bytes(generation: int | None, width: int | None) -> float | None:
    """Theoretical bytes/s per direction of a PCIe link after line encoding (the exporter's
    exporter/sources/nvml/poller.py link_bandwidth_bytes, copied: the kit runs standalone)."""
    if generation is None or width is None or width <= 0:
        return None
    rate = _TRANSFERS_PER_LANE.get(generation)
    if rate is None:
        return None
    if generation <= 2:
        eff = 8 / 10
    elif generation <= 5:
        eff = 128 / 130
    else:
        eff = 236 / 256
    return rate * eff * width / 8


def metrics_line(sample: Mapping[str, Any]) -> str | None:
    """A scraper sample {"t", "ms", "status", "error", "body"} -> the recording's line
    {"t", "body"}; failed scrapes are dropped (None)."""
    if sample.get("status") != 200 or not sample.get("body"):
        return None
    return json.dumps({"t": sample["t"], "body": sample["body"]})


def kv_event_line(rec: Mapping[str, Any]) -> str | None:
    """The recorder's {"nframes", "topic", "seq", "payload"} -> {"topic", "seq", "payload"};
    undecodable messages are dropped (None)."""
    if "payload" not in rec or "error" in rec:
        return None
    return json.dumps({"topic": rec["topic"], "seq": rec["seq"], "payload": rec["payload"]})


# --------------------------------------------------------------------------------------------
# KV-event compaction: token ids that the workload's blocks imply
# --------------------------------------------------------------------------------------------

# meta.json key of a compacted recording; its "scheme" says how (COMPACT_SCHEME).
COMPACT_KEY = "kv_events_compaction"
COMPACT_SCHEME = "workload-block-ids-v1"
BLOCK_IDS = "block_ids"  # the field a compacted BlockStored event gains

BlockKey = tuple[int, tuple[int, ...]]  # (parent block id, 0 at the root; the block's tokens)


@dataclass(frozen=True)
class BlockIds:
    """Every distinct full block of a workload's prompts, numbered 1, 2, ... by its first
    appearance; a block is its tokens and its parent's id (vLLM's prefix hash chains the same
    way), so the numbering is a function of the workload alone, the same in every run of it."""

    ids: Mapping[BlockKey, int]
    tokens: Sequence[tuple[int, ...]]  # tokens[id - 1]: the block's token ids
    block_size: int


def workload_block_ids(prompts: Iterable[Sequence[int]], block_size: int) -> BlockIds:
    """Ids of the full blocks of `prompts`, in order (matrix.py: the request sequence of
    `generate`, then the warmup prompts, so the number of warmups leaves the traffic's ids)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    ids: dict[BlockKey, int] = {}
    toks: list[tuple[int, ...]] = []
    for prompt in prompts:
        parent = 0
        for k in range(len(prompt) // block_size):
            chunk = tuple(prompt[k * block_size : (k + 1) * block_size])
            key = (parent, chunk)
            got = ids.get(key)
            if got is None:
                got = ids[key] = len(ids) + 1
                toks.append(chunk)
            parent = got
    return BlockIds(ids, toks, block_size)


@dataclass(frozen=True)
class CompactStats:
    hashes: int  # distinct block hashes in the events
    identified: int  # of them whose tokens and parent are a block of the workload
    zeroed_events: int  # BlockStored events whose token ids were zeroed (block_ids added)

    def as_json(self) -> dict[str, int]:
        return {
            "hashes": self.hashes,
            "identified": self.identified,
            "zeroed_events": self.zeroed_events,
        }


def _event_maps(rec: Mapping[str, Any]) -> list[Any]:
    payload = rec.get("payload")
    events = payload.get("events") if isinstance(payload, Mapping) else None
    if isinstance(payload, list) and len(payload) in (2, 3):
        events = payload[1]
    if not isinstance(events, list):
        raise ValueError(f"record seq {rec.get('seq')}: no event list in the payload")
    for e in events:
        if not isinstance(e, Mapping):
            raise ValueError(f"record seq {rec.get('seq')}: an event that is not a map")
    return events


def _hash(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"block hash {value!r} is not an integer")
    return value


def _plain_block(e: Mapping[str, Any], k: int) -> bool:
    """No LoRA, extra keys or second KV group: the block's identity is its tokens and parent."""
    extra = e.get("extra_keys")
    if isinstance(extra, list) and k < len(extra) and extra[k] is not None:
        return False
    return e.get("lora_id") is None and e.get("lora_name") is None and not e.get("group_idx")


def _full_blocks(e: Mapping[str, Any], bs: int) -> tuple[list[int], list[Any]] | None:
    """(hashes, token ids) of a BlockStored event that carries all its blocks' tokens."""
    toks = e.get("token_ids")
    if e.get("type") != "BlockStored" or e.get("block_size") != bs or not isinstance(toks, list):
        return None
    hashes = [_hash(h) for h in e.get("block_hashes") or ()]
    if not hashes or len(toks) != len(hashes) * bs:
        return None
    return hashes, toks


def compact_kv_records(
    records: Sequence[Mapping[str, Any]], blocks: BlockIds
) -> tuple[list[dict[str, Any]], CompactStats]:
    """A run's KV-event records with the token ids of each BlockStored event whose blocks are
    all the workload's (`workload_block_ids`: same tokens, same parent chain) replaced by zeros
    of the same length (what the codec reads of them: num_tokens), and the blocks' ids added as
    `block_ids` (one per hash; the tokens are blocks.tokens[id - 1], `restore_token_ids`).

    Nothing else changes: block hashes keep their values (the what-if simulator reads more than
    their identity: SHARDS samples their low bits, the vLLM model's set order their value), and
    a hash is known as a workload block only from a BlockStored event whose tokens say so.
    Idempotent: zeroed token ids match no block (real ones are >= 100)."""
    bs = blocks.block_size
    raw2id: dict[int, int] = {}
    id2raw: dict[int, int] = {}
    seen: dict[int, None] = {}
    for rec in records:
        for e in _event_maps(rec):
            for h in e.get("block_hashes") or ():
                seen.setdefault(_hash(h), None)
            full = _full_blocks(e, bs)
            if full is None:
                continue
            hashes, toks = full
            parent = e.get("parent_block_hash")
            pid = 0 if parent is None else raw2id.get(_hash(parent))
            for k, h in enumerate(hashes):
                if pid is None or not _plain_block(e, k):
                    break
                bid = blocks.ids.get((pid, tuple(toks[k * bs : (k + 1) * bs])))
                if bid is None:
                    break
                if raw2id.setdefault(h, bid) != bid or id2raw.setdefault(bid, h) != h:
                    raise ValueError(f"block hash {h} and block id {bid} do not map one to one")
                pid = bid

    def implied(h: int, chunk: Sequence[Any]) -> bool:
        return h in raw2id and blocks.tokens[raw2id[h] - 1] == tuple(chunk)

    zeroed = 0
    out: list[dict[str, Any]] = []
    for rec in records:
        doc = json.loads(json.dumps(rec))  # a deep copy that keeps JSON's types
        for e in _event_maps(doc):
            full = _full_blocks(e, bs)
            if full is None or BLOCK_IDS in e:
                continue
            hashes, toks = full
            if all(implied(h, toks[k * bs : (k + 1) * bs]) for k, h in enumerate(hashes)):
                e["token_ids"] = [0] * len(toks)
                e[BLOCK_IDS] = [raw2id[h] for h in hashes]
                zeroed += 1
        out.append(doc)
    return out, CompactStats(len(seen), len(raw2id), zeroed)


def restore_token_ids(record: Mapping[str, Any], blocks: BlockIds) -> dict[str, Any]:
    """The inverse: a compacted record with the token ids of its BlockStored events filled in
    again from their `block_ids`, which go; the record as recorded."""
    doc: dict[str, Any] = json.loads(json.dumps(record))
    for e in _event_maps(doc):
        ids = e.pop(BLOCK_IDS, None)
        if isinstance(ids, list):
            e["token_ids"] = [t for b in ids for t in blocks.tokens[b - 1]]
    return doc


def ttft_definition(max_tokens: int) -> str:
    """How a run's requests.jsonl timed TTFT (meta.json's traffic.ttft_definition)."""
    if max_tokens > 1:
        return f"streamed completion with max_tokens {max_tokens}: t_first - t_send"
    return "non-streamed completion with max_tokens 1: t_end - t_send"


def request_record(
    req: Req,
    *,
    slot: int,
    t_sched: float,
    t_send: float,
    t_end: float,
    status: int | None,
    body: Mapping[str, Any] | None,
    error: str | None = None,
    t_first: float | None = None,
) -> dict[str, Any]:
    """One line of requests.jsonl (ttft_definition says how its TTFT was timed). A streamed
    request (max_tokens above 1) carries `t_first`, its first token's arrival, and its TTFT
    ends there; one that was not ends at its response."""
    usage = (body or {}).get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    first = t_end if t_first is None else t_first
    return {
        "i": req.i,
        "id": (body or {}).get("id"),
        "slot": slot,
        "t_sched": round(t_sched, 6),
        "t_send": round(t_send, 6),
        **({"t_first": round(t_first, 6)} if t_first is not None else {}),
        "t_end": round(t_end, 6),
        "ttft_s": round(first - t_send, 6),
        "status": status,
        "prompt_tokens": usage.get("prompt_tokens", len(req.prompt)),
        "cached_tokens": details.get("cached_tokens"),
        "sent_tokens": len(req.prompt),
        "tags": dict(req.tags),
        **({"error": error} if error else {}),
    }


# --------------------------------------------------------------------------------------------
# Ground truth: the same request sequence with and without offload
# --------------------------------------------------------------------------------------------


def verdict(relative_change: float, threshold: float = TRUTH_THRESHOLD) -> str:
    """pays: summed TTFT drops by >= threshold; costs: rises by >= threshold; else neutral."""
    if relative_change <= -threshold:
        return "pays"
    if relative_change >= threshold:
        return "costs"
    return "neutral"


def _ok(records: Iterable[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    return {
        int(r["i"]): r
        for r in records
        if r.get("status") == 200 and r.get("i") is not None and r.get("ttft_s") is not None
    }


def matched_requests(
    base: Iterable[Mapping[str, Any]], offload: Iterable[Mapping[str, Any]]
) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """The requests both runs completed, paired by position i (the prompts are identical by
    construction), as paired_truth sums them."""
    a, b = _ok(base), _ok(offload)
    return [(a[i], b[i]) for i in sorted(set(a) & set(b))]


def run_totals(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    ok = list(_ok(records).values())
    if not ok:
        return {"requests": 0}
    t0 = min(float(r["t_send"]) for r in ok)
    t1 = max(float(r["t_end"]) for r in ok)
    prompt = sum(int(r.get("prompt_tokens") or 0) for r in ok)
    return {
        "requests": len(ok),
        "failed": sum(1 for r in records if r.get("status") != 200),
        "summed_ttft_s": round(sum(float(r["ttft_s"]) for r in ok), 6),
        "mean_ttft_s": round(sum(float(r["ttft_s"]) for r in ok) / len(ok), 6),
        "prompt_tokens": prompt,
        "cached_tokens": sum(int(r.get("cached_tokens") or 0) for r in ok),
        "traffic_span_s": round(t1 - t0, 3),
        "requests_per_s": round(len(ok) / (t1 - t0), 4) if t1 > t0 else None,
        "prompt_tokens_per_s": round(prompt / (t1 - t0), 1) if t1 > t0 else None,
        "max_inflight_seen": max_inflight(ok),
    }


def max_inflight(records: Iterable[Mapping[str, Any]]) -> int:
    edges: list[tuple[float, int]] = []
    for r in records:
        edges += [(float(r["t_send"]), 1), (float(r["t_end"]), -1)]
    cur = best = 0
    for _, d in sorted(edges, key=lambda e: (e[0], e[1])):
        cur += d
        best = max(best, cur)
    return best


def traffic_start(meta: Mapping[str, Any]) -> float:
    traffic = meta.get("traffic")
    t = traffic.get("t_traffic_start") if isinstance(traffic, Mapping) else None
    return float(t) if isinstance(t, int | float) else 0.0


def base_run(metas: Mapping[str, Mapping[str, Any]], name: str) -> str | None:
    """The run without offload an offload run is compared with: of its pair family (the same
    shape, workload and flags: meta "pair"), the one whose traffic started nearest in time.
    A family split across device sessions records its run without offload again as a control
    (scenarios/controls.json, `<run>-ctl`): the offload runs of each session pair with the run
    of their own machine, and the two runs without offload measure the drift between them.
    An offload run is compared on its own machine only (None where its family has no run
    without offload there): the same sequence ran up to 28 % slower on one H200 VM than on
    another, more than most of what offload changes (session 11's 0.6B chat 21 GiB run, on a
    fresh machine after the one of its run without offload went back, has no base). A run
    without offload gets the nearest one of any machine: that comparison is the drift."""
    meta = metas[name]
    nones = [
        n
        for n, m in metas.items()
        if m.get("pair") == meta.get("pair") and m.get("offload") is None and n != name
    ]
    if meta.get("offload") is not None:
        nones = [n for n in nones if same_machine(metas[n], meta)]
    if not nones:
        return None
    t = traffic_start(meta)
    return min(nones, key=lambda n: (abs(traffic_start(metas[n]) - t), n))


def same_work(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> bool:
    """Both runs completed the same requests, (nearly) every one of them with the same cached
    tokens, or the same computed tokens in all: the GPU computed the same tokens in both."""
    ra, rb = _ok(a), _ok(b)
    if not ra or set(ra) != set(rb):
        return False
    same = sum(1 for i in ra if ra[i].get("cached_tokens") == rb[i].get("cached_tokens"))
    if same >= SAME_WORK_SHARE * len(ra):
        return True
    ca, cb = (
        sum(int(r.get("prompt_tokens", 0)) - int(r.get("cached_tokens", 0)) for r in x.values())
        for x in (ra, rb)
    )
    return abs(ca - cb) <= SAME_WORK_TOKENS * max(min(ca, cb), 1)


def same_machine(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Both runs on one GPU: the same NVML UUID where both metas have one, else traffic
    started within SAME_MACHINE_S."""
    ua, ub = (
        m.get("gpu", {}).get("uuid") if isinstance(m.get("gpu"), Mapping) else None for m in (a, b)
    )
    if isinstance(ua, str) and isinstance(ub, str):
        return ua == ub
    return abs(traffic_start(a) - traffic_start(b)) <= SAME_MACHINE_S


def family_noise(
    metas: Mapping[str, Mapping[str, Any]], records: Mapping[str, Sequence[Mapping[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """Per pair family with two runs that did the same work on one machine (both with offload
    or both without, the same cached tokens per request, traffic within SAME_MACHINE_S): the
    largest relative difference of their summed TTFT and the two runs. Such a difference is
    the machine's, not offload's: a change no larger than it is not measured."""
    out: dict[str, dict[str, Any]] = {}
    for x, y in same_work_pairs(metas, records):
        sx = sum(float(r["ttft_s"]) for r in _ok(records[x]).values())
        sy = sum(float(r["ttft_s"]) for r in _ok(records[y]).values())
        rel = abs(sx - sy) / min(sx, sy) if min(sx, sy) > 0 else 0.0
        family = str(metas[x].get("pair", ""))
        if rel > out.get(family, {}).get("relative_difference", -1.0):
            out[family] = {"relative_difference": round(rel, 5), "runs": [x, y]}
    return out


def same_work_pairs(
    metas: Mapping[str, Mapping[str, Any]], records: Mapping[str, Sequence[Mapping[str, Any]]]
) -> list[tuple[str, str]]:
    """Every pair of runs (sorted by name) of one pair family, both with offload or both
    without, that did the same work on one machine (same_work, same_machine)."""
    names = sorted(metas)
    return [
        (x, y)
        for i, x in enumerate(names)
        for y in names[i + 1 :]
        if metas[x].get("pair") == metas[y].get("pair")
        and (metas[x].get("offload") is None) == (metas[y].get("offload") is None)
        and same_machine(metas[x], metas[y])
        and same_work(records[x], records[y])
    ]


def noise_of(noise: Mapping[str, Any] | None) -> float:
    """The family's relative difference between runs that did the same work (0: none known)."""
    rel = noise.get("relative_difference") if noise else None
    return float(rel) if isinstance(rel, int | float) else 0.0


def truth_threshold(noise: Mapping[str, Any] | None) -> float:
    """The change a pair of the family must exceed to pay or cost (see TRUTH_THRESHOLD)."""
    return max(TRUTH_THRESHOLD, noise_of(noise))


def paired_truth(
    base: Sequence[Mapping[str, Any]],
    offload: Sequence[Mapping[str, Any]],
    *,
    threshold: float = TRUTH_THRESHOLD,
    noise: float = 0.0,
) -> dict[str, Any]:
    """Summed TTFT of the requests both runs completed (matched by position i, the prompts are
    identical by construction), the relative change, the verdict, and throughput. `noise`
    (family_noise's relative difference) is also stated per second of traffic: a saving is
    not measured more finely than that."""
    a, b = _ok(base), _ok(offload)
    common = sorted(set(a) & set(b))
    if not common:
        return {"matched": 0, "verdict": "unknown"}
    sa = sum(float(a[i]["ttft_s"]) for i in common)
    sb = sum(float(b[i]["ttft_s"]) for i in common)
    rel = (sb - sa) / sa if sa > 0 else 0.0
    ta, tb = run_totals([a[i] for i in common]), run_totals([b[i] for i in common])
    span = max(ta["traffic_span_s"], 1e-9)
    return {
        "matched": len(common),
        "only_base": len(set(a) - set(b)),
        "only_offload": len(set(b) - set(a)),
        "summed_ttft_base_s": round(sa, 6),
        "summed_ttft_offload_s": round(sb, 6),
        "relative_change": round(rel, 5),
        "threshold": threshold,
        "verdict": verdict(rel, threshold),
        "verdict_3pct": verdict(rel, TRUTH_THRESHOLD),
        "ttft_saved_s_per_s": round((sa - sb) / span, 6),
        "noise_s_per_s": round(noise * sa / span, 6),
        "cached_tokens_base": ta["cached_tokens"],
        "cached_tokens_offload": tb["cached_tokens"],
        "requests_per_s_base": ta["requests_per_s"],
        "requests_per_s_offload": tb["requests_per_s"],
        "throughput_change": (
            round(tb["requests_per_s"] / ta["requests_per_s"] - 1, 5)
            if ta["requests_per_s"] and tb["requests_per_s"]
            else None
        ),
    }


def load_requests(run: Path) -> list[dict[str, Any]]:
    """A recording's requests.jsonl.xz (the compacted fixtures: whole lines only)."""
    with lzma.open(run / "requests.jsonl.xz", "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def family_truth(
    metas: Mapping[str, Mapping[str, Any]],
    records: Mapping[str, Sequence[Mapping[str, Any]]],
    noise: Mapping[str, Mapping[str, Any]],
    base: str,
    run: str,
) -> dict[str, Any]:
    """paired_truth of `run` against `base`, judged in the band of `run`'s family (noise:
    family_noise's result)."""
    band = noise.get(str(metas[run].get("pair", "")))
    return paired_truth(
        records[base], records[run], threshold=truth_threshold(band), noise=noise_of(band)
    )
