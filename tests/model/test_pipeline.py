"""exporter/model/pipeline.py: the order of one cycle and the state kept between cycles."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from exporter.model import pipeline
from exporter.model.advisor.types import Action, Advice, AdvisorInput, MemoryState, Reason
from exporter.model.derive.engines import CostBefore, DeriveSettings
from exporter.model.derive.fits import PrefillFit
from exporter.model.inputs import CycleInputs, TargetInputs
from exporter.model.pipeline import CycleResult, Pipeline, forget, memory_for
from exporter.model.whatif.engine import POLICY_COMBOS, StreamItemLike
from exporter.model.whatif.simulator import blocks_for_bytes
from exporter.vllm_metrics import EngineKey, EngineSample, TargetSample
from exporter.window import TargetWindow
from tests.model.advisor.common import base
from tests.model.whatif.common import Item, stored

EK = EngineKey("m", "0")
KV_BYTES_PER_TOKEN = 114_688.0
PER_BLOCK = 16 * int(KV_BYTES_PER_TOKEN)
SETTINGS = DeriveSettings(stale_after=30.0, kv_bytes_per_token=KV_BYTES_PER_TOKEN)
CACHE = {"0": {"block_size": "16"}}
GIB = 1 << 30


class Target:
    """One target's window, grown cycle by cycle (cumulative prompt tokens of engine EK)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.window = TargetWindow(3600.0)

    def at(
        self, t: float, prompt: float, kv: Sequence[StreamItemLike] | None = None
    ) -> TargetInputs:
        sample = EngineSample(counters={"prompt_tokens": prompt}, gauges={"kv_usage": 0.95})
        self.window.add(TargetSample(t, {EK: sample}, CACHE))
        return TargetInputs(self.label, self.window, SETTINGS, kv_items=kv)


def batches(*ts: float, first: int = 1) -> list[Item]:
    """One 16-token block stored per batch (a chain), from DP rank 0."""
    return [
        Item(0, stored(t, first + i, parent=first + i - 1 if i else None)) for i, t in enumerate(ts)
    ]


class Recommending:
    """An advisor that always recommends enabling offload at `size`, and keeps its inputs."""

    def __init__(self, size: float) -> None:
        self.size = size
        self.inputs: list[AdvisorInput] = []

    def update(self, target: str, inp: AdvisorInput, now: float | None = None) -> Advice:
        self.inputs.append(inp)
        return Advice(Action.ENABLE_OFFLOAD, Reason.RECOMPUTE_AFTER_EVICTION, "x", self.size)

    def forget_missing(self, present: set[tuple[str, EngineKey]]) -> None:
        pass


def test_pipeline_steps_the_kv_events_before_it_derives(monkeypatch) -> None:
    pipe = Pipeline()
    seen: list[int | None] = []
    real = pipeline.derive_target

    def spy(
        win: TargetWindow,
        now: float,
        settings: DeriveSettings,
        before: Mapping[EngineKey, CostBefore] | None,
    ):
        w = pipe.simulation("t")
        seen.append(None if w is None else w.processed)
        return real(win, now, settings, before)

    monkeypatch.setattr(pipeline, "derive_target", spy)
    t = Target("t")
    t.at(0.0, 0.0)
    first = pipe.step(CycleInputs(10.0, (t.at(10.0, 1000.0, batches(1.0, 2.0, 3.0)),)))
    second = pipe.step(CycleInputs(20.0, (t.at(20.0, 3000.0, batches(11.0, 12.0, first=4)),)))
    assert seen == [3, 5]  # every item of the cycle simulated when the derivations run
    assert first.targets[0].simulation is not None
    assert first.targets[0].simulation[0].batches == 3  # this cycle's events, this cycle
    assert second.targets[0].simulation is not None
    assert second.targets[0].simulation[0].batches == 5


def test_pipeline_target_without_kv_events_gets_no_simulation() -> None:
    pipe = Pipeline()
    quiet, silent = Target("quiet"), Target("silent")
    quiet.at(0.0, 0.0)
    silent.at(0.0, 0.0)
    result = pipe.step(CycleInputs(10.0, (quiet.at(10.0, 1000.0, ()), silent.at(10.0, 1000.0))))
    assert pipe.simulation("silent") is None
    assert pipe.simulation("quiet") is not None  # a consumer that received nothing yet
    by_label = {t.label: t for t in result.targets}
    assert by_label["silent"].simulation is None
    assert by_label["quiet"].simulation == {}
    (e,) = by_label["silent"].engines
    assert e.whatif is None and e.policies == ()
    assert e.derived.key == EK and e.advice.action == Action.INSUFFICIENT_DATA  # still advised


def test_pipeline_recommendation_of_one_cycle_sizes_the_next_cycles_policy_comparison() -> None:
    size = 0.25 * GIB
    pipe = Pipeline()
    advisor = Recommending(size)
    pipe.advisor = advisor  # type: ignore[assignment]
    t = Target("t")
    t.at(0.0, 0.0)
    r1 = pipe.step(CycleInputs(10.0, (t.at(10.0, 1000.0, batches(1.0, 2.0, 9.0)),)))
    sim = pipe.simulation("t")
    assert sim is not None
    planned = sim.planned(0)
    assert planned is not None
    assert planned.policy_blocks == blocks_for_bytes(int(size), PER_BLOCK)
    # Cycle k: recommended only now, so nothing was simulated at that size yet.
    assert r1.targets[0].simulation is not None
    assert r1.targets[0].simulation[0].policy_blocks is None
    assert advisor.inputs[0].policy_alternatives == ()
    assert r1.targets[0].engines[0].policies == ()
    # Cycle k+1: the planned size is applied before its events, and the advisor compares.
    r2 = pipe.step(CycleInputs(20.0, (t.at(20.0, 3000.0, batches(11.0, 12.0, first=4)),)))
    assert r2.targets[0].simulation is not None
    assert r2.targets[0].simulation[0].policy_blocks == planned.policy_blocks
    points = advisor.inputs[1].policy_alternatives
    assert [(p.policy, p.store_threshold) for p in points] == list(POLICY_COMBOS)
    assert all(p.cpu_buffer_bytes == size and not p.configured for p in points)
    assert r2.targets[0].engines[0].policies == points


def test_pipeline_forgets_engines_that_disappear() -> None:
    pipe = Pipeline(confirm=3)
    presents: list[set[tuple[str, EngineKey]]] = []
    forget_missing = pipe.advisor.forget_missing

    def spy(present: set[tuple[str, EngineKey]]) -> None:
        presents.append(set(present))
        forget_missing(present)

    pipe.advisor.forget_missing = spy  # type: ignore[method-assign]
    a, b = Target("a"), Target("b")
    a.at(0.0, 0.0)
    b.at(0.0, 0.0)
    first = pipe.step(CycleInputs(10.0, (a.at(10.0, 1000.0), b.at(10.0, 1000.0))))
    assert set(first.advice()) == {"a", "b"}
    second = pipe.step(CycleInputs(20.0, (a.at(20.0, 2000.0),)))
    assert presents == [{("a", EK), ("b", EK)}, {("a", EK)}]
    assert ("b", EK) not in pipe.advisor._current
    assert set(pipe._recommended) == {("a", EK)}
    assert list(second.derived()) == ["a"]
    ((key, advice),) = second.advice()["a"]
    assert key == EK and advice == second.targets[0].engines[0].advice


def test_pipeline_keeps_what_an_engine_measured_with_offload_off_across_its_restart() -> None:
    """Enabling offload restarts vLLM: the engine is gone for a few cycles and comes back with
    offload on. The cost of a computed token it measured before stays (the offload fit needs
    it where every request loads); only a bound on targets ever seen drops the oldest."""
    pipe = Pipeline(confirm=3)
    fit = CostBefore(PrefillFit(0.02, 300e-6, 40, 0.9, 5e-6), 147_456.0)
    pipe.remember_before("a", {EK: fit})
    a = Target("a")
    a.at(0.0, 0.0)
    pipe.step(CycleInputs(10.0, ()))  # vLLM restarting: no target answered
    assert pipe.before("a") == {EK: fit}
    pipe.step(CycleInputs(20.0, (a.at(20.0, 1000.0),)))
    assert pipe.before("a") == {EK: fit}
    for i in range(pipeline.MAX_REMEMBERED - 1):
        pipe.remember_before(f"t{i}", {EK: fit})
    pipe.remember_before("a", {})  # nothing new: "a" is not refreshed
    assert pipe.before("a") == {EK: fit}
    pipe.remember_before("newest", {EK: fit})
    assert pipe.before("a") == {} and pipe.before("newest") == {EK: fit}


def test_memory_for_adds_the_measured_pool_to_buffer_ratio() -> None:
    d = base(offload_enabled=True, offload_buffer_bytes=0.5 * GIB)
    mem = MemoryState(limit_bytes=16 * GIB, usage_bytes=8 * GIB, pool_bytes=0.875 * GIB)
    got = memory_for(d, mem)
    assert got is not None and got.pool_to_buffer_ratio == pytest.approx(1.75)
    assert got.limit_bytes == 16 * GIB and got.pool_bytes == 0.875 * GIB
    no_pool = MemoryState(16 * GIB, 8 * GIB, None)
    assert memory_for(d, no_pool) is no_pool
    assert memory_for(base(), mem) is mem  # no offload buffer: no ratio
    assert memory_for(d, None) is None


def test_forget_drops_the_named_targets_from_a_result() -> None:
    pipe = Pipeline()
    a, b = Target("a"), Target("b")
    a.at(0.0, 0.0)
    b.at(0.0, 0.0)
    result = pipe.step(CycleInputs(10.0, (a.at(10.0, 100.0), b.at(10.0, 100.0))))
    kept = forget(result, ["b"])
    assert isinstance(kept, CycleResult) and kept.now == 10.0
    assert [t.label for t in kept.targets] == ["a"]
    assert [t.label for t in result.targets] == ["a", "b"]  # the original is unchanged
