"""What-if families over the scrape window: the curve, the TTFT it would save, the
simulation at the configured buffer and the policy comparison."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from exporter.catalogue import Family
from exporter.model.advisor.types import PolicyPoint, WhatIfState
from exporter.vllm_metrics import EngineKey

# One engine's what-if values: its key, the curve (None: not simulated or no prompts in
# the covered window) and the policy comparison (empty: none).
EngineWhatIf = tuple[EngineKey, WhatIfState | None, Sequence[PolicyPoint]]


def whatif_families(target: str, engines: Iterable[EngineWhatIf]) -> list[Family]:
    """kvoffload_whatif_{offload_hit_ratio, ttft_saved_seconds_per_second,
    configured_hit_ratio, policy_hit_ratio} of one target's engines, in that order."""
    rows = list(engines)
    policy_ratio = Family("kvoffload_whatif_policy_hit_ratio")
    for key, _, points in rows:
        for p in points:
            policy_ratio.add(
                [target, key.model_name, key.engine, p.policy, str(p.store_threshold)],
                p.hit_ratio,
            )
    ratio = Family("kvoffload_whatif_offload_hit_ratio")
    saved = Family("kvoffload_whatif_ttft_saved_seconds_per_second")
    configured = Family("kvoffload_whatif_configured_hit_ratio")
    for key, state, _ in rows:
        if state is None:
            continue
        labels = [target, key.model_name, key.engine]
        for point in state.points:
            size = str(int(point.cpu_buffer_bytes))  # a --whatif-sizes entry: whole bytes
            ratio.add([*labels, size], point.hit_ratio)
            if point.ttft_saved_seconds_per_second is not None:
                saved.add([*labels, size], point.ttft_saved_seconds_per_second)
        if state.configured_hit_ratio is not None:
            configured.add(labels, state.configured_hit_ratio)
    return [ratio, saved, configured, policy_ratio]
