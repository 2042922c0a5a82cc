"""The what-if results over the scrape window (pure): simulated hits joined with the
prompt tokens of the window's intervals that the simulation covered."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from exporter.model.advisor.types import PolicyPoint, TierEvidence, WhatIfPoint, WhatIfState
from exporter.model.derive.engines import EngineDerived
from exporter.model.whatif.engine import POLICY_COMBOS, EngineSnapshot, SimConfig
from exporter.model.whatif.plan import engine_policy, policy_size, ttft_cost_per_token
from exporter.model.whatif.simulator import (
    REUSE_GAP_BLOCK_EDGES,
    bucket_quantile,
    ttft_saved_seconds_per_second,
)
from exporter.vllm_metrics import EngineKey
from exporter.window import TargetWindow


@dataclass(frozen=True, slots=True)
class WhatIfView:
    """Simulated hits over the part of the window the simulator covered."""

    prompt_tokens: float
    seconds: float
    hits: tuple[float, ...]
    configured_hits: float | None
    recomputed_tokens: float
    # Tokens the engine would compute without offload over the same span (computed plus
    # loaded from a CPU tier): every one of them crosses the link once with offload on.
    computed_tokens: float | None = None
    recomputing_requests: float = 0.0  # requests that recomputed an evicted block

    def loads(self, hits: float) -> float:
        """Loads from a CPU tier serving `hits` tokens: every request that recomputed an
        evicted prefix loads it once at the size that holds them all (hits = recomputed);
        a smaller tier serves a share of those prefixes, as many loads of the same mean size."""
        if self.recomputed_tokens <= 0:
            return 0.0
        return self.recomputing_requests * min(1.0, hits / self.recomputed_tokens)


def engine_rank(key: EngineKey) -> int | None:
    """The DP rank of an engine label (the key of WhatIf.snapshots()); None if not a rank."""
    try:
        return int(key.engine)
    except ValueError:
        return None


def _span(
    window: TargetWindow, key: EngineKey, start: float
) -> tuple[float, float | None, float, float] | None:
    """Prompt tokens, tokens computed or loaded from a CPU tier (None when vLLM does not
    break prompt tokens down by source) and the time span of the intervals from `start` on."""
    prompt = 0.0
    computed: float | None = None
    t0 = math.inf
    t1 = -math.inf
    for iv in window.intervals():
        if iv.t0 < start:
            continue  # the simulator had not started: its hits would be missing
        deltas = iv.deltas.get(key)
        if not deltas or "prompt_tokens" not in deltas:
            continue
        prompt += deltas["prompt_tokens"]
        local = deltas.get("prompt_by_source:local_compute")
        if local is not None:
            loaded = deltas.get("prompt_by_source:external_kv_transfer", 0.0)
            computed = (computed or 0.0) + local + loaded
        t0, t1 = min(t0, iv.t0), max(t1, iv.t1)
    if prompt <= 0 or t1 <= t0:
        return None
    return prompt, computed, t0, t1


def prompt_span(
    window: TargetWindow, key: EngineKey, start: float
) -> tuple[float, float, float] | None:
    """Prompt tokens and the time span of the window's intervals from `start` on."""
    span = _span(window, key, start)
    return None if span is None else (span[0], span[2], span[3])


def window_view(
    es: EngineSnapshot | None, window: TargetWindow, key: EngineKey
) -> WhatIfView | None:
    """The curve's hits over the window; None until simulated and joined with prompts."""
    if es is None or es.capacities is None or es.sim_start is None:
        return None
    span = _span(window, key, es.sim_start)
    if span is None:
        return None
    prompt, computed, t0, t1 = span
    k = len(es.capacities)
    hits = [0.0] * k
    conf = 0.0
    recomputed = 0.0
    recomputing = 0.0
    for b in es.buckets:
        if t0 <= b.start < t1 and len(b.hits) == k:
            recomputed += b.recomputed_tokens
            recomputing += b.recomputing_requests
            conf += b.configured_hits
            for i in range(k):
                hits[i] += b.hits[i]
    return WhatIfView(
        prompt,
        t1 - t0,
        tuple(hits),
        conf if es.configured_blocks is not None else None,
        recomputed,
        computed,
        recomputing,
    )


def policy_points(
    es: EngineSnapshot | None,
    window: TargetWindow,
    d: EngineDerived,
    planned: SimConfig | None,
    recommended: float | None,
) -> tuple[PolicyPoint, ...]:
    """Hit ratio of each POLICY_COMBOS entry at the comparison size, over the window.

    `planned` is the engine's last planned config (WhatIf.planned) and `recommended` the
    recommendation it was planned with: empty while the planned size is not simulated."""
    if es is None or planned is None or es.policy_blocks is None or es.policy_start is None:
        return ()
    if es.policy_blocks != planned.policy_blocks:
        return ()  # the new size is not simulated yet
    size = policy_size(d, recommended)
    span = prompt_span(window, d.key, es.policy_start)
    if span is None or not size:
        return ()
    prompt, t0, t1 = span
    hits = [0.0] * len(POLICY_COMBOS)
    for b in es.policy_buckets:
        if t0 <= b.start < t1 and len(b.hits) == len(POLICY_COMBOS):
            for i in range(len(POLICY_COMBOS)):
                hits[i] += b.hits[i]
    policy, threshold = engine_policy(d)
    own = (policy, threshold or 0) if d.offload_enabled and policy is not None else None
    return tuple(
        PolicyPoint(p, t, float(size), min(1.0, h / prompt), (p, t) == own)
        for (p, t), h in zip(POLICY_COMBOS, hits, strict=True)
    )


def whatif_state(
    es: EngineSnapshot | None,
    window: TargetWindow,
    d: EngineDerived,
    sizes_bytes: Sequence[int],
) -> WhatIfState | None:
    """The what-if curve over the window for the advisor and the whatif families."""
    view = window_view(es, window, d.key)
    if view is None:
        return None
    cost = ttft_cost_per_token(d)
    computed = view.computed_tokens
    bal, fit = d.balance, d.offload_fit

    def saved(hits: float) -> float | None:
        if bal is not None and fit is not None and computed is not None:
            # Offload on: price each hit at the measured saving per loaded token and every
            # token computed without offload at the measured store cost, as the balance does
            # (at the configured size the two agree).
            per_store = bal.store_seconds / (bal.loaded_tokens + bal.computed_tokens)
            net = hits * fit.saving_seconds_per_token - computed * per_store
            return net / view.seconds
        return ttft_saved_seconds_per_second(
            hits / view.seconds,
            cost,
            d.transfer_tokens_per_second,
            computed / view.seconds if computed is not None else None,
            view.loads(hits) / view.seconds,
            d.load_wait_seconds,
        )

    points = tuple(
        WhatIfPoint(float(size), min(1.0, hits / view.prompt_tokens), saved(hits))
        for size, hits in zip(sizes_bytes, view.hits, strict=True)
    )
    conf = (
        min(1.0, view.configured_hits / view.prompt_tokens)
        if view.configured_hits is not None
        else None
    )
    return WhatIfState(points, view.recomputed_tokens, conf)


def tier_evidence(es: EngineSnapshot | None, d: EngineDerived) -> TierEvidence | None:
    """The CPU tier's own events and the reuse gaps, for the advisor (None: no simulation)."""
    if es is None:
        return None
    per_token = d.kv_bytes_per_token
    per_block = per_token * es.block_size if per_token and es.block_size else None

    def gap(share: float) -> float | None:
        blocks = bucket_quantile(REUSE_GAP_BLOCK_EDGES, es.reuse_gap_blocks, share)
        return blocks * per_block if blocks is not None and per_block is not None else None

    return TierEvidence(
        dropped_chunks=es.cpu_removed,
        wasted_share=es.wasted_stores / es.cpu_removed if es.cpu_removed else None,
        wasted_bytes=es.wasted_store_tokens * per_token if per_token and es.cpu_stored else None,
        reuse_gap_bytes_half=gap(0.5),
        reuse_gap_bytes_most=gap(0.9),
    )
