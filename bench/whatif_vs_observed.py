"""Predicted vs observed offload hit share: the what-if model against real offload runs.

    .venv/bin/python -m bench.whatif_vs_observed tests/fixtures/gpu/EXPERIMENT [--seeds 8]
    .venv/bin/python -m bench.whatif_vs_observed --synthetic-h200

An experiment directory holds one run without offload and one run per CPU buffer size,
all with the same workload (layout: docs/whatif.md, "Ground truth"):

    run.json                 {"block_size": 16, "kv_bytes_per_block": 1835008,
                              "runs": [{"dir": "nooffload"},
                                       {"dir": "offload-0.5GiB", "offload_bytes": 536870912}]}
    nooffload/kv-events.jsonl         every KV-event message (--record-events format)
    <dir>/metrics_before.txt, metrics_after.txt   GET /metrics around the workload

The prediction replays the no-offload run's events through vLLM 0.26's CPU tier at each
size (mean of --seeds set-order permutations, with their range) and divides the hit
tokens by the run's prompt tokens; the observation is delta external_kv_transfer
prompt tokens / delta prompt tokens of the offload run. --synthetic-h200 uses the
rebuilt event stream of the recorded H200 workload and b_offload's real metrics.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter import expfmt
from exporter.kvevents_codec import Message, read_file
from exporter.vllm_metrics import WANTED, normalise
from exporter.whatif import blocks_for_bytes, replay

REPO = Path(__file__).resolve().parent.parent
H200 = REPO / "tests" / "fixtures" / "vllm-0.26.0-h200"


def counters(path: Path) -> dict[str, float]:
    """vLLM counters summed over engines."""
    sample = normalise(expfmt.parse(path.read_text(), WANTED), 0.0)
    out: dict[str, float] = {}
    for es in sample.engines.values():
        for k, v in es.counters.items():
            out[k] = out.get(k, 0.0) + v
    return out


def observed(run_dir: Path) -> tuple[float, float]:
    """(external_kv_transfer tokens, all prompt tokens) of one run."""
    before = counters(run_dir / "metrics_before.txt")
    after = counters(run_dir / "metrics_after.txt")
    key = "prompt_by_source:external_kv_transfer"
    ext = after.get(key, 0.0) - before.get(key, 0.0)
    return ext, after["prompt_tokens"] - before.get("prompt_tokens", 0.0)


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    offload_bytes: int
    blocks: int
    observed: float
    predicted: float
    predicted_min: float
    predicted_max: float
    stack: float
    plain: float

    @property
    def error(self) -> float:
        return abs(self.predicted - self.observed)


def compare(
    messages: Sequence[Message],
    prompt_tokens: float,
    runs: Sequence[tuple[str, int, float]],  # label, offload bytes, observed share
    kv_bytes_per_block: int,
    seeds: int = 8,
    policy: str = "lru",
) -> list[Row]:
    msgs = list(messages)
    caps = [blocks_for_bytes(b, kv_bytes_per_block) for _, b, _ in runs]
    per_seed = [replay(msgs, caps, policy=policy, seeds=[s]).sizes for s in range(seeds)]
    stack = replay(msgs, caps, model="stack").sizes
    plain = replay(msgs, caps, model="plain").sizes
    rows = []
    for i, (label, size, obs) in enumerate(runs):
        hits = [p[i].hit_tokens / prompt_tokens for p in per_seed]
        rows.append(
            Row(
                label,
                size,
                caps[i],
                obs,
                sum(hits) / len(hits),
                min(hits),
                max(hits),
                stack[i].hit_tokens / prompt_tokens,
                plain[i].hit_tokens / prompt_tokens,
            )
        )
    return rows


def experiment(path: Path, seeds: int) -> list[Row]:
    spec = json.loads((path / "run.json").read_text())
    runs = spec["runs"]
    base = next(r for r in runs if not r.get("offload_bytes"))
    base_dir = path / base["dir"]
    _, prompt = observed(base_dir)
    msgs = list(read_file(base_dir / base.get("events", "kv-events.jsonl")))
    offload = []
    for r in runs:
        if not r.get("offload_bytes"):
            continue
        ext, p = observed(path / r["dir"])
        if abs(p - prompt) > 0.001 * prompt:
            print(f"warning: {r['dir']} saw {p:.0f} prompt tokens, the base run {prompt:.0f}")
        offload.append((r["dir"], int(r["offload_bytes"]), ext / p))
    return compare(
        msgs,
        prompt,
        offload,
        int(spec["kv_bytes_per_block"]),
        seeds=seeds,
        policy=spec.get("eviction_policy", "lru"),
    )


def synthetic_h200(seeds: int) -> list[Row]:
    sys.path.insert(0, str(REPO))
    from tests.test_whatif_synth import abcab_messages

    ext, prompt = observed(H200 / "b_offload")
    return compare(
        abcab_messages(), prompt, [("b_offload", 1 << 29, ext / prompt)], 1_835_008, seeds
    )


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| run | CPU buffer | blocks | observed | predicted (vLLM 0.26 model) "
        "| range over set orders | abs error | stack LRU | plain LRU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.label} | {r.offload_bytes / (1 << 30):g} GiB | {r.blocks} | {r.observed:.4f} "
            f"| {r.predicted:.4f} | {r.predicted_min:.4f}-{r.predicted_max:.4f} "
            f"| {r.error:.4f} | {r.stack:.4f} | {r.plain:.4f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", nargs="?", type=Path, help="experiment directory")
    ap.add_argument("--synthetic-h200", action="store_true")
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args(argv)
    if args.synthetic_h200:
        rows = synthetic_h200(args.seeds)
    elif args.experiment is not None:
        rows = experiment(args.experiment, args.seeds)
    else:
        ap.error("give an experiment directory or --synthetic-h200")
    print(table(rows))
    worst = max((r.error for r in rows), default=0.0)
    print(f"\nworst absolute error {worst:.4f} ({'within' if worst <= 0.01 else 'OUTSIDE'} 0.01)")
    return 0 if worst <= 0.01 else 1


if __name__ == "__main__":
    raise SystemExit(main())
