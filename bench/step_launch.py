"""A step's launch time from what vLLM exports, per recording (docs/whatif.md, "What batch 29
measured"): the quantity the launch a load adds needs and the prefill fit does not give on an
engine whose launch is as long as its compute (the held-out 4B bursts).

    PYTHONPATH=. .venv/bin/python -m bench.step_launch [tests/fixtures/gpu/matrix] [RUN ...]
        [--json]

Per scrape interval in which a prefill ended: its requests R and their prefill seconds Y
(`vllm:request_prefill_time_seconds`), and vLLM's engine steps S and their tokens T
(`vllm:iteration_tokens_total`). A request's prefill spans its step, and a step takes the
longer of its launch (CPU time on the engine's one thread, whatever its tokens) and its
compute, so the mean prefill Y / R is fitted against the mean tokens a step T / S as a hinge,
max(L, c x T / S), each interval weighted by R: L the launch, c a token's compute. Where L
exceeds c x the mean tokens a step, a step's compute hides under its launch (launch-bound);
where it does not, L is only where the fit bends, not a launch. Nor is it where requests come
one at a time (about one prefill a step): there a request's fixed time is its own work (the
attention over a long cached prefix: 32B RAG-Zipf reads 94 ms "launch-bound" against 86 ms
of compute), so L reads a launch only where requests share steps, as in bursts.

Beside it, the fixed time a request of the prefill fit (`fits.prefill_fit` on requests and
computed tokens, as the exporter fits it, here on the whole recording) and, where the
recording has vLLM's engine-step log (`steps.jsonl.xz`, bench/gpu/steplog.py), the launch
measured: the median time between the plans of a step computing under `SMALL_STEP_TOKENS`
tokens and the next one (the next step is planned once this one is launched).
"""

from __future__ import annotations

import itertools
import json
import lzma
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.advice_eval import MATRIX
from bench.common import markdown_table, recording_metas, recordings_main
from exporter import expfmt
from exporter.model.derive.fits import prefill_fit
from exporter.vllm_metrics import WANTED, normalise

# The exporter's quantities (exporter/vllm_metrics.py), and vLLM's step histogram, which the
# exporter does not read (yet): its count is the engine's steps, its sum their tokens.
PREFILL_S, PREFILL_N, COMPUTED = (
    "prefill_seconds",
    "prefill_requests",
    "prompt_by_source:local_compute",
)
STEP_T, STEP_N = "vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count"
SERIES = (PREFILL_S, PREFILL_N, STEP_T, STEP_N, COMPUTED)
SMALL_STEP_TOKENS = 300
NEXT_PLAN_S = 0.3  # a longer gap between two plans is idle time, not a launch
MIN_INTERVALS = 10  # the exporter's default min_fit_points
HINGE_GRID_S = 0.0005


def _totals(rec: Mapping[str, Any]) -> dict[str, float]:
    out = dict.fromkeys(SERIES, 0.0)
    for es in normalise(expfmt.parse(rec["body"], WANTED), float(rec["t"])).engines.values():
        for k in (PREFILL_S, PREFILL_N, COMPUTED):
            out[k] += es.counters.get(k, 0.0)
    for sample in expfmt.parse(rec["body"], (STEP_T, STEP_N)):
        out[sample.name] += sample.value
    return out


def intervals(run: Path) -> list[tuple[float, float, float, float, float]]:
    """Per scrape interval in which a prefill ended: (requests, prefill seconds, steps, step
    tokens, computed prompt tokens), every engine of the recording added."""
    with lzma.open(run / "metrics.jsonl.xz", "rt", encoding="utf-8") as fh:
        scrapes = [_totals(json.loads(line)) for line in fh if line.strip()]
    out = []
    for a, b in itertools.pairwise(scrapes):
        d = {k: b[k] - a[k] for k in SERIES}
        if d[PREFILL_N] > 0 and d[STEP_N] > 0:
            out.append((d[PREFILL_N], d[PREFILL_S], d[STEP_N], d[STEP_T], d[COMPUTED]))
    return out


def hinge_fit(points: Sequence[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(L, c) minimising the sum of w (y - max(L, c x))^2 over points (x, y, w): for each L on
    a grid of `HINGE_GRID_S`, c by weighted least squares on the points it prices above L
    (repeated until those points stop changing); None with fewer than `MIN_INTERVALS` points
    or no spread in x."""
    pts = [(x, y, w) for x, y, w in points if x > 0 and y >= 0 and w > 0]
    if len(pts) < MIN_INTERVALS or len({x for x, _, _ in pts}) < 2:
        return None

    def slope(sel: Sequence[tuple[float, float, float]]) -> float:
        sxx = sum(w * x * x for x, _, w in sel)
        return sum(w * x * y for x, y, w in sel) / sxx if sxx > 0 else 0.0

    best: tuple[float, float, float] | None = None
    top = max(y for _, y, _ in pts)
    for k in range(int(top / HINGE_GRID_S) + 1):
        level = k * HINGE_GRID_S
        c = slope(pts)
        above: list[tuple[float, float, float]] = []
        for _ in range(50):
            sel = [p for p in pts if c * p[0] > level]
            if sel == above or not sel:
                break
            above, c = sel, slope(sel)
        err = sum(w * (y - max(level, c * x)) ** 2 for x, y, w in pts)
        if best is None or err < best[0]:
            best = (err, level, c)
    assert best is not None
    return best[1], best[2]


def logged_launch(run: Path) -> float | None:
    """The median time between the plan of a step computing under `SMALL_STEP_TOKENS`
    tokens and the next plan, from vLLM's engine-step log; None without one."""
    path = run / "steps.jsonl.xz"
    if not path.exists():
        return None
    with lzma.open(path, "rt", encoding="utf-8") as fh:
        steps = [s for s in map(json.loads, fh) if "i" in s and s.get("n", 0) > 0]
    steps.sort(key=lambda s: float(s["t1"]))
    gaps = [
        float(b["t1"]) - float(a["t1"])
        for a, b in itertools.pairwise(steps)
        if a["n"] < SMALL_STEP_TOKENS and float(b["t1"]) - float(a["t1"]) < NEXT_PLAN_S
    ]
    return statistics.median(gaps) if gaps else None


def measure(run: Path) -> dict[str, Any]:
    """One recording's row: the hinge's L and c, a step's mean tokens and their compute
    (c x tokens), launch-bound or not, the prefill fit's fixed time and the logged launch."""
    ivs = intervals(run)
    fit = hinge_fit([(t / s, y / r, r) for r, y, s, t, _ in ivs])
    steps = sum(s for _, _, s, _, _ in ivs)
    tokens = sum(t for *_, t, _ in ivs) / steps if ivs else None
    pf = prefill_fit([(r, comp, y) for r, y, _, _, comp in ivs], MIN_INTERVALS)
    row: dict[str, Any] = {
        "intervals": len(ivs),
        "tokens_per_step": None if tokens is None else round(tokens),
        "requests_per_step": round(sum(r for r, *_ in ivs) / steps, 2) if ivs else None,
        "hinge_launch_ms": None,
        "token_compute_us": None,
        "step_compute_ms": None,
        "launch_bound": None,
        "prefill_fit_fixed_ms": None if pf is None else round(1e3 * pf.overhead_seconds, 1),
        "logged_launch_ms": None,
    }
    if fit is not None and tokens is not None:
        level, c = fit
        row.update(
            hinge_launch_ms=round(1e3 * level, 1),
            token_compute_us=round(1e6 * c, 2),
            step_compute_ms=round(1e3 * c * tokens, 1),
            launch_bound=level > c * tokens,
        )
    logged = logged_launch(run)
    if logged is not None:
        row["logged_launch_ms"] = round(1e3 * logged, 1)
    return row


def table(root: Path = MATRIX, names: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per recording without offload under `root` (or each of `names`): `measure`."""
    metas = recording_metas(root, names)
    return {
        name: measure(root / name)
        for name in names or sorted(metas)
        if names or not metas[name].get("offload")
    }


def markdown(rows: Mapping[str, Mapping[str, Any]]) -> str:
    def v(x: object) -> str:
        return "-" if x is None else str(x)

    header = [
        "recording",
        "prefills a step",
        "tokens a step",
        "hinge: launch ms",
        "a step's compute ms",
        "launch-bound",
        "prefill fit: fixed ms",
        "step log: launch ms",
    ]
    body = [
        [
            name,
            v(r["requests_per_step"]),
            v(r["tokens_per_step"]),
            v(r["hinge_launch_ms"]),
            v(r["step_compute_ms"]),
            {True: "yes", False: "no", None: "-"}[r["launch_bound"]],
            v(r["prefill_fit_fixed_ms"]),
            v(r["logged_launch_ms"]),
        ]
        for name, r in rows.items()
    ]
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> int:
    return recordings_main(__doc__, MATRIX, table, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
