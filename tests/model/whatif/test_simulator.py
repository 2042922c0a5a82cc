"""exporter/model/whatif/simulator.py: trace reconstruction, vLLM 0.26 CPU-tier semantics,
one-pass curve."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.kvevents_codec import Message, decode_batch, read_file
from exporter.model.whatif.simulator import (
    Access,
    PlainLru,
    Replay,
    StackModel,
    StackReference,
    TraceBuilder,
    VllmCpuTier,
    blocks_for_bytes,
    replay,
    ttft_saved_seconds_per_second,
)
from tests.test_whatif_synth import abcab_messages, shared_prefix_messages

FIXTURES = Path(__file__).parents[2] / "fixtures"
CPU_EVENTS = FIXTURES / "vllm-0.32.0-cpu" / "kv-events.jsonl"
H200 = FIXTURES / "vllm-0.26.0-h200"
H200_KV_BYTES_PER_BLOCK = 114_688 * 16  # 28 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes


def stored(hashes: list[int], parent: int | None, bs: int = 16, medium: str = "GPU") -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": [],
        "block_size": bs,
        "medium": medium,
        "group_idx": 0,
    }


def removed(hashes: list[int], medium: str = "GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}


def msg(seq: int, events: list[dict], ts: float | None = None) -> Message:
    payload = [1000.0 + seq if ts is None else ts, events, 0]
    return Message("kv", seq, decode_batch(payload), payload)


def access(keys: list[int], start: int = 0, req: int = 0, first: bool = True) -> Access:
    return Access(req, tuple(keys), start, first, 16, start * 16)


# --- trace reconstruction ----------------------------------------------------------------


def test_cpu_fixture_recomputed_after_eviction_is_the_request_pattern() -> None:
    r = Replay([], PlainLru)
    for m in read_file(CPU_EVENTS):
        r.feed(m)
    st_ = r.builders[0].stats
    # README ground truth: A's 12 full blocks are stored again after eviction in each of
    # the 5 batches; 20 stored events of 12 blocks each, 222 removals.
    assert st_.recomputed_blocks == 60
    assert st_.recomputed_tokens == 60 * 128
    assert st_.recomputing_requests == 5  # one load per batch's request A, had a tier held it
    assert st_.stored_blocks == 240
    assert st_.requests == 20
    assert st_.events == {("BlockStored", "GPU"): 20, ("BlockRemoved", "GPU"): 222}


def test_builder_rebuilds_gpu_hit_prefix_from_the_parent_chain() -> None:
    b = TraceBuilder()
    (a1,) = b.process(msg(0, [stored([1, 2, 3, 4], None)]).batch, 0)
    assert a1.first and a1.keys == (1, 2, 3, 4) and a1.start == 0
    # A request that hit 1, 2 on the GPU and computed 5, 6.
    (a2,) = b.process(msg(1, [stored([5, 6], 2)]).batch, 5)
    assert a2.first and a2.req != a1.req
    assert a2.keys == (1, 2, 5, 6) and a2.start == 2 and a2.computed_tokens == 32


def test_builder_tells_decode_blocks_and_chunked_prefill_apart() -> None:
    b = TraceBuilder()
    (a1,) = b.process(msg(0, [stored([1, 2, 3], None)]).batch, 0)
    # Next engine step extends the tail by several blocks: the same request's next chunk.
    (a2,) = b.process(msg(1, [stored([4, 5], 3)]).batch, 1)
    assert a2.req == a1.req and not a2.first and a2.start == 3
    # A single block on the tail later on: decode output, never offloaded.
    assert b.process(msg(9, [stored([6], 5)]).batch, 9) == []
    assert b.stats.decode_blocks == 1
    # A multi-block extension much later: a new turn of the conversation, a new request.
    (a3,) = b.process(msg(30, [stored([7, 8], 6)]).batch, 30)
    assert a3.first and a3.req != a1.req and a3.keys == (1, 2, 3, 4, 5, 6, 7, 8)


def test_builder_loads_from_the_cpu_tier_are_not_recomputes() -> None:
    b = TraceBuilder()
    b.process(msg(0, [stored([1, 2, 3], None), stored([1], None, bs=0, medium="CPU")]).batch, 0)
    b.process(msg(1, [removed([1, 2, 3])]).batch, 1)
    # Offload on: block 1 comes back from the CPU tier (stored in its own event), then
    # blocks 2 and 3 are computed in the same step.
    (a, c) = b.process(msg(2, [stored([1], None), stored([2, 3], 1)]).batch, 2)
    assert b.stats.loaded_blocks == 1 and b.stats.recomputed_blocks == 2
    assert a.first and not c.first and c.req == a.req  # one request, not a decode block
    # The same shape with a single computed block is still that request, not decode.
    b.process(msg(3, [removed([1, 2, 3])]).batch, 3)
    (_, d) = b.process(msg(4, [stored([1, 2], None), stored([3], 2)]).batch, 4)
    assert not d.first and b.stats.decode_blocks == 0


def test_builder_counts_resident_blocks_per_medium_and_clears() -> None:
    b = TraceBuilder()
    b.process(msg(0, [stored([1, 2], None), stored([1], None, bs=0, medium="CPU")]).batch, 0)
    assert (b.gpu_resident, b.cpu_resident) == (2, 1)
    b.process(msg(1, [removed([2]), removed([1], "CPU")]).batch, 1)
    assert (b.gpu_resident, b.cpu_resident) == (1, 0)
    b.process(msg(2, [{"type": "AllBlocksCleared"}]).batch, 2)
    assert b.gpu_resident == 0
    assert b.stats.events[("AllBlocksCleared", "none")] == 1


def test_builder_duplicate_hash_needs_two_removals() -> None:
    b = TraceBuilder()
    b.process(msg(0, [stored([1, 2], None)]).batch, 0)
    b.process(msg(1, [stored([2], 1)]).batch, 1)  # block-aligned prompt re-stores its last block
    b.process(msg(2, [removed([2])]).batch, 2)
    assert 2 in b.parent
    b.process(msg(3, [removed([2])]).batch, 3)
    assert 2 not in b.parent
    b.process(msg(4, [stored([2], 1)]).batch, 4)
    assert b.stats.recomputed_blocks == 1


def test_builder_unknown_parent_and_caps_stay_bounded() -> None:
    b = TraceBuilder(max_resident=10, max_evicted=4, max_open=3)
    (a,) = b.process(msg(0, [stored([5, 6], 99)]).batch, 0)
    assert a.keys == (5, 6) and b.stats.unknown_parent == 1
    for i in range(50):
        b.process(msg(i + 1, [stored([1000 + i, 2000 + i], None), removed([1000 + i])]).batch, i)
    assert len(b.parent) <= 10 and len(b.evicted) <= 4 and len(b.tails) <= 3
    assert b.stats.overflow > 0


def test_builder_parent_cycle_does_not_hang() -> None:
    b = TraceBuilder(max_chain=100)
    b.process(msg(0, [stored([1], 2), stored([2], 1)]).batch, 0)
    (a,) = b.process(msg(1, [stored([3, 4], 1)]).batch, 1)
    assert len(a.keys) <= 102


# --- vLLM 0.26 CPU tier ------------------------------------------------------------------


def run_tier(tier: VllmCpuTier, batches: list[list[Access]], gap: float = 1.0) -> list[float]:
    out = []
    t = max(tier._last_ts, 0.0)
    for accesses in batches:
        t += gap
        out.append(tier.process_batch(t, accesses)[0])
    return out


def drop(tier: VllmCpuTier, key: int) -> None:
    """Remove one idle block, as if evicted earlier."""
    tier.finish()
    del tier.status[key]
    del tier.lru[key]
    tier.n_evictable -= 1


def test_tier_lookup_is_contiguous_from_the_gpu_hit() -> None:
    tier = VllmCpuTier(100, seed=None)
    run_tier(tier, [[access([1, 2, 3, 4])]])
    drop(tier, 2)  # a hole in the middle
    hits = tier.process_batch(5.0, [access([1, 2, 3, 4], req=1)])[0]
    assert hits == 16  # only block 1: the lookup stops at the first miss
    # Starting after a GPU hit of 2 blocks, the lookup starts at block 3.
    assert tier.process_batch(9.0, [access([1, 2, 3, 4], start=2, req=2)])[0] == 32


def test_tier_touch_makes_the_first_block_most_recent() -> None:
    tier = VllmCpuTier(4, seed=None)
    run_tier(tier, [[access([1, 2, 3, 4])], [access([1, 2, 3, 4], start=4, req=1)]])
    # The second request hit everything on the GPU: no lookup, but a reverse touch.
    assert list(tier.lru) == [4, 3, 2, 1]
    run_tier(tier, [[access([9], req=2)]], gap=0.001)
    assert 4 not in tier.status and 1 in tier.status  # the tail is evicted first


def test_tier_stores_gpu_hit_blocks_it_lost_when_nothing_loaded() -> None:
    tier = VllmCpuTier(4, seed=None)
    run_tier(tier, [[access([1, 2])], [access([7, 8, 9, 10], req=1)]])
    assert 1 not in tier.status and 2 not in tier.status
    # GPU still holds 1, 2; the request computes 3. vLLM offers all its blocks.
    run_tier(tier, [[access([1, 2, 3], start=2, req=2)]])
    assert {1, 2, 3} <= set(tier.status)


def test_tier_skips_blocks_before_an_offload_hit() -> None:
    tier = VllmCpuTier(8, seed=None)
    run_tier(tier, [[access([1, 2, 3])]])
    drop(tier, 1)
    # GPU holds 1; the lookup from block 2 hits 2, 3; only blocks after the hit are offered.
    assert run_tier(tier, [[access([1, 2, 3, 4], start=1, req=1)]]) == [32]
    assert 1 not in tier.status and 4 in tier.status


def test_tier_request_larger_than_the_pool_stores_nothing() -> None:
    tier = VllmCpuTier(3, seed=None)
    assert run_tier(tier, [[access([1, 2, 3, 4])], [access([1, 2, 3, 4], req=1)]]) == [0, 0]
    # Each request fails, and the first fails again when offered once more a step later.
    assert tier.allocation_failures == 3 and not tier.status


def test_tier_store_threshold_counts_lookups_as_vllm_026_does() -> None:
    tier = VllmCpuTier(100, store_threshold=2, seed=None)
    # First sight: the lookup counts block 1 (the first miss) only; nothing is stored.
    run_tier(tier, [[access([1, 2, 3])]])
    assert not tier.status and tier.stores_skipped == 3
    # Second sight: block 1 has been looked up twice and is stored; 2 and 3 never were.
    run_tier(tier, [[access([1, 2, 3], req=1)]])
    assert set(tier.status) == {1}


def test_tier_store_in_flight_is_a_hit_and_not_evictable() -> None:
    tier = VllmCpuTier(2, seed=None, completion_lag=0.05)
    tier.process_batch(0.0, [access([1, 2])])
    assert tier.status == {1: -1, 2: -1}
    # The next engine step (10 ms later) cannot evict the copies still in flight.
    tier.process_batch(0.01, [access([5, 6], req=1)])
    assert tier.allocation_failures == 1
    assert tier.process_batch(0.02, [access([1, 2], req=2)]) == [32.0]
    # The failed store is offered again in the next step, once the copies have landed.
    assert set(tier.status) == {5, 6}


def test_tier_arc_keeps_reused_blocks_through_a_scan() -> None:
    def run(policy: str) -> float:
        tier = VllmCpuTier(8, policy=policy, seed=None)
        hot = [1, 2, 3, 4]
        ts = 0.0
        hits = 0.0
        for i in range(30):
            ts += 1
            hits += tier.process_batch(ts, [access(hot, req=2 * i)])[0]
            ts += 1
            scan = [1000 + 10 * i + j for j in range(5)]
            tier.process_batch(ts, [access(scan, req=2 * i + 1)])
        return hits

    assert run("arc") > run("lru")


def test_blocks_for_bytes_matches_the_h200_pool() -> None:
    # README: --kv-offloading-size 0.5 gave a CPU pool of 292 blocks of 1.75 MiB.
    assert blocks_for_bytes(1 << 29, H200_KV_BYTES_PER_BLOCK) == 292


def test_cpu_fixture_curve_tier_of_39_blocks_serves_every_recompute() -> None:
    msgs = list(read_file(CPU_EVENTS))
    curve = replay(msgs, [24, 35, 36, 39, 200], seeds=range(4))
    hits = [s.hit_tokens for s in curve.sizes]
    assert hits[2:] == [7680.0, 7680.0, 7680.0]
    assert hits[0] == 0.0  # A, B fill 24 blocks; C's store evicts all of A
    # 35 blocks: one of A's blocks goes, and the lookup stops there (set order decides where).
    assert 0 < hits[1] < 7680
    assert curve.stored_tokens == 30720 and curve.recomputed_after_eviction_tokens == 7680


def _observed_share(run: Path) -> tuple[float, float]:
    def counters(text: str) -> tuple[float, float]:
        ext = re.search(
            r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)',
            text,
            re.M,
        )
        total = re.search(r"^vllm:prompt_tokens_total\{[^}]*\} (\S+)", text, re.M)
        assert ext and total
        return float(ext.group(1)), float(total.group(1))

    e0, p0 = counters((run / "metrics_before.txt").read_text())
    e1, p1 = counters((run / "metrics_after.txt").read_text())
    return e1 - e0, p1 - p0


def test_h200_prediction_matches_the_observed_offload_share() -> None:
    """No-offload stream (rebuilt, checked against a_nooffload) -> b_offload's observed share."""
    external, prompt = _observed_share(H200 / "b_offload")
    assert (external, prompt) == (7360.0, 40000.0)
    msgs = abcab_messages()  # matches a_nooffload: 2005 stored blocks, 99-block GPU hits
    cap = blocks_for_bytes(1 << 29, H200_KV_BYTES_PER_BLOCK)
    curve = replay(msgs, [cap], seeds=range(8))
    predicted = curve.sizes[0].hit_tokens / prompt
    assert abs(predicted - external / prompt) <= 0.01
    assert curve.sizes[0].hit_tokens == 7360  # 5 x (16 on the GPU-hit re-send + 91 blocks)
    # A plain LRU over the GPU-miss stream misses it: it evicts A's head, not its tail.
    plain = replay(msgs, [cap], model="plain")
    assert abs(plain.sizes[0].hit_tokens / prompt - external / prompt) > 0.1


def test_h200_arc_prediction_differs_from_lru() -> None:
    # The GPU-hit re-send touches A while it is in the CPU tier: ARC promotes A to its
    # frequent list, so B and C evict each other instead of A.
    msgs = abcab_messages()
    lru = replay(msgs, [146], policy="lru").sizes[0].hit_tokens
    arc = replay(msgs, [146], policy="arc").sizes[0].hit_tokens
    assert lru == 80 and arc > 10 * lru


# --- one-pass stack model ----------------------------------------------------------------


def _random_batches(rnd: random.Random, n_batches: int) -> list[list[Access]]:
    chains = [[rnd.randrange(1, 1 << 40) for _ in range(rnd.randint(1, 12))] for _ in range(8)]
    out: list[list[Access]] = []
    req = 0
    open_reqs: list[tuple[int, list[int]]] = []
    for _ in range(n_batches):
        batch = []
        for _ in range(rnd.randint(0, 3)):
            if open_reqs and rnd.random() < 0.3:
                r, keys = open_reqs.pop()
                extra = [rnd.randrange(1, 1 << 40) for _ in range(rnd.randint(1, 3))]
                batch.append(Access(r, tuple(keys + extra), len(keys), False, 16, len(keys) * 16))
                continue
            chain = rnd.choice(chains)
            cut = rnd.randint(0, len(chain))
            keys = chain[:cut] + [rnd.randrange(1, 1 << 40) for _ in range(rnd.randint(0, 2))]
            start = rnd.randint(0, len(keys))
            batch.append(Access(req, tuple(keys), start, True, 16, start * 16))
            open_reqs.append((req, keys))
            req += 1
        out.append(batch)
    return out


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10**9),
    caps=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    n=st.integers(1, 80),
    rate=st.sampled_from([1.0, 0.5]),
)
def test_stack_model_equals_per_size_simulation(
    seed: int, caps: list[int], n: int, rate: float
) -> None:
    batches = _random_batches(random.Random(seed), n)
    one_pass = StackModel(caps, sample_rate=rate)
    reference = StackReference(caps, sample_rate=rate)
    for i, b in enumerate(batches):
        assert one_pass.process_batch(float(i), b) == reference.process_batch(float(i), b)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**9), caps=st.lists(st.integers(1, 300), min_size=1, max_size=5))
def test_stack_model_equals_per_size_simulation_on_pool_streams(seed: int, caps: list[int]) -> None:
    msgs = list(shared_prefix_messages(150, gpu_blocks=120, seed=seed))
    a = Replay(caps, StackModel)
    b = Replay(caps, StackReference)
    for m in msgs:
        assert a.feed(m) == b.feed(m)


def test_stack_model_equals_reference_on_the_recorded_stream() -> None:
    msgs = list(read_file(CPU_EVENTS))
    caps = list(range(0, 60, 3))
    a = Replay(caps, StackModel)
    b = Replay(caps, StackReference)
    for m in msgs:
        assert a.feed(m) == b.feed(m)


def test_stack_model_compacts_and_stays_bounded() -> None:
    model = StackModel([4, 64])
    for i in range(20_000):
        keys = (i % 7, 100 + i % 50, 10_000 + i)
        model.process_batch(float(i), [Access(i, keys, 0, True, 16, 0)])
    assert model.tracked_blocks <= 64
    assert len(model.slots) <= 2 * model.live + 4096 + 3


def test_sampled_curve_is_within_002_of_exact() -> None:
    msgs = list(
        shared_prefix_messages(
            2500, gpu_blocks=400, prefixes=400, prefix_blocks=(20, 80), skew=0.9, seed=3
        )
    )
    caps = [200, 800, 1600, 3200, 6400, 12800]
    exact = replay(msgs, caps, model="stack")
    sampled = replay(msgs, caps, model="stack", sample_rate=0.1)
    for e, s in zip(exact.sizes, sampled.sizes, strict=True):
        assert abs(e.hit_tokens - s.hit_tokens) / exact.stored_tokens <= 0.02
    assert exact.sizes[-1].hit_tokens > 0.2 * exact.stored_tokens  # a curve worth checking


def test_ttft_saved_keeps_the_sign_and_needs_both_rates() -> None:
    # 1000 hit tokens/s at 100 us each, loaded at 40k tokens/s: 0.1 - 0.025 s/s.
    assert ttft_saved_seconds_per_second(1000.0, 1e-4, 40_000.0) == pytest.approx(0.075)
    # Recompute cheaper than a load: the sign says offload costs.
    assert ttft_saved_seconds_per_second(1000.0, 2.5e-5, 10_000.0) == pytest.approx(-0.075)
    assert ttft_saved_seconds_per_second(1000.0, None, 10_000.0) is None
    assert ttft_saved_seconds_per_second(1000.0, 1e-4, 0.0) is None
    assert ttft_saved_seconds_per_second(1000.0, -1e-6, 10_000.0) is None


def test_ttft_saved_charges_the_wait_of_every_load() -> None:
    """Two loads a second, each waiting 10 ms for a scheduler step beyond its copy: 0.02 s/s
    less than the tokens alone save, whatever their number."""
    plain = ttft_saved_seconds_per_second(1000.0, 1e-4, 40_000.0, 4000.0)
    assert plain is not None
    waited = ttft_saved_seconds_per_second(1000.0, 1e-4, 40_000.0, 4000.0, 2.0, 0.01)
    assert waited == pytest.approx(plain - 0.02)


def test_builder_counts_a_recomputing_request_once_however_it_is_chunked() -> None:
    b = TraceBuilder()
    b.process(msg(0, [stored([1, 2, 3], None)]).batch, 0)
    b.process(msg(1, [removed([1, 2, 3])]).batch, 1)
    # The prefix comes back in two chunks of one request, then in a second request.
    b.process(msg(5, [stored([1, 2], None)]).batch, 5)
    b.process(msg(6, [stored([3, 4], 2)]).batch, 6)
    assert b.stats.recomputed_blocks == 3 and b.stats.recomputing_requests == 1
    assert b.prefills == [(32, 16)]  # the last call's prefill: 2 blocks, 1 of them back
    b.process(msg(20, [removed([1, 2, 3, 4])]).batch, 20)
    b.process(msg(30, [stored([1, 2, 3, 4], None)]).batch, 30)
    assert b.stats.recomputing_requests == 2


def test_ttft_saved_charges_the_stores_of_every_computed_token() -> None:
    """With offload every token computed without it crosses the link once: the 1000 hits are
    loaded, the other 3000 computed tokens stored. 0.1 s saved - 4000 / 40k s moved."""
    assert ttft_saved_seconds_per_second(1000.0, 1e-4, 40_000.0, 4000.0) == pytest.approx(0.0)
    # Fewer computed tokens than hits cannot be: the hits are moved at least.
    assert ttft_saved_seconds_per_second(1000.0, 1e-4, 40_000.0, 10.0) == pytest.approx(0.075)
    assert ttft_saved_seconds_per_second(1000.0, 10_000.0, 0.0) is None
