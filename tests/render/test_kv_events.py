"""exporter/render/kv_events.py: the KV-event families of one source snapshot and the
simulation's engine snapshots."""

from __future__ import annotations

from exporter.model.whatif.engine import EngineSnapshot
from exporter.render.kv_events import kv_events_families
from exporter.sources.kv_events.source import KvEventsSnapshot, StreamStats
from exporter.vllm_metrics import EngineKey

NAMES = [
    "kvoffload_kv_events_dropped_total",
    "kvoffload_kv_event_queue_depth",
    "kvoffload_kv_event_gaps_total",
    "kvoffload_kv_events_replayed_total",
    "kvoffload_kv_events_lost_total",
    "kvoffload_kv_event_publisher_restarts_total",
    "kvoffload_kv_events_total",
    "kvoffload_kv_event_batches_total",
    "kvoffload_kv_resident_blocks",
    "kvoffload_recomputed_after_eviction_tokens_total",
    "kvoffload_whatif_tracked_blocks",
    "kvoffload_offload_wasted_stores_total",
    "kvoffload_offload_wasted_store_bytes_total",
    "kvoffload_offload_wasted_store_ratio",
    "kvoffload_reuse_gap_bytes",
    "kvoffload_reuse_gap_seconds",
]


def engine(rank: int, capacities: tuple[int, ...] | None) -> EngineSnapshot:
    return EngineSnapshot(
        rank=rank,
        events={("BlockStored", "GPU"): 3, ("BlockRemoved", "GPU"): 1},
        batches=4,
        gpu_resident=2,
        cpu_resident=0,
        recomputed_tokens=32,
        stored_tokens=48,
        tracked_blocks=7,
        capacities=capacities,
        configured_blocks=None,
        sim_start=None,
        buckets=(),
    )


def series(fams: list) -> dict[str, list[tuple[tuple[str, ...], float]]]:
    """The families that have samples, by name (an empty family is never exposed)."""
    return {f.definition.name: list(f.samples) for f in fams if len(f)}


def test_no_snapshot_no_engines_gives_empty_families_in_order() -> None:
    fams = kv_events_families("t", None, [], {})
    assert [f.definition.name for f in fams] == NAMES
    assert all(len(f) == 0 for f in fams)


def test_transport_counters_by_rank_and_engines_with_scraped_labels() -> None:
    snap = KvEventsSnapshot(
        streams={1: StreamStats(9, 1, 2, 3, 4), 0: StreamStats(5, 0, 0, 0, 1)},
        dropped=6,
        queue_depth=2,
        bad_frames=0,
        bad_payloads=0,
        decoded=14,
        items=(),
    )
    keys = [EngineKey("m", "0"), EngineKey("other", "0"), EngineKey("m", "1")]
    engines = {1: engine(1, None), 0: engine(0, (4,)), 5: engine(5, (4,))}  # 5: never scraped
    s = series(kv_events_families("t", snap, keys, engines))
    assert s["kvoffload_kv_events_dropped_total"] == [(("t",), 6)]
    assert s["kvoffload_kv_event_queue_depth"] == [(("t",), 2)]
    assert s["kvoffload_kv_event_gaps_total"] == [(("t", "0"), 0), (("t", "1"), 1)]
    assert s["kvoffload_kv_events_replayed_total"] == [(("t", "0"), 0), (("t", "1"), 2)]
    assert s["kvoffload_kv_events_lost_total"] == [(("t", "0"), 0), (("t", "1"), 3)]
    assert s["kvoffload_kv_event_publisher_restarts_total"] == [(("t", "0"), 1), (("t", "1"), 4)]
    assert s["kvoffload_kv_events_total"] == [
        (("t", "m", "0", "BlockRemoved", "GPU"), 1),
        (("t", "m", "0", "BlockStored", "GPU"), 3),
        (("t", "m", "1", "BlockRemoved", "GPU"), 1),
        (("t", "m", "1", "BlockStored", "GPU"), 3),
    ]
    assert s["kvoffload_kv_event_batches_total"] == [(("t", "m", "0"), 4), (("t", "m", "1"), 4)]
    assert s["kvoffload_kv_resident_blocks"][:2] == [
        (("t", "m", "0", "GPU"), 2),
        (("t", "m", "0", "CPU"), 0),
    ]
    assert s["kvoffload_recomputed_after_eviction_tokens_total"][0] == (("t", "m", "0"), 32)
    # tracked blocks only where a curve is simulated
    assert s["kvoffload_whatif_tracked_blocks"] == [(("t", "m", "0"), 7)]


def test_evidence_families_need_cpu_events_and_known_bytes() -> None:
    from dataclasses import replace

    from exporter.model.whatif.simulator import REUSE_GAP_BLOCK_EDGES, REUSE_GAP_SECOND_EDGES

    gaps_blocks = [0] * (len(REUSE_GAP_BLOCK_EDGES) + 1)
    gaps_blocks[3] = 4  # four returns within 8 blocks computed
    gaps_seconds = [0] * (len(REUSE_GAP_SECOND_EDGES) + 1)
    gaps_seconds[5] = 4  # within 3.2 s of their eviction
    es = replace(
        engine(0, (10,)),
        cpu_stored=10,
        cpu_removed=4,
        wasted_stores=3,
        wasted_store_tokens=48,
        reuse_gap_blocks=tuple(gaps_blocks),
        reuse_gap_seconds=tuple(gaps_seconds),
        block_size=16,
    )
    key = EngineKey("m", "0")
    labels = ("t", "m", "0")
    got = series(kv_events_families("t", None, [key], {0: es}, {key: 1000.0}))
    assert got["kvoffload_offload_wasted_stores_total"] == [(labels, 3)]
    assert got["kvoffload_offload_wasted_store_bytes_total"] == [(labels, 48_000)]
    assert got["kvoffload_offload_wasted_store_ratio"] == [(labels, 0.75)]
    assert got["kvoffload_reuse_gap_bytes"] == [
        ((*labels, "0.5"), 8 * 16 * 1000.0),
        ((*labels, "0.9"), 8 * 16 * 1000.0),
    ]
    assert [v for _, v in got["kvoffload_reuse_gap_seconds"]] == [3.2, 3.2]
    # Without the KV bytes per token: counts and seconds, no bytes.
    got = series(kv_events_families("t", None, [key], {0: es}))
    assert "kvoffload_offload_wasted_store_bytes_total" not in got
    assert "kvoffload_reuse_gap_bytes" not in got
    assert got["kvoffload_offload_wasted_stores_total"] == [(labels, 3)]
    # No CPU tier (offload off): no wasted-store series at all, not zeros.
    got = series(kv_events_families("t", None, [key], {0: engine(0, (10,))}, {key: 1000.0}))
    assert not any(name.startswith("kvoffload_offload_wasted") for name in got)
