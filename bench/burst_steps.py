"""A burst's engine steps, per offload run of the bursts (`concurrent`) and its run without
offload: what a request that loads its prefix from the CPU tier waits for.

    PYTHONPATH=. .venv/bin/python -m bench.burst_steps [tests/fixtures/gpu/matrix] [RUN ...]
        [--json]

From the KV events, in every recording: vLLM publishes one batch of events per engine step
that stored or removed a block, stamped when the scheduler takes the step's output back
(`Scheduler.update_from_output`, vLLM 0.26 and 0.32), on the clock the client stamps its
sends with (one host). The first batch with a GPU store after a burst's first send ends the
first step that computed the burst's prompts ("first step", ms after the send). A request
loaded where its cached tokens exceed its own in the run without offload (as in
`bench.latency_parts`); per burst in which one did, how long after that first step the last
loader got its first token, and the same requests in the run without offload (they computed
their prefix there, in that step or the next). The loads' wait beyond the run without
offload is that difference, the burst's loaders saved of their compute included. Beside
them, the pair's summed TTFT change (`matrixkit.paired_truth`), and under the table how well
the first step's change orders it over the pairs shown (Spearman's rho).

From the engine-step log where a recording has one (`steps.jsonl.xz`, `"step_log": true`
scenarios since batch 28; bench/gpu/steplog.py): each step's model time (from its plan, or
from the previous step's output where vLLM's async scheduling planned it earlier, to its own
output), fitted on the tokens it computed (the intercept is what any step
costs, the small one a loader's suffix takes included), per loader the steps from its load
job's submission to the worker reporting it done and to the step that computed its suffix,
and each run's step submission over the run (`submission`: the engine's CPU handing a step
over, which under `--enforce-eager` drifts within and between runs of the same work;
docs/whatif.md, "What a step's submission says"), with what one load job adds to a step's
submission and plan within the run (`load_job_cost`) and, where the driver probed the host
around the run (meta.json's `host_probe`, batch 37 on), its kernel launch time before and
after the traffic. Steps that computed nothing are the
log's `idle` count. Under that table, per shape and engine, how well the tier run's submission
against its base's orders the pairs' summed TTFT change (`submission_order`).
"""

from __future__ import annotations

import bisect
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from bench.advice_eval import MATRIX
from bench.common import loaded_tokens, markdown_table, recording_metas, recordings_main
from exporter.model.derive.fits import least_squares

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import gpukit  # type: ignore[import-not-found]  # bench/gpu holds scripts, not a package
import matrixkit  # type: ignore[import-not-found]


def gpu_store_steps(run: Path) -> list[float]:
    """The end of every step that stored a block on the GPU (its event batch's stamp)."""
    out = []
    for rec in gpukit.iter_jsonl(run / "kv_events.jsonl.xz"):
        ts, events = rec["payload"][0], rec["payload"][1]
        if any(e.get("type") == "BlockStored" and e.get("medium") == "GPU" for e in events):
            out.append(float(ts))
    return sorted(out)


def _first_step(steps: Sequence[float], t: float) -> float | None:
    k = bisect.bisect_left(steps, t)
    return steps[k] - t if k < len(steps) else None


def _ms(x: float) -> float:
    return round(1000 * x, 1)


def _median(xs: Sequence[float]) -> float | None:
    return _ms(statistics.median(xs)) if xs else None


def event_steps(base: Path, offload: Path) -> dict[str, Any]:
    """Per pair of burst recordings: medians over the bursts in which a request loaded ("first
    step" and "loaders after it", each without and with offload, in ms, and the difference of
    the latter per burst) and the mean TTFT change of a request in the bursts without one."""
    b_steps, o_steps = gpu_store_steps(base), gpu_store_steps(offload)
    bursts: dict[int, list[tuple[Mapping[str, Any], Mapping[str, Any]]]] = defaultdict(list)
    b_records, o_records = matrixkit.load_requests(base), matrixkit.load_requests(offload)
    pairs = matrixkit.matched_requests(b_records, o_records)
    for b, o in pairs:
        burst = (b.get("tags") or {}).get("burst")
        if burst is not None:
            bursts[int(burst)].append((b, o))
    first: dict[str, list[float]] = {"base": [], "offload": []}
    after: dict[str, list[float]] = {"base": [], "offload": []}
    waited: list[float] = []
    loaders: list[int] = []
    unloaded: list[float] = []
    # TTFT change with the tier, in the bursts in which a request loaded: of the loaders, and
    # of the others (whom the launch of the loaders' later step keeps waiting on a
    # launch-bound engine, docs/whatif.md "The launch a load adds").
    changes: dict[str, list[float]] = {"loaders": [], "others": []}
    quiet = 0  # bursts in which no request loaded
    for burst in sorted(bursts):
        matched = bursts[burst]
        mine = [(b, o) for b, o in matched if loaded_tokens(b, o) > 0]
        if not mine:
            unloaded += [o["ttft_s"] - b["ttft_s"] for b, o in matched]
            quiet += 1
            continue
        spans: dict[str, tuple[float, float]] = {}  # side: (first step, loaders after it)
        for side, k, steps in (("base", 0, b_steps), ("offload", 1, o_steps)):
            t0 = min(pair[k]["t_send"] for pair in matched)
            f = _first_step(steps, t0)
            if f is not None:
                last = max(pair[k]["t_send"] + pair[k]["ttft_s"] for pair in mine) - t0
                spans[side] = (f, last - f)
        for b, o in matched:
            side = "loaders" if loaded_tokens(b, o) > 0 else "others"
            changes[side].append(o["ttft_s"] - b["ttft_s"])
        if len(spans) < 2:
            continue  # a side whose burst no store batch followed: nothing to place it by
        for side, (f, span) in spans.items():
            first[side].append(f)
            after[side].append(span)
        waited.append(spans["offload"][1] - spans["base"][1])
        loaders.append(len(mine))
    truth = matrixkit.paired_truth(b_records, o_records)
    change = truth.get("relative_change")
    return {
        "summed_ttft_change": None if change is None else round(float(change), 4),
        "summed_ttft_base_s": truth.get("summed_ttft_base_s"),
        "bursts_loading": len(waited),
        "loaders_per_burst": round(statistics.fmean(loaders), 2) if loaders else None,
        "first_step_ms": {side: _median(v) for side, v in first.items()},
        "loaders_after_ms": {side: _median(v) for side, v in after.items()},
        "loaders_waited_more_ms": _median(waited),
        "bursts_without_loads": quiet,
        "without_loads_ttft_change_ms": _ms(statistics.fmean(unloaded)) if unloaded else None,
        "ttft_change_ms": {
            side: _ms(statistics.fmean(v)) if v else None for side, v in changes.items()
        },
    }


# -- the engine-step log ----------------------------------------------------------------------


def engine_steps(lines: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """From a step log's lines: the model time of a step on its tokens (least squares: ms at
    no token, us a token), the median of the steps under 256 tokens, and per loader (a request
    with a load job) the steps and ms from its load's submission to the step that reported
    it done and to its first step that computed tokens (both from the submitting step's end)."""
    steps = [s for s in lines if "i" in s]
    # A step runs from its plan (t1) or the previous step's output (t2 before), whichever is
    # later, to its output: with async scheduling (vLLM's default in 0.26) step k+1 is planned
    # while step k still runs on the GPU, and waits for it.
    xs: list[float] = []
    ys: list[float] = []
    prev_t2: float | None = None
    for s in steps:
        if s["n"] > 0 and s.get("t1") is not None:
            xs.append(float(s["n"]))
            ys.append(float(s["t2"] - max(s["t1"], prev_t2 or s["t1"])))
        prev_t2 = s.get("t2", prev_t2)
    fit = None
    if len(xs) >= 3 and max(xs) > min(xs):
        slope, intercept = statistics.linear_regression(xs, ys)
        fit = {"fixed_ms": _ms(intercept), "per_token_us": round(1e6 * slope, 2)}
    small = [y for x, y in zip(xs, ys, strict=True) if x < 256]
    job_of: dict[str, tuple[str, int]] = {}
    for k, s in enumerate(steps):
        for job, req in (s.get("load") or {}).items():
            job_of[job] = (req, k)
    done_at: dict[str, int] = {}
    for k, s in enumerate(steps):
        for job in s.get("done") or ():
            if job in job_of:
                done_at.setdefault(job, k)
    spans = []
    for job, (req, k) in job_of.items():
        computed = next((j for j in range(k + 1, len(steps)) if req in steps[j]["r"]), None)
        d = done_at.get(job)
        if d is None or computed is None:
            continue
        spans.append(
            {
                "request": req,
                "steps_to_done": d - k,
                "steps_to_computed": computed - k,
                "idle_steps": sum(int(steps[j].get("idle", 0)) for j in range(k + 1, computed + 1)),
                "ms_to_done": _ms(steps[d]["t3"] - steps[k]["t3"]),
                "ms_to_computed": _ms(steps[computed]["t3"] - steps[k]["t3"]),
                "suffix_tokens": steps[computed]["r"][req],
                "suffix_step_tokens": steps[computed]["n"],
            }
        )
    return {
        "steps": len(steps),
        "idle_steps": sum(int(s.get("idle", 0)) for s in steps),
        "submission": submission(steps),
        "step_time": fit,
        "small_step_ms": _median(small),
        "loads": len(job_of),
        "loaders": spans,
        "loader_medians": {
            key: statistics.median(float(x[key]) for x in spans)
            for key in ("steps_to_done", "steps_to_computed", "ms_to_done", "ms_to_computed")
        }
        if spans
        else None,
    }


# Sixths of a run: enough to show a drift over its ~3 minutes; a run times 49 to 165 steps
# (`submission`), so a sixth holds 8 to 28.
PARTS = 6


def submission(lines: Iterable[Mapping[str, Any]], parts: int = PARTS) -> dict[str, Any]:
    """How long the engine takes to submit a step: from its plan (t1) to the next step's plan
    (t0), over the steps that computed tokens and whose next step was planned before their
    output came back (vLLM's async scheduling: the engine plans step k+1 as soon as it has
    handed step k over, so this is the CPU's work on step k, its kernel launches under
    `--enforce-eager`, not the GPU's). The median (ms) over the run and over each of `parts`
    equal spans of it, in order: whether the host drifts over a run. Beside it the medians of
    the scheduler's own work on the steps that computed tokens: planning (`schedule()`) and
    taking the output back (`update_from_output()`), where the connector's scheduler side
    runs."""
    steps = [s for s in lines if "i" in s and s.get("t1") is not None]
    computing = [s for s in steps if s["n"] > 0]
    marks: list[tuple[float, float]] = []
    timed: list[Mapping[str, Any]] = []
    for s, nxt in pairwise(steps):
        if s["n"] > 0 and not nxt.get("idle") and nxt["t0"] < s["t2"]:
            marks.append((float(s["t1"]), float(nxt["t0"] - s["t1"])))
            timed.append(s)
    out: dict[str, Any] = {
        "schedule_ms": _median([s["t1"] - s["t0"] for s in computing]),
        "update_ms": _median([s["t3"] - s["t2"] for s in computing]),
        "steps": len(marks),
        "median_ms": None,
        "by_part_ms": [],
        "per_load_job": load_job_cost(computing, timed, [1000 * s for _, s in marks]),
    }
    if not marks:
        return out
    t_first, span = marks[0][0], (marks[-1][0] - marks[0][0]) or 1.0
    by_part: list[list[float]] = [[] for _ in range(parts)]
    for t, ms in marks:
        by_part[min(parts - 1, int(parts * (t - t_first) / span))].append(ms)
    out["median_ms"] = _median([ms for _, ms in marks])
    out["by_part_ms"] = [_median(p) for p in by_part]
    return out


def load_job_cost(
    computing: Sequence[Mapping[str, Any]],
    timed: Sequence[Mapping[str, Any]],
    submitted_ms: Sequence[float],
) -> dict[str, Any] | None:
    """What one load job adds to the engine's CPU work on its step, within one run (so the
    host's speed, which drifts between runs, is held): the step's submission
    (`submitted_ms`, of the `timed` steps) and its `schedule()` on the step's thousands of
    tokens, requests and load jobs (least squares, ms a job with its standard error); and
    the summed wait that implies, each job's ms times the requests its step carried (seconds:
    under `--enforce-eager` the engine's one thread launches every step, so its requests all
    wait for the extra work). None where the run has no load job."""
    if not any(s.get("load") for s in computing):
        return None

    def columns(steps: Sequence[Mapping[str, Any]]) -> list[list[float]]:
        return [
            [1.0] * len(steps),
            [s["n"] / 1000 for s in steps],
            [float(len(s["r"])) for s in steps],
            [float(len(s.get("load") or {})) for s in steps],
        ]

    sub = least_squares(columns(timed), list(submitted_ms))
    sched = least_squares(columns(computing), [1000 * (s["t1"] - s["t0"]) for s in computing])
    if sub is None or sched is None:
        return None
    per_job_ms = sub[0][3] + sched[0][3]
    carried = sum(len(s.get("load") or {}) * len(s["r"]) for s in computing)
    return {
        "submission_ms": round(sub[0][3], 2),
        "submission_se_ms": round(sub[1][3], 2),
        "schedule_ms": round(sched[0][3], 2),
        "schedule_se_ms": round(sched[1][3], 2),
        "jobs": sum(len(s.get("load") or {}) for s in computing),
        "implied_wait_s": round(per_job_ms * carried / 1000, 3),
    }


def host_probe(run: Path) -> dict[str, float | None] | None:
    """The kernel launch time (us, the fastest of its repeats) the driver measured on the
    host before and after the run's traffic (meta.json's `host_probe`, since batch 37;
    bench/gpu/matrix.py); None for a run recorded without it."""
    meta = json.loads((run / "meta.json").read_text())
    probes = meta.get("host_probe")
    if not isinstance(probes, dict):
        return None
    out: dict[str, float | None] = {}
    for when in ("before", "after"):
        launch = (probes.get(when) or {}).get("launch_us")
        out[when] = float(launch) if isinstance(launch, int | float) else None
    return out


def burst_pairs(root: Path, names: Sequence[str] = ()) -> dict[str, str]:
    """Every offload run of the bursts (generator `concurrent`) under `root` (or of `names`) whose
    pair has a run without offload on its machine: that run (matrixkit.base_run)."""
    metas = recording_metas(root, names)
    out: dict[str, str] = {}
    for name in names or sorted(metas):
        meta = metas[name]
        # The generator, not the workload's name: `bursts-decode` is the same bursts with
        # tokens decoded after each prompt.
        if not meta.get("offload") or (meta.get("workload") or {}).get("generator") != "concurrent":
            continue
        base = matrixkit.base_run(metas, name)
        if base is not None:
            out[name] = base
    return out


def table(root: Path = MATRIX, names: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per offload run of the bursts under `root` (or `names`): its base, `event_steps`, and
    `engine_steps` of both where both have a step log."""
    out: dict[str, dict[str, Any]] = {}
    metas = recording_metas(root, names)
    for name, base in burst_pairs(root, names).items():
        row: dict[str, Any] = {
            "base": base,
            "shape": (metas[name].get("shape") or {}).get("name"),
            "eager": "--enforce-eager" in (metas[name].get("vllm_argv") or ()),
            # Tokens each request decoded (`bursts-decode`: 32): its steps are then shared
            # with the decode of every running request.
            "max_tokens": int((metas[name].get("workload") or {}).get("max_tokens") or 1),
            **event_steps(root / base, root / name),
        }
        logs = [root / n / "steps.jsonl.xz" for n in (base, name)]
        if all(p.exists() for p in logs):
            row["engine"] = {
                side: {
                    **engine_steps(gpukit.iter_jsonl(p)),
                    "host_probe": host_probe(root / run),
                }
                for side, p, run in zip(("base", "offload"), logs, (base, name), strict=True)
            }
        out[name] = row
    return out


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rho of two paired series (ties take their mean rank); None under 3 pairs
    or where either series is constant."""
    if len(xs) != len(ys) or len(xs) < 3:
        return None

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in order[i : j + 1]:
                out[k] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None


def first_step_order(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """How well the change of a burst's first step with the tier orders the change of summed
    TTFT over the pairs in `rows` (docs/whatif.md, "What batch 36 measured")."""
    xs, ys = [], []
    for r in rows.values():
        first, change = r.get("first_step_ms") or {}, r.get("summed_ttft_change")
        if (
            first.get("base") is not None
            and first.get("offload") is not None
            and change is not None
        ):
            xs.append(first["offload"] - first["base"])
            ys.append(change)
    rho = rank_correlation(xs, ys)
    return {"pairs": len(xs), "rho": None if rho is None else round(rho, 3)}


def submission_order(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per shape and engine (eager or CUDA graphs), and apart where the requests decoded,
    with step-logged pairs: how well the tier run's submission against its base's (the ratio
    of their `submission` medians less one) orders the pairs' summed TTFT change
    (docs/whatif.md, "What a step's submission says")."""
    groups: dict[str, tuple[list[float], list[float]]] = {}
    for r in rows.values():
        change = r.get("summed_ttft_change")
        if "engine" not in r or change is None:
            continue
        base, tier = (r["engine"][k]["submission"]["median_ms"] for k in ("base", "offload"))
        if base and tier is not None:
            key = f"{r.get('shape')} {'eager' if r.get('eager') else 'graphs'}" + (
                " decode" if r.get("max_tokens", 1) > 1 else ""
            )
            xs, ys = groups.setdefault(key, ([], []))
            xs.append(tier / base - 1)
            ys.append(change)
    out = {}
    for key, (xs, ys) in sorted(groups.items()):
        rho = rank_correlation(xs, ys)
        out[key] = {"pairs": len(xs), "rho": None if rho is None else round(rho, 3)}
    return out


def markdown(rows: Mapping[str, Mapping[str, Any]]) -> str:
    def v(x: object) -> str:
        return "-" if x is None else f"{x}"

    def signed(x: float | None) -> str:
        return "-" if x is None else f"{x:+.1f}"

    header = [
        "offload run",
        "base",
        "bursts that loaded",
        "loaders a burst",
        "first step ms, without / with",
        "loaders after it ms, without / with",
        "loads waited more ms",
        "bursts that loaded: TTFT change ms, loaders / others",
        "bursts without loads: TTFT change a request ms (bursts)",
        "summed TTFT change",
    ]
    body = [
        [
            name,
            r["base"],
            str(r["bursts_loading"]),
            v(r["loaders_per_burst"]),
            f"{v(r['first_step_ms']['base'])} / {v(r['first_step_ms']['offload'])}",
            f"{v(r['loaders_after_ms']['base'])} / {v(r['loaders_after_ms']['offload'])}",
            v(r["loaders_waited_more_ms"]),
            f"{signed(r['ttft_change_ms']['loaders'])} / {signed(r['ttft_change_ms']['others'])}",
            f"{signed(r['without_loads_ttft_change_ms'])} ({r['bursts_without_loads']})",
            "-" if r["summed_ttft_change"] is None else f"{100 * r['summed_ttft_change']:+.1f} %",
        ]
        for name, r in rows.items()
    ]
    order = first_step_order(rows)
    rho = "-" if order["rho"] is None else f"{order['rho']:.2f}"
    text = (
        markdown_table(header, body)
        + f"\n\nThe first step's change against the summed TTFT change: Spearman's rho {rho}"
        + f" over {order['pairs']} pairs."
    )
    runs: dict[str, Mapping[str, Any]] = {}
    probes: dict[str, Mapping[str, float | None] | None] = {}
    base_ttft: dict[str, float] = {}
    for name, r in rows.items():
        if "engine" in r:
            for run, side in ((r["base"], "base"), (name, "offload")):
                runs[run] = r["engine"][side]["submission"]
                probes[run] = r["engine"][side].get("host_probe")
            if r.get("summed_ttft_base_s"):
                base_ttft[name] = float(r["summed_ttft_base_s"])

    def probe(n: str) -> str:
        p = probes.get(n)
        return "-" if not p else f"{v(p['before'])} / {v(p['after'])}"

    def per_job(n: str, x: Mapping[str, Any]) -> list[str]:
        j = x.get("per_load_job")
        if not j:
            return ["-", "-", "-"]
        share = f" ({100 * j['implied_wait_s'] / base_ttft[n]:.1f} %)" if n in base_ttft else ""
        return [
            f"{j['submission_ms']} +- {j['submission_se_ms']}",
            f"{j['schedule_ms']} +- {j['schedule_se_ms']}",
            f"{j['implied_wait_s']}{share}",
        ]

    if runs:
        sub = markdown_table(
            [
                "run",
                "schedule() ms",
                "update_from_output() ms",
                "steps timed",
                "submission ms",
                f"by {PARTS} spans of the run, ms",
                "a load job: submission ms",
                "a load job: schedule() ms",
                "load jobs' implied wait s (of the base's summed TTFT)",
                "host: a launch us, before / after",
            ],
            [
                [
                    n,
                    v(x["schedule_ms"]),
                    v(x["update_ms"]),
                    str(x["steps"]),
                    v(x["median_ms"]),
                    " ".join(map(v, x["by_part_ms"])),
                    *per_job(n, x),
                    probe(n),
                ]
                for n, x in runs.items()
            ],
        )
        text += f"\n\nA step's submission, where the step log has it (`submission`):\n\n{sub}"
        ranked = [
            f"{key} {g['rho']:.2f} over {g['pairs']} pairs"
            for key, g in submission_order(rows).items()
            if g["rho"] is not None
        ]
        if ranked:
            text += (
                "\n\nThe tier run's submission against its base's, against the summed TTFT"
                " change: Spearman's rho " + "; ".join(ranked) + "."
            )
    return text


def main(argv: list[str] | None = None) -> int:
    return recordings_main(__doc__, MATRIX, table, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
