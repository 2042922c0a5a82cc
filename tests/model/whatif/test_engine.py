"""exporter/model/whatif/engine.py: the per-engine simulation state and the WhatIf stepper
(configuration timing, routing by DP rank, restarts, buckets)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench.whatif_vs_observed import observed, windowed_hits
from exporter.kvevents_codec import Message, decode_batch
from exporter.model.whatif.engine import (
    POLICY_COMBOS,
    Bucket,
    EngineSim,
    PolicyBucket,
    SimConfig,
    WhatIf,
    WhatIfSettings,
)
from exporter.model.whatif.simulator import blocks_for_bytes
from tests.helpers import CHUNK, GIB, GPU, gpu_events
from tests.model.whatif.common import Item, stored


def test_simulation_coverage_starts_after_the_last_unsimulated_batch() -> None:
    def batch(ts: float, h: int) -> Message:
        payload = [ts, [{"type": "BlockStored", "block_hashes": [h], "block_size": 16}], 0]
        return Message("kv", int(ts), decode_batch(payload), payload)

    late = EngineSim(0, WhatIfSettings())
    late.process(batch(10.0, 1))  # seen before the bytes per block were known
    late.configure(SimConfig((4,), None))
    late.process(batch(20.0, 2))
    assert late.sim_start == pytest.approx(10.0)
    early = EngineSim(0, WhatIfSettings())
    early.configure(SimConfig((4,), None))
    early.process(batch(5.0, 1))
    assert early.sim_start == 5.0


def test_configure_is_applied_by_the_next_step_before_its_items_last_one_wins() -> None:
    w = WhatIf(WhatIfSettings(sizes_bytes=(1, 2)))
    a, b = SimConfig((4, 8), None), SimConfig((5, 9), None)
    assert w.configure(0, a) and w.configure(0, b)
    assert not w.configure(0, b)  # the same as the last one planned: nothing to do
    assert w.planned(0) == b and w.engines == {} and w.snapshots() == {}
    w.step([Item(0, stored(1.0, 1))])
    assert w.engines[0].config == b
    snap = w.snapshots()[0]
    assert snap.capacities == (5, 9) and snap.sim_start == 1.0 and snap.batches == 1
    # planned during this cycle, applied before the next cycle's items
    c = SimConfig((6, 10), None)
    assert w.configure(0, c)
    assert w.snapshots()[0].capacities == (5, 9)
    w.step([Item(0, stored(2.0, 2, parent=1))])
    assert w.snapshots()[0].capacities == (6, 10)
    assert w.snapshots()[0].sim_start == pytest.approx(1.0 + 1e-6)


def test_a_config_alone_creates_the_engine_at_the_next_step() -> None:
    w = WhatIf(WhatIfSettings())
    w.configure(3, SimConfig((4,), None))
    w.step([])
    snap = w.snapshots()[3]
    assert snap.batches == 0 and snap.capacities == (4,) and snap.sim_start is None


def test_step_routes_by_the_batch_dp_rank_and_restarts_one_stream() -> None:
    w = WhatIf(WhatIfSettings())
    w.step(
        [
            Item(0, stored(1.0, 1, dp_rank=None)),  # no rank in the batch: the stream's
            Item(0, stored(1.0, 2, dp_rank=1)),  # one SUB for every rank (a proxy)
            Item(1, stored(1.1, 3, dp_rank=1)),
        ]
    )
    assert {r: e.builder.gpu_resident for r, e in w.engines.items()} == {0: 1, 1: 2}
    assert w.processed == 3
    w.step([Item(1, None), Item(1, stored(2.0, 9, dp_rank=1))])
    assert {r: e.builder.gpu_resident for r, e in w.engines.items()} == {0: 1, 1: 1}
    assert w.snapshots()[1].batches == 3  # counted across the restart


def test_restart_starts_every_simulator_cold_with_the_same_config() -> None:
    w = WhatIf(WhatIfSettings())
    cfg = SimConfig((4,), 4, policy_blocks=4)
    w.configure(0, cfg)
    w.step([Item(0, stored(1.0, 1, 2))])
    before = w.engines[0].model
    w.step([Item(0, None)])
    e = w.engines[0]
    assert e.config == cfg and e.model is not before and e.builder.gpu_resident == 0
    assert e.sim_start == pytest.approx(1.0 + 1e-6) and len(e.policy_sims) == len(POLICY_COMBOS)


def test_only_the_policy_size_moved_keeps_the_curve_and_its_history() -> None:
    e = EngineSim(0, WhatIfSettings())
    cfg = SimConfig((4,), None, policy_blocks=4)
    e.configure(cfg)
    e.process(stored(1.0, 1))
    model = e.model
    e.configure(dataclasses.replace(cfg, policy_blocks=8))
    snap = e.snapshot()
    assert e.model is model and snap.sim_start == 1.0 and len(snap.buckets) == 1
    assert snap.policy_buckets == () and snap.policy_blocks == 8
    assert snap.policy_start == pytest.approx(1.0 + 1e-6)
    e.configure(dataclasses.replace(cfg, policy_blocks=None))
    assert e.snapshot().policy_blocks is None and e.policy_sims == []


def test_buckets_are_typed_bounded_and_split_on_a_new_width() -> None:
    e = EngineSim(0, WhatIfSettings(bucket_seconds=0.5, history_seconds=4.0))  # 8 buckets
    e.process(stored(0.1, 1))  # before any config: no hits columns
    e.configure(SimConfig((4, 8), None))
    e.process(stored(0.2, 2, parent=1))  # same start, new width: a second bucket
    e.process(stored(0.05, 3, parent=2))  # clock went back: folded into the newest
    snap = e.snapshot()
    assert [(b.start, len(b.hits)) for b in snap.buckets] == [(0.0, 0), (0.0, 2)]
    assert all(isinstance(b, Bucket) for b in snap.buckets)
    assert snap.buckets[1].stored_tokens == 32.0
    for i in range(20):
        e.process(stored(1.0 + i, 100 + i))
    starts = [b.start for b in e.snapshot().buckets]
    assert starts == [13.0 + i for i in range(7)] + [20.0]


def test_policy_buckets_hold_one_hit_count_per_combination() -> None:
    e = EngineSim(0, WhatIfSettings())
    e.configure(SimConfig((4,), None, policy_blocks=16))
    e.process(stored(1.0, 1, 2))
    (pb,) = e.snapshot().policy_buckets
    assert isinstance(pb, PolicyBucket) and pb.start == 1.0 and len(pb.hits) == len(POLICY_COMBOS)


def test_snapshots_are_frozen_and_refreshed_by_step_only() -> None:
    w = WhatIf(WhatIfSettings())
    w.step([Item(0, stored(1.0, 1))])
    first = w.snapshots()
    assert w.snapshots() is first
    with pytest.raises(dataclasses.FrozenInstanceError):
        first[0].batches = 5  # type: ignore[misc]
    w.step([Item(0, stored(2.0, 2, parent=1))])
    assert w.snapshots() is not first and w.snapshots()[0].batches == 2


# --- the policy simulators against the real ARC and threshold runs (H200, vLLM 0.26) ------


@pytest.fixture(scope="module")
def small_a_events() -> list[Message]:
    return gpu_events("small-a")


def _count_window(wl: str) -> tuple[float, float]:
    doc = json.loads((GPU / f"small-eager-{wl}" / "run.json").read_text())
    (nooffload,) = [r for r in doc["runs"] if r["dir"] == "nooffload"]
    return float(nooffload["count"][0]), float(nooffload["count"][1])


@pytest.mark.parametrize("wl", ["W1", "W2"])
@pytest.mark.parametrize(
    ("run", "size", "combo"),
    [
        ("offload-0.25GiB-arc", 0.25, ("arc", 0)),
        ("offload-0.5GiB-thr2", 0.5, ("lru", 2)),
        ("offload-0.25GiB", 0.25, ("lru", 0)),
        ("offload-0.5GiB", 0.5, ("lru", 0)),
    ],
)
def test_policy_whatif_predicts_the_real_arc_and_threshold_runs(
    small_a_events: list[Message], wl: str, run: str, size: float, combo: tuple[str, int]
) -> None:
    """The exporter's policy simulators on the no-offload events vs the offload runs' own
    external_kv_transfer share (the prompts are identical: fixed seeds)."""
    blocks = blocks_for_bytes(int(size * GIB), CHUNK)
    sim = EngineSim(0, WhatIfSettings(sizes_bytes=(int(size * GIB),)))
    sim.configure(SimConfig((blocks,), None, policy_blocks=blocks))
    for msg in small_a_events:
        sim.process(msg)
    t0, t1 = _count_window(wl)
    i = POLICY_COMBOS.index(combo)
    hits = sum(b.hits[i] for b in sim.snapshot().policy_buckets if t0 <= b.start < t1)
    ext, prompt = observed(GPU / f"small-eager-{wl}" / run)
    assert abs(hits / prompt - ext / prompt) <= 0.01, (hits / prompt, ext / prompt)
    # and the same hits as the offline what-if's own replay of the same window
    (offline,) = windowed_hits(
        small_a_events, [blocks], (t0, t1), policy=combo[0], store_threshold=combo[1]
    )
    assert hits == offline


def test_batches_missing_from_the_sequence_are_counted_lost_per_bucket() -> None:
    def at(seq: int, ts: float, h: int) -> Item:
        payload = [ts, [{"type": "BlockStored", "block_hashes": [h], "block_size": 16}], 0]
        return Item(0, Message("kv", seq, decode_batch(payload), payload))

    w = WhatIf(WhatIfSettings(bucket_seconds=1.0))
    w.configure(0, SimConfig((4,), None))
    # 3 and 4 never arrived; then a new publisher counts from 0 again, which loses nothing.
    w.step([at(0, 1.0, 1), at(1, 1.2, 2), at(2, 1.4, 3), at(5, 2.1, 4), Item(0, None)])
    w.step([at(0, 3.0, 5), at(1, 3.1, 6), at(-1, 3.2, 7), at(-1, 3.3, 8)])  # -1: no number
    got = [(b.start, b.batches, b.lost_batches) for b in w.snapshots()[0].buckets]
    assert got == [(1.0, 3, 0), (2.0, 1, 2), (3.0, 4, 0)]
