"""A computed token's cost from physics, against what the real-GPU matrix measured.

With offload on, the window's TTFT fit cannot price a computed token where every request
loads and computes a similar few hundred new tokens (multi-turn chat with a tier that holds
the histories): the advice waits (`reload_benefit_unmeasured`) until the engine has run
without offload. Physics gives a floor the window cannot: computing a token takes at least 2
FLOPs per parameter, so at least `weight bytes / dense BF16 peak` seconds (a BF16 weight is 2
bytes; FP8 halves the bytes and doubles the peak). This analysis asks, on every offload run
with a run without offload on its machine, whether that floor is safe and whether it would
decide what the window alone leaves open:

    .venv/bin/python -m bench.compute_bound [--json]

Per run: the weight bytes vLLM logged (meta.json's model_weight_bytes, from "Model loading
took X GiB" in its log), the floor (exporter/model/derive/compute.py, as the advisor has it),
the baseline (the TTFT fit of a computed token on the run without offload of the same
sequence and machine, matrixkit.base_run) and floor / baseline, where the baseline is
significant: the floor must not lie above the baseline's ~95 % interval; then the offload
run's own fit of a loaded token, the saving the loaded tokens make at least (floor less a
loaded token's cost at the upper end of its ~95 % interval, times the loaded tokens), that
saving less the stores at `store_cost_factor_max` times their copy time as a share of the TTFT
the traffic would have had without offload, and the run's measured truth. The fits here are
the window's own, without the floor: whether the floor is safe is judged against them. Since
session 18 the advisor bounds a computed token's cost by the floor where it knows the weight
bytes (`--model-weight-bytes`) and the GPU's peak (docs/advisor.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import markdown_table
from bench.store_cost import COMPUTED, LOADED, MATRIX, MIN_POINTS, intervals, paired
from exporter.model.derive.compute import computed_token_floor
from exporter.model.derive.fits import offload_fit, prefill_fit
from exporter.recording import read_meta
from exporter.thresholds import Thresholds

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Row:
    run: str
    base: str
    weights_gib: float | None
    floor_us: float | None  # weight bytes / peak: a computed token's least TTFT cost
    baseline_us: float | None  # the run without offload's TTFT fit of a computed token
    baseline_stderr_us: float | None
    floor_over_baseline: float | None  # where the baseline is significant
    own_computed_us: float | None  # the offload run's own fit, as the exporter has it
    own_computed_stderr_us: float | None
    loaded_us: float | None
    loaded_stderr_us: float | None
    saving_at_least_s: float | None  # (floor - loaded token's upper end) x loaded tokens
    store_copy_s: float
    ttft_s: float
    net_share_at_least: float | None  # less the stores at store_cost_factor_max x copy time
    truth: str


def measure(root: Path, run: str, base: str, truth: str, store_factor: float) -> Row:
    # The exporter's own floor from the recording's meta.json, as `replay` computes it.
    meta = read_meta(root / run)
    weights = meta.model_weight_bytes
    floor = computed_token_floor(weights, meta.gpu_names)
    b_int, o_int = intervals(root / base), intervals(root / run)
    before = prefill_fit(
        [tuple(d[k] for k in ("ttft_requests", COMPUTED, "ttft_seconds")) for d in b_int],
        MIN_POINTS,
    )
    own = offload_fit(
        [tuple(d[k] for k in ("ttft_requests", COMPUTED, LOADED, "ttft_seconds")) for d in o_int],
        MIN_POINTS,
    )
    b0 = before.seconds_per_token if before is not None else None
    b0_se = before.stderr if before is not None else None
    ratio = None
    if floor is not None and b0 is not None and b0_se is not None and b0 - 2 * b0_se > 0:
        ratio = floor / b0
    loaded = sum(d[LOADED] for d in o_int)
    store = sum(d["store_seconds"] for d in o_int)
    ttft = sum(d["ttft_seconds"] for d in o_int)
    saving = share = None
    if floor is not None and own is not None and own.loaded_stderr is not None:
        saving = (floor - (own.loaded_seconds_per_token + 2 * own.loaded_stderr)) * loaded
        net = saving - store_factor * store
        share = net / (ttft + net) if ttft + net > 0 else None

    def us(x: float | None) -> float | None:
        return None if x is None else x * 1e6

    return Row(
        run,
        base,
        None if weights is None else weights / GIB,
        us(floor),
        us(b0),
        us(b0_se),
        ratio,
        us(own.computed_seconds_per_token) if own is not None else None,
        us(own.computed_stderr) if own is not None else None,
        us(own.loaded_seconds_per_token) if own is not None else None,
        us(own.loaded_stderr) if own is not None else None,
        saving,
        store,
        ttft,
        share,
        truth,
    )


def rows(root: Path = MATRIX) -> list[Row]:
    """Every offload run with a run without offload on its machine, judged in its family's
    noise band as bench/advice_eval.py does."""
    factor = Thresholds().store_cost_factor_max
    return [measure(root, name, base, truth, factor) for name, _, base, truth in paired(root)]


def _f(x: float | None, fmt: str, err: float | None = None) -> str:
    if x is None:
        return "-"
    return format(x, fmt) + ("" if err is None else " +- " + format(2 * err, fmt))


def table(rs: Sequence[Row]) -> str:
    head = [
        "offload run",
        "against",
        "weights (GiB)",
        "floor (us)",
        "computed token without offload (us, +- 2 se)",
        "floor / that",
        "computed token, the run's own fit",
        "loaded token, the run's own fit",
        "loaded tokens saved at least (s)",
        "net after the stores, share of TTFT",
        "truth",
    ]
    body = []
    for r in rs:
        cells = [
            r.run,
            r.base,
            _f(r.weights_gib, ".2f"),
            _f(r.floor_us, ".1f"),
            _f(r.baseline_us, ".1f", r.baseline_stderr_us),
            _f(r.floor_over_baseline, ".2f"),
            _f(r.own_computed_us, ".1f", r.own_computed_stderr_us),
            _f(r.loaded_us, ".1f", r.loaded_stderr_us),
            _f(r.saving_at_least_s, ".2f"),
            "-" if r.net_share_at_least is None else f"{100 * r.net_share_at_least:+.1f}%",
            r.truth,
        ]
        body.append(cells)
    return markdown_table(head, body)


@dataclass(frozen=True, slots=True)
class Summary:
    runs: int
    floor_checked: int  # pairs whose run without offload measured a computed token's cost
    floor_over_baseline_max: float | None
    floor_above_the_baseline_interval: list[str]
    proves_a_saving: list[str]
    proves_a_saving_where_it_costs: list[str]


def summary(rs: Sequence[Row], material: float | None = None) -> Summary:
    """The floor's safety (pairs whose baseline is significant, and those where the floor lies
    above the baseline's ~95 % interval: physics or the fit wrong) and what it would prove:
    the runs where the saving net of the stores reaches the material share, and among them
    any whose truth is a cost (harmful, were it used)."""
    m = Thresholds().ttft_saving_material if material is None else material
    checked = [r for r in rs if r.floor_over_baseline is not None]
    ratios = [r.floor_over_baseline for r in checked if r.floor_over_baseline is not None]
    above = [
        r.run
        for r in checked
        if r.floor_us is not None
        and r.baseline_us is not None
        and r.baseline_stderr_us is not None
        and r.floor_us > r.baseline_us + 2 * r.baseline_stderr_us
    ]
    proven = [r for r in rs if r.net_share_at_least is not None and r.net_share_at_least >= m]
    return Summary(
        runs=len(rs),
        floor_checked=len(checked),
        floor_over_baseline_max=max(ratios) if ratios else None,
        floor_above_the_baseline_interval=above,
        proves_a_saving=[r.run for r in proven],
        proves_a_saving_where_it_costs=[r.run for r in proven if r.truth == "costs"],
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=MATRIX)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rs = rows(args.root)
    if args.json:
        doc = {"rows": [asdict(r) for r in rs], "summary": asdict(summary(rs))}
        print(json.dumps(doc, indent=1))
    else:
        print(table(rs))
        print()
        print(json.dumps(asdict(summary(rs))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
