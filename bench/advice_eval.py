"""The advice against measured truth, on every real-GPU matrix recording (issue 16).

    PYTHONPATH=. .venv/bin/python -m bench.advice_eval [tests/fixtures/gpu/matrix] [--json]
        [--interval SECONDS ...]   (several: the goals at each exporter --interval)

(the replays run in parallel, one worker process per CPU; KVOE_EVAL_WORKERS sets how many;
an evaluation is kept in .cache/advice-eval/, keyed by the bytes of exporter/, bench/ and
the recordings, and read back while none of them changes; KVOE_EVAL_CACHE=off evaluates
afresh)

Each recording is replayed with DEFAULT thresholds (`kv-offload-exporter replay`, the code
the live exporter runs). Its label comes from what the runs measured, never from which
shape or workload it is: the summed TTFT of the identical request sequence with and without
offload at the same size (bench/gpu/matrixkit.py `paired_truth`: offload pays when it cuts
summed TTFT by at least 3 %, costs when it adds 3 % or more, neutral in between).

- Advice is judged at the size it speaks about: keep or disable at the run's own size, enable,
  grow or shrink at the recommended size (*unverified* until a run of that size exists: the
  "close the loop" runs of bench/gpu/scenarios/close-the-loop.json), "leave it off" at the
  best size measured. The truth at size S is the verdict of the family's run with S against
  its run without offload on its machine (the family: the same shape, workload and vLLM
  flags; matrixkit.base_run). A run is judged by its own machine's pairs first; where its
  machine has no run of the size (an offload run without a base there, an enable at a size
  recorded elsewhere, "leave it off" on a machine without a run of any size), by the
  family's pair of that size on another machine (`_elsewhere`, marked "elsewhere" in the
  table); predictions only on its own machine.
- Agreement: enable/keep/grow/shrink/raise_store_threshold agree where offload pays (or is
  neutral), no_action/disable where it costs (or is neutral); insufficient_data agrees with
  nothing. Harmful: a pays-side action (enable, keep, grow, shrink, raise_store_threshold)
  where it costs at the size it speaks of, disable where it pays, for the settled advice at
  the end and at any time before it (an operator acts on what the exporter says when it says
  it); settled advice at a size no machine has a run of is listed as unmeasured. Swinging:
  the settled action going back to one it had left.
- Prediction: for a run without offload, the advisor's predicted TTFT saving at every size
  its family measured (the what-if, `ttft_saved_seconds_per_second`) against the saving
  measured when that size was enabled on the same sequence; within 25 % or 0.02 s/s,
  whichever is larger.
- After enabling: each offload run is also replayed after its run without offload
  (`replay --prior`): the cost of a computed token measured there is remembered, as a live
  exporter remembers it across the restart that enables offload. Reported beside the goals,
  which are measured on every recording alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.pool import replay_pool
from exporter.config import Config
from exporter.model.derive.engines import CostBefore
from exporter.replay import Step, replay_one
from exporter.vllm_metrics import EngineKey

REPO = Path(__file__).resolve().parent.parent
MATRIX = REPO / "tests" / "fixtures" / "gpu" / "matrix"
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import matrixkit  # type: ignore[import-not-found]  # noqa: E402  bench/gpu holds scripts, not a package

PAYS_ACTIONS = frozenset(
    {"enable_offload", "keep", "grow_buffer", "shrink_buffer", "raise_store_threshold"}
)
COSTS_ACTIONS = frozenset({"no_action", "disable_offload"})
GOALS = {"agreement": 0.90, "decided": 0.80, "decision_within_s": 300.0}
# Scenarios recorded after the advisor's rules were fixed, on a shape it was not tuned on:
# reported on their own as well, the closest the recordings come to runs it has not seen.
HOLDOUT = "holdout.json"


def held_out() -> frozenset[str]:
    """The run names bench/gpu/scenarios/holdout.json defines."""
    return frozenset(matrixkit.load_scenarios(files=(HOLDOUT,)))


PREDICTION_REL, PREDICTION_ABS = 0.25, 0.02


@dataclass(frozen=True, slots=True)
class Prediction:
    run: str  # the run without offload it was made on
    size_bytes: float
    predicted: float | None  # the what-if's TTFT saving at that size, before enabling
    measured: float  # what enabling that size measured on the same sequence
    ok: bool | None


@dataclass(frozen=True, slots=True)
class After:
    """An offload run's settled advice when replayed after its run without offload."""

    base: str
    action: str
    reason: str
    verified: bool  # a run of the size it speaks about exists
    agrees: bool
    harmful: bool  # at the end or settled at any time before


@dataclass(frozen=True, slots=True)
class RunEval:
    run: str
    offload_bytes: float | None  # the run's CPU buffer (None: offload off)
    pair_size_bytes: float | None  # the size the advice speaks about (its truth's size)
    truth: str  # pays | neutral | costs | unknown (no run of that size)
    measured_saving: float | None  # TTFT s saved per s of traffic at that size
    action: str
    reason: str
    recommended_bytes: float | None
    first_decision_s: float | None
    verified: bool  # the truth speaks about the size the advice is about
    agrees: bool
    harmful: bool
    predicted_saving: float | None = None  # runs without offload: the what-if at the size
    prediction_ok: bool | None = None
    predictions: tuple[Prediction, ...] = ()  # runs without offload: at every size measured
    family: str = ""  # meta "pair": the same shape, workload and vLLM flags
    threshold: float = matrixkit.TRUTH_THRESHOLD  # the change the truth needed (noise band)
    truth_3pct: str = "unknown"  # the truth at a flat 3 %, the machine's noise ignored
    harmful_3pct: bool = False
    # When a settled advice was harmful at the size it spoke about, the final one included
    # (seconds since the recording's first scrape).
    harmful_at_s: tuple[float, ...] = ()
    # Times the settled action went back to one it had left (grow, disable, grow: one): advice
    # that swings tells an operator nothing.
    swings: int = 0
    after: After | None = None  # offload runs: replayed after their run without offload
    # Settled advice about a size the family has no run of: neither harmful nor agreeing, so
    # it is listed (first time, action, size) rather than silently left out of both counts.
    unmeasured: tuple[tuple[float, str, float], ...] = ()
    # The truth is the family's pair of that size on another machine (runs without offload
    # whose machine has no run of the size their advice speaks about; _elsewhere).
    truth_elsewhere: bool = False


def _requests(run: Path) -> list[dict[str, Any]]:
    return matrixkit.load_requests(run)  # type: ignore[no-any-return]


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
    # The "never harmful": no enable or keep where offload costs at the size in
    # question, no grow where the larger size costs; a shrink keeps the tier at the smaller
    # size, and raising the store threshold keeps it too.
    harmful = (pays_side and truth == "costs") or (action == "disable_offload" and truth == "pays")
    return agrees, harmful


def _about(
    own: float | None, action: str, rec: float | None, measured_at: dict[float, dict[str, Any]]
) -> float | None:
    """The size the advice speaks about: keep/disable the run's own, enable/grow/shrink the
    recommended one (verified only where a run of that size exists). "Leave it off" speaks
    about every size: judged on the best one measured."""
    if own is not None:
        return rec if action in ("grow_buffer", "shrink_buffer") else own
    if action == "enable_offload":
        return rec
    return max(
        measured_at,
        key=lambda b: measured_at[b].get("ttft_saved_s_per_s") or 0.0,
        default=None,
    )


def _swings(actions: Sequence[str]) -> int:
    """How often a sequence of settled actions (repeats collapsed) returns to one it left."""
    return sum(a in actions[:i] for i, a in enumerate(actions))


def _pairs(
    runs: Sequence[Path], metas: dict[str, dict[str, Any]], run: Path
) -> dict[float, tuple[Path, Path]]:
    """By offload size, (run without offload, offload run) of the run's pair family, each
    offload run with the run without offload it is compared with (matrixkit.base_run); for a
    run without offload the pairs it is the base of, and at sizes where it is the base of
    none, the offload runs of its own machine (a replicate: the same sequence on the same
    GPU as the run they are based on). Where a size has several pairs (a pair recorded again
    on another machine, `-rep`), an offload run keeps its own at its size, and elsewhere
    the one of its machine, else the one recorded nearest in time: each run is judged by
    what its own machine measured."""
    by_name = {r.name: r for r in runs}
    same = [r for r in runs if metas[r.name].get("pair") == metas[run.name].get("pair")]
    without = _offload_bytes(metas[run.name]) is None
    t = matrixkit.traffic_start(metas[run.name])
    found: dict[float, tuple[tuple[int, float, str], tuple[Path, Path]]] = {}
    for on in same:
        size = _offload_bytes(metas[on.name])
        base = matrixkit.base_run(metas, on.name) if size is not None else None
        if size is None or base is None:
            continue
        mine = on == run or base == run.name
        here = matrixkit.same_machine(metas[run.name], metas[on.name])
        if without and not mine and not here:
            continue
        pair = (by_name[base], on) if not without or mine else (run, on)
        dt = abs(matrixkit.traffic_start(metas[on.name]) - t)
        key = (0 if mine else 1 if here else 2, dt, on.name)
        if size not in found or key < found[size][0]:
            found[size] = (key, pair)
    return {size: pair for size, (_, pair) in found.items()}


def _elsewhere(
    runs: Sequence[Path], metas: dict[str, dict[str, Any]], run: Path, own: Iterable[float]
) -> dict[float, tuple[Path, Path]]:
    """For a run without offload, at the sizes `_pairs` has none for it: the family's pair of
    that size on another machine, the one whose traffic started nearest in time. It labels
    the advice as an offload run without a base on its machine is labelled (by the family's
    pair of its size), so an enable at a size recorded only elsewhere is judged, not listed
    as unmeasured; predictions stay on the run's own machine, where the sequence's speed is
    the same."""
    if _offload_bytes(metas[run.name]) is not None:
        return {}
    by_name = {r.name: r for r in runs}
    taken = set(own)
    t = matrixkit.traffic_start(metas[run.name])
    out: dict[float, tuple[Path, Path]] = {}
    for on in sorted(
        runs, key=lambda r: (-abs(matrixkit.traffic_start(metas[r.name]) - t), r.name)
    ):
        size = _offload_bytes(metas[on.name])
        if (
            size is None
            or size in taken
            or metas[on.name].get("pair") != metas[run.name].get("pair")
        ):
            continue
        base = matrixkit.base_run(metas, on.name)
        if base is not None:
            out[size] = (by_name[base], on)  # the nearest in time is written last
    return out


@dataclass(frozen=True, slots=True)
class _Replay:
    """What the evaluation takes from one replay (the whole CycleResult stays in the worker)."""

    action: str
    reason: str
    recommended_buffer_bytes: float | None
    first_decision: float | None
    timeline: tuple[Step, ...]
    before: dict[EngineKey, CostBefore]
    curve: dict[float, float | None] | None  # the what-if at the sizes asked for


_Job = tuple[Path, tuple[int, ...], Mapping[EngineKey, CostBefore] | None, float]


def _replay(job: _Job) -> _Replay:
    """Replay one recording with default thresholds at the exporter's --interval (after
    `before` where given) and, where sizes are given, once more with the what-if at those
    sizes. A top-level function: it runs in a worker process."""
    run, sizes, before, interval = job
    r = replay_one(run, Config(interval=interval), before=before)
    (final,) = (e for t in r.final.targets for e in t.engines)
    curve = None
    if sizes:
        at = replay_one(run, Config(interval=interval, whatif_sizes=sizes))
        (e,) = (x for tt in at.final.targets for x in tt.engines)
        curve = {
            p.cpu_buffer_bytes: p.ttft_saved_seconds_per_second
            for p in (e.whatif.points if e.whatif is not None else ())
        }
    a = final.advice
    return _Replay(
        str(a.action),
        str(a.reason),
        a.recommended_buffer_bytes,
        next(iter(r.first_decision.values()), None),
        r.timeline,
        r.before,
        curve,
    )


def _workers() -> int:
    """KVOE_EVAL_WORKERS, else one per CPU: each replay is independent but for the fits an
    offload run's replay after its base takes from the base's."""
    env = os.environ.get("KVOE_EVAL_WORKERS")
    if env and not env.isdigit():
        raise SystemExit(f"KVOE_EVAL_WORKERS={env!r}: expected a number of worker processes")
    return max(1, int(env) if env else (os.cpu_count() or 1))


# An evaluation is a pure function of the code it runs and the recordings: `./run test`
# evaluates the matrix in `gen --check` and again in tests/test_advice_eval.py, about 2.5 min
# each on two cores, and the second reads what the first wrote. Keyed by the bytes of every
# file under exporter/ and bench/ and of every recording, so any change evaluates afresh;
# KVOE_EVAL_CACHE=off never reads or writes it.
CACHE = REPO / ".cache" / "advice-eval"
# Entries kept (about 70 KB each): the newest, enough for a few code states at each of the
# four intervals docs/advisor.md tabulates.
CACHE_KEEP = 16


def _prune(keep: int = CACHE_KEEP) -> None:
    """Remove all but the `keep` most recently written entries: each code state under
    development leaves one per interval, and none is read again once the code moves on."""
    entries = sorted(CACHE.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        old.unlink(missing_ok=True)


def cache_key(root: Path, interval: float, full: bool = True) -> str:
    h = hashlib.sha256(f"{interval!r} {full} {sys.version}".encode())
    for base, files in (
        (REPO, [f for d in ("exporter", "bench") for f in (REPO / d).rglob("*")]),
        (root, list(root.rglob("*"))),
    ):
        for f in sorted(files):
            if f.is_file() and "__pycache__" not in f.parts:
                h.update(f"\0{f.relative_to(base)}\0".encode())
                h.update(f.read_bytes())
    return h.hexdigest()


def _from_json(d: dict[str, Any]) -> RunEval:
    """RunEval from its asdict() JSON (the cache)."""
    after = d["after"]
    return RunEval(
        **{
            **d,
            "predictions": tuple(Prediction(**p) for p in d["predictions"]),
            "after": After(**after) if after is not None else None,
            "harmful_at_s": tuple(d["harmful_at_s"]),
            "unmeasured": tuple(tuple(u) for u in d["unmeasured"]),
        }
    )


def evaluate(
    root: Path = MATRIX, interval: float | None = None, *, full: bool = True
) -> list[RunEval]:
    """Every recording under root judged; `interval`: the exporter's --interval the replays
    run at (default: the exporter's default; one scrape per interval where it is coarser
    than the recordings' 1 s). Read from the cache (above) where the same code evaluated
    the same recordings before. `full=False`: the advice alone, without the predictions
    and the replays after a run without offload (no `predictions`, `after` None), about
    half the replays."""
    interval = Config().interval if interval is None else interval
    if os.environ.get("KVOE_EVAL_CACHE", "on") == "off":
        return _evaluate(root, interval, full)
    path = CACHE / f"{cache_key(root, interval, full)}.json"
    try:
        return [_from_json(d) for d in json.loads(path.read_text())]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: evaluate
    evals = _evaluate(root, interval, full)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps([asdict(e) for e in evals]))
        tmp.replace(path)  # atomic: a concurrent reader sees all of it or nothing
        _prune()
    except OSError as e:  # a read-only checkout: evaluated, just not kept
        print(f"advice_eval: not cached ({e})", file=sys.stderr)
    return evals


class Truths:
    """The measured truths of a folder of recordings, each pair's computed once, and the
    judgement of an action against them (the rules of the module doc)."""

    def __init__(self, root: Path) -> None:
        self.runs = sorted(p.parent for p in root.glob("*/meta.json"))
        self.metas = {r.name: _meta(r) for r in self.runs}
        self._records = {r.name: _requests(r) for r in self.runs}
        self._noise = matrixkit.family_noise(self.metas, self._records)
        self._done: dict[tuple[str, str], dict[str, Any]] = {}
        self._by_name = {r.name: r for r in self.runs}

    def truth(self, base: Path, on: Path) -> dict[str, Any]:
        """matrixkit.family_truth of one pair (run without offload, offload run)."""
        if (base.name, on.name) not in self._done:
            self._done[base.name, on.name] = matrixkit.family_truth(
                self.metas, self._records, self._noise, base.name, on.name
            )
        return self._done[base.name, on.name]

    def pairs(self, run: str) -> dict[float, tuple[Path, Path]]:
        return _pairs(self.runs, self.metas, self._by_name[run])

    def measured_at(self, run: str) -> dict[float, dict[str, Any]]:
        """By size, the truth of the run's family on its own machine (`_pairs`)."""
        return {size: self.truth(b, on) for size, (b, on) in self.pairs(run).items()}

    def elsewhere(
        self, run: str, measured_at: dict[float, dict[str, Any]]
    ) -> dict[float, dict[str, Any]]:
        """By size, the truth of the run's family on other machines (`_elsewhere`)."""
        found = _elsewhere(self.runs, self.metas, self._by_name[run], measured_at)
        return {size: self.truth(b, on) for size, (b, on) in found.items()}

    def judged(self, run: str, action: str, recommended: float | None) -> Judged:
        """Where the action of `run` is judged: its own machine's truths, those elsewhere,
        the size it speaks about and the truth there (the rules of the module doc)."""
        measured_at = self.measured_at(run)
        elsewhere = self.elsewhere(run, measured_at)
        judged_at = _judged_at(action, measured_at, elsewhere)
        about = _about(_offload_bytes(self.metas[run]), action, recommended, judged_at)
        t = judged_at.get(about) if about is not None else None
        return Judged(measured_at, elsewhere, about, t)

    def judge(self, run: str, action: str, recommended: float | None) -> tuple[str, bool, bool]:
        """(truth at the size the action speaks about, agrees, harmful); truth "unknown"
        where no run of that size exists."""
        t = self.judged(run, action, recommended).truth
        verdict = str(t["verdict"]) if t is not None else "unknown"
        agrees, harmful = _judge(action, verdict, t is not None)
        return verdict, agrees, harmful


@dataclass(frozen=True, slots=True)
class Judged:
    measured_at: dict[float, dict[str, Any]]  # by size, the family's truths on its machine
    elsewhere: dict[float, dict[str, Any]]  # and on other machines (`_elsewhere`)
    about: float | None  # the size the action speaks about
    truth: dict[str, Any] | None  # the truth there (None: no run of that size)


def _evaluate(root: Path, interval: float, full: bool = True) -> list[RunEval]:
    truths = Truths(root)
    runs, metas = truths.runs, truths.metas
    pairs = {r.name: truths.pairs(r.name) for r in runs}
    without = [r for r in runs if _offload_bytes(metas[r.name]) is None]
    with_ = [r for r in runs if _offload_bytes(metas[r.name]) is not None]
    bases = {r.name: matrixkit.base_run(metas, r.name) for r in with_}
    with replay_pool(_workers()) as pool:
        # Runs without offload first: an offload run's replay after its base takes its fits.
        done = dict(
            zip(
                (r.name for r in without),
                pool.map(
                    _replay,
                    [
                        (
                            r,
                            tuple(int(b) for b in sorted(pairs[r.name])) if full else (),
                            None,
                            interval,
                        )
                        for r in without
                    ],
                ),
                strict=True,
            )
        )
        after_of = [r for r in with_ if bases[r.name] in done] if full else []
        jobs: list[_Job] = [(r, (), None, interval) for r in with_] + [
            (r, (), done[str(bases[r.name])].before, interval) for r in after_of
        ]
        results = list(pool.map(_replay, jobs))
    done.update(zip((r.name for r in with_), results[: len(with_)], strict=True))
    afters = dict(zip((r.name for r in after_of), results[len(with_) :], strict=True))

    out: list[RunEval] = []
    for run in runs:
        own = _offload_bytes(metas[run.name])
        rp = done[run.name]
        action, rec = rp.action, rp.recommended_buffer_bytes
        j = truths.judged(run.name, action, rec)
        measured_at, elsewhere, about, t = j.measured_at, j.elsewhere, j.about, j.truth
        verdict = str(t["verdict"]) if t is not None else "unknown"
        verdict_3pct = str(t["verdict_3pct"]) if t is not None else "unknown"
        measured = t.get("ttft_saved_s_per_s") if t is not None else None
        agrees, harmful = _judge(action, verdict, t is not None)
        harmful_at, settled, unmeasured = _timeline(rp.timeline, own, measured_at, elsewhere)
        predictions: list[Prediction] = []
        if own is None and measured_at and rp.curve is not None:
            for size in sorted(measured_at):
                m = measured_at[size].get("ttft_saved_s_per_s")
                if m is None:
                    continue
                pred = rp.curve.get(float(int(size)))
                ok = None
                if pred is not None:
                    # Not finer than the measurement: two runs of the same work differ by
                    # the family's noise (matrixkit.family_noise).
                    noise_abs = float(measured_at[size].get("noise_s_per_s") or 0.0)
                    tolerance = max(PREDICTION_REL * abs(m), PREDICTION_ABS, noise_abs)
                    ok = abs(pred - m) <= tolerance
                predictions.append(Prediction(run.name, size, pred, m, ok))
        row = next((p for p in predictions if p.size_bytes == about), None)
        after = None
        if own is not None and run.name in afters:
            after = _after(afters[run.name], str(bases[run.name]), own, measured_at)
        out.append(
            RunEval(
                run.name,
                own,
                about,
                verdict,
                measured,
                action,
                rp.reason,
                rec,
                rp.first_decision,
                t is not None,
                agrees,
                harmful,
                row.predicted if row is not None else None,
                row.ok if row is not None else None,
                tuple(predictions),
                str(metas[run.name].get("pair", "")),
                float(t["threshold"]) if t is not None else matrixkit.TRUTH_THRESHOLD,
                verdict_3pct,
                _judge(action, verdict_3pct, t is not None)[1],
                tuple(harmful_at),
                _swings(settled),
                after,
                tuple(unmeasured),
                about in elsewhere and about not in measured_at,
            )
        )
    return sorted(out, key=lambda e: e.run)


def _judged_at(
    action: str, measured_at: dict[float, dict[str, Any]], elsewhere: dict[float, dict[str, Any]]
) -> dict[float, dict[str, Any]]:
    """The truths an action is judged by: the run's own machine's, and another machine's
    (`_elsewhere`) only where its own has none: at the size an enable names, or for "leave
    it off" on a machine without any run of the family's sizes."""
    if action == "enable_offload":
        return {**elsewhere, **measured_at}
    return measured_at or elsewhere


def _timeline(
    timeline: Sequence[Step],
    own: float | None,
    measured_at: dict[float, dict[str, Any]],
    elsewhere: dict[float, dict[str, Any]] | None = None,
) -> tuple[list[float], list[str], list[tuple[float, str, float]]]:
    """When a settled advice was harmful at the size it spoke about, the settled actions in
    order (repeats collapsed), and the first time each (action, size) was settled at a size
    no run of the family measured (on the run's machine, or on another where `elsewhere`
    gives its pairs: _judged_at). An operator acts on any settled advice, not only on the
    last one: a harmful action settled for a few cycles mid-run counts as harmful too."""
    harmful_at: list[float] = []
    settled: list[str] = []
    unmeasured: list[tuple[float, str, float]] = []
    for step in timeline:
        if step.action == "insufficient_data" or step.pending_action is not None:
            continue
        if not settled or settled[-1] != step.action:
            settled.append(step.action)
        judged_at = _judged_at(step.action, measured_at, elsewhere or {})
        size = _about(own, step.action, step.recommended_buffer_bytes, judged_at)
        then = judged_at.get(size) if size is not None else None
        if then is not None and _judge(step.action, str(then["verdict"]), True)[1]:
            harmful_at.append(step.t)
        if (
            size is not None
            and then is None
            and judged_at
            and not any(a == step.action and b == size for _, a, b in unmeasured)
        ):
            unmeasured.append((step.t, step.action, size))
    return harmful_at, settled, unmeasured


def _after(rp: _Replay, base: str, own: float, measured_at: dict[float, dict[str, Any]]) -> After:
    """The offload run replayed with what its run without offload measured remembered."""
    about = _about(own, rp.action, rp.recommended_buffer_bytes, measured_at)
    t = measured_at.get(about) if about is not None else None
    agrees, harmful = _judge(rp.action, str(t["verdict"]) if t else "unknown", t is not None)
    harmful_at, _, _ = _timeline(rp.timeline, own, measured_at)
    return After(base, rp.action, rp.reason, t is not None, agrees, harmful or bool(harmful_at))


def summary(evals: Sequence[RunEval]) -> dict[str, Any]:
    labelled = [e for e in evals if e.verified]
    decided = [e for e in evals if e.action != "insufficient_data"]
    in_time = [
        e
        for e in decided
        if e.first_decision_s is not None and e.first_decision_s <= GOALS["decision_within_s"]
    ]
    predictions = [p for e in evals for p in e.predictions if p.ok is not None]
    errors = [abs(p.predicted - p.measured) for p in predictions if p.predicted is not None]
    after = [e.after for e in evals if e.after is not None and e.after.verified]
    return {
        "runs": len(evals),
        "verified": len(labelled),
        "agreeing": sum(e.agrees for e in labelled),
        "agreement": sum(e.agrees for e in labelled) / len(labelled) if labelled else None,
        "harmful": [e.run for e in evals if e.harmful or e.harmful_at_s],
        "harmful_3pct": [e.run for e in evals if e.harmful_3pct],
        "swinging": [e.run for e in evals if e.swings],
        "unmeasured": [
            f"{e.run}: {a} {_gib(b)} at {t:.0f} s" for e in evals for t, a, b in e.unmeasured
        ],
        "decided_runs": len(in_time),
        "decided": len(in_time) / len(evals) if evals else None,
        "predictions": len(predictions),
        "predictions_ok": sum(bool(p.ok) for p in predictions),
        # How near the predictions come on the whole, inside the tolerance or not: what a
        # change to the what-if that moves none across it still shows (session 26).
        "prediction_mean_abs_error": (sum(errors) / len(errors) if errors else None),
        "prediction_misses": [f"{p.run} at {_gib(p.size_bytes)}" for p in predictions if not p.ok],
        # A miss above what enabling measured is the side that enables where it does not pay.
        "prediction_misses_high": sum(
            not p.ok and p.predicted is not None and p.predicted > p.measured for p in predictions
        ),
        "after": {
            "verified": len(after),
            "agreeing": sum(a.agrees for a in after),
            "agreement": sum(a.agrees for a in after) / len(after) if after else None,
            "harmful": [e.run for e in evals if e.after is not None and e.after.harmful],
        },
        "goals": GOALS,
    }


def _mae(s: Mapping[str, Any]) -> str:
    mae = s.get("prediction_mean_abs_error")
    if mae is None:
        return ""
    misses = len(s["prediction_misses"])
    high = (
        f"; {s['prediction_misses_high']} of the {misses} misses above the measured saving"
        if misses
        else ""
    )
    return f" (mean absolute error {mae:.3f} s/s{high})"


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / (1 << 30):.2f} GiB"


def _num(x: float | None, fmt: str = "{:+.4f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(evals: Sequence[RunEval]) -> str:
    s = summary(evals)
    rows = [
        "| run | offload | truth (at size) | band | at 3 % | measured s/s | predicted s/s | "
        "settled action (reason) | recommended | first decision | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in evals:
        verdict = (
            "harmful"
            if e.harmful
            else f"harmful at {e.harmful_at_s[0]:.0f} s"
            if e.harmful_at_s
            else "agrees"
            if e.agrees
            else "unverified"
            if not e.verified
            else "no decision"
            if e.action == "insufficient_data"
            else "disagrees"
        )
        rows.append(
            f"| {e.run} | {_gib(e.offload_bytes)} | {e.truth} ({_gib(e.pair_size_bytes)}"
            f"{', elsewhere' if e.truth_elsewhere else ''}) | "
            f"{e.threshold:.1%} | {e.truth_3pct} | {_num(e.measured_saving)} | "
            f"{_num(e.predicted_saving)} | {e.action} ({e.reason}) | "
            f"{_gib(e.recommended_bytes)} | {_num(e.first_decision_s, '{:.0f} s')} | {verdict} |"
        )
    rows += [
        "",
        "| run without offload | size | predicted s/s (before enabling) | measured s/s | within |",
        "|---|---|---|---|---|",
    ]
    for e in evals:
        for p in e.predictions:
            within = "-" if p.ok is None else "yes" if p.ok else "no"
            rows.append(
                f"| {p.run} | {_gib(p.size_bytes)} | {_num(p.predicted)} | {_num(p.measured)} | "
                f"{within} |"
            )
    rows += [
        "",
        "| offload run | settled action alone | after its run without offload | verdict after |",
        "|---|---|---|---|",
    ]
    for e in evals:
        if e.after is None:
            continue
        a = e.after
        then = (
            "harmful"
            if a.harmful
            else "agrees"
            if a.agrees
            else "unverified"
            if not a.verified
            else "no decision"
            if a.action == "insufficient_data"
            else "disagrees"
        )
        rows.append(
            f"| {e.run} | {e.action} ({e.reason}) | {a.action} ({a.reason}) after {a.base} | "
            f"{then} |"
        )
    agreement = "-" if s["agreement"] is None else f"{s['agreement']:.0%}"
    decided = "-" if s["decided"] is None else f"{s['decided']:.0%}"
    after = s["after"]
    after_agreement = "-" if after["agreement"] is None else f"{after['agreement']:.0%}"
    rows += [
        "",
        f"Agreement on verified runs: {agreement} of {s['verified']} (goal "
        f"{GOALS['agreement']:.0%}); decided within {GOALS['decision_within_s']:.0f} s: "
        f"{decided} of {s['runs']} (goal {GOALS['decided']:.0%}); harmful: "
        f"{', '.join(s['harmful']) or 'none'} (at a flat 3 %, the noise ignored: "
        f"{', '.join(s['harmful_3pct']) or 'none'}); settled advice swinging back to an action "
        f"it left: {', '.join(s['swinging']) or 'none'}; predicted saving within 25 %, 0.02 s/s "
        f"or the family's noise of the measured one: {s['predictions_ok']} of {s['predictions']}"
        f"{_mae(s)}; "
        "settled at a size no run of the family measured on any machine (neither agreeing nor "
        f"harmful): "
        f"{'; '.join(s['unmeasured']) or 'none'}.",
        "",
        f"Offload runs replayed after their run without offload (`replay --prior`): agreement "
        f"{after_agreement} of {after['verified']} verified; harmful: "
        f"{', '.join(after['harmful']) or 'none'}.",
    ]
    held = [e for e in evals if e.run in held_out()]
    if held:
        h = summary(held)
        rows += [
            "",
            f"Held out (`bench/gpu/scenarios/{HOLDOUT}`, recorded after the rules were fixed): "
            f"{h['runs']} runs; agreement {h['agreeing']} of {h['verified']} verified; decided "
            f"within {GOALS['decision_within_s']:.0f} s: {h['decided_runs']} of {h['runs']}; "
            f"harmful: {', '.join(h['harmful']) or 'none'}; predictions within tolerance: "
            f"{h['predictions_ok']} of {h['predictions']}; after their run without offload: "
            f"{h['after']['agreeing']} of {h['after']['verified']} verified agree.",
        ]
    return "\n".join(rows) + "\n"


def cadence_table(by_interval: Sequence[tuple[float, Sequence[RunEval]]]) -> str:
    """The goals at each exporter --interval: the fits take one point per interval, so a
    coarser one has fewer and wider intervals to separate the costs with."""
    rows = [
        "| --interval | decided within 5 min | agreement | harmful | predictions within "
        "tolerance | median first decision |",
        "|---|---|---|---|---|---|",
    ]
    for interval, evals in by_interval:
        s = summary(evals)
        firsts = sorted(e.first_decision_s for e in evals if e.first_decision_s is not None)
        median = f"{firsts[len(firsts) // 2]:.0f} s" if firsts else "-"
        agree = sum(e.agrees for e in evals if e.verified)
        rows.append(
            f"| {interval:g} s | {s['decided']:.0%} | {agree} of {s['verified']} "
            f"({s['agreement']:.0%}) | {len(s['harmful'])} | {s['predictions_ok']} of "
            f"{s['predictions']} | {median} |"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", nargs="?", type=Path, default=MATRIX)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--interval",
        type=float,
        action="append",
        metavar="SECONDS",
        help="replay as an exporter at this --interval (default: its default); given more "
        "than once, print the goals at each instead of the table",
    )
    args = parser.parse_args(argv)
    if args.interval and len(args.interval) > 1:
        print(cadence_table([(i, evaluate(args.root, i)) for i in args.interval]), end="")
        return 0
    evals = evaluate(args.root, args.interval[0] if args.interval else None)
    if args.json:
        print(json.dumps({**summary(evals), "evals": [asdict(e) for e in evals]}, indent=1))
    else:
        print(markdown(evals), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
