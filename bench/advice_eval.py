"""The advice against measured truth, on every real-GPU matrix recording (issue 16).

    PYTHONPATH=. .venv/bin/python -m bench.advice_eval [tests/fixtures/gpu/matrix] [--json]

Each recording is replayed with DEFAULT thresholds (`kv-offload-exporter replay`, the code
the live exporter runs). Its label comes from what the runs measured, never from which
shape or workload it is: the summed TTFT of the identical request sequence with and without
offload at the same size (bench/gpu/matrixkit.py `paired_truth`: offload pays when it cuts
summed TTFT by at least 3 %, costs when it adds 3 % or more, neutral in between).

- An offload run's truth is its own pair's verdict (keep it on at this size, or not).
- A run without offload is labelled by enabling at the size its pair measured; an "enable"
  recommending another size is *unverified*: only a run at that size can check it.
- Agreement: enable/keep/grow/shrink/raise_store_threshold agree where offload pays (or is
  neutral), no_action/disable where it costs (or is neutral); insufficient_data agrees with
  nothing. Harmful: enable or keep where it costs, disable where it pays.
- Prediction: for a run without offload, the advisor's predicted TTFT saving at its pair's
  size (the what-if, `ttft_saved_seconds_per_second`) against the saving measured when that
  size was enabled on the same sequence; within 25 % or 0.02 s/s, whichever is larger.
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from exporter.config import Config
from exporter.replay import replay_one

REPO = Path(__file__).resolve().parent.parent
MATRIX = REPO / "tests" / "fixtures" / "gpu" / "matrix"
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import matrixkit  # type: ignore[import-not-found]  # noqa: E402  bench/gpu holds scripts, not a package

PAYS_ACTIONS = frozenset(
    {"enable_offload", "keep", "grow_buffer", "shrink_buffer", "raise_store_threshold"}
)
COSTS_ACTIONS = frozenset({"no_action", "disable_offload"})
GOALS = {"agreement": 0.90, "decided": 0.80, "decision_within_s": 300.0}
PREDICTION_REL, PREDICTION_ABS = 0.25, 0.02


@dataclass(frozen=True, slots=True)
class RunEval:
    run: str
    offload_bytes: float | None  # the run's CPU buffer (None: offload off)
    pair_size_bytes: float | None  # the size its pair measured
    truth: str  # pays | neutral | costs | unknown (no pair)
    measured_saving: float | None  # TTFT s saved per s of traffic at the pair's size
    action: str
    reason: str
    recommended_bytes: float | None
    first_decision_s: float | None
    verified: bool  # the truth speaks about the size the advice is about
    agrees: bool
    harmful: bool
    predicted_saving: float | None = None  # runs without offload: the what-if at the size
    prediction_ok: bool | None = None


def _requests(run: Path) -> list[dict[str, Any]]:
    with lzma.open(run / "requests.jsonl.xz", "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _meta(run: Path) -> dict[str, Any]:
    doc = json.loads((run / "meta.json").read_text())
    assert isinstance(doc, dict)
    return doc


def _offload_bytes(meta: dict[str, Any]) -> float | None:
    off = meta.get("offload")
    if not isinstance(off, dict):
        return None
    gib = off.get("size_gib")
    if isinstance(gib, int | float):
        return float(gib) * (1 << 30)
    size = off.get("bytes") or off.get("size_bytes")
    return float(size) if isinstance(size, int | float) else None


def _judge(action: str, truth: str, verified: bool) -> tuple[bool, bool]:
    """(agrees, harmful) of a settled action against the truth at its size."""
    if not verified or truth == "unknown":
        return False, False
    pays_side = action in PAYS_ACTIONS
    costs_side = action in COSTS_ACTIONS
    agrees = (pays_side and truth in ("pays", "neutral")) or (
        costs_side and truth in ("costs", "neutral")
    )
    harmful = (action in ("enable_offload", "keep") and truth == "costs") or (
        action == "disable_offload" and truth == "pays"
    )
    return agrees, harmful


def evaluate(root: Path = MATRIX) -> list[RunEval]:
    runs = sorted(p.parent for p in root.glob("*/meta.json"))
    metas = {r.name: _meta(r) for r in runs}
    out: list[RunEval] = []
    for run in runs:
        meta = metas[run.name]
        own = _offload_bytes(meta)
        partner = next(
            (
                other
                for other in runs
                if other != run
                and metas[other.name].get("pair") == meta.get("pair")
                and (_offload_bytes(metas[other.name]) is None) != (own is None)
            ),
            None,
        )
        base, on = (partner, run) if own is not None else (run, partner)
        truth, measured, pair_size = "unknown", None, None
        if base is not None and on is not None:
            t = matrixkit.paired_truth(_requests(base), _requests(on))
            truth, measured = str(t["verdict"]), t.get("ttft_saved_s_per_s")
            pair_size = _offload_bytes(metas[on.name])
        r = replay_one(run, Config())
        (final,) = (e for t in r.final.targets for e in t.engines)
        a = final.advice
        action, rec = str(a.action), a.recommended_buffer_bytes
        first = next(iter(r.first_decision.values()), None)
        # enable is about the size it recommends; grow/shrink about a size nobody ran yet.
        verified = truth != "unknown" and not (
            (action == "enable_offload" and rec is not None and rec != pair_size)
            or action in ("grow_buffer", "shrink_buffer")
        )
        agrees, harmful = _judge(action, truth, verified)
        predicted = ok = None
        if own is None and pair_size is not None and measured is not None:
            at_size = replay_one(run, Config(whatif_sizes=(int(pair_size),)))
            (e,) = (x for t in at_size.final.targets for x in t.engines)
            if e.whatif is not None and e.whatif.points:
                predicted = e.whatif.points[0].ttft_saved_seconds_per_second
            if predicted is not None:
                tolerance = max(PREDICTION_REL * abs(measured), PREDICTION_ABS)
                ok = abs(predicted - measured) <= tolerance
        out.append(
            RunEval(
                run.name,
                own,
                pair_size,
                truth,
                measured,
                action,
                str(a.reason),
                rec,
                first,
                verified,
                agrees,
                harmful,
                predicted,
                ok,
            )
        )
    return out


def summary(evals: Sequence[RunEval]) -> dict[str, Any]:
    labelled = [e for e in evals if e.verified]
    decided = [e for e in evals if e.action != "insufficient_data"]
    in_time = [
        e
        for e in decided
        if e.first_decision_s is not None and e.first_decision_s <= GOALS["decision_within_s"]
    ]
    predictions = [e for e in evals if e.prediction_ok is not None]
    return {
        "runs": len(evals),
        "verified": len(labelled),
        "agreement": sum(e.agrees for e in labelled) / len(labelled) if labelled else None,
        "harmful": [e.run for e in evals if e.harmful],
        "decided": len(in_time) / len(evals) if evals else None,
        "predictions": len(predictions),
        "predictions_ok": sum(bool(e.prediction_ok) for e in predictions),
        "goals": GOALS,
    }


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / (1 << 30):.2f} GiB"


def _num(x: float | None, fmt: str = "{:+.4f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(evals: Sequence[RunEval]) -> str:
    s = summary(evals)
    rows = [
        "| run | offload | truth (at size) | measured s/s | predicted s/s | settled action "
        "(reason) | recommended | first decision | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in evals:
        verdict = (
            "harmful"
            if e.harmful
            else "agrees"
            if e.agrees
            else "unverified"
            if not e.verified
            else "no decision"
            if e.action == "insufficient_data"
            else "disagrees"
        )
        rows.append(
            f"| {e.run} | {_gib(e.offload_bytes)} | {e.truth} ({_gib(e.pair_size_bytes)}) | "
            f"{_num(e.measured_saving)} | {_num(e.predicted_saving)} | {e.action} ({e.reason}) | "
            f"{_gib(e.recommended_bytes)} | {_num(e.first_decision_s, '{:.0f} s')} | {verdict} |"
        )
    agreement = "-" if s["agreement"] is None else f"{s['agreement']:.0%}"
    decided = "-" if s["decided"] is None else f"{s['decided']:.0%}"
    rows += [
        "",
        f"Agreement on verified runs: {agreement} of {s['verified']} (goal "
        f"{GOALS['agreement']:.0%}); decided within {GOALS['decision_within_s']:.0f} s: "
        f"{decided} of {s['runs']} (goal {GOALS['decided']:.0%}); harmful: "
        f"{', '.join(s['harmful']) or 'none'}; predicted saving within 25 % or 0.02 s/s of "
        f"the measured one: {s['predictions_ok']} of {s['predictions']}.",
    ]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", nargs="?", type=Path, default=MATRIX)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    evals = evaluate(args.root)
    if args.json:
        print(json.dumps({"runs": [asdict(e) for e in evals], **summary(evals)}, indent=1))
    else:
        print(markdown(evals), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
