"""The advice on every real-GPU matrix recording against the truth its runs measured
(bench/advice_eval.py, issue 16): never harmful, predictions within tolerance, labels from
the measured latencies only."""

from __future__ import annotations

import json
import lzma
import os
import re
import shutil
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from bench import advice_eval, burst_parts, burst_steps, fit_repeat
from bench.advice_eval import (
    GOALS,
    MATRIX,
    RunEval,
    _about,
    _from_json,
    _judge,
    _judged_at,
    _meta,
    _requests,
    _swings,
    _timeline,
    cache_key,
    evaluate,
    held_out,
    markdown,
    matrixkit,
    summary,
)
from exporter.config import Config
from exporter.replay import Step, replay_one

GIB = 1 << 30


def unmet_goal(reason: str) -> pytest.MarkDecorator:
    """A goal of the issue not met on the recordings yet: expected to fail, and failing the
    run the day it passes (strict), so that it turns back into a plain assertion."""
    return pytest.mark.xfail(strict=True, reason=reason)


@pytest.fixture(scope="module")
def evals():  # type: ignore[no-untyped-def]
    return evaluate()


def test_the_matrix_is_there_and_every_label_is_measured(evals) -> None:  # type: ignore[no-untyped-def]
    """A run is labelled from its family's runs at the size its advice speaks about; it is
    unlabelled only when no run of that size was recorded on its machine yet (a loop still
    to close there: 8B concurrent's 16 GiB run is on another machine than two of its runs
    without offload, 7.6 % apart from them by drift alone; 32B concurrent's 16 GiB run was
    lost with its machine in session 9, so its run without offload of that session has no offload
    run on its machine; session 10 recorded the family again, with a control; so did 32B
    long-context's 48 GiB run in session 11; session 22's 8B concurrent runs with CUDA graphs
    named 16 GiB, recorded in session 23, whose 32B chat runs with graphs named 32 GiB,
    recorded in session 24: since then every run is verified). An offload run is labelled by
    its family's pair of its size, wherever that pair ran (session 11's 0.6B chat with 21
    GiB, alone on a fresh machine, by session 12's pair of that size). A run without offload
    that says leave it off speaks about the best size measured on its machine, and has none
    when its offload partner was lost (session 12's 0.6B long-context replicate)."""
    assert len(evals) >= 12
    metas = {e.run: _meta(MATRIX / e.run) for e in evals}
    for e in evals:
        if e.verified:
            assert e.truth in ("pays", "neutral", "costs"), e.run
            continue
        assert e.truth == "unknown", e.run
        mine = [x for x in evals if x.family == e.family and x.run != e.run]
        mine = [x for x in mine if matrixkit.same_machine(metas[x.run], metas[e.run])]
        if e.pair_size_bytes is None:
            assert e.offload_bytes is None and e.action in ("no_action", "insufficient_data")
            assert all(x.offload_bytes is None for x in mine), e.run
            continue
        if e.offload_bytes is not None and e.pair_size_bytes == e.offload_bytes:
            assert all(x.offload_bytes is not None for x in mine), e.run
        else:
            assert e.pair_size_bytes not in {x.offload_bytes for x in mine}, e.run


def test_a_family_served_with_cuda_graphs_is_judged_on_its_own(evals) -> None:  # type: ignore[no-untyped-def]
    """Session 22 recorded 8B and 0.6B concurrent without --enforce-eager, as vLLM serves by default
    (torch.compile and CUDA graphs; bench/gpu/scenarios/graphs.json). Their pair family has no flag
    tag, so an offload run is compared with a graphs run without offload only, never with the
    matrix's eager ones. The what-if made on the 8B run without offload is within tolerance at 27
    GiB (pays 25.5 %) and, until session 26, at 9 GiB (pays 5.9 %): the engine's queue
    (simulator.queue_saving) adds 0.004 s/s there, +0.055 for +0.033, 0.002 over the 0.02 s/s
    tolerance; its advice is 16 GiB; its control on a second machine says the same. Session 23
    closed that loop on a third machine (batch 17): a run without offload and 16 GiB beside it,
    which pays 18.1 %, as the what-if made on that run without offload predicted (+0.0975 s/s for
    +0.0966; +0.102 with the queue). Every 8B graphs run then agrees: enable and keep at 16 GiB,
    grow 9 GiB to it, shrink 27 GiB to it. 0.6B costs 47 % and its run without offload leaves
    offload off. 32B chat (session 23, a fourth machine): 16 GiB pays 37.0 %, and the linear what-if
    under-predicted it as it did with the eager engine (+0.283 s/s for +0.465; eager +0.265 and
    +0.277 for +0.482 and +0.490): the what-if's, not the eager engine's. With the engine's queue
    (session 26: 1.2-1.3 requests waiting for a first token, 1.8 to a step, about 40 % utilisation)
    all three are within: +0.424, +0.420 and +0.432. Both of its runs name 32 GiB; session 24
    recorded it beside a control on a fifth machine (batch 19): 32 GiB pays 78.8 %, predicted from
    the control at +0.923 s/s for +0.973 (+0.981 with the queue; within, as the eager family's 32
    and 48 GiB predictions are), and the 32 GiB run keeps: every graphs run agrees or waits.
    Session 27 (batch 21): 8B and 0.6B unique prompts, where offload is its stores alone, cost
    11.6 and 15.1 %, as much of the stores' charge as the eager runs measured, and both
    predictions made without offload are within; no run of that family enables or keeps.
    Session 31 (batch 28): the 8B bursts' 16 GiB pair again, with the engine-step log, on
    another machine: pays 33.0 %, predicted within (+0.124 s/s for +0.159)."""
    by = {e.run: e for e in evals}
    # Batch 39's decoding bursts with CUDA graphs (session 46) and batch 41's, decoding 256
    # tokens (session 49), are work of another kind: their own tests.
    graphs = [e for e in evals if "-graphs-" in e.run and "-bursts-decode" not in e.run]
    # + batch 33, 4B's bursts (session 36), batch 35, 8B's each server alone (session 40,
    # three of four), and batch 40's one-token pair beside its decoding one (session 47): each
    # its own test as well.
    assert len(graphs) == 18 + 4 + 3 + 2
    families = {e.family for e in graphs}
    assert families == {
        "qwen3-8b-concurrent",
        "qwen3-0.6b-concurrent",
        "qwen3-4b-concurrent",
        "qwen3-32b-chat",
        "qwen3-8b-unique",
        "qwen3-0.6b-unique",
    }
    assert not families & {e.family for e in evals if "-graphs-" not in e.run}
    for e in graphs:
        if e.offload_bytes is not None:
            assert e.after is not None and "-graphs-none" in e.after.base, e.run
            assert not e.harmful and not e.after.harmful, e.run
    eight = by["qwen3-8b-concurrent-graphs-none"]
    assert {p.size_bytes for p in eight.predictions} == {9 * GIB, 27 * GIB}
    assert {p.size_bytes: p.ok for p in eight.predictions} == {9 * GIB: False, 27 * GIB: True}
    assert all(p.measured > 0 for p in eight.predictions)
    assert eight.action == "enable_offload" and eight.recommended_bytes == 16 * GIB
    # Labelled by the 16 GiB pair of the third machine (none on its own).
    assert eight.verified and eight.truth == "pays" and eight.agrees
    closing = by["qwen3-8b-concurrent-graphs-none-ctl2"]
    assert (closing.action, closing.recommended_bytes) == ("enable_offload", 16 * GIB)
    (at16,) = closing.predictions
    assert at16.size_bytes == 16 * GIB and at16.ok and at16.measured > 0
    assert by["qwen3-8b-concurrent-graphs-cpu16g"].after is not None
    assert by["qwen3-8b-concurrent-graphs-cpu16g"].after.base == closing.run
    control = by["qwen3-8b-concurrent-graphs-none-ctl"]
    assert (control.action, control.recommended_bytes) == (eight.action, eight.recommended_bytes)
    assert control.predictions == ()
    eights = [e for e in graphs if e.family == "qwen3-8b-concurrent"]
    assert all(e.truth == "pays" and e.agrees for e in eights)
    assert {
        by[f"qwen3-8b-concurrent-graphs-{t}"].action for t in ("cpu64k", "cpu16g", "cpu192k")
    } == {"grow_buffer", "keep", "shrink_buffer"}
    small = by["qwen3-0.6b-concurrent-graphs-none"]
    assert small.truth == "costs" and small.action == "no_action" and small.agrees
    chat = by["qwen3-32b-chat-graphs-none"]
    (at16,) = chat.predictions
    eager = [p for e in evals if e.family == "qwen3-32b-chat-eager" for p in e.predictions]
    eager16 = [p for p in eager if p.size_bytes == 16 * GIB]
    assert at16.size_bytes == 16 * GIB and at16.measured > 0 and eager16
    # Both engines' what-ifs err the same way on the same sequence, and are within.
    assert {p.predicted < p.measured for p in (at16, *eager16)} == {True}
    assert {p.ok for p in (at16, *eager16)} == {True}
    # The size both name, recorded beside a control of its own (batch 19), closes the loop.
    for e in (chat, by["qwen3-32b-chat-graphs-cpu64k"]):
        assert e.recommended_bytes == 32 * GIB and e.verified and e.agrees, e.run
    control32 = by["qwen3-32b-chat-graphs-none-ctl"]
    assert (control32.action, control32.recommended_bytes) == ("enable_offload", 32 * GIB)
    (at32,) = control32.predictions
    assert at32.size_bytes == 32 * GIB and at32.measured > 0 and at32.ok
    assert by["qwen3-32b-chat-graphs-cpu32g"].after is not None
    assert by["qwen3-32b-chat-graphs-cpu32g"].after.base == control32.run
    assert by["qwen3-32b-chat-graphs-cpu32g"].action == "keep"
    assert all(e.agrees or e.action == "insufficient_data" for e in graphs)
    for shape in ("qwen3-8b", "qwen3-0.6b"):
        none, on = by[f"{shape}-unique-graphs-none"], by[f"{shape}-unique-graphs-cpu64k"]
        assert none.truth == on.truth == "costs" and none.agrees and on.agrees
        (p,) = none.predictions
        assert p.measured < 0 and p.predicted < 0 and p.ok, shape
        assert none.action == "no_action" and on.action == "disable_offload"


def test_the_held_out_shape_is_judged_like_the_matrix(evals) -> None:  # type: ignore[no-untyped-def]
    """Session 15 recorded a shape the advisor was never tuned on (qwen3-14b, chat and
    RAG-Zipf; bench/gpu/scenarios/holdout.json) after its rules were fixed: its six runs are
    judged by every test here like the matrix's. With the what-if's sizes of until then (up to
    16 GiB) its RAG-Zipf engine without offload was told offload would not pay, where the
    same sequence measured a saving with 30 GiB; with the default sizes (up to 32 GiB) it is
    told to enable 32 GiB. From session 18's floor on a computed token's cost (29.9 us where
    its TTFT fit says 26.1 +- 4.0) to session 20 the sizes up to 16 GiB enabled 16 GiB at
    180 s, a size no run of the family measured (10 GiB costs 16.9 %, 30 GiB pays 5.5 %):
    unverified, which is why the default sizes reach 32 GiB. Since session 21, with a store
    paid by every request sharing its step (1.2 per step there) and a load's wait at least a
    fifth of a prefill, 16 GiB is predicted to save 1.9 % of TTFT: below the 3 % that pays,
    so the sizes up to 16 GiB say no_action again, and only the default sizes reach the size
    that pays. Since session 26 the prediction counts the engine's queue, 3.7 % there, but an
    enable must pay without it (1.9 %), and the explanation says both."""
    held = {
        e.run: e
        for e in evals
        if e.run in held_out() and "-concurrent-" not in e.run and "-bursts-" not in e.run
    }
    assert len(held) == 6 and all(run.startswith("qwen3-14b-") for run in held)
    assert "Held out (`bench/gpu/scenarios/holdout.json`" in markdown(evals)
    rag = MATRIX / "qwen3-14b-rag-zipf-none"
    truth = matrixkit.paired_truth(_requests(rag), _requests(MATRIX / "qwen3-14b-rag-zipf-cpu192k"))
    assert truth["verdict"] == "pays"
    sizes = tuple(s for s in Config().whatif_sizes if s <= 16 * GIB)
    (until,) = replay_one(rag, Config(whatif_sizes=sizes)).final.targets[0].engines
    assert (until.advice.action, until.advice.reason) == (
        "no_action",
        "predicted_saving_immaterial",
    )
    assert "without the engine's queue: 1.9% of the TTFT now" in until.advice.explanation
    now = held["qwen3-14b-rag-zipf-none"]
    assert (now.action, now.recommended_bytes) == ("enable_offload", 32 * GIB)
    assert not now.harmful


def test_the_bursts_on_shapes_held_out_test_the_launch_a_load_adds(evals) -> None:  # type: ignore[no-untyped-def]
    """Batch 29 (holdout.json's second matrix, staged in session 32 before the launch a load
    adds was written, recorded in session 33 on an H200 host): the bursts on two shapes never
    recorded before, 1.7B and 4B, and on 14B, without offload and with 65536 CPU tokens.
    Batch 30 (staged in session 33, recorded in session 34 on another H200 host): 4B and 14B
    at the 16 GiB their runs without offload were told to enable, beside a control each.
    Judged by what each pair measured: where offload cost, the offload run turns it off,
    alone and after its run without offload; where it paid, nothing turns it off; nothing
    is harmful, and every run without offload agrees with the pair of the size it names.

    The launch term's out-of-sample test, met on 1.7B and missed on 4B: 1.7B's engine is
    launch-bound (its wait charged > 0) and its prediction is within; 4B's loads cost its bursts
    what 1.7B's did (bench.burst_steps: loaders +80 ms, the others +28 ms a request, 1.7B +68 /
    +24), but its prefill fit's fixed time (22.7 ms) is under half its mean prefill, so no wait
    is charged and +0.006 s/s is predicted for -0.143 (docs/whatif.md, "What batch 29
    measured"). Its run without offload is told to enable 16 GiB (it swung once through
    no_action for 10 s until session 37's hysteresis in seconds); batch 30 measured that size
    neutral on another host (the same loads, about 1,000 tokens each, cost its bursts nothing
    there: loaders +13 ms, the others -9 ms), so the enable is verified and not harmful, and its
    control, told no_action, agrees too; its prediction there (-0.046 for +0.008) counts as
    within since session 35 only because batches 31 and 32 widened the family's band to 23.5 %.
    Those two batches are judged in their own test (ONE_HOST), batch 33 in its (GRAPHS_ALONE),
    batch 34 in its (EAGER_ALONE), batch 35 in its (GRAPHS8_ALONE), batch 36 in its
    (EAGER8_ALONE), batch 37 in its (PROBED) and batch 40 in its (HOST8)."""
    held = {
        e.run: e
        for e in evals
        if e.run in held_out()
        and "-concurrent-" in e.run
        and not ONE_HOST.search(e.run)
        and not GRAPHS_ALONE.search(e.run)
        and not EAGER_ALONE.search(e.run)
        and not GRAPHS8_ALONE.search(e.run)
        and not EAGER8_ALONE.search(e.run)
        and not PROBED.search(e.run)
        and not HOST8.search(e.run)
    }
    shapes = ("qwen3-1.7b", "qwen3-4b", "qwen3-14b")
    loops = {
        f"{s}-concurrent-{t}" for s in ("qwen3-4b", "qwen3-14b") for t in ("none-ctl", "cpu16g")
    }
    assert set(held) == loops | {f"{s}-concurrent-{t}" for s in shapes for t in ("none", "cpu64k")}
    verdicts = {}
    for on in (e for e in held.values() if e.offload_bytes is not None):
        assert on.after is not None, on.run
        verdicts[on.run] = truth = matrixkit.paired_truth(
            _requests(MATRIX / on.after.base), _requests(MATRIX / on.run)
        )["verdict"]
        assert not on.harmful and not on.after.harmful, on.run
        if truth == "costs":
            assert on.truth == truth and on.action == "disable_offload" and on.agrees, on.run
            assert on.after.action == "disable_offload", on.run
        elif truth == "pays":
            assert on.action != "disable_offload" and on.after.action != "disable_offload", on.run
    for none in (e for e in held.values() if e.offload_bytes is None):
        assert none.verified and none.agrees and not none.harmful, none.run
    one, four = held["qwen3-1.7b-concurrent-none"], held["qwen3-4b-concurrent-none"]
    assert one.truth == "costs" and one.agrees and one.action == "no_action"
    (p,) = one.predictions
    assert p.ok and p.predicted is not None and p.predicted < 0 and p.measured < 0
    (engine,) = replay_one(MATRIX / one.run, Config()).final.targets[0].engines
    assert engine.advice.numbers["whatif_launch_wait_seconds"] > 0.0
    (q,) = four.predictions
    assert q.measured < 0 and not q.ok
    (engine,) = replay_one(MATRIX / four.run, Config()).final.targets[0].engines
    assert engine.advice.numbers["whatif_launch_wait_seconds"] == 0.0
    assert (four.action, four.recommended_bytes) == ("enable_offload", 16 * GIB)
    assert four.swings == 0 and four.truth_elsewhere
    assert four.truth == verdicts["qwen3-4b-concurrent-cpu16g"] != "costs"
    control = held["qwen3-4b-concurrent-none-ctl"]
    (c,) = control.predictions
    assert c.predicted is not None and c.predicted < 0 and c.measured > 0
    # Within since session 35 only by the band batch 31's and 32's 9 GiB replicate set.
    assert c.ok and abs(c.predicted - c.measured) > 0.25 * abs(c.measured) + 0.02
    assert control.action != "enable_offload"
    big, again = held["qwen3-14b-concurrent-none"], held["qwen3-14b-concurrent-none-ctl"]
    (r,) = big.predictions
    assert r.measured > 0 and r.ok
    for e in (big, again):
        assert (e.action, e.recommended_bytes) == ("enable_offload", 16 * GIB), e.run
        assert e.truth == verdicts["qwen3-14b-concurrent-cpu16g"] == "pays", e.run
    (s,) = again.predictions
    assert s.measured > 0 and s.predicted is not None and s.predicted > s.measured and not s.ok


# Batches 31 and 32: 4B's eager bursts again, on one host; batch 33: the same with CUDA graphs,
# each server alone; batch 34: eager again, each server alone; batch 35: 8B's bursts with CUDA
# graphs, each server alone; batch 36: 8B's eager bursts, each server alone; batch 37: 4B's
# eager bursts again, each server alone, the host timed around every run.
ONE_HOST = re.compile(r"^qwen3-4b-concurrent-(none|cpu64k|cpu16g)-rep2?$")
GRAPHS_ALONE = re.compile(r"^qwen3-4b-concurrent-graphs-")
EAGER_ALONE = re.compile(r"^qwen3-4b-concurrent-(none|cpu16g)-alone2?$")
GRAPHS8_ALONE = re.compile(r"^qwen3-8b-concurrent-graphs-(none|cpu16g)-alone2?$")
EAGER8_ALONE = re.compile(r"^qwen3-8b-concurrent-(none|cpu16g)-alone2?$")
PROBED = re.compile(r"^qwen3-4b-concurrent-(none|cpu16g)-probe2?$")
HOST8 = re.compile(r"^qwen3-8b-(concurrent|bursts-decode)-graphs-(none|cpu16g)-host$")


def test_4b_bursts_on_one_host_cost_what_their_run_with_the_tier_did_not_show_before(evals) -> None:  # type: ignore[no-untyped-def]
    """Batches 31 and 32 (holdout.json's `-rep` and `-rep2`, session 35, one H100 host, one
    after the other, the second in reverse order): 4B's bursts without offload, at 9 GiB and
    at 16 GiB, twice. Staged to tell batch 29's 27 % cost at 9 GiB (one H200 host) from batch
    30's neutral 16 GiB (another) by size or by host; it is neither. The same 9 GiB run
    saved on this host and then cost (-10.0 %, +21.1 %), 16 GiB cost twice (+14.1, +38.8 %),
    while the two runs without offload differed by 8.9 %; so the family's band (the largest
    difference of two runs of the same work on one machine) is the 9 GiB replicate's, above
    20 %, and each truth below is judged in it. What moved with the cost is the time every
    engine step takes with the tier on (the step log's fixed time, `bench.burst_steps`):
    over the eight eager 4B pairs of batches 29 to 34 it ordered the costs but for three
    neighbours' swaps (Spearman's rho 0.905), over the ten with batch 37's 0.891. The run
    without offload cannot show it: both runs without offload here are told to enable 16
    GiB (predicted +0.046 and +0.066 s/s); the first is neutral in the band, the second
    costs 38.8 %: the one harmful advice of the matrix (test_no_advice_is_harmful). Every
    offload run, replayed after its run without offload, turns offload off where it costs;
    none of them is harmful."""
    runs = {e.run: e for e in evals if ONE_HOST.search(e.run)}
    names = {
        f"qwen3-4b-concurrent-{t}-{r}"
        for t in ("none", "cpu64k", "cpu16g")
        for r in ("rep", "rep2")
    }
    assert set(runs) == names and names <= held_out()
    metas = {n: _meta(MATRIX / n) for n in names}
    assert len({m["gpu"]["uuid"] for m in metas.values()}) == 1
    records = {n: _requests(MATRIX / n) for n in names}
    rel = {
        n: matrixkit.paired_truth(records[matrixkit.base_run(metas, n)], records[n])[
            "relative_change"
        ]
        for n in names
        if metas[n]["offload"] is not None
    }
    # One size, one host, one sequence: the verdict at the flat 3 % is not reproducible.
    by_size = {
        t: sorted(
            matrixkit.verdict(rel[f"qwen3-4b-concurrent-{t}-{r}"], matrixkit.TRUTH_THRESHOLD)
            for r in ("rep", "rep2")
        )
        for t in ("cpu64k", "cpu16g")
    }
    assert by_size["cpu64k"] == ["costs", "pays"] and by_size["cpu16g"] == ["costs", "costs"]
    band = matrixkit.family_noise(metas, records)["qwen3-4b-concurrent-eager"]
    spread = abs(rel["qwen3-4b-concurrent-cpu64k-rep"] - rel["qwen3-4b-concurrent-cpu64k-rep2"])
    assert band["relative_difference"] > 0.2 and spread > band["relative_difference"]
    for n, e in runs.items():
        assert e.verified and e.threshold == band["relative_difference"], n
        if e.offload_bytes is None:
            continue
        assert e.after is not None and not e.harmful and not e.after.harmful, n
        if e.truth == "costs":
            assert e.after.action == "disable_offload" and e.action in (
                "disable_offload",
                "insufficient_data",
            ), n
    first, second = runs["qwen3-4b-concurrent-none-rep"], runs["qwen3-4b-concurrent-none-rep2"]
    for e in (first, second):
        assert (e.action, e.recommended_bytes) == ("enable_offload", 16 * GIB), e.run
        at16 = next(p for p in e.predictions if p.size_bytes == 16 * GIB)
        assert at16.predicted is not None and at16.predicted > 0 > at16.measured, e.run
    assert first.truth == "neutral" and first.agrees and not first.harmful
    assert second.truth == "costs" and second.harmful
    # The fixed time of a step with the tier on, against the cost, over every eager 4B pair.
    pairs = {
        on: base
        for on, base in burst_steps.burst_pairs(MATRIX).items()
        if on.startswith("qwen3-4b-concurrent-") and not GRAPHS_ALONE.search(on)
    }
    steps = burst_steps.table(MATRIX, [*pairs, *set(pairs.values())])
    fixed = {n: r["engine"]["offload"]["step_time"]["fixed_ms"] for n, r in steps.items()}
    cost = {
        on: matrixkit.paired_truth(_requests(MATRIX / base), _requests(MATRIX / on))[
            "relative_change"
        ]
        for on, base in pairs.items()
    }
    keys = sorted(fixed)
    rho = burst_steps.rank_correlation([fixed[k] for k in keys], [cost[k] for k in keys])
    assert len(fixed) == 10 and rho is not None and rho > 0.85


def test_4b_bursts_with_cuda_graphs_each_server_alone_never_cost(evals) -> None:  # type: ignore[no-untyped-def]
    """Batch 33 (holdout.json's `-graphs-`, session 36, one H200 host, each server alone:
    `matrix.py run --max-group 1`): the same 4B bursts served with CUDA graphs, without
    offload and with 16 GiB, twice, interleaved. Staged to tell whether the cost batches 31
    and 32 found in every eager step with the tier on is the eager engine's CPU work. It is:
    with graphs 16 GiB never cost (-3.6 and -11.4 % summed TTFT, where the eager engine paid
    +14 to +39 % at that size), a step with the tier on took less fixed time than in any
    eager 4B run, and the loaders waited less beyond their prefix's compute. Each server
    alone, the two runs without offload repeat to 0.01 % (the eager pair on one host, with
    idle servers beside the first, 8.9 %); the two offload runs still differ by 8.8 %, the
    graphs family's band (its own family: the vLLM flags are part of it). Every run agrees and
    none is harmful; the second run without offload swung once on its way to enabling
    until session 37's hysteresis in seconds (test_settled_advice_does_not_swing_back)."""
    runs = {e.run: e for e in evals if GRAPHS_ALONE.search(e.run)}
    names = {f"qwen3-4b-concurrent-graphs-{t}{r}" for t in ("none", "cpu16g") for r in ("", "-rep")}
    assert set(runs) == names and names <= held_out()
    metas = {n: _meta(MATRIX / n) for n in names}
    assert len({m["gpu"]["uuid"] for m in metas.values()}) == 1
    eager = {e.run for e in evals if ONE_HOST.search(e.run)}
    metas |= {n: _meta(MATRIX / n) for n in eager}
    assert all(("--enforce-eager" in metas[n]["vllm_argv"]) == (n in eager) for n in metas)
    records = {n: _requests(MATRIX / n) for n in names | eager}

    def apart(a: str, b: str) -> float:
        return abs(matrixkit.paired_truth(records[a], records[b])["relative_change"])

    alone = apart("qwen3-4b-concurrent-graphs-none", "qwen3-4b-concurrent-graphs-none-rep")
    beside = apart("qwen3-4b-concurrent-none-rep", "qwen3-4b-concurrent-none-rep2")
    assert alone < 0.001 < 0.05 < beside
    rel = {
        n: matrixkit.paired_truth(records[matrixkit.base_run(metas, n)], records[n])[
            "relative_change"
        ]
        for n in sorted(names)
        if metas[n]["offload"] is not None
    }
    assert len(rel) == 2 and all(
        matrixkit.verdict(r, matrixkit.TRUTH_THRESHOLD) != "costs" for r in rel.values()
    )
    eager16 = {
        n: matrixkit.paired_truth(records[matrixkit.base_run(metas, n)], records[n])[
            "relative_change"
        ]
        for n in eager
        if n.startswith("qwen3-4b-concurrent-cpu16g-")
    }
    assert len(eager16) == 2 and min(eager16.values()) > max(rel.values())
    steps = burst_steps.table(MATRIX, sorted(rel) + sorted(eager16))
    fixed = {n: r["engine"]["offload"]["step_time"]["fixed_ms"] for n, r in steps.items()}
    waited = {n: r["loaders_waited_more_ms"] for n, r in steps.items()}
    assert max(fixed[n] for n in rel) < min(fixed[n] for n in eager16)
    assert max(waited[n] for n in rel) < min(waited[n] for n in eager16)
    band = matrixkit.family_noise({n: metas[n] for n in names}, {n: records[n] for n in names})
    (graphs_family,) = band
    assert runs["qwen3-4b-concurrent-graphs-cpu16g"].threshold == pytest.approx(
        band[graphs_family]["relative_difference"], abs=1e-5
    )
    for n, e in runs.items():
        assert e.verified and e.agrees and not e.harmful, n
        if e.offload_bytes is not None:
            assert e.action == "keep" and e.after is not None and not e.after.harmful, n
    first, second = (
        runs["qwen3-4b-concurrent-graphs-none"],
        runs["qwen3-4b-concurrent-graphs-none-rep"],
    )
    assert first.action == "no_action" and first.truth != "pays"
    assert (second.action, second.recommended_bytes) == ("enable_offload", 16 * GIB)
    assert second.truth != "costs" and second.swings == 0


def test_4b_eager_bursts_each_server_alone_still_cost(evals) -> None:  # type: ignore[no-untyped-def]
    """Batch 34 (holdout.json's `-alone`, session 37, one H100 host, each server alone): the
    eager 4B bursts of batches 31 and 32 without the idle servers beside, the 16 GiB pair
    twice, interleaved. Staged to tell whether the eager tier's cost was the engine's or the
    neighbours': it is the engine's. Alone, 16 GiB still cost more than the flat 3 % in both
    pairs, more than either graphs pair, and a step with the tier on still took the eager
    fixed time; the runs without offload repeat closer alone than beside, not to batch 33's
    0.01 %. The family's band (23.5 %, the 9 GiB replicates beside) calls both costs neutral,
    so the runs without offload, told to enable 16 GiB from a what-if that predicts a
    saving, agree; at this host's own band (its two runs without offload) that enable costs.
    Alone, the first 16 GiB run does not decide (reload_benefit_unmeasured) and the second
    keeps; replayed after their run without offload, both turn offload off."""
    runs = {e.run: e for e in evals if EAGER_ALONE.search(e.run)}
    names = {f"qwen3-4b-concurrent-{t}-alone{r}" for t in ("none", "cpu16g") for r in ("", "2")}
    assert set(runs) == names and names <= held_out()
    beside = {e.run for e in evals if ONE_HOST.search(e.run)}
    graphs = {e.run for e in evals if GRAPHS_ALONE.search(e.run)}
    metas = {n: _meta(MATRIX / n) for n in names | beside | graphs}
    assert len({metas[n]["gpu"]["uuid"] for n in names}) == 1
    assert {metas[n]["gpu"]["uuid"] for n in names}.isdisjoint(
        metas[n]["gpu"]["uuid"] for n in beside
    )
    assert all("--enforce-eager" in metas[n]["vllm_argv"] for n in names)
    records = {n: _requests(MATRIX / n) for n in metas}

    def change(base: str, on: str) -> float:
        return float(matrixkit.paired_truth(records[base], records[on])["relative_change"])

    alone = abs(change("qwen3-4b-concurrent-none-alone", "qwen3-4b-concurrent-none-alone2"))
    apart = abs(change("qwen3-4b-concurrent-none-rep", "qwen3-4b-concurrent-none-rep2"))
    graphs_apart = abs(
        change("qwen3-4b-concurrent-graphs-none", "qwen3-4b-concurrent-graphs-none-rep")
    )
    assert graphs_apart < alone < apart
    cost = {n: change(matrixkit.base_run(metas, n), n) for n in names if metas[n]["offload"]}
    graphs_cost = {
        n: change(matrixkit.base_run(metas, n), n) for n in graphs if metas[n]["offload"]
    }
    assert len(cost) == 2 and min(cost.values()) > max(alone, matrixkit.TRUTH_THRESHOLD)
    assert min(cost.values()) > max(graphs_cost.values())
    steps = burst_steps.table(MATRIX, sorted(cost) + sorted(graphs_cost))
    fixed = {n: r["engine"]["offload"]["step_time"]["fixed_ms"] for n, r in steps.items()}
    assert min(fixed[n] for n in cost) > max(fixed[n] for n in graphs_cost)
    band = matrixkit.family_noise(metas, records)["qwen3-4b-concurrent-eager"]
    assert band["relative_difference"] > max(cost.values())
    for n, e in runs.items():
        assert e.verified and not e.harmful, n
        assert e.agrees or e.action == "insufficient_data", n
        assert e.threshold == band["relative_difference"], n
        if e.offload_bytes is not None:
            assert e.truth == "neutral" and e.after is not None, n
            assert e.after.action == "disable_offload" and not e.after.harmful, n
            continue
        assert (e.action, e.recommended_bytes) == ("enable_offload", 16 * GIB), n
        at16 = next(p for p in e.predictions if p.size_bytes == 16 * GIB)
        assert at16.predicted is not None and at16.predicted > 0 > at16.measured, n
        on = n.replace("-none-", "-cpu16g-")
        assert matrixkit.verdict(cost[on], alone) == "costs", n


def test_8b_bursts_with_cuda_graphs_alone_repeat_their_price_and_their_prediction(evals) -> None:  # type: ignore[no-untyped-def]
    """Batch 35 (holdout.json's `qwen3-8b-concurrent-graphs-...-alone`, session 40, one H100
    host, each server alone): 8B's bursts with CUDA graphs without offload twice and with 16
    GiB once between them (the second 16 GiB run, staged, did not fit the device time left).
    Staged because batch 33's two runs without offload on 4B did the same work to 0.01 % while
    their TTFT fits priced a computed token 37 % apart and so predicted the same 16 GiB 0.064
    s/s apart (one within, one out). On 8B the two runs without offload did the same work,
    the fits' prices repeat within their standard errors, more closely than 4B's, and so do
    the two predictions made from them: both within tolerance of what 16 GiB measured against
    each, and closer to each other than the two measurements are. Every run agrees: both runs
    without offload enable 16 GiB, which pays, and the 16 GiB run keeps, alone and after its
    run without offload."""
    runs = {e.run: e for e in evals if GRAPHS8_ALONE.search(e.run)}
    base = "qwen3-8b-concurrent-graphs-none-alone"
    names = {base, base + "2", "qwen3-8b-concurrent-graphs-cpu16g-alone"}
    assert set(runs) == names and names <= held_out()
    metas = {n: _meta(MATRIX / n) for n in names}
    assert len({m["gpu"]["uuid"] for m in metas.values()}) == 1
    assert not any("--enforce-eager" in m["vllm_argv"] for m in metas.values())
    records = {n: _requests(MATRIX / n) for n in names}
    assert matrixkit.same_work(records[base], records[base + "2"])
    apart = abs(matrixkit.paired_truth(records[base], records[base + "2"])["relative_change"])
    on = "qwen3-8b-concurrent-graphs-cpu16g-alone"
    measured = {}
    for n in (base, base + "2"):
        t = matrixkit.paired_truth(records[n], records[on])
        assert t["verdict"] == "pays" and -t["relative_change"] > apart, n
        measured[n] = t["ttft_saved_s_per_s"]
    doc = fit_repeat.table(
        MATRIX,
        [
            base,
            base + "2",
            "qwen3-4b-concurrent-graphs-none",
            "qwen3-4b-concurrent-graphs-none-rep",
        ],
    )
    eight = doc["pairs"][f"{base} / {base}2"]
    four = doc["pairs"]["qwen3-4b-concurrent-graphs-none / qwen3-4b-concurrent-graphs-none-rep"]
    assert eight["baseline_sigmas_apart"] < 1.0 < four["baseline_sigmas_apart"]
    assert eight[fit_repeat.BASELINE]["apart"] < four[fit_repeat.BASELINE]["apart"]
    predicted = {}
    for n in (base, base + "2"):
        e = runs[n]
        assert (e.action, e.recommended_bytes) == ("enable_offload", 16 * GIB), n
        (p,) = e.predictions
        assert p.size_bytes == 16 * GIB and p.ok and p.measured == pytest.approx(measured[n]), n
        assert p.predicted is not None
        predicted[n] = p.predicted
    assert abs(predicted[base] - predicted[base + "2"]) < abs(measured[base] - measured[base + "2"])
    for n, e in runs.items():
        assert e.verified and e.agrees and not e.harmful and e.swings == 0, n
    keep = runs[on]
    assert keep.action == "keep" and keep.truth == "pays"
    assert keep.after is not None and keep.after.action == "keep" and keep.after.agrees


def test_8b_eager_bursts_alone_pay_as_far_as_the_step_that_loads_lets_them(evals) -> None:  # type: ignore[no-untyped-def]
    """Batch 36 (holdout.json's `qwen3-8b-concurrent-...-alone`, session 41, one H200 host,
    each server alone): the eager 8B bursts without offload and with 16 GiB, twice,
    interleaved; batch 35 without its CUDA graphs, as batch 34 was batch 33 without them on
    4B. Staged to tell whether the eager tier costs 8B what it cost 4B alone. It does not:
    neither 16 GiB run costs (where both of 4B's did) and both save less than 8B with graphs.
    But the two 16 GiB runs of the same work are much further apart than the two runs
    without offload, so the family's band is theirs, and what separates them is the first
    engine step of a burst that loads (`bench.burst_steps`): longer with the tier in the run
    that saved less. Both runs without offload are told to enable 16 GiB and predict more
    than either measured, within only by that band; every run agrees, none swings, and both
    16 GiB runs keep, alone and after their run without offload."""
    runs = {e.run: e for e in evals if EAGER8_ALONE.search(e.run)}
    base, on = "qwen3-8b-concurrent-none-alone", "qwen3-8b-concurrent-cpu16g-alone"
    names = {base, base + "2", on, on + "2"}
    assert set(runs) == names and names <= held_out()
    graphs = {e.run for e in evals if GRAPHS8_ALONE.search(e.run)}
    four = {e.run for e in evals if EAGER_ALONE.search(e.run)}
    metas = {n: _meta(MATRIX / n) for n in names | graphs | four}
    assert len({metas[n]["gpu"]["uuid"] for n in names}) == 1
    assert all("--enforce-eager" in metas[n]["vllm_argv"] for n in names)
    records = {n: _requests(MATRIX / n) for n in metas}

    def change(a: str, b: str) -> float:
        return float(matrixkit.paired_truth(records[a], records[b])["relative_change"])

    assert matrixkit.same_work(records[base], records[base + "2"])
    assert matrixkit.same_work(records[on], records[on + "2"])
    none_apart, on_apart = abs(change(base, base + "2")), abs(change(on, on + "2"))
    assert on_apart > 2 * none_apart
    cost = {n: change(matrixkit.base_run(metas, n), n) for n in names if metas[n]["offload"]}
    cost4 = {n: change(matrixkit.base_run(metas, n), n) for n in four if metas[n]["offload"]}
    cost_graphs = {
        n: change(matrixkit.base_run(metas, n), n) for n in graphs if metas[n]["offload"]
    }
    assert len(cost) == 2 and all(
        matrixkit.verdict(c, matrixkit.TRUTH_THRESHOLD) != "costs" for c in cost.values()
    )
    assert max(cost.values()) < min(cost4.values())
    assert max(cost_graphs.values()) < min(cost.values())
    steps = burst_steps.table(MATRIX, sorted(cost))
    longer = {
        n: r["first_step_ms"]["offload"] - r["first_step_ms"]["base"] for n, r in steps.items()
    }
    saved_less, saved_more = sorted(cost, key=cost.__getitem__, reverse=True)
    assert longer[saved_less] > longer[saved_more]
    noise = matrixkit.family_noise({n: metas[n] for n in names}, {n: records[n] for n in names})[
        "qwen3-8b-concurrent-eager"
    ]
    assert noise["runs"] == sorted((on, on + "2"))
    band = runs[on].threshold
    assert band == noise["relative_difference"] > none_apart
    for n, e in runs.items():
        assert e.verified and e.agrees and not e.harmful and e.swings == 0, n
        assert e.threshold == band, n
        if e.offload_bytes is not None:
            assert e.action == "keep" and e.after is not None, n
            assert e.after.action == "keep" and e.after.agrees, n
            continue
        assert (e.action, e.recommended_bytes) == ("enable_offload", 16 * GIB), n
        (p,) = e.predictions
        assert p.size_bytes == 16 * GIB and p.predicted is not None, n
        assert p.ok and p.predicted > p.measured > 0, n
        # Within only by the band the two 16 GiB runs set.
        assert p.predicted - p.measured > max(
            advice_eval.PREDICTION_REL * p.measured, advice_eval.PREDICTION_ABS
        ), n


def test_4b_eager_bursts_on_a_host_that_steps_fast_do_not_cost(evals) -> None:  # type: ignore[no-untyped-def]
    """Batch 37 (holdout.json's `-probe`, `-probe2`, session 44, one H100 host, each server
    alone): batch 34's eager 4B bursts again, without offload and with 16 GiB, twice,
    interleaved, the driver timing the host's own kernel launch and Python loop before and
    after every run's traffic (meta.json's `host_probe`). Staged to tell whether the host's
    speed moves as the engine's step submission does, which ordered what the eager tier cost
    4B. The host held still over the batch (every launch within a tenth of the batch's
    median: no core taken, where session 43 saw busy cores double it), its two runs without
    offload ended closer than batch 34's, and its engine handed a step over faster than in
    any other eager 4B run. There 16 GiB did not cost: both pairs below the
    flat 3 % and below every eager 4B 16 GiB pair elsewhere whose tier run stepped no faster
    than its base. So the eager tier's cost is not the tier's alone: it is paid in the time
    each added step takes, which the host sets. Both runs without offload are told to enable
    16 GiB and predict more than measured, within by the family's band; every run agrees,
    none is harmful, and after its run without offload the pair that saved nothing turns
    offload off while the one that paid keeps."""
    runs = {e.run: e for e in evals if PROBED.search(e.run)}
    names = {f"qwen3-4b-concurrent-{t}-probe{r}" for t in ("none", "cpu16g") for r in ("", "2")}
    assert set(runs) == names and names <= held_out()
    metas = {n: _meta(MATRIX / n) for n in names}
    assert len({m["gpu"]["uuid"] for m in metas.values()}) == 1
    assert all("--enforce-eager" in m["vllm_argv"] for m in metas.values())
    launches = [
        m["host_probe"][k]["launch_us"] for m in metas.values() for k in ("before", "after")
    ]
    middle = statistics.median(launches)
    assert len(launches) == 8 and all(abs(x / middle - 1) < 0.1 for x in launches)
    records = {n: _requests(MATRIX / n) for n in names}
    base, other = "qwen3-4b-concurrent-none-probe", "qwen3-4b-concurrent-none-probe2"
    apart = abs(matrixkit.paired_truth(records[base], records[other])["relative_change"])
    alone = {e.run: _requests(MATRIX / e.run) for e in evals if EAGER_ALONE.search(e.run)}
    alone_apart = abs(
        matrixkit.paired_truth(
            alone["qwen3-4b-concurrent-none-alone"], alone["qwen3-4b-concurrent-none-alone2"]
        )["relative_change"]
    )
    assert apart < alone_apart
    # Every eager 4B step-logged pair of one-token bursts, this batch's and the other hosts'
    # (batch 38's decoding bursts are work of another kind: every step they share decodes).
    rows = {
        on: r
        for on, r in burst_steps.table(MATRIX).items()
        if r["shape"] == "qwen3-4b" and r["eager"] and "engine" in r and "-decode-" not in on
    }
    sub = {
        n: r["engine"][side]["submission"]["median_ms"]
        for on, r in rows.items()
        for side, n in (("base", r["base"]), ("offload", on))
    }
    here = {n for n in sub if n in names}
    assert len(here) >= 3 and max(sub[n] for n in here) < min(
        v for n, v in sub.items() if n not in names
    )
    cost = {on: r["summed_ttft_change"] for on, r in rows.items()}
    probed = {on for on in rows if on in names}
    assert len(probed) == 2 and max(cost[on] for on in probed) < matrixkit.TRUTH_THRESHOLD
    no_faster = [
        on
        for on, r in rows.items()
        if on not in names and "-cpu16g" in on and sub[on] >= sub[r["base"]]
    ]
    assert len(no_faster) >= 3 and max(cost[on] for on in probed) < min(
        cost[on] for on in no_faster
    )
    # The family's band is still the widest two runs of the same work on one host set: none
    # of this batch's (batch 31 and 32's 9 GiB replicates).
    family = {e.run for e in evals if ONE_HOST.search(e.run)} | set(alone) | names
    band = matrixkit.family_noise(
        {n: _meta(MATRIX / n) for n in family}, {n: _requests(MATRIX / n) for n in family}
    )["qwen3-4b-concurrent-eager"]
    assert not set(band["runs"]) & names
    for n, e in runs.items():
        assert e.verified and e.agrees and not e.harmful, n
        assert e.threshold == band["relative_difference"], n
        if e.offload_bytes is not None:
            assert e.action == "keep" and e.after is not None and not e.after.harmful, n
            pays = matrixkit.verdict(cost[n], matrixkit.TRUTH_THRESHOLD) == "pays"
            assert e.after.action == ("keep" if pays else "disable_offload"), n
            continue
        assert (e.action, e.recommended_bytes) == ("enable_offload", 16 * GIB), n
        at16 = next(p for p in e.predictions if p.size_bytes == 16 * GIB)
        assert at16.predicted is not None and at16.ok and at16.predicted > at16.measured, n


def test_4b_decoding_bursts_wait_where_their_loads_steps_eat_the_balance(evals) -> None:  # type: ignore[no-untyped-def]
    """Batch 38 (holdout.json's `bursts-decode`, session 45, one H100 host, each server
    alone): batch 37's eager 4B bursts with 32 tokens decoded per request. 16 GiB cost, on a
    host whose engine stepped as fast as batch 37's, where the same pair without decode did
    not: a loader waited two steps more than it would have computing its prefix, and while
    the engine decodes each step is an inter-token latency long. The window alone cannot see
    that: its balance proved a saving and kept the tier until session 45 (harmful). Since
    then a keep must survive every load charged two steps at vLLM's inter-token latency;
    here the balance then reaches a material cost, so the tier waits. The run without
    offload is told to leave it off, and after it the tier is turned off."""
    on_name, base_name = "qwen3-4b-bursts-decode-cpu16g-probe", "qwen3-4b-bursts-decode-none-probe2"
    runs = {e.run: e for e in evals if e.run in (on_name, base_name)}
    on, base = runs[on_name], runs[base_name]
    metas = {n: _meta(MATRIX / n) for n in runs}
    assert len({m["gpu"]["uuid"] for m in metas.values()}) == 1 and set(runs) <= held_out()
    row = burst_steps.table(MATRIX, [on_name])[on_name]
    assert row["base"] == base_name
    cost = row["summed_ttft_change"]
    assert on.truth == matrixkit.verdict(cost, on.threshold) == "costs"
    # The loaders' extra wait is at least the two steps a load adds, at the engine's decode
    # step (vLLM's mean inter-token latency over the run, as the exporter reads it).
    (engine,) = replay_one(MATRIX / on_name, Config()).final.targets[0].engines
    n = engine.advice.numbers
    step, loads = n["decode_step_seconds"], engine.derived.window["load_ops"]
    assert step is not None and row["loaders_waited_more_ms"] >= 2 * step * 1e3
    assert n["offload_load_steps_seconds"] == pytest.approx(2 * loads * step)
    # Without the steps the balance proves a material saving: what kept the tier before.
    lower = n["offload_net_saving_seconds"] - 2 * n["offload_net_saving_stderr_seconds"]
    ttft = engine.derived.window["ttft_seconds"]
    assert lower / (ttft + lower) >= Config().thresholds.ttft_saving_material
    stepped = lower - n["offload_load_steps_seconds"]
    assert stepped / (ttft + stepped) <= -Config().thresholds.ttft_saving_material
    assert (on.action, engine.advice.reason.value) == (
        "insufficient_data",
        "reload_benefit_unmeasured",
    )
    assert "inter-token latency" in engine.advice.explanation
    assert not on.harmful and on.after is not None and on.after.action == "disable_offload"
    assert on.after.agrees and not on.after.harmful
    assert base.agrees and base.action == "no_action" and not base.harmful
    # The same bound before enabling: collected every 5 s the what-if puts 16 GiB at a
    # material saving without the queue, and only its loads' steps leave the tier off.
    (five,) = replay_one(MATRIX / base_name, Config(interval=5.0)).final.targets[0].engines
    assert (five.advice.action.value, five.advice.reason.value) == (
        "no_action",
        "predicted_saving_immaterial",
    )
    assert "inter-token latency" in five.advice.explanation
    assert five.whatif is not None
    at16 = next(p for p in five.whatif.points if p.cpu_buffer_bytes == 16 * GIB)
    linear, steps = at16.ttft_saved_linear_seconds_per_second, at16.load_steps_seconds_per_second
    window = five.derived.window
    assert linear is not None and steps > 0
    share = Config().thresholds.ttft_saving_material
    assert linear * five.advice.numbers["window_covered_seconds"] / window["ttft_seconds"] >= share
    # A run of one-token requests has no decode step to charge: the bound leaves it be.
    decoding = {e.run for e in evals if _meta(MATRIX / e.run)["workload"].get("max_tokens", 1) > 1}
    assert set(runs) <= decoding and len(decoding) < len(evals) // 10
    (one,) = (
        replay_one(MATRIX / "qwen3-4b-concurrent-cpu16g-probe", Config()).final.targets[0].engines
    )
    assert one.derived.decode_step_seconds is None and one.derived.balance is not None
    assert one.derived.balance.load_step_seconds == 0.0
    assert one.advice.numbers["offload_load_steps_seconds"] is None


def test_8b_decoding_bursts_with_graphs_keep_and_enable_through_their_loads_steps(evals) -> None:  # type: ignore[no-untyped-def]
    """Batch 39 (holdout.json's `bursts-decode` on 8B with CUDA graphs, session 46, one
    H200 host, each server alone): the decoding run where the tier should pay, because
    8B's one-token bursts with graphs saved 18 to 33 % with 16 GiB. It paid, and the
    two-step bound that holds back batch 38's keep must not hold back this one or the
    enable before it. It does not: with every load charged two steps at vLLM's inter-token
    latency, the keep's balance and the enable's saving both stay material.

    What the window alone and the what-if promise is about twice what enabling delivered
    (docs/whatif.md, "What batch 39 measured"): the estimate is not a bound. After its run
    without offload, the delivered saving is measured against the engine's TTFT fit from
    before, and that comes within the truth's 3 %."""
    on_name, base_name = (
        "qwen3-8b-bursts-decode-graphs-cpu16g",
        "qwen3-8b-bursts-decode-graphs-none",
    )
    runs = {e.run: e for e in evals if e.run in (on_name, base_name)}
    on, base = runs[on_name], runs[base_name]
    metas = {n: _meta(MATRIX / n) for n in runs}
    assert len({m["gpu"]["uuid"] for m in metas.values()}) == 1 and set(runs) <= held_out()
    assert {m["workload"]["max_tokens"] for m in metas.values()} == {32}
    row = burst_steps.table(MATRIX, [on_name])[on_name]
    assert row["base"] == base_name and not row["eager"]
    cost = row["summed_ttft_change"]
    assert on.truth == base.truth == matrixkit.verdict(cost, on.threshold) == "pays"
    material = Config().thresholds.ttft_saving_material
    (engine,) = replay_one(MATRIX / on_name, Config()).final.targets[0].engines
    n = engine.advice.numbers
    step, loads = n["decode_step_seconds"], engine.derived.window["load_ops"]
    assert step is not None and loads > 0
    assert n["offload_load_steps_seconds"] == pytest.approx(2 * loads * step)
    # The keep survives its loads' steps at the balance's lower end.
    lower = n["offload_net_saving_seconds"] - 2 * n["offload_net_saving_stderr_seconds"]
    stepped = lower - n["offload_load_steps_seconds"]
    ttft = engine.derived.window["ttft_seconds"]
    assert stepped / (ttft + stepped) >= material
    assert (on.action, engine.advice.reason.value) == ("keep", "paying_off") and on.agrees
    # The balance promised more than twice what the pair measured (per second of its window).
    delivered = -cost * row["summed_ttft_base_s"]
    assert n["offload_net_saving_seconds"] > 2 * delivered
    # After its run without offload the tier is kept on what it delivered, which comes within
    # the truth's threshold of the pair's own change.
    base_replay = replay_one(MATRIX / base_name, Config())
    (base_engine,) = base_replay.final.targets[0].engines
    (after,) = (
        replay_one(MATRIX / on_name, Config(), before=base_replay.before).final.targets[0].engines
    )
    assert after.advice.action.value == "keep" and on.after is not None and on.after.agrees
    share = after.advice.numbers["offload_delivered_saving_share"]
    assert share is not None and abs(share - (-cost)) < matrixkit.TRUTH_THRESHOLD
    # The enable survives its loads' steps too, at the size the pair measured.
    assert (base.action, base.recommended_bytes) == ("enable_offload", 16 * GIB) and base.agrees
    assert base_engine.whatif is not None
    at16 = next(p for p in base_engine.whatif.points if p.cpu_buffer_bytes == 16 * GIB)
    linear, steps = at16.ttft_saved_linear_seconds_per_second, at16.load_steps_seconds_per_second
    covered = base_engine.advice.numbers["window_covered_seconds"]
    assert linear is not None and steps > 0
    assert (linear - steps) * covered / base_engine.derived.window["ttft_seconds"] >= material
    # The keep's balance says that on an engine that decodes it has run high; the enable,
    # whose prediction came within on batch 40's host, does not.
    assert "This engine decodes" in engine.advice.explanation
    assert "This engine decodes" not in base_engine.advice.explanation
    # Its prediction is more than twice what the pair measured: a miss.
    (p,) = base.predictions
    assert p.predicted is not None and not p.ok and p.predicted > 2 * p.measured > 0


def test_decoding_and_one_token_bursts_on_one_host_are_both_predicted_within(evals) -> None:  # type: ignore[no-untyped-def]
    """Batch 40 (holdout.json's `-host`, session 47): batch 39's decoding 8B bursts with CUDA
    graphs and the same bursts without decode, each without offload and with 16 GiB, all
    four on one host. Batch 39's enable promised twice what 16 GiB delivered; on this host
    both enables come within what their pairs measured, so decoding does not make the
    prediction run high (docs/whatif.md, "What batch 40 measured"). The window's balance
    does run high on the decoding pair, as on batch 39, and not on the one-token pair:
    the keep that states it says so."""
    pairs = {
        "qwen3-8b-bursts-decode-graphs-cpu16g-host": "qwen3-8b-bursts-decode-graphs-none-host",
        "qwen3-8b-concurrent-graphs-cpu16g-host": "qwen3-8b-concurrent-graphs-none-host",
    }
    names = set(pairs) | set(pairs.values())
    runs = {e.run: e for e in evals if HOST8.search(e.run)}
    metas = {n: _meta(MATRIX / n) for n in names}
    assert set(runs) == names <= held_out()
    assert len({m["gpu"]["uuid"] for m in metas.values()}) == 1
    assert all(m["step_log"] and "host_probe" in m for m in metas.values())
    ratios = {}
    for on_name, base_name in pairs.items():
        on, base = runs[on_name], runs[base_name]
        row = burst_steps.table(MATRIX, [on_name])[on_name]
        decodes = row["max_tokens"] > 1
        assert row["base"] == base_name
        cost = row["summed_ttft_change"]
        assert on.truth == base.truth == matrixkit.verdict(cost, on.threshold) == "pays"
        assert (base.action, base.recommended_bytes) == ("enable_offload", 16 * GIB)
        (p,) = base.predictions
        assert p.predicted is not None and p.measured > 0 and p.ok
        (engine,) = replay_one(MATRIX / on_name, Config()).final.targets[0].engines
        assert on.action == "keep" and on.agrees
        delivered = -cost * row["summed_ttft_base_s"]
        ratios[decodes] = engine.advice.numbers["offload_net_saving_seconds"] / delivered
        assert ("This engine decodes" in engine.advice.explanation) == decodes
    assert ratios[True] > 1.5 and ratios[False] < 1.25


def test_8b_bursts_decoding_256_tokens_pay_and_the_balance_overshoots_no_more(evals) -> None:  # type: ignore[no-untyped-def]
    """Batch 41 (holdout.json's `bursts-decode256`, session 49, one H100 host, each server
    alone): batch 39's decoding 8B bursts with CUDA graphs, each request decoding 256 tokens
    instead of 32, so the engine decodes for most of the time between bursts. 16 GiB pays;
    the window's balance and the tier's cost a request stay inside what the two 32-token
    pairs measured, so neither grows with the decode. The prediction before enabling is
    twice what 16 GiB delivered, as on batch 39, and as there the host's kernel launches
    were slower around the tier run than around its base (docs/whatif.md, "What batch 41
    measured"). After its run without offload the tier is kept on what it delivered."""
    on_name, base_name = (
        "qwen3-8b-bursts-decode256-graphs-cpu16g",
        "qwen3-8b-bursts-decode256-graphs-none",
    )
    decode32 = {  # the 32-token pairs: batch 39's host, batch 40's
        "qwen3-8b-bursts-decode-graphs-cpu16g": "qwen3-8b-bursts-decode-graphs-none",
        "qwen3-8b-bursts-decode-graphs-cpu16g-host": "qwen3-8b-bursts-decode-graphs-none-host",
    }
    runs = {e.run: e for e in evals if e.run in (on_name, base_name)}
    on, base = runs[on_name], runs[base_name]
    metas = {n: _meta(MATRIX / n) for n in runs}
    assert len({m["gpu"]["uuid"] for m in metas.values()}) == 1 and set(runs) <= held_out()
    assert {m["workload"]["max_tokens"] for m in metas.values()} == {256}
    steps = burst_steps.table(MATRIX, [on_name, *decode32])
    row = steps[on_name]
    assert row["base"] == base_name and not row["eager"]
    cost = row["summed_ttft_change"]
    assert on.truth == base.truth == matrixkit.verdict(cost, on.threshold) == "pays"

    def overshoot(name: str) -> float:
        (engine,) = replay_one(MATRIX / name, Config()).final.targets[0].engines
        delivered = -steps[name]["summed_ttft_change"] * steps[name]["summed_ttft_base_s"]
        return float(engine.advice.numbers["offload_net_saving_seconds"]) / delivered

    assert on.action == "keep" and on.agrees
    ratios = [overshoot(n) for n in decode32]
    assert 1.5 < min(ratios) <= overshoot(on_name) <= max(ratios)
    parts = burst_parts.table(MATRIX, [on_name, *decode32])
    a_request = [parts[n]["request_ms"] for n in decode32]
    assert min(a_request) <= parts[on_name]["request_ms"] <= max(a_request)
    # The enable agrees and promises twice what 16 GiB delivered: a miss, high.
    assert (base.action, base.recommended_bytes) == ("enable_offload", 16 * GIB) and base.agrees
    (p,) = base.predictions
    assert p.predicted is not None and not p.ok and p.predicted > 2 * p.measured > 0
    # Its host launched kernels more slowly around the tier run than around its base, and a
    # load job took more of a step's submission than on batch 40's steady host.
    probes = row["engine"]
    launch = {k: statistics.mean(probes[k]["host_probe"].values()) for k in ("base", "offload")}
    assert launch["offload"] > 1.3 * launch["base"]
    steady = steps["qwen3-8b-bursts-decode-graphs-cpu16g-host"]["engine"]["offload"]
    job = probes["offload"]["submission"]["per_load_job"]["submission_ms"]
    assert job > 1.5 * steady["submission"]["per_load_job"]["submission_ms"]
    # After its run without offload: kept on what it delivered, within the truth's threshold
    # of the pair's change.
    before = replay_one(MATRIX / base_name, Config()).before
    (after,) = replay_one(MATRIX / on_name, Config(), before=before).final.targets[0].engines
    assert after.advice.action.value == "keep" and on.after is not None and on.after.agrees
    share = after.advice.numbers["offload_delivered_saving_share"]
    assert share is not None and abs(share - (-cost)) < matrixkit.TRUTH_THRESHOLD


def test_decisions_within_five_minutes(evals) -> None:  # type: ignore[no-untyped-def]
    """80 % of the runs reach a decision within 5 minutes of traffic (issue 16)."""
    s = summary(evals)
    assert s["decided"] >= s["goals"]["decided"]


def test_every_decision_agrees_with_the_truth(evals) -> None:  # type: ignore[no-untyped-def]
    """Where the advice settles on an action and a run of its size exists, it agrees with the
    truth: the runs that miss the agreement goal are the ones without a decision. Broken in
    session 17 by the 14B RAG-Zipf control's no_action (the what-if priced a computed token
    at its TTFT fit, 21.0 +- 8.2 us, and predicted +0.0019 s/s at 32 GiB for +0.0163
    measured); since session 18 the price is bounded by the token's floor, 29.9 us, and it
    enables 32 GiB (+0.0118 predicted). Broken in session 35 by the one harmful advice
    (test_no_advice_is_harmful), and in session 37 by the same control again: told no_action
    from 123 s, its what-if crosses into enabling 32 GiB at 180 s, 2 s before the recording
    ends, which a change of a standing decision must hold for 30 s to take (10 s from
    session 37, 30 s from session 39: the hysteresis in seconds, docs/advisor.md): it ends
    no_action with enable_offload pending. This fails when either is fixed, and when
    another run disagrees."""
    disagree = [
        e.run for e in evals if e.verified and e.action != "insufficient_data" and not e.agrees
    ]
    assert disagree == ["qwen3-14b-rag-zipf-none-ctl", "qwen3-4b-concurrent-none-rep2"]
    (control,) = (e for e in evals if e.run == "qwen3-14b-rag-zipf-none-ctl")
    (engine,) = replay_one(MATRIX / control.run, Config()).final.targets[0].engines
    assert (engine.advice.action, engine.advice.candidate) == ("no_action", "enable_offload")


def test_the_agreement_goal_of_the_issue(evals) -> None:  # type: ignore[no-untyped-def]
    """Settled advice agrees with the measured truth in 90 % of at least 25 verified runs
    (issue 16), each recording replayed alone. Met in session 6 (28 of 31), missed from
    session 7 (the 0.6B concurrent runs) to session 19 (73 of 82, every miss a run without a
    decision), met since session 20 (74 of 82): a computed token's floor has no store in it,
    so a loaded token priced at the floor carries none (docs/advisor.md, the balance), and
    14B RAG-Zipf with 32 GiB (pays 6.4 %) keeps; 75 of 82 since session 21, where a store is
    charged once per request sharing its step and 0.6B concurrent without offload says
    no_action. The seven misses all wait: six 0.6B offload runs (a reload costs about what a
    recompute does, and the stores' cost is not separable from a computed token's) and 8B
    chat with 16 GiB (neutral; its balance spans -5.9 to +4.3 %). Session 22's CUDA-graphs
    runs add one more of the first kind (0.6B concurrent with 7 GiB waits): 76 of 84
    verified, 90 %, the goal's edge; session 23's loop closed six of them that agree: 82 of
    90, 91 %; session 24's four more (32B chat with graphs at 32 GiB): 86 of 94, every run
    verified. The history of the misses is in docs/gpu-acceptance.md."""
    s = summary(evals)
    assert s["verified"] >= 25
    assert s["agreement"] >= s["goals"]["agreement"]


def test_after_enabling_the_cost_measured_without_offload_only_adds_decisions(evals) -> None:  # type: ignore[no-untyped-def]
    """Each offload run replayed after its run without offload on its machine (`replay
    --prior`, what a running exporter knows after the restart that enables offload: a
    computed token's cost, and what the same traffic cost the engine before): nothing
    harmful, the agreement goal holds, no run loses its decision, and a run the window alone
    could not price gets one."""
    s = summary(evals)["after"]
    assert s["harmful"] == []
    assert s["verified"] >= 15 and s["agreement"] >= GOALS["agreement"]
    offload = [e for e in evals if e.after is not None]
    metas = {e.run: _meta(MATRIX / e.run) for e in evals}
    assert len(offload) == sum(
        matrixkit.base_run(metas, e.run) is not None for e in evals if e.offload_bytes is not None
    )
    for e in offload:
        assert e.after is not None
        if e.action != "insufficient_data":
            assert e.after.action != "insufficient_data", e.run
    assert any(
        e.action == "insufficient_data" and e.after and e.after.action != "insufficient_data"
        for e in offload
    )


def test_no_advice_is_harmful(evals) -> None:  # type: ignore[no-untyped-def]
    """The issue's hard goal, on every run: no enable, keep, grow or shrink where offload
    costs at the size in question, no disable where it pays, neither at the end nor settled
    at any time before. Met since session 12: 0.6B long-context with 7 GiB kept the tier at
    121 s where offload costs 9.6 % (its balance priced each loaded token's recompute ~1.8 us
    too high: with offload on a computed token cost 8.6 us against 3.7 us without, and the
    store copies explain only 3.1 us of that rise), and session 12's 0.6B chat run with 21
    GiB settled a shrink to 16 GiB for 15 s, a size not recorded, where 7 and 21 GiB cost;
    both wait since a keep must survive the stores costing store_cost_factor_max times
    their copy time (docs/advisor.md). Broken in session 17 and met again since session 18:
    14B RAG-Zipf with 32 GiB (pays 6.4 %) turned offload off for 28 s at 121 s, with 28 of
    its 32 GiB stored, and for a second at 150 and 173 s; a tier that has never filled is
    not turned off, and leaving insufficient_data needs the hysteresis' confirmations.
    Broken in session 35 by a run held out (batch 32, an H100 host): 4B's bursts without
    offload are told to enable 16 GiB (+0.066 s/s predicted) where that size cost 38.8 %
    on the same host, in a band of 23.5 % (test_4b_bursts_on_one_host_...): the cost came
    with every engine step taking longer with the tier on, which a run without offload does
    not show. Joined in session 45 by batch 38's 4B decoding bursts with 16 GiB, kept by
    the window alone where the tier cost 12.4 %, and left again since a keep must survive
    every load charged two engine steps at vLLM's inter-token latency
    (test_4b_decoding_bursts_wait_where_their_loads_steps_eat_the_balance). A known defect
    of issue 16: this fails when it is fixed, and when any other run becomes harmful."""
    assert summary(evals)["harmful"] == ["qwen3-4b-concurrent-none-rep2"]


def test_settled_advice_does_not_swing_back(evals) -> None:  # type: ignore[no-untyped-def]
    """Once settled, an action may change as evidence grows, not go back to one it left (the
    8B chat engine with 9 GiB swung between grow and disable ten times before session 5).
    Four 4B runs without offload did until session 37 (batch 29's, batch 31's, batch 33's
    second and batch 34's second: enable, no_action, enable, each no_action standing 1 to
    10 s between 123 and 137 s): the enable gate's share of the TTFT moves by several points
    between cycles in the first seconds of a decision (docs/whatif.md, "What batch 33
    measured": the TTFT fit), and the hysteresis counted evaluations only, 2 s at 1 s. With
    a standing decision unseated only by an answer of 10 s (session 37) one was left, batch
    31's, whose evaluations said no_action for 26 s (standing from 135 to 161 s); since
    session 39 it takes 30 s, a tenth of the default window (docs/advisor.md,
    "Hysteresis")."""
    assert summary(evals)["swinging"] == []


def test_collecting_less_often_decides_less_but_never_harms() -> None:
    """An exporter at --interval 5 (the default until 2026-12-03) sees every fifth scrape of
    the recordings: fewer and wider intervals for its fits, so it decides fewer runs (76 %
    against 90 % in session 20: docs/advisor.md, "How often to collect"), but nothing it
    settles on may be harmful or swing back, but for the one run harmful at 1 s too, batch
    32's 4B run without offload (test_no_advice_is_harmful), which enables 16 GiB at every
    interval."""
    coarse = evaluate(interval=5.0, full=False)
    s = summary(coarse)
    assert s["harmful"] == ["qwen3-4b-concurrent-none-rep2"] and s["swinging"] == []
    assert s["runs"] == len(coarse) >= 60


def test_advice_settled_at_a_size_no_run_measured_is_listed() -> None:
    """A shrink to a size the family has no run of is neither harmful nor agreeing: it is
    listed with its first time, and a harmful one at a measured size is still caught."""

    def step(t: float, action: str, rec: float | None = None) -> Step:
        return Step(t, "t", "m", "0", action, "r", rec, None)

    measured = {7.0 * GIB: {"verdict": "costs"}, 21.0 * GIB: {"verdict": "costs"}}
    timeline = [
        step(0.0, "insufficient_data"),
        step(121.0, "shrink_buffer", 16.0 * GIB),
        step(124.0, "insufficient_data"),
        step(129.0, "shrink_buffer", 16.0 * GIB),
        step(141.0, "keep"),
    ]
    harmful_at, settled, unmeasured = _timeline(timeline, 21.0 * GIB, measured)
    assert unmeasured == [(121.0, "shrink_buffer", 16.0 * GIB)]
    assert harmful_at == [141.0]
    assert settled == ["shrink_buffer", "keep"]
    # A shrink to a measured size that costs is harmful there, not unmeasured.
    harmful_at, _, unmeasured = _timeline(
        [step(121.0, "shrink_buffer", 7.0 * GIB)], 21.0 * GIB, measured
    )
    assert harmful_at == [121.0] and unmeasured == []


def test_a_run_without_offload_is_judged_elsewhere_only_where_its_machine_has_no_run() -> None:
    """An enable at a size recorded only on another machine is judged by the family's pair
    there, as an offload run without a base on its machine is; "leave it off" stays judged
    on the sizes of the run's own machine where it has any."""
    own = {7.0 * GIB: {"verdict": "costs"}}
    elsewhere = {16.0 * GIB: {"verdict": "pays"}, 7.0 * GIB: {"verdict": "pays"}}
    assert _judged_at("enable_offload", own, elsewhere)[7.0 * GIB] == own[7.0 * GIB]
    assert _judged_at("enable_offload", own, elsewhere)[16.0 * GIB]["verdict"] == "pays"
    assert _judged_at("no_action", own, elsewhere) == own
    assert _judged_at("no_action", {}, elsewhere) == elsewhere

    def step(t: float, action: str, rec: float | None = None) -> Step:
        return Step(t, "t", "m", "0", action, "r", rec, None)

    # No run of 16 GiB on the machine: unmeasured alone, judged (here agreeing) elsewhere.
    timeline = [step(121.0, "enable_offload", 16.0 * GIB), step(140.0, "no_action")]
    assert _timeline(timeline, None, own)[2] == [(121.0, "enable_offload", 16.0 * GIB)]
    harmful_at, _, unmeasured = _timeline(timeline, None, own, elsewhere)
    assert harmful_at == [] and unmeasured == []
    # Leaving it off where the other machine's 16 GiB pays is not judged by it.
    harmful_at, _, _ = _timeline([step(121.0, "no_action")], None, own, elsewhere)
    assert harmful_at == []
    # Enabling where the other machine's pair costs is harmful.
    harmful_at, _, _ = _timeline(
        [step(121.0, "enable_offload", 16.0 * GIB)], None, own, {16.0 * GIB: {"verdict": "costs"}}
    )
    assert harmful_at == [121.0]


def test_swings_count_returns_only() -> None:
    assert _swings(["grow_buffer", "disable_offload", "grow_buffer", "disable_offload"]) == 2
    assert _swings(["grow_buffer", "disable_offload"]) == 0
    assert _swings([]) == 0


def test_a_harmful_advice_settled_mid_run_counts() -> None:
    """The 32B chat run with 48 GiB (offload cut its summed TTFT by 77 %) said
    disable_offload for three cycles at 155 s before this was fixed: harmful, though its
    final advice was insufficient_data."""
    run = RunEval(
        "qwen3-32b-chat-cpu192k", 48.0 * GIB, 48.0 * GIB, "pays", 1.04,
        "insufficient_data", "reload_benefit_unmeasured", None, 155.0, True, False, False,
        harmful_at_s=(155.0,),
    )  # fmt: skip
    assert summary([run])["harmful"] == ["qwen3-32b-chat-cpu192k"]
    assert "harmful at 155 s" in markdown([run])
    assert _about(48.0 * GIB, "disable_offload", None, {}) == 48.0 * GIB
    assert _about(None, "enable_offload", 16.0 * GIB, {}) == 16.0 * GIB
    best = {9.0 * GIB: {"ttft_saved_s_per_s": -0.01}, 27.0 * GIB: {"ttft_saved_s_per_s": 0.02}}
    assert _about(None, "no_action", None, best) == 27.0 * GIB


def test_predictions_before_enabling_are_checked(evals) -> None:  # type: ignore[no-untyped-def]
    """Every run without offload predicts a saving at every size its family measured."""
    predictions = [p for e in evals for p in e.predictions]
    assert len(predictions) >= 10
    assert all(p.predicted is not None and p.ok is not None for p in predictions)
    # How near they come on the whole is reported beside how many are within tolerance.
    errors = [abs(p.predicted - p.measured) for p in predictions if p.predicted is not None]
    s = summary(evals)
    mae = s["prediction_mean_abs_error"]
    assert mae == pytest.approx(sum(errors) / len(errors))
    # And which side the misses fall on: above the measured saving is where they enable.
    misses = [p for p in predictions if not p.ok]
    high = [p for p in misses if p.predicted is not None and p.predicted > p.measured]
    assert s["prediction_misses_high"] == len(high) <= len(misses) == len(s["prediction_misses"])
    tail = f"; {len(high)} of the {len(misses)} misses above the measured saving" if misses else ""
    assert f"(mean absolute error {mae:.3f} s/s{tail})" in markdown(evals)


def test_a_launch_bound_engines_bursts_are_charged_the_launch_a_load_adds(evals) -> None:  # type: ignore[no-untyped-def]
    """docs/whatif.md, "The launch a load adds": on 0.6B served eager or with CUDA graphs a
    step's launch is most of its time, and a load in a burst of twelve keeps the burst's other
    requests waiting for its later step's launch. Charged since session 32, the five 0.6B
    burst predictions come within 25 % of the cost measured on four (0.41 to 0.59 of it
    before); the 8B bursts' compute covers two launches, so their wait is none and their
    predictions what they were."""
    small = [
        p for e in evals if e.family.startswith("qwen3-0.6b-concurrent") for p in e.predictions
    ]
    assert len(small) == 5 and all(p.predicted is not None for p in small)
    assert all(p.measured < 0 and p.predicted is not None and p.predicted < 0 for p in small)
    assert sum(bool(p.ok) for p in small) == 4
    assert all(p.predicted is not None and p.predicted < 0.7 * p.measured for p in small)
    steps = {e.run: e for e in evals if e.run.endswith("-concurrent-none-steps")}
    (eight,) = (
        replay_one(MATRIX / "qwen3-8b-concurrent-none-steps", Config()).final.targets[0].engines
    )
    (small_steps,) = (
        replay_one(MATRIX / "qwen3-0.6b-concurrent-none-steps", Config()).final.targets[0].engines
    )
    assert eight.advice.numbers["whatif_launch_wait_seconds"] == 0.0
    assert 0.005 < small_steps.advice.numbers["whatif_launch_wait_seconds"] < 0.015
    assert 3.0 < small_steps.advice.numbers["whatif_launch_waiters_per_load"] < 3.5
    assert steps["qwen3-8b-concurrent-none-steps"].predictions[0].ok


@unmet_goal(
    "23 of 96 miss (docs/gpu-acceptance.md; session 27's two, unique prompts with CUDA graphs, "
    "session 28's two, 32B chat at 24 GiB (+0.940 for +1.024) and 32B unique prompts at "
    "1 request/s (-0.009 for -0.002), session 29's three, 14B and 8B unique prompts on an "
    "H100 host (-0.022 for -0.004, -0.005 and -0.005 for -0.001), session 30's 8B unique "
    "prompts at 4 requests/s again (-0.021 for -0.012) and session 40's two, batch 35's 8B "
    "bursts with CUDA graphs each server alone (+0.123 for +0.157, +0.129 for +0.168), and "
    "session 41's two, batch 36's eager 8B bursts each server alone (+0.117 for +0.028, "
    "+0.121 for +0.077, both high, in only by the 16.7 % band their two 16 GiB runs set), and "
    "session 44's two, batch 37's eager 4B bursts on a host whose steps submit fastest "
    "(+0.035 for +0.009, +0.037 for +0.001, high, in by the family's band), and session "
    "47's two, batch 40's decoding and one-token 8B bursts with CUDA graphs on one H100 host "
    "(+0.121 for +0.121, +0.124 for +0.110), are within; session 30's eager 8B "
    "bursts' 16 GiB pair again missed until that band (+0.101 for +0.046: a request that "
    "loaded saved itself nothing, eager, where with CUDA graphs each saved 9-46 ms); "
    "session 31's batch 28, the "
    "bursts with the engine-step log on another H100 host: the eager 8B pair at 16 GiB and "
    "the same with CUDA graphs within (+0.099 for +0.112, +0.124 for +0.159); since session "
    "32 a load on a launch-bound engine is charged the launch of its later step for every "
    "prefill of its burst but the first, which brought in four of the five eager and graphs "
    "0.6B bursts (-0.067 to -0.168 for -0.071 to -0.152; -0.042 to -0.062 before), and "
    "session 33's held-out 1.7B and 14B bursts (-0.112 for -0.120, +0.138 for +0.182); since "
    "session 26 the hits' saving is a queue's, "
    "which brought in 32B chat at 16 GiB from both eager runs and the graphs run (+0.420, "
    "+0.432, +0.424 for +0.482, +0.490, +0.465; linear +0.265 to +0.283) and the held-out "
    "14B chat at 10 GiB, and lost four by at most 0.013 s/s: 14B chat at 16 GiB from its "
    "control (+0.155 for +0.121), 32B RAG-Zipf at 32 GiB from its control and at 48 GiB from "
    "the replicate (+0.075 for +0.048, +0.098 for +0.069) and 8B concurrent with CUDA graphs "
    "at 9 GiB (+0.055 for +0.033); its mean absolute error fell from 0.047 to 0.029 s/s, "
    "0.025 since session 32): "
    "8B concurrent at 16 GiB from its control and at 27 GiB from the replicate, predicted "
    "+0.136 and +0.142 s/s, measured -0.023 and +0.039 (since session 41 its other three, "
    "27 GiB from the first run, 9 GiB from the replicate and 16 GiB from the second "
    "replicate, high too, are within by batch 36's band; bursts: vLLM's "
    "prefill time fell 126 us per loaded token, not the 195 us the TTFT fit prices a hit at, "
    "and requests that loaded nothing went into the loaders' later step; with CUDA graphs "
    "the same inputs predict +0.118 for +0.141 at 27 GiB, within, and +0.102 for +0.097 at "
    "16 GiB); the eager 0.6B bursts at 7 GiB from the H100 replicate, predicted -0.131, "
    "measured -0.101 (over, where its H200 pair is within); 0.6B "
    "rag-zipf at 21 GiB from its control, predicted -0.018, measured -0.040 (the same, 16 %); "
    "32B unique at 16 and 48 GiB from both runs without offload, predicted -0.045, measured "
    "-0.001 to -0.010 (the 32B unique runs pay almost none of their stores' copy time, where "
    "0.6B and 8B pay about all of it even with CUDA graphs, batch 21; at 1 request/s, the "
    "engine idle, a 32B request arriving alone still paid a quarter of its copy time, batch "
    "22: not the load hides it; nor the shape, batches 23 and 24: on an H100 host 14B paid a "
    "tenth and 8B a fifth of theirs at 1 request/s); 8B "
    "chat at 16 GiB, predicted +0.017, measured -0.015 (the slower of two runs of the same "
    "work); the held-out 14B RAG-Zipf at 10 GiB, predicted -0.001, measured -0.036 (the "
    "requests that loaded nothing took 8.3 ms more each with the full 10 GiB tier, 0.1 ms less "
    "with 30 GiB; its other three predictions are within); the held-out 4B bursts at 9 GiB "
    "(batch 29), predicted +0.006, measured -0.143 (its loads cost its bursts what 1.7B's "
    "did, but its prefill fit's fixed time, 22.7 ms of a 73.5 ms prefill, charges no launch: "
    "the step log shows 45-58 ms between its steps' launches); batch 30's two controls at 16 "
    "GiB on another H200 host (session 34): the 4B bursts', predicted -0.046, measured +0.008 "
    "(the same loads that cost them 27 % at 9 GiB on batch 29's host cost nothing there: "
    "loaders +13 ms, the others -9 ms; within since session 35 by the family's band), and the "
    "14B bursts', predicted +0.249, measured +0.186 (its first run's 10 GiB prediction is "
    "within); batches 31 and 32 (session 35), 4B's bursts twice on one H100 host: the first "
    "run without offload within at both sizes by the band (+0.007 for +0.049 at 9 GiB, +0.046 "
    "for -0.069 at 16), the second out at both (+0.022 for -0.095, +0.066 for -0.176: every "
    "step took longer with the tier on, which no run without offload shows); batch 33 "
    "(session 36), the same bursts with CUDA graphs, each server alone: the second run "
    "without offload within by the band (+0.029 for +0.053), the first, the same work to "
    "0.01 %, out (-0.035 for +0.017: its TTFT fit prices a computed token 3 standard errors "
    "below the second's); batch 34 (session 37), the eager bursts each server alone on "
    "another H100 host: the second run without offload within by the band (+0.046 for "
    "-0.042), the first out (+0.040 for -0.062: alone too the eager tier cost every step "
    "more than its loads saved); batch 38 (session 45), the eager 4B bursts decoding 32 "
    "tokens a request: +0.006 for -0.057 (its loaders waited two decode steps, which the "
    "what-if prices from the prefill times, not the inter-token latency); batch 39 (session "
    "46), 8B's decoding bursts with CUDA graphs on an H200 host: +0.144 for +0.070 (the "
    "one-token 8B bursts with graphs on another H200 host: +0.102 for +0.097; batch 40: the "
    "host, whose launches slowed by half while the pair ran); batch 41 (session 49), the same "
    "bursts decoding 256 tokens on an H100 host: +0.202 for +0.100 (its host's launches "
    "two fifths slower around the tier run than around its base); and the four above",
)
def test_every_saving_predicted_before_enabling_matches_what_enabling_measured(evals) -> None:  # type: ignore[no-untyped-def]
    s = summary(evals)
    assert s["prediction_misses"] == []


def test_a_control_run_without_offload_pairs_with_the_offload_runs_of_its_session(
    tmp_path: Path,
) -> None:
    """A family split across device sessions: its run without offload recorded again (a
    control, later in time) is the base of the offload run recorded beside it, and the first
    one stays the base of the earlier offload run."""
    for name in ("qwen3-8b-rag-zipf-none", "qwen3-8b-rag-zipf-cpu64k"):
        shutil.copytree(MATRIX / name, tmp_path / name)
    for name, src in (
        ("qwen3-8b-rag-zipf-none-ctl", "qwen3-8b-rag-zipf-none"),
        ("qwen3-8b-rag-zipf-cpu192k", "qwen3-8b-rag-zipf-cpu64k"),
    ):
        shutil.copytree(MATRIX / src, tmp_path / name)
        meta = json.loads((tmp_path / name / "meta.json").read_text())
        meta["traffic"]["t_traffic_start"] += 86_400.0  # a day later, on another machine
        if name.endswith("cpu192k"):
            meta["offload"]["size_gib"] = 27.0
        (tmp_path / name / "meta.json").write_text(json.dumps(meta))
    metas = {p.name: json.loads((p / "meta.json").read_text()) for p in tmp_path.iterdir()}
    assert matrixkit.base_run(metas, "qwen3-8b-rag-zipf-cpu64k") == "qwen3-8b-rag-zipf-none"
    assert matrixkit.base_run(metas, "qwen3-8b-rag-zipf-cpu192k") == "qwen3-8b-rag-zipf-none-ctl"
    evals = {e.run: e for e in evaluate(tmp_path)}
    assert {p.size_bytes for p in evals["qwen3-8b-rag-zipf-none"].predictions} == {9 * GIB}
    assert {p.size_bytes for p in evals["qwen3-8b-rag-zipf-none-ctl"].predictions} == {27 * GIB}


def test_a_cached_evaluation_is_the_evaluation(
    evals, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The cache (`./run test` evaluates the matrix in gen --check and here) gives back
    exactly what was evaluated, and any byte of a recording, or another interval, is
    another key: evaluated afresh, never a stale result."""
    assert [_from_json(json.loads(json.dumps(asdict(e)))) for e in evals] == evals
    for name in ("qwen3-8b-rag-zipf-none", "qwen3-8b-rag-zipf-cpu64k"):
        shutil.copytree(MATRIX / name, tmp_path / name)
    key = cache_key(tmp_path, 1.0)
    assert key == cache_key(tmp_path, 1.0) != cache_key(tmp_path, 2.0)
    assert cache_key(tmp_path, 1.0, full=False) != key
    fresh = evaluate(tmp_path)  # written to the cache, or read where a run wrote it
    assert evaluate(tmp_path) == fresh
    # The advice alone: the same actions, neither predictions nor replays after a prior.
    alone = evaluate(tmp_path, full=False)
    assert [(e.run, e.action, e.first_decision_s) for e in alone] == [
        (e.run, e.action, e.first_decision_s) for e in fresh
    ]
    assert any(e.predictions for e in fresh) and not any(e.predictions for e in alone)
    assert any(e.after for e in fresh) and not any(e.after for e in alone)
    monkeypatch.setenv("KVOE_EVAL_CACHE", "off")
    assert evaluate(tmp_path) == fresh  # evaluated again, not read
    # Where the cache cannot be written (a read-only checkout): evaluated, not kept.
    monkeypatch.setenv("KVOE_EVAL_CACHE", "on")
    blocked = tmp_path.parent / f"{tmp_path.name}-a-file"  # outside the recordings
    blocked.write_text("")
    monkeypatch.setattr(advice_eval, "CACHE", blocked / "cache")
    assert evaluate(tmp_path) == fresh
    meta = tmp_path / "qwen3-8b-rag-zipf-cpu64k" / "meta.json"
    meta.write_bytes(meta.read_bytes() + b"\n")
    assert cache_key(tmp_path, 1.0) != key


def test_the_cache_keeps_its_newest_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each code state leaves an entry per interval; only the newest are kept."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setattr(advice_eval, "CACHE", cache)
    for i in range(5):
        entry = cache / f"{i}.json"
        entry.write_text("[]")
        os.utime(entry, (1000.0 + i, 1000.0 + i))
    (cache / "notes.txt").write_text("not an entry")
    advice_eval._prune(keep=2)
    assert sorted(p.name for p in cache.iterdir()) == ["3.json", "4.json", "notes.txt"]


def test_a_replicate_without_offload_pairs_with_the_offload_runs_of_its_machine(
    tmp_path: Path,
) -> None:
    """A run without offload recorded again on the same machine (a replicate) is the base of
    no offload run nearer in time to the first, yet did the same work: its advice is judged
    against the offload runs of its machine. A copy on another day is not."""
    for name in ("qwen3-8b-rag-zipf-none", "qwen3-8b-rag-zipf-cpu64k"):
        shutil.copytree(MATRIX / name, tmp_path / name)

    def copy(name: str, shift: float) -> None:
        shutil.copytree(MATRIX / "qwen3-8b-rag-zipf-none", tmp_path / name)
        meta = json.loads((tmp_path / name / "meta.json").read_text())
        meta["traffic"]["t_traffic_start"] += shift
        (tmp_path / name / "meta.json").write_text(json.dumps(meta))

    copy("qwen3-8b-rag-zipf-none-rep", 900.0)  # the same session, after the offload run
    copy("qwen3-8b-rag-zipf-none-ctl", 86_400.0)  # a day later
    metas = {p.name: json.loads((p / "meta.json").read_text()) for p in tmp_path.iterdir()}
    assert matrixkit.base_run(metas, "qwen3-8b-rag-zipf-cpu64k") == "qwen3-8b-rag-zipf-none"
    evals = {e.run: e for e in evaluate(tmp_path)}
    first, rep = evals["qwen3-8b-rag-zipf-none"], evals["qwen3-8b-rag-zipf-none-rep"]
    assert {p.size_bytes for p in rep.predictions} == {9 * GIB}
    assert rep.verified and rep.truth == first.truth
    assert evals["qwen3-8b-rag-zipf-none-ctl"].predictions == ()


def test_a_pair_recorded_again_elsewhere_leaves_each_run_its_own_truth(
    tmp_path: Path,
) -> None:
    """A pair recorded again on another machine (`-rep`, batch 26): two offload runs of one
    size. Each is judged by its own pair, not by whichever of them sorts last: here the
    replicate's TTFTs are cut by a fifth, so it pays, and the first pair still costs."""
    pair = ("qwen3-8b-rag-zipf-none", "qwen3-8b-rag-zipf-cpu64k")
    for name in pair:
        shutil.copytree(MATRIX / name, tmp_path / name)
        rep = tmp_path / name.replace("-none", "-none-rep").replace("-cpu64k", "-cpu64k-rep")
        shutil.copytree(MATRIX / name, rep)
        meta = json.loads((rep / "meta.json").read_text())
        meta["traffic"]["t_traffic_start"] += 86_400.0  # a day later, on another machine
        (rep / "meta.json").write_text(json.dumps(meta))

    def faster(row: dict[str, Any]) -> None:
        if row.get("ttft_s") is not None:
            row["ttft_s"] *= 0.8

    _rewrite_requests(tmp_path / "qwen3-8b-rag-zipf-cpu64k-rep", faster)
    evals = {e.run: e for e in evaluate(tmp_path)}
    assert {run: e.truth for run, e in evals.items()} == {
        "qwen3-8b-rag-zipf-none": "costs",
        "qwen3-8b-rag-zipf-cpu64k": "costs",
        "qwen3-8b-rag-zipf-none-rep": "pays",
        "qwen3-8b-rag-zipf-cpu64k-rep": "pays",
    }
    # Each run without offload predicts what enabling measured on its own machine.
    for run, measured in (("none", "costs"), ("none-rep", "pays")):
        (p,) = evals[f"qwen3-8b-rag-zipf-{run}"].predictions
        assert (p.measured > 0) == (measured == "pays")


def test_judging_follows_the_definition() -> None:
    assert _judge("enable_offload", "pays", True) == (True, False)
    assert _judge("enable_offload", "costs", True) == (False, True)
    assert _judge("keep", "costs", True) == (False, True)
    assert _judge("disable_offload", "pays", True) == (False, True)
    assert _judge("disable_offload", "neutral", True) == (True, False)
    assert _judge("no_action", "costs", True) == (True, False)
    assert _judge("insufficient_data", "costs", True) == (False, False)
    assert _judge("enable_offload", "costs", False) == (False, False)  # unverified size


def test_labels_come_from_the_measured_latencies(tmp_path: Path) -> None:
    """The same recordings with the offload run's TTFTs cut by a fifth: the pair's label
    turns to pays, whatever the shape or workload."""
    pair = ("qwen3-8b-rag-zipf-none", "qwen3-8b-rag-zipf-cpu64k")
    for name in pair:
        shutil.copytree(MATRIX / name, tmp_path / name)
    path = tmp_path / pair[1] / "requests.jsonl.xz"
    with lzma.open(path, "rt") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    for row in rows:
        if row.get("ttft_s") is not None:
            row["ttft_s"] *= 0.8
    with lzma.open(path, "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    truths = {e.run: e.truth for e in evaluate(tmp_path)}
    assert truths == {pair[0]: "pays", pair[1]: "pays"}


def _rewrite_requests(run: Path, change) -> None:  # type: ignore[no-untyped-def]
    path = run / "requests.jsonl.xz"
    with lzma.open(path, "rt") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    for row in rows:
        change(row)
    with lzma.open(path, "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def test_two_runs_of_the_same_work_set_the_band_a_change_must_exceed(tmp_path: Path) -> None:
    """An offload run recorded twice on one machine, the same cached tokens per request and
    TTFTs 10 % apart: that difference is the machine's, so the family's pair needs a change
    larger than it. The 9 GiB run's +3.1 % turns from costs to neutral; a twin that did other
    work (different cached tokens) or ran on another day sets no band."""
    pair = ("qwen3-8b-rag-zipf-none", "qwen3-8b-rag-zipf-cpu64k")
    for name in pair:
        shutil.copytree(MATRIX / name, tmp_path / name)
    before = {e.run: e for e in evaluate(tmp_path)}
    assert before[pair[1]].truth == "costs" and before[pair[1]].threshold == 0.03

    twin = tmp_path / "qwen3-8b-rag-zipf-cpu64k-twin"
    shutil.copytree(tmp_path / pair[1], twin)
    meta = json.loads((twin / "meta.json").read_text())
    meta["traffic"]["t_traffic_start"] += 400.0
    meta["offload"]["size_gib"] = 27.0
    (twin / "meta.json").write_text(json.dumps(meta))
    _rewrite_requests(
        twin, lambda r: r.update(ttft_s=r["ttft_s"] * 1.1) if r.get("ttft_s") else None
    )
    records = {p.name: _requests(p) for p in tmp_path.iterdir()}
    metas = {p.name: json.loads((p / "meta.json").read_text()) for p in tmp_path.iterdir()}
    noise = matrixkit.family_noise(metas, records)
    (band,) = noise.values()
    assert band["relative_difference"] == pytest.approx(0.1, abs=1e-3)
    after = {e.run: e for e in evaluate(tmp_path)}
    assert after[pair[1]].threshold == pytest.approx(0.1, abs=1e-3)
    assert after[pair[1]].truth == "neutral" and after[pair[1]].truth_3pct == "costs"

    # Other work: one request in ten computed its whole prompt (no cached tokens).
    _rewrite_requests(twin, lambda r: r.update(cached_tokens=0) if r["i"] % 10 == 0 else None)
    metas = {p.name: json.loads((p / "meta.json").read_text()) for p in tmp_path.iterdir()}
    records = {p.name: _requests(p) for p in tmp_path.iterdir()}
    assert matrixkit.family_noise(metas, records) == {}
    assert {e.run: e.truth for e in evaluate(tmp_path)}[pair[1]] == "costs"
