"""An eager engine's step time, as the kit's step log times it and as vLLM's own inter-token
latency does, on recordings whose requests decode more than one token (`bursts-decode`,
batch 38 on; the one-token bursts never fill vLLM's inter-token histogram):

    PYTHONPATH=. .venv/bin/python -m bench.step_time [tests/fixtures/gpu/decode] [RUN ...] [--json]

Per recording:

- `inter_token_ms`: vLLM's `vllm:inter_token_latency_seconds` over the run (the last scrape's
  sum and count less the first's), the mean ms between two tokens of a request: what a live
  exporter can read of a step's time;
- `decode_step_ms`: from the step log (`steps.jsonl.xz`), the time from a step that only
  decoded (every request in it one token) to the next step's plan: the engine's whole step
  (plan, launch, compute and output), median and mean over gaps under `GAP_S` (longer gaps
  are the engine idling between bursts);
- `client_token_ms`: the client's (t_end - t_first) / (max_tokens - 1), per request: the
  same time seen from outside, median and mean.

Batch 37 found the eager tier's cost paid in the small steps it adds, each at the engine's
step time (docs/whatif.md, "What batch 37 measured"); this says whether the figure a live
exporter has (the inter-token latency) is that step time.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import markdown_table, recording_metas, recordings_main
from exporter import expfmt
from exporter.recording import read_scrapes

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import gpukit  # type: ignore[import-not-found]  # bench/gpu holds scripts, not a package

DECODE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gpu" / "decode"
ITL = "vllm:inter_token_latency_seconds"
# Between two steps of one burst's decode the engine does not idle; a longer gap is the wait
# for the next burst (every 3 s).
GAP_S = 0.2


def _total(body: str, name: str) -> float:
    """The sum of `name`'s samples over every label set (one per engine)."""
    return sum(x.value for x in expfmt.parse(body, (name,)))


def inter_token(run: Path) -> dict[str, float] | None:
    """vLLM's inter-token latency over the recording (exporter.recording.read_scrapes, which
    names what is wrong with a recording it cannot read): tokens and mean ms; None where no
    request decoded a second token."""
    bodies = [x.body for x in read_scrapes(run) if x.body is not None]
    if not bodies:
        return None
    first, last = bodies[0], bodies[-1]
    n = _total(last, ITL + "_count") - _total(first, ITL + "_count")
    s = _total(last, ITL + "_sum") - _total(first, ITL + "_sum")
    return {"tokens": n, "mean_ms": round(1000 * s / n, 2)} if n > 0 else None


def decode_steps(lines: Iterable[Mapping[str, Any]]) -> dict[str, float] | None:
    """From a step log: the gap from each decode-only step to the next plan (ms), median and
    mean, over gaps under GAP_S."""
    steps = list(lines)
    gaps = [
        1000 * (b["t0"] - a["t0"])
        for a, b in itertools.pairwise(steps)
        if a.get("r") and all(v == 1 for v in a["r"].values()) and 0 < b["t0"] - a["t0"] < GAP_S
    ]
    return _summary("steps", gaps)


def client_tokens(run: Path, max_tokens: int) -> dict[str, float] | None:
    """Per streamed request, (t_end - t_first) / (max_tokens - 1) in ms: median and mean."""
    if max_tokens < 2 or not (run / "requests.jsonl.xz").exists():
        return None
    per = [
        1000 * (r["t_end"] - r["t_first"]) / (max_tokens - 1)
        for r in gpukit.iter_jsonl(run / "requests.jsonl.xz")
        if r.get("status") == 200 and r.get("t_first") is not None
    ]
    return _summary("requests", per)


def _summary(counted: str, ms: Sequence[float]) -> dict[str, float] | None:
    """How many, and their median and mean ms; None for none."""
    if not ms:
        return None
    return {
        counted: len(ms),
        "median_ms": round(statistics.median(ms), 2),
        "mean_ms": round(statistics.fmean(ms), 2),
    }


def table(root: Path = DECODE, names: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """One row per recording under `root` (or of `names`) whose requests decoded."""
    out: dict[str, dict[str, Any]] = {}
    metas = recording_metas(root, names)
    for name in names or sorted(metas):
        meta = metas[name]
        max_tokens = int((meta.get("workload") or {}).get("max_tokens") or 1)
        if max_tokens < 2:
            continue
        run = root / name
        log = run / "steps.jsonl.xz"
        out[name] = {
            "gpu": (meta.get("gpu") or {}).get("name"),
            "eager": "--enforce-eager" in (meta.get("vllm_argv") or ()),
            "max_tokens": max_tokens,
            "inter_token_ms": inter_token(run),
            "decode_step_ms": decode_steps(gpukit.iter_jsonl(log)) if log.exists() else None,
            "client_token_ms": client_tokens(run, max_tokens),
            "host_probe": meta.get("host_probe"),
        }
    return out


def markdown(rows: Mapping[str, Mapping[str, Any]]) -> str:
    def v(x: Mapping[str, Any] | None, *keys: str) -> str:
        return "-" if not x else " / ".join(f"{x[k]}" for k in keys)

    return markdown_table(
        [
            "run",
            "GPU",
            "eager",
            "vLLM inter-token ms (tokens)",
            "step log: decode step ms, median / mean (steps)",
            "client: a token ms, median / mean",
        ],
        [
            [
                n,
                str(r["gpu"]),
                "yes" if r["eager"] else "no",
                "-"
                if not r["inter_token_ms"]
                else f"{r['inter_token_ms']['mean_ms']} ({int(r['inter_token_ms']['tokens'])})",
                "-"
                if not r["decode_step_ms"]
                else f"{v(r['decode_step_ms'], 'median_ms', 'mean_ms')}"
                f" ({r['decode_step_ms']['steps']})",
                v(r["client_token_ms"], "median_ms", "mean_ms"),
            ]
            for n, r in rows.items()
        ],
    )


def main(argv: list[str] | None = None) -> int:
    return recordings_main(__doc__, DECODE, table, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
