"""The advisor's vocabulary: actions, reasons, its inputs and its answer.

Action and Reason are the one definition of what the advisor can say: the dashboards' value
mappings, the catalogue's help text, the alert rules and docs/advisor.md are generated from
them (scripts/gen.py) and a test keeps them in step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from exporter.model.derive.engines import EngineDerived


class Action(StrEnum):
    ENABLE_OFFLOAD = "enable_offload"
    GROW_BUFFER = "grow_buffer"
    SHRINK_BUFFER = "shrink_buffer"
    RAISE_STORE_THRESHOLD = "raise_store_threshold"
    DISABLE_OFFLOAD = "disable_offload"
    REDUCE_BUFFER_OOM_RISK = "reduce_buffer_oom_risk"
    KEEP = "keep"
    NO_ACTION = "no_action"
    INSUFFICIENT_DATA = "insufficient_data"


# Acted on at once: waiting out the hysteresis would mean an OOM kill or stale advice.
URGENT = frozenset({Action.REDUCE_BUFFER_OOM_RISK, Action.INSUFFICIENT_DATA})


class Reason(StrEnum):
    """Why the advisor chose its action; the `reason` label of kvoffload_advice_info."""

    TARGET_STALE = "target_stale"
    WINDOW_TOO_SHORT = "window_too_short"
    TOO_LITTLE_TRAFFIC = "too_little_traffic"
    MEMORY_NEAR_LIMIT = "memory_near_limit"
    RELOAD_SLOWER_THAN_RECOMPUTE = "reload_slower_than_recompute"
    RELOAD_GAIN_TOO_SMALL = "reload_gain_too_small"
    BUFFER_TOO_SMALL = "buffer_too_small"
    SPEEDUP_UNCERTAIN = "speedup_uncertain"
    NO_REUSE = "no_reuse"
    RELOAD_BENEFIT_UNMEASURED = "reload_benefit_unmeasured"
    STORES_WITHOUT_REUSE_PCIE_BUSY = "stores_without_reuse_pcie_busy"
    BUFFER_LARGER_THAN_NEEDED = "buffer_larger_than_needed"
    PAYING_OFF = "paying_off"
    KV_EVENTS_OFF = "kv_events_off"
    NO_KV_PRESSURE = "no_kv_pressure"
    NO_RECOMPUTE_AFTER_EVICTION = "no_recompute_after_eviction"
    TRANSFER_RATE_UNKNOWN = "transfer_rate_unknown"
    RELOAD_NOT_FASTER_ESTIMATE = "reload_not_faster_estimate"
    WHATIF_NO_GAIN = "whatif_no_gain"
    RECOMPUTE_AFTER_EVICTION = "recompute_after_eviction"


@dataclass(frozen=True, slots=True)
class WhatIfPoint:
    cpu_buffer_bytes: float
    hit_ratio: float  # hit tokens / all prompt tokens, comparable to the observed ratio
    ttft_saved_seconds_per_second: float | None = None


@dataclass(frozen=True, slots=True)
class WhatIfState:
    points: tuple[WhatIfPoint, ...]
    recomputed_after_eviction_tokens: float  # over the window
    configured_hit_ratio: float | None = None  # simulated at the configured buffer


@dataclass(frozen=True, slots=True)
class MemoryState:
    limit_bytes: float | None  # None: no container limit
    usage_bytes: float | None
    pool_bytes: float | None  # offload pool actually pinned/shared for this target
    pool_to_buffer_ratio: float | None = None


@dataclass(frozen=True, slots=True)
class PolicyPoint:
    """The what-if hit ratio of one eviction policy and store threshold at one size."""

    policy: str  # lru | arc
    store_threshold: int  # 0 = off
    cpu_buffer_bytes: float
    hit_ratio: float  # hit tokens / all prompt tokens
    configured: bool = False  # the engine runs with this policy and threshold


@dataclass(frozen=True, slots=True)
class AdvisorInput:
    derived: EngineDerived
    covered_seconds: float
    whatif: WhatIfState | None = None
    memory: MemoryState | None = None
    pcie_utilization: float | None = None  # busiest direction of the busiest GPU, 0..1
    # The same traffic replayed with each policy/threshold (explanations only, no action).
    policy_alternatives: tuple[PolicyPoint, ...] = ()


@dataclass(frozen=True, slots=True)
class Advice:
    action: Action
    reason: Reason
    explanation: str
    recommended_buffer_bytes: float | None = None
    numbers: Mapping[str, float | None] = field(default_factory=dict)
    candidate: Action | None = None  # what the latest evaluation alone would say
