"""How far the price of a computed token moves between two runs of the same work: the pairs of
runs without offload that did the same work on one machine (the pairs `family_noise` judges a
family's band by), each replayed as the exporter would see it (`replay`, 1 s), and the price
read at the end by each estimator:

    PYTHONPATH=. .venv/bin/python -m bench.fit_repeat [tests/fixtures/gpu/matrix] [RUN ...]
        [--json]

- `ttft_fit` (the baseline, what the what-if prices a computed token at): the least squares of
  an interval's summed TTFT on its requests and computed tokens (`fits.prefill_fit` on
  `TTFT_FIT_KEYS`), its slope;
- `prefill_fit`: the same fit of vLLM's own prefill seconds (its `prefill_time` histogram),
  the part of a first token the engine spends computing;
- `prefill_x_queue`: that slope times the window's summed TTFT over its summed prefill time,
  a computed token's prefill stretched by the wait every first token had on top of it.

Per pair: each estimator's two prices and their relative difference (|a - b| / min), and for
the baseline how many of its own standard errors apart they are. A price that moves more
between two runs of the same work than its standard error says cannot tell a saving from the
placement of bursts in scrape intervals (docs/whatif.md, "What batch 33 measured"). The
summary states each estimator's median and largest difference as a ratio of the baseline's.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.advice_eval import MATRIX, _requests
from bench.common import markdown_table, recording_metas, recordings_main
from bench.pool import replay_pool
from exporter.config import Config
from exporter.replay import replay_one

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import matrixkit  # type: ignore[import-not-found]  # bench/gpu holds scripts, not a package

BASELINE = "ttft_fit"
ESTIMATORS = (BASELINE, "prefill_fit", "prefill_x_queue")


def replicate_pairs(root: Path, names: Sequence[str] = ()) -> list[tuple[str, str]]:
    """Pairs of runs without offload of one family that did the same work on one machine
    (matrixkit.same_work_pairs), restricted to `names` where given."""
    metas = {
        n: m
        for n, m in recording_metas(root, names).items()
        if m.get("offload") is None and (not names or n in names)
    }
    pairs: list[tuple[str, str]] = matrixkit.same_work_pairs(
        metas, {n: _requests(root / n) for n in metas}
    )
    return pairs


def prices(run: Path) -> dict[str, Any]:
    """Each estimator's price of a computed token (seconds) at the end of the replay, and the
    baseline's standard error; None where the window did not separate it."""
    final = replay_one(run, Config(interval=1.0)).final
    (engine,) = (e for t in final.targets for e in t.engines)
    d = engine.derived
    tfit, pfit, w = d.ttft_fit, d.prefill_fit, d.window
    queue = (
        w["ttft_seconds"] / w["prefill_seconds"]
        if w.get("prefill_seconds", 0.0) > 0 and "ttft_seconds" in w
        else None
    )
    pre = pfit.seconds_per_token if pfit is not None else None
    return {
        BASELINE: tfit.seconds_per_token if tfit is not None else None,
        "prefill_fit": pre,
        "prefill_x_queue": pre * queue if pre is not None and queue is not None else None,
        "stderr": tfit.stderr if tfit is not None else None,
    }


def _apart(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or min(a, b) <= 0:
        return None
    return abs(a - b) / min(a, b)


def table(root: Path, runs: Sequence[str]) -> dict[str, Any]:
    pairs = replicate_pairs(root, runs)
    names = sorted({n for p in pairs for n in p})
    with replay_pool(min(len(names), os.cpu_count() or 1)) as pool:
        got = dict(zip(names, pool.map(prices, [root / n for n in names]), strict=True))
    rows: dict[str, Any] = {}
    for x, y in pairs:
        px, py = got[x], got[y]
        row: dict[str, Any] = {"runs": [x, y]}
        for est in ESTIMATORS:
            row[est] = {"seconds_per_token": [px[est], py[est]], "apart": _apart(px[est], py[est])}
        se = (px["stderr"], py["stderr"])
        a, b = px[BASELINE], py[BASELINE]
        row["baseline_sigmas_apart"] = (
            abs(a - b) / math.hypot(*se)
            if a is not None and b is not None and None not in se and math.hypot(*se) > 0
            else None
        )
        rows[f"{x} / {y}"] = row
    return {"pairs": rows, "summary": summarize(rows)}


def summarize(rows: Mapping[str, Any]) -> dict[str, Any]:
    """Per estimator, over the pairs every estimator priced: the median and the largest
    relative difference, and each as a ratio of the baseline's."""
    both = [r for r in rows.values() if all(r[e]["apart"] is not None for e in ESTIMATORS)]
    out: dict[str, Any] = {"pairs": len(both)}
    if not both:
        return out
    stats = {
        e: (statistics.median(r[e]["apart"] for r in both), max(r[e]["apart"] for r in both))
        for e in ESTIMATORS
    }
    base_med, base_max = stats[BASELINE]
    for e, (med, top) in stats.items():
        out[e] = {
            "median_apart": med,
            "max_apart": top,
            "median_vs_baseline": med / base_med if base_med > 0 else None,
            "max_vs_baseline": top / base_max if base_max > 0 else None,
        }
    return out


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f} %"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} x"


def markdown(doc: Mapping[str, Any]) -> str:
    header = ["runs", *(f"{e} (us)" for e in ESTIMATORS), "baseline sigmas apart"]
    body = [
        [
            " / ".join(r["runs"]),
            *(
                " / ".join(_us(v) for v in r[e]["seconds_per_token"]) + f" ({_pct(r[e]['apart'])})"
                for e in ESTIMATORS
            ),
            "-" if r["baseline_sigmas_apart"] is None else f"{r['baseline_sigmas_apart']:.1f}",
        ]
        for r in doc["pairs"].values()
    ]
    s = doc["summary"]
    lines = [
        markdown_table(header, body),
        "",
        f"Over the {s['pairs']} pairs every estimator priced:",
    ]
    for e in ESTIMATORS:
        if e in s:
            lines.append(
                f"- {e}: median {_pct(s[e]['median_apart'])} apart "
                f"({_ratio(s[e]['median_vs_baseline'])} {BASELINE}), largest "
                f"{_pct(s[e]['max_apart'])} ({_ratio(s[e]['max_vs_baseline'])})"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return recordings_main(__doc__, MATRIX, table, markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
