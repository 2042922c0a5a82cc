"""A real vLLM CPU server with a tiny config-only model, and the seed workload.

The model is a config.json alone, served with --load-format dummy (random weights)
and --skip-tokenizer-init, so prompts are token-id lists. --num-gpu-blocks-override
makes the KV pool small enough that B and C evict A, as in the published experiment.
--enforce-eager: vLLM's CPU build otherwise compiles the model with inductor at every start
(the compile cache is keyed by the model's path, a fresh one per test), 57 s to ready instead
of 25 s on two cores; nothing here measures the compiled model's speed.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.procs import free_port, start, stop, wait_http

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("KVOE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))

TINY_MODEL = {
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
BLOCK_SIZE = 128  # vLLM's CPU backend block size
MODEL_NAME = "tiny-llama"


def _int_field(cfg: dict[str, object], key: str) -> int:
    value = cfg[key]
    if not isinstance(value, int | float | str):
        raise TypeError(f"model config {key}: {value!r} is not an integer")
    return int(value)


def kv_bytes_per_token(cfg: dict[str, object] = TINY_MODEL, dtype_bytes: int = 4) -> int:
    """K and V per layer per KV head per head dim."""
    layers = _int_field(cfg, "num_hidden_layers")
    heads = _int_field(cfg, "num_key_value_heads")
    head_dim = _int_field(cfg, "head_dim")
    return 2 * layers * heads * head_dim * dtype_bytes


def write_model(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_MODEL, indent=2))
    return directory


@dataclass
class VllmServer:
    workdir: Path
    num_gpu_blocks: int = 20
    kv_events_endpoint: str | None = None  # e.g. tcp://127.0.0.1:5557 (subscriber binds)
    replay_endpoint: str | None = None
    port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # over os.environ and the CPU settings
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"vllm-{self.port}.log"

    def command(self) -> list[str]:
        model = write_model(self.workdir / "tiny-model")
        cmd = [
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--load-format",
            "dummy",
            "--skip-tokenizer-init",
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--enable-prefix-caching",
            "--num-gpu-blocks-override",
            str(self.num_gpu_blocks),
            "--max-num-seqs",
            "4",
            "--enforce-eager",
        ]
        if self.kv_events_endpoint:
            cfg: dict[str, object] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_events_endpoint,
                "topic": "kv",
            }
            if self.replay_endpoint:
                cfg["replay_endpoint"] = self.replay_endpoint
            cmd += ["--kv-events-config", json.dumps(cfg)]
        return cmd + self.extra_args

    def start(self, timeout: float = 240.0) -> VllmServer:
        self.spawn()
        self.wait_ready(timeout)
        return self

    def spawn(self) -> VllmServer:
        """Start the server process without waiting for it (see wait_ready)."""
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        env.update(self.env)
        self.proc = start(self.command(), self.log_path, env=env)
        return self

    def wait_ready(self, timeout: float = 240.0) -> VllmServer:
        try:
            wait_http(self.url + "/health", timeout, self.proc, self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop(self.proc)
        self.proc = None


def complete(
    url: str, prompt: list[int], max_tokens: int = 1, timeout: float = 120.0
) -> dict[str, Any]:
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
    ).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return dict(json.loads(resp.read()))


@dataclass(frozen=True)
class RequestRecord:
    batch: int
    name: str
    seconds: float
    prompt_tokens: int


def seed_workload(
    url: str,
    batches: int = 5,
    prompt_tokens: int = 1600,
    seed: int = 7,
    vocab: int = 2048,
    pause: float = 0.05,
) -> list[RequestRecord]:
    """The published pattern per batch: A (cold), A (GPU hit), B, C (evict A), A again.

    Each batch draws fresh A, B, C so batches do not hit each other's prefixes.
    """
    rng = random.Random(seed)
    out: list[RequestRecord] = []
    for b in range(batches):
        docs = {k: [rng.randrange(3, vocab) for _ in range(prompt_tokens)] for k in "ABC"}
        for name, doc in (
            ("A_cold", "A"),
            ("A_gpu_hit", "A"),
            ("B", "B"),
            ("C", "C"),
            ("A_after_evict", "A"),
        ):
            t0 = time.perf_counter()
            resp = complete(url, docs[doc])
            out.append(
                RequestRecord(
                    b, name, time.perf_counter() - t0, int(resp["usage"]["prompt_tokens"])
                )
            )
            time.sleep(pause)
    return out


@dataclass
class WorkloadStats:
    requests: int = 0
    prompt_tokens: int = 0
    errors: int = 0
    last_error: str = ""


def shared_documents_workload(
    url: str,
    stop: threading.Event,
    stats: WorkloadStats,
    *,
    documents: int = 16,
    doc_tokens: tuple[int, int] = (800, 1700),
    question_tokens: tuple[int, int] = (30, 200),
    mean_gap: float = 0.25,
    zipf: float = 1.0,
    seed: int = 11,
    vocab: int = 2048,
) -> None:
    """Requests that share long document prefixes, until `stop` is set.

    Each request is one of `documents` fixed documents (chosen with Zipf popularity, as
    with system prompts or RAG documents) followed by a fresh question. The GPU pool holds
    one or two documents, so most documents are evicted before they are asked about again
    and recomputed: the traffic a CPU tier would catch. Prompt lengths and the gaps between
    requests vary, so scrape intervals differ in requests and computed tokens and the
    exporter's prefill fit can separate per-request from per-token cost.
    """
    rng = random.Random(seed)
    docs = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(*doc_tokens))] for _ in range(documents)
    ]
    weights = [1.0 / (i + 1) ** zipf for i in range(documents)]
    while not stop.is_set():
        doc = rng.choices(docs, weights)[0]
        prompt = doc + [rng.randrange(3, vocab) for _ in range(rng.randint(*question_tokens))]
        try:
            resp = complete(url, prompt, timeout=60.0)
            stats.requests += 1
            stats.prompt_tokens += int(resp["usage"]["prompt_tokens"])
        except (OSError, ValueError, KeyError) as exc:
            stats.errors += 1
            stats.last_error = str(exc)
            stop.wait(1.0)
        stop.wait(rng.expovariate(1.0 / mean_gap))


if __name__ == "__main__":  # manual use: python -m testbed.vllm_cpu WORKDIR
    server = VllmServer(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvoe-vllm")).start()
    print(server.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.stop()
