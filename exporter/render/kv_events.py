"""KV-event families: transport counters of the streams and the per-engine event counts,
resident blocks and recomputation the simulation rebuilt."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from exporter.catalogue import Family
from exporter.model.whatif.engine import EngineSnapshot
from exporter.sources.kv_events.source import KvEventsSnapshot
from exporter.vllm_metrics import EngineKey


def kv_events_families(
    target: str,
    snapshot: KvEventsSnapshot | None,
    engine_keys: Iterable[EngineKey],
    engines: Mapping[int, EngineSnapshot],
) -> list[Family]:
    """`engine_keys`: the engines of the target's latest scrape (they give each DP rank its
    model_name; an engine not scraped yet gets no per-engine series). `engines`: the
    simulation state per DP rank (WhatIf.snapshots())."""
    dropped = Family("kvoffload_kv_events_dropped_total")
    depth = Family("kvoffload_kv_event_queue_depth")
    gaps = Family("kvoffload_kv_event_gaps_total")
    replayed = Family("kvoffload_kv_events_replayed_total")
    lost = Family("kvoffload_kv_events_lost_total")
    restarts = Family("kvoffload_kv_event_publisher_restarts_total")
    if snapshot is not None:
        dropped.add([target], snapshot.dropped)
        depth.add([target], snapshot.queue_depth)
        for rank, c in sorted(snapshot.streams.items()):
            gaps.add([target, str(rank)], c.gaps)
            replayed.add([target, str(rank)], c.replayed)
            lost.add([target, str(rank)], c.lost)
            restarts.add([target, str(rank)], c.restarts)
    keys: dict[str, EngineKey] = {}
    for ek in engine_keys:
        keys.setdefault(ek.engine, ek)
    events = Family("kvoffload_kv_events_total")
    batches = Family("kvoffload_kv_event_batches_total")
    resident = Family("kvoffload_kv_resident_blocks")
    recomputed = Family("kvoffload_recomputed_after_eviction_tokens_total")
    tracked = Family("kvoffload_whatif_tracked_blocks")
    for rank, es in sorted(engines.items()):
        key = keys.get(str(rank))
        if key is None:
            continue  # model_name unknown until the first scrape: no guessed labels
        labels = [target, key.model_name, key.engine]
        for (kind, medium), n in sorted(es.events.items()):
            events.add([*labels, kind, medium], n)
        batches.add(labels, es.batches)
        resident.add([*labels, "GPU"], es.gpu_resident)
        resident.add([*labels, "CPU"], es.cpu_resident)
        recomputed.add(labels, es.recomputed_tokens)
        if es.capacities is not None:
            tracked.add(labels, es.tracked_blocks)
    return [
        dropped,
        depth,
        gaps,
        replayed,
        lost,
        restarts,
        events,
        batches,
        resident,
        recomputed,
        tracked,
    ]
