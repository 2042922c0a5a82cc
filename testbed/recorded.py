"""Recorded real runs laid out as /metrics sequences for replay.

The first H200 captures (tests/fixtures/vllm-0.26.0-h200/) hold /metrics only before and after
the workload, plus the client-side latency of every request. `request_sequence()` lays the run
out as one scrape after each request: counters accumulate from the recorded per-request
latencies and cached-token counts (max_tokens=1, so latency is TTFT plus a constant HTTP cost),
the cache configuration line is the recorded one, and offload bytes follow the run's own
measured bytes per token and copy bandwidth. The client saw 80 fewer cached tokens than vLLM
counted (7280 against 7360 external, 8000 against 7920 local), so the sequence's totals differ
from the recorded /metrics by that much.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

KV_BYTES_PER_TOKEN = 114688  # Qwen3-0.6B shape: 28 layers x 8 KV heads x 128 x K,V x bf16
BLOCK = 16


def _line(name: str, labels: dict[str, str], value: float) -> str:
    lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{lab}}} {value!r}"


def _sample(exposition: str, name: str) -> float:
    """The value of the first labelled sample of `name` in `exposition`."""
    found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)", exposition, re.M)
    if found is None:
        raise ValueError(f"no {name} sample in the recorded /metrics")
    return float(found.group(1))


def request_sequence(run: Path) -> list[str]:
    records = json.loads((run / "latency.json").read_text())
    after = (run / "metrics_after.txt").read_text()
    offload = 'kv_offloading_size="None"' not in after
    config = next(line for line in after.splitlines() if line.startswith("vllm:cache_config_info"))
    model = re.search(r'model_name="([^"]+)"', after)
    assert model is not None
    base = {"model_name": model.group(1), "engine": "0"}
    if offload:
        load_b = _sample(after, "vllm:kv_offload_load_bytes_total")
        load_t = _sample(after, "vllm:kv_offload_load_time_total")
        bandwidth = load_b / load_t
    c = {
        k: 0.0
        for k in (
            "prompt",
            "compute",
            "hit",
            "ext",
            "ttft",
            "n",
            "computed",
            "load_b",
            "load_t",
            "store_b",
            "store_t",
            "ext_q",
        )
    }
    out = []

    def render() -> str:
        lines = [
            "# TYPE vllm:prompt_tokens_total counter",
            _line("vllm:prompt_tokens_total", base, c["prompt"]),
            _line(
                "vllm:prompt_tokens_by_source_total",
                {**base, "source": "local_compute"},
                c["compute"],
            ),
            _line(
                "vllm:prompt_tokens_by_source_total",
                {**base, "source": "local_cache_hit"},
                c["hit"],
            ),
            _line(
                "vllm:prompt_tokens_by_source_total",
                {**base, "source": "external_kv_transfer"},
                c["ext"],
            ),
            _line("vllm:prefix_cache_queries_total", base, c["prompt"]),
            _line("vllm:prefix_cache_hits_total", base, c["hit"]),
            _line("vllm:external_prefix_cache_queries_total", base, c["ext_q"]),
            _line("vllm:external_prefix_cache_hits_total", base, c["ext"]),
            _line("vllm:time_to_first_token_seconds_sum", base, c["ttft"]),
            _line("vllm:time_to_first_token_seconds_count", base, c["n"]),
            _line("vllm:request_prefill_time_seconds_sum", base, c["ttft"]),
            _line("vllm:request_prefill_time_seconds_count", base, c["n"]),
            _line("vllm:request_prefill_kv_computed_tokens_sum", base, c["computed"]),
            _line("vllm:request_prefill_kv_computed_tokens_count", base, c["n"]),
            _line("vllm:num_preemptions_total", base, 0.0),
            _line("vllm:kv_cache_usage_perc", base, 0.0),
            config,
            "process_start_time_seconds 1.0",
        ]
        if offload:
            lines += [
                _line("vllm:kv_offload_load_bytes_total", base, c["load_b"]),
                _line("vllm:kv_offload_load_time_total", base, c["load_t"]),
                _line("vllm:kv_offload_store_bytes_total", base, c["store_b"]),
                _line("vllm:kv_offload_store_time_total", base, c["store_t"]),
            ]
        return "\n".join(lines) + "\n"

    out.append(render())
    for r in records:
        ext = r["cached_tokens"] if offload and r["req"] == "A_after_evict" else 0
        computed = r["prompt_tokens"] - r["cached_tokens"]
        c["prompt"] += r["prompt_tokens"]
        c["compute"] += computed
        c["hit"] += r["cached_tokens"] - ext
        c["ext"] += ext
        c["ext_q"] += r["prompt_tokens"] - (r["cached_tokens"] - ext) if offload else 0
        c["ttft"] += r["ms"] / 1e3
        c["n"] += 1
        c["computed"] += computed
        if offload:
            c["load_b"] += ext * KV_BYTES_PER_TOKEN
            c["load_t"] += ext * KV_BYTES_PER_TOKEN / bandwidth
            stored = (computed // BLOCK) * BLOCK * KV_BYTES_PER_TOKEN
            c["store_b"] += stored
            c["store_t"] += stored / bandwidth
        out.append(render())
    return out
