"""KV-event families: transport counters of the streams and the per-engine event counts,
resident blocks and recomputation the simulation rebuilt."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from exporter.catalogue import Family
from exporter.model.whatif.engine import EngineSnapshot
from exporter.model.whatif.simulator import (
    REUSE_GAP_BLOCK_EDGES,
    REUSE_GAP_SECOND_EDGES,
    bucket_quantile,
)
from exporter.sources.kv_events.source import KvEventsSnapshot
from exporter.vllm_metrics import EngineKey

# The gap that covers this share of the returns (promtool reserves `quantile` for summaries).
REUSE_GAP_SHARES = (0.5, 0.9)


def kv_events_families(
    target: str,
    snapshot: KvEventsSnapshot | None,
    engine_keys: Iterable[EngineKey],
    engines: Mapping[int, EngineSnapshot],
    kv_bytes_per_token: Mapping[EngineKey, float | None] | None = None,
) -> list[Family]:
    """`engine_keys`: the engines of the target's latest scrape (they give each DP rank its
    model_name; an engine not scraped yet gets no per-engine series). `engines`: the
    simulation state per DP rank (WhatIf.snapshots()). `kv_bytes_per_token`: per engine,
    to put bytes on token counts (absent: no byte series)."""
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
        *evidence_families(target, keys, engines, kv_bytes_per_token or {}),
    ]


def evidence_families(
    target: str,
    keys: Mapping[str, EngineKey],
    engines: Mapping[int, EngineSnapshot],
    kv_bytes_per_token: Mapping[EngineKey, float | None],
) -> list[Family]:
    """What the KV events show that vLLM does not export: stores the CPU tier dropped
    unused, and how far back the blocks that return after an eviction were computed."""
    wasted = Family("kvoffload_offload_wasted_stores_total")
    wasted_bytes = Family("kvoffload_offload_wasted_store_bytes_total")
    wasted_ratio = Family("kvoffload_offload_wasted_store_ratio")
    gap_bytes = Family("kvoffload_reuse_gap_bytes")
    gap_seconds = Family("kvoffload_reuse_gap_seconds")
    for rank, es in sorted(engines.items()):
        ek = keys.get(str(rank))
        if ek is None:
            continue
        labels = [target, ek.model_name, ek.engine]
        per_token = kv_bytes_per_token.get(ek)
        if es.cpu_stored:
            wasted.add(labels, es.wasted_stores)
            if per_token:
                wasted_bytes.add(labels, es.wasted_store_tokens * per_token)
        if es.cpu_removed:
            wasted_ratio.add(labels, es.wasted_stores / es.cpu_removed)
        for share in REUSE_GAP_SHARES:
            blocks = bucket_quantile(REUSE_GAP_BLOCK_EDGES, es.reuse_gap_blocks, share)
            if blocks is not None and per_token and es.block_size:
                gap_bytes.add([*labels, f"{share:g}"], blocks * es.block_size * per_token)
            seconds = bucket_quantile(REUSE_GAP_SECOND_EDGES, es.reuse_gap_seconds, share)
            if seconds is not None:
                gap_seconds.add([*labels, f"{share:g}"], seconds)
    return [wasted, wasted_bytes, wasted_ratio, gap_bytes, gap_seconds]
