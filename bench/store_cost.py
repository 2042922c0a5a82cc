"""What a store costs a computing request, against its copy time, on the real-GPU matrix.

The window's balance (exporter/model/derive/balance.py) prices a loaded token's recompute at
what a computed token costs with offload on, less vLLM's store copy time per computed token.
Whether the copy time is all the stores cost is measurable only where both runs of a pair
exist: the TTFT fit of the run without offload gives a computed token's own cost b0, the
offload run's fit (computed and loaded tokens) the cost with its store, b. Their difference
against the copy time s is the store's cost that the balance does not see:

    .venv/bin/python -m bench.store_cost [--json]

Per offload run of the matrix (tests/fixtures/gpu/matrix, each against its base run,
matrixkit.base_run) it prints b0, b, s and (b - b0) / s with the fits' standard errors (and
the same two slopes on vLLM's prefill time, which leaves out queueing and load waits), using
the exporter's own fits (exporter/model/derive/fits.py) on the scrape intervals of
metrics.jsonl. A ratio is only as good as the two slopes: it is printed where both are
significant and the rise exceeds its own error, "-" elsewhere. Results: docs/advisor.md
("Its limit").

Why the run alone cannot measure that rise: with offload on, nearly every computed token is
stored in the same interval, so no interval computes without storing. The last two columns
say so per run: the stored share of the computed tokens and the correlation of stored and
computed tokens across the scrape intervals. And why no fixed factor on the copy time repairs
the balance (`--sweep`): per factor k, the balance's decision on every paired offload run
against its measured truth, and each shape's decisions at the factor the other two shapes
would choose:

    .venv/bin/python -m bench.store_cost --sweep
"""

from __future__ import annotations

import argparse
import itertools
import json
import lzma
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import markdown_table
from exporter import expfmt
from exporter.model.derive.balance import OffloadBalance, offload_balance
from exporter.model.derive.fits import offload_fit, prefill_fit
from exporter.vllm_metrics import WANTED, normalise

REPO = Path(__file__).resolve().parent.parent
MATRIX = REPO / "tests" / "fixtures" / "gpu" / "matrix"
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import matrixkit  # type: ignore[import-not-found]  # noqa: E402  bench/gpu holds scripts, not a package

COMPUTED = "prompt_by_source:local_compute"
LOADED = "prompt_by_source:external_kv_transfer"
KEYS = (
    "ttft_requests",
    COMPUTED,
    LOADED,
    "ttft_seconds",
    "store_seconds",
    "prefill_requests",
    "prefill_seconds",
    "store_bytes",
)
MIN_POINTS = 10  # the exporter's default min_fit_points


def _scrapes(run: Path) -> list[dict[str, float]]:
    """The summed counters of KEYS at every scrape of a recording (engines added)."""
    out: list[dict[str, float]] = []
    with lzma.open(run / "metrics.jsonl.xz", "rt", encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            sample = normalise(expfmt.parse(rec["body"], WANTED), float(rec["t"]))
            tot = dict.fromkeys(KEYS, 0.0)
            for es in sample.engines.values():
                for k in KEYS:
                    tot[k] += es.counters.get(k, 0.0)
            out.append(tot)
    return out


def intervals(run: Path) -> list[dict[str, float]]:
    """Per scrape interval the counters' increase, for the intervals in which a first token
    came (the exporter's fits take the same)."""
    s = _scrapes(run)
    deltas = [{k: b[k] - a[k] for k in KEYS} for a, b in itertools.pairwise(s)]
    return [d for d in deltas if d["ttft_requests"] > 0]


@dataclass(frozen=True, slots=True)
class Row:
    run: str
    base: str
    computed_us: float | None  # b0: a computed token's TTFT cost without offload
    computed_stderr_us: float | None
    with_store_us: float | None  # b: the same with offload on (its store included)
    with_store_stderr_us: float | None
    copy_us: float | None  # s: store copy time per computed token
    ratio: float | None  # (b - b0) / s, where measured
    # The same two slopes on vLLM's prefill time (scheduled to first token: no queueing, and
    # no load, which vLLM counts as queue time), and their rise over s.
    prefill_computed_us: float | None = None
    prefill_with_store_us: float | None = None
    prefill_ratio: float | None = None
    # Stored over computed tokens, and their correlation across the scrape intervals: near 1
    # and 1, the stores' cost is inseparable from the computing within the run.
    stored_share: float | None = None
    stored_correlation: float | None = None

    def cells(self) -> list[str]:
        def us(x: float | None, e: float | None) -> str:
            if x is None:
                return "-"
            return f"{x:.1f}" + (f" +- {2 * e:.1f}" if e is not None else "")

        return [
            self.run,
            self.base,
            us(self.computed_us, self.computed_stderr_us),
            us(self.with_store_us, self.with_store_stderr_us),
            "-" if self.copy_us is None else f"{self.copy_us:.2f}",
            "-" if self.ratio is None else f"{self.ratio:.1f}",
            us(self.prefill_computed_us, None) + " / " + us(self.prefill_with_store_us, None),
            "-" if self.prefill_ratio is None else f"{self.prefill_ratio:.1f}",
            "-" if self.stored_share is None else f"{self.stored_share:.2f}",
            "-" if self.stored_correlation is None else f"{self.stored_correlation:.2f}",
        ]


def _rise(
    base: list[dict[str, float]], run: list[dict[str, float]], n: str, y: str, copy: float | None
) -> tuple[float | None, float | None, float | None, float | None, float | None]:
    """(b0, its stderr, b, its stderr, (b - b0) / copy) of `y` on requests `n` and tokens."""
    before = prefill_fit([tuple(d[k] for k in (n, COMPUTED, y)) for d in base], MIN_POINTS)
    # Without `before`: the run's own price of a computed token, as an exporter started on an
    # engine that already offloads has it.
    with_ = offload_fit([tuple(d[k] for k in (n, COMPUTED, LOADED, y)) for d in run], MIN_POINTS)
    b0 = before.seconds_per_token if before is not None else None
    b0_se = before.stderr if before is not None else None
    b = with_.computed_seconds_per_token if with_ is not None else None
    b_se = with_.computed_stderr if with_ is not None else None
    ratio = None
    if b0 is not None and b0_se is not None and b is not None and b_se is not None and copy:
        rise, rise_se = b - b0, math.hypot(b0_se, b_se)
        if b0 - 2 * b0_se > 0 and b - 2 * b_se > 0 and abs(rise) > 2 * rise_se:
            ratio = rise / copy
    return b0, b0_se, b, b_se, ratio


def _correlation(x: Sequence[float], y: Sequence[float]) -> float | None:
    n = len(x)
    if n < 3:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def measure(run: Path, base: Path) -> Row:
    b_int, o_int = intervals(base), intervals(run)
    computed = sum(d[COMPUTED] for d in o_int)
    kv_bytes = json.loads((run / "meta.json").read_text()).get("kv_bytes_per_token")
    share = corr = None
    if isinstance(kv_bytes, int | float) and kv_bytes > 0 and computed > 0:
        share = sum(d["store_bytes"] for d in o_int) / kv_bytes / computed
        corr = _correlation([d[COMPUTED] for d in o_int], [d["store_bytes"] for d in o_int])
    copy = sum(d["store_seconds"] for d in o_int) / computed if computed > 0 else None
    b0, b0_se, b, b_se, ratio = _rise(b_int, o_int, "ttft_requests", "ttft_seconds", copy)
    p0, _, p, _, p_ratio = _rise(b_int, o_int, "prefill_requests", "prefill_seconds", copy)

    def us(x: float | None) -> float | None:
        return None if x is None else x * 1e6

    return Row(
        run.name,
        base.name,
        us(b0),
        us(b0_se),
        us(b),
        us(b_se),
        us(copy),
        ratio,
        us(p0),
        us(p),
        p_ratio,
        share,
        corr,
    )


def load_metas(root: Path) -> dict[str, dict[str, Any]]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(root.glob("*/meta.json"))}


def rows(root: Path = MATRIX) -> list[Row]:
    metas = load_metas(root)
    out = []
    for name, meta in sorted(metas.items()):
        if not isinstance(meta.get("offload"), dict):
            continue
        base = matrixkit.base_run(metas, name)
        if base is not None:
            out.append(measure(root / name, root / base))
    return out


def table(rs: Sequence[Row]) -> str:
    head = [
        "offload run",
        "against",
        "computed token, without offload (us, +- 2 se)",
        "with offload on",
        "store copy per computed token (us)",
        "rise / copy",
        "prefill time: computed token without / with offload (us)",
        "rise / copy",
        "stored / computed tokens",
        "correlation per interval",
    ]
    return markdown_table(head, [r.cells() for r in rs])


# Store cost factors tried: from the copy time itself to twice the largest TTFT rise over it
# that bench.store_cost measured where requests barely overlap.
FACTORS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0)
Z = 2.0  # standard errors either side, as the advisor's keep takes the lower end


@dataclass(frozen=True, slots=True)
class Judged:
    run: str
    shape: str
    truth: str  # pays, neutral or costs: the paired truth in the family's band
    balance: OffloadBalance | None  # the window alone: the exporter's own fit and balance


def decide(bal: OffloadBalance | None, factor: float) -> str:
    """The balance's decision with stores at `factor` times their copy time: pays where its
    lower end saves at least the truth's 3 %, costs where its upper end saves less (turning
    offload off loses nothing measurable), else wait."""
    if bal is None:
        return "wait"
    lo, hi = bal.share(-Z, factor), bal.share(Z, factor)
    if lo is not None and lo >= matrixkit.TRUTH_THRESHOLD:
        return "pays"
    if hi is not None and hi < matrixkit.TRUTH_THRESHOLD:
        return "costs"
    return "wait"


def score(js: Sequence[Judged], factor: float) -> dict[str, Any]:
    """Agreeing (pays where it pays, costs where it costs, either where neutral), harmful
    (pays where it costs, costs where it pays) and waiting runs at one factor."""
    out: dict[str, Any] = {"factor": factor, "agree": 0, "harmful": [], "wait": 0}
    for j in js:
        d = decide(j.balance, factor)
        if d == "wait":
            out["wait"] += 1
        elif d == j.truth or j.truth == "neutral":
            out["agree"] += 1
        elif j.truth in ("pays", "costs"):
            out["harmful"].append(f"{j.run}: {d}")
    return out


def paired(root: Path = MATRIX) -> list[tuple[str, dict[str, Any], str, str]]:
    """(run, meta, base, truth) of every offload run with a base on its machine, its truth
    judged in its family's noise band as bench/advice_eval.py does."""
    metas = load_metas(root)
    records = {name: matrixkit.load_requests(root / name) for name in metas}
    noise = matrixkit.family_noise(metas, records)
    out = []
    for name, meta in sorted(metas.items()):
        base = matrixkit.base_run(metas, name) if isinstance(meta.get("offload"), dict) else None
        if base is not None:
            truth = str(matrixkit.family_truth(metas, records, noise, base, name)["verdict"])
            out.append((name, meta, base, truth))
    return out


def judged(root: Path = MATRIX) -> list[Judged]:
    """Every offload run with a base on its machine, its truth and its window's balance."""
    out = []
    for name, meta, _base, truth in paired(root):
        iv = intervals(root / name)
        fit = offload_fit(
            [tuple(d[k] for k in ("ttft_requests", COMPUTED, LOADED, "ttft_seconds")) for d in iv],
            MIN_POINTS,
        )
        sums = {k: sum(d[k] for d in iv) for k in (LOADED, COMPUTED, "store_seconds")}
        sums["ttft_seconds"] = sum(d["ttft_seconds"] for d in iv)
        shape = meta.get("shape")
        label = str(shape.get("name", "")) if isinstance(shape, dict) else str(shape)
        out.append(Judged(name, label, truth, offload_balance(fit, sums)))
    return out


def sweep(js: Sequence[Judged], factors: Sequence[float] = FACTORS) -> dict[str, Any]:
    """Each factor on every run, then per shape held out: the factor the other shapes choose
    (fewest harmful, then most agreeing, then the smallest) and what it does on the shape."""
    held = []
    for shape in sorted({j.shape for j in js}):
        rest = [j for j in js if j.shape != shape]
        ranked = sorted(
            factors, key=lambda k: (len(score(rest, k)["harmful"]), -score(rest, k)["agree"], k)
        )
        k = ranked[0]
        own = [j for j in js if j.shape == shape]
        held.append({"held_out": shape, "runs": len(own), **score(own, k)})
    return {
        "runs": len(js),
        "truths": {t: sum(j.truth == t for j in js) for t in ("pays", "neutral", "costs")},
        "factors": [score(js, k) for k in factors],
        "leave_one_shape_out": held,
    }


def sweep_table(sw: dict[str, Any]) -> str:
    lines = [
        f"{sw['runs']} offload runs with a base on their machine; truth {sw['truths']}",
        "",
        "| store cost factor | agree | harmful | wait |",
        "|---|---|---|---|",
    ]
    for f in sw["factors"]:
        harm = ", ".join(f["harmful"]) or "none"
        lines.append(
            f"| {f['factor']:g} | {f['agree']} | {len(f['harmful'])} ({harm}) | {f['wait']} |"
        )
    lines += ["", "| shape held out | runs | factor the others choose | agree | harmful | wait |"]
    lines.append("|---|---|---|---|---|---|")
    for h in sw["leave_one_shape_out"]:
        harm = ", ".join(h["harmful"]) or "none"
        lines.append(
            f"| {h['held_out']} | {h['runs']} | {h['factor']:g} | {h['agree']} | "
            f"{len(h['harmful'])} ({harm}) | {h['wait']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=MATRIX)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="the store cost factor sweep")
    args = ap.parse_args(argv)
    if args.sweep:
        sw = sweep(judged(args.root))
        print(json.dumps(sw, indent=1) if args.json else sweep_table(sw))
        return 0
    rs = rows(args.root)
    print(json.dumps([asdict(r) for r in rs], indent=1) if args.json else table(rs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
