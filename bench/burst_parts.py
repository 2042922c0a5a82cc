"""What a CPU tier changed in each burst of a pair, split into what it cost every request,
what it cost a computed token and what a loaded token saved; and whether the exporter's own
TTFT fits see the first of the three.

    PYTHONPATH=. .venv/bin/python -m bench.burst_parts [tests/fixtures/gpu/matrix] [RUN ...]
        [--json]

Per offload run whose requests come in bursts (the `concurrent` generator's, which tags each
request with its burst: the concurrent and bursts-decode workloads) with a run without
offload of the same sequence on its machine (`matrixkit.base_run`): every burst's summed
TTFT change with the tier, its requests paired by position (`matrixkit.matched_requests`),
fitted by least squares with no intercept on the burst's requests, its computed tokens (with
the tier) and its loaded tokens (`bench.common.loaded_tokens`):

    change = r x requests + c x computed + l x loaded

`request_ms` (r) is what the tier cost each request whether it loaded or not (the steps it
adds, docs/whatif.md "What batch 37 measured"), `computed_us` (c) what it cost a computed
token beyond its compute (its store), `loaded_us` (-l) what a loaded token saved; `*_s` are
those terms over the run's bursts and `change_s` the run's summed TTFT change (negative: the
tier saved).

Beside them the exporter's TTFT fits over the scrape intervals (the fits a replay makes,
exporter/model/derive/fits.py): `window_rise_ms`, the per-request cost of the offload run's
fit (`offload_fit`, on requests, computed and loaded tokens) less that of its base's
(`prefill_fit` on requests and computed tokens), what a running exporter has of r once it
knows the fit from before enabling (`replay --prior`); and `window_loaded_us`, the offload
fit's computed less loaded token cost, the saving per loaded token the window's balance
prices (exporter/model/derive/balance.py). The balance charges the stores but not r: where r
is large its saving runs high (docs/whatif.md, "What a tier costs every request").
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.advice_eval import MATRIX
from bench.common import loaded_tokens, markdown_table, recording_metas, recordings_main
from bench.store_cost import COMPUTED, LOADED, MIN_POINTS, intervals
from exporter.model.derive.fits import least_squares, offload_fit, prefill_fit

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import matrixkit  # type: ignore[import-not-found]  # bench/gpu holds scripts, not a package

# The workload generators (bench/gpu/matrixkit.py) that tag each request with its burst.
BURSTY = ("concurrent",)


def bursts(
    base: Sequence[Mapping[str, Any]], offload: Sequence[Mapping[str, Any]]
) -> list[tuple[float, float, float, float]]:
    """Per burst of the paired requests: (requests, computed tokens with the tier, loaded
    tokens, summed TTFT with the tier less without, s)."""
    groups: dict[Any, list[tuple[Mapping[str, Any], Mapping[str, Any]]]] = defaultdict(list)
    for b, o in matrixkit.matched_requests(base, offload):
        groups[(o.get("tags") or {}).get("burst")].append((b, o))
    return [
        (
            float(len(g)),
            float(sum(int(o["prompt_tokens"]) - int(o.get("cached_tokens") or 0) for _, o in g)),
            float(sum(max(loaded_tokens(b, o), 0) for b, o in g)),
            sum(float(o["ttft_s"]) - float(b["ttft_s"]) for b, o in g),
        )
        for _, g in sorted(groups.items(), key=lambda kv: str(kv[0]))
    ]


def parts(rows: Sequence[tuple[float, float, float, float]]) -> dict[str, float] | None:
    """The three costs of `bursts` (r ms, c us, -l us) with their standard errors, the terms
    over the bursts (s) and the whole change (s); None where the fit is not determined."""
    fitted = least_squares([[r[i] for r in rows] for i in range(3)], [r[3] for r in rows])
    if fitted is None:
        return None
    (r, c, per_loaded), (r_se, c_se, per_loaded_se) = fitted
    total = [sum(row[i] for row in rows) for i in range(4)]
    return {
        "bursts": float(len(rows)),
        "request_ms": 1e3 * r,
        "request_stderr_ms": 1e3 * r_se,
        "computed_us": 1e6 * c,
        "computed_stderr_us": 1e6 * c_se,
        "loaded_us": -1e6 * per_loaded,
        "loaded_stderr_us": 1e6 * per_loaded_se,
        "request_s": r * total[0],
        "computed_s": c * total[1],
        "loaded_s": per_loaded * total[2],
        "change_s": total[3],
    }


def window(base: Path, run: Path) -> dict[str, float | None]:
    """The exporter's fits over each recording's scrape intervals: `window_rise_ms` and
    `window_loaded_us` (the module's doc)."""
    before = prefill_fit(
        [(d["ttft_requests"], d[COMPUTED], d["ttft_seconds"]) for d in intervals(base)],
        MIN_POINTS,
    )
    on = offload_fit(
        [(d["ttft_requests"], d[COMPUTED], d[LOADED], d["ttft_seconds"]) for d in intervals(run)],
        MIN_POINTS,
    )
    return {
        "window_rise_ms": (
            1e3 * (on.overhead_seconds - before.overhead_seconds)
            if on is not None and before is not None
            else None
        ),
        "window_loaded_us": (
            1e6 * (on.computed_seconds_per_token - on.loaded_seconds_per_token)
            if on is not None
            else None
        ),
    }


def table(root: Path = MATRIX, names: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per offload run of a bursty workload under `root` (or `names`) with a base on its
    machine: its base, workload, tokens decoded a request, `parts` and `window`."""
    metas = recording_metas(root, names)
    out: dict[str, dict[str, Any]] = {}
    for name in names or sorted(metas):
        meta = metas[name]
        workload = meta.get("workload") or {}
        if not meta.get("offload") or workload.get("generator") not in BURSTY:
            continue
        base = matrixkit.base_run(metas, name)
        if base is None:
            continue
        got = parts(
            bursts(matrixkit.load_requests(root / base), matrixkit.load_requests(root / name))
        )
        if got is None:
            continue
        out[name] = {
            "base": base,
            "workload": workload["name"],
            "max_tokens": workload.get("max_tokens"),
            **got,
            **window(root / base, root / name),
        }
    return out


def markdown(rows: Mapping[str, Mapping[str, Any]]) -> str:
    def est(r: Mapping[str, Any], key: str, unit: str) -> str:
        return f"{r[f'{key}_{unit}']:+.1f} +- {2 * r[f'{key}_stderr_{unit}']:.1f}"

    def opt(x: float | None) -> str:
        return "-" if x is None else f"{x:+.1f}"

    header = [
        "offload run",
        "base",
        "decoded",
        "bursts",
        "a request, ms",
        "a computed token, us",
        "a loaded token saved, us",
        "requests / computed / loaded, s",
        "change, s",
        "window: a request's rise, ms",
        "window: a loaded token saved, us",
    ]
    body = [
        [
            name,
            r["base"],
            str(r["max_tokens"]),
            f"{r['bursts']:.0f}",
            est(r, "request", "ms"),
            est(r, "computed", "us"),
            est(r, "loaded", "us"),
            f"{r['request_s']:+.1f} / {r['computed_s']:+.1f} / {r['loaded_s']:+.1f}",
            f"{r['change_s']:+.2f}",
            opt(r["window_rise_ms"]),
            opt(r["window_loaded_us"]),
        ]
        for name, r in rows.items()
    ]
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> int:
    return recordings_main(__doc__, MATRIX, table, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
