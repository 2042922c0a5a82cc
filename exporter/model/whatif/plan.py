"""What to simulate for one engine, from its derived values (pure)."""

from __future__ import annotations

import math

from exporter.model.derive.engines import EngineDerived
from exporter.model.whatif.engine import SimConfig, WhatIfSettings
from exporter.model.whatif.simulator import blocks_for_bytes


def engine_policy(d: EngineDerived) -> tuple[str | None, int | None]:
    """The engine's eviction policy and active store threshold, where its command line
    gives them; (None, None) leaves the configured-size simulation to the --whatif-* flags."""
    b = d.backend
    if b is None or b.config.source != "cmdline" or b.config.connector != "OffloadingConnector":
        return None, None
    policy = b.config.eviction_policy
    threshold = int(b.config.store_threshold) if b.config.store_threshold.isdigit() else None
    return (policy if policy in ("lru", "arc") else None), threshold


def policy_size(d: EngineDerived, recommended: float | None) -> float | None:
    """The size the policy comparison runs at: the configured CPU buffer of a native
    OffloadingConnector (the only backend with these policies), else with offload off
    the advisor's recommendation; None where no comparison applies."""
    connector = d.backend.config.connector if d.backend is not None else "unknown"
    if d.offload_enabled:
        if connector in ("OffloadingConnector", "unknown") and d.offload_buffer_bytes:
            return d.offload_buffer_bytes
        return None
    return recommended or None


def recompute_rate(d: EngineDerived) -> float | None:
    """Marginal recompute tokens/s; infinite when the per-token cost is below the noise."""
    return math.inf if d.recompute_negligible else d.recompute_tokens_per_second


def ttft_cost_per_token(d: EngineDerived) -> float | None:
    """Summed TTFT one more computed token costs, for the what-if's saving: the TTFT fits
    where measured (offload off: TTFT on requests and computed tokens; on: the computed
    token's cost in the offload fit), else the prefill fit's marginal cost; 0 below noise."""
    if d.ttft_fit is not None and d.ttft_fit.stderr is not None:
        return max(d.ttft_fit.seconds_per_token, 0.0)
    if d.offload_fit is not None and d.offload_fit.valid:
        return d.offload_fit.computed_seconds_per_token
    rate = recompute_rate(d)
    if rate is None or rate <= 0:
        return None
    return 1.0 / rate


def ttft_cost_stderr(d: EngineDerived) -> float | None:
    """Standard error of ttft_cost_per_token where a fit with offload off gives it."""
    if d.ttft_fit is not None and d.ttft_fit.stderr is not None:
        return d.ttft_fit.stderr
    if d.offload_fit is not None and d.offload_fit.valid:
        return d.offload_fit.computed_stderr
    if d.recompute_negligible or d.prefill_fit is None:
        return None
    return d.prefill_fit.stderr


def sim_config(
    d: EngineDerived, settings: WhatIfSettings, recommended: float | None
) -> SimConfig | None:
    """The simulators engine `d` needs (None until its KV bytes per block are known).

    `recommended` is the advisor's last recommended buffer for the engine: with offload
    off, the policy comparison runs at that size."""
    if not d.kv_bytes_per_token or not d.block_size:
        return None
    per_block = round(d.kv_bytes_per_token * d.block_size)
    if per_block <= 0:
        return None
    bpc = settings.blocks_per_chunk
    caps = tuple(blocks_for_bytes(b, per_block, bpc) for b in settings.sizes_bytes)
    configured = None
    if d.offload_enabled and d.offload_buffer_bytes:
        configured = blocks_for_bytes(int(d.offload_buffer_bytes), per_block, bpc)
    policy, threshold = engine_policy(d)
    size = policy_size(d, recommended)
    # Four more exact simulators at one size; --whatif-model stack is chosen to save
    # exactly that, so the comparison runs with the exact (vllm) model only.
    exact = settings.model == "vllm"
    policy_blocks = blocks_for_bytes(int(size), per_block, bpc) if size and exact else None
    return SimConfig(caps, configured, policy_blocks, policy, threshold)
