"""Evidence vLLM does not export, rebuilt from the KV events (TraceBuilder, issue 16):
stores the CPU tier drops unused, and how far back returning blocks were computed."""

from __future__ import annotations

import math

from exporter.kvevents_codec import BlockRemoved, BlockStored, EventBatch
from exporter.model.whatif.simulator import (
    REUSE_GAP_BLOCK_EDGES,
    REUSE_GAP_SECOND_EDGES,
    TraceBuilder,
    bucket_quantile,
)

BS = 16


def gpu(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, BS, "GPU", 0, BS * len(hashes))


def cpu(*hashes: int) -> BlockStored:
    # vLLM's CPU-tier placeholder: no parent, no tokens, block size 0.
    return BlockStored(tuple(hashes), None, 0, "CPU", 0, 0)


def gone(*hashes: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(tuple(hashes), medium, 0)


def feed(tb: TraceBuilder, *steps: tuple[float, tuple[object, ...]]) -> None:
    for seq, (ts, events) in enumerate(steps):
        tb.process(EventBatch(ts, events, None), seq)  # type: ignore[arg-type]


def test_a_chunk_dropped_unloaded_is_a_wasted_store_and_a_loaded_one_is_not() -> None:
    tb = TraceBuilder()
    feed(
        tb,
        (1.0, (gpu(1, 2), cpu(1, 2))),  # prompt computed and offloaded
        (2.0, (gone(1, 2),)),  # evicted from the GPU
        (3.0, (gpu(1),)),  # block 1 returns: the CPU tier holds it, so it was loaded
        (4.0, (gone(1, 2, medium="CPU"),)),  # the tier drops both
    )
    st = tb.stats
    assert (st.cpu_stored, st.cpu_removed, st.loaded_blocks) == (2, 2, 1)
    assert st.wasted == 1 and st.wasted_tokens == BS  # block 2 never came back
    # A chunk stored before the stream was joined has no history: not counted.
    feed(tb, (5.0, (gone(99, medium="CPU"),)))
    assert (st.cpu_removed, st.wasted) == (2, 1)


def test_reuse_gap_counts_the_blocks_computed_since_and_the_seconds_since_eviction() -> None:
    tb = TraceBuilder()
    feed(
        tb,
        (10.0, (gpu(1),)),  # computed: 1 store so far
        (11.0, (gpu(2, 3, 4),)),  # 3 more computed
        (12.0, (gone(1),)),  # 1 evicted at t=12
        (20.0, (gpu(5, 6, 7, 8),)),  # 4 more computed
        (20.5, (gpu(1),)),  # 1 returns, recomputed (no CPU tier): 8.5 s after eviction
    )
    st = tb.stats
    assert st.recomputed_blocks == 1
    # Stores between its computation (after 1 store) and its return (9 stores): 8, which
    # falls in the bucket whose upper edge is 8.
    assert bucket_quantile(REUSE_GAP_BLOCK_EDGES, st.reuse_gap_blocks.counts, 0.5) == 8.0
    assert bucket_quantile(REUSE_GAP_SECOND_EDGES, st.reuse_gap_seconds.counts, 0.5) == (
        min(e for e in REUSE_GAP_SECOND_EDGES if e >= 8.5)
    )
    assert tb.block_size == BS


def test_bucket_quantile_is_an_upper_bound_and_none_without_observations() -> None:
    edges = (1.0, 2.0, 4.0)
    assert bucket_quantile(edges, [0, 0, 0, 0], 0.5) is None
    assert bucket_quantile(edges, [1, 1, 1, 1], 0.5) == 2.0
    assert bucket_quantile(edges, [1, 1, 1, 1], 0.9) == math.inf  # past the last edge
    assert bucket_quantile(edges, [0, 4, 0, 0], 0.1) == 2.0
