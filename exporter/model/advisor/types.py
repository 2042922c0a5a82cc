"""The advisor's vocabulary: actions, reasons, its inputs and its answer.

Action and Reason are the one definition of what the advisor can say: the dashboards' value
mappings, the catalogue's help text, the alert rules and docs/advisor.md are generated from
them (scripts/gen.py) and a test keeps them in step. NUMBER_INFO is the same for the numbers
behind an advice: the status page's labels and docs/status-page.md's table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

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


# Acted on at once: waiting out the hysteresis would mean an OOM kill or stale advice (but a
# decision holds through insufficient_data that is only doubt: hysteresis.HELD_THROUGH).
URGENT = frozenset({Action.REDUCE_BUFFER_OOM_RISK, Action.INSUFFICIENT_DATA})


class Reason(StrEnum):
    """Why the advisor chose its action; the `reason` label of kvoffload_advice_info."""

    TARGET_STALE = "target_stale"
    WINDOW_TOO_SHORT = "window_too_short"
    TOO_LITTLE_TRAFFIC = "too_little_traffic"
    MEMORY_NEAR_LIMIT = "memory_near_limit"
    RELOAD_SLOWER_THAN_RECOMPUTE = "reload_slower_than_recompute"
    RELOAD_GAIN_TOO_SMALL = "reload_gain_too_small"
    TTFT_SAVING_IMMATERIAL = "ttft_saving_immaterial"
    DELIVERED_SAVING_IMMATERIAL = "delivered_saving_immaterial"
    PREDICTED_SAVING_IMMATERIAL = "predicted_saving_immaterial"
    BUFFER_TOO_SMALL = "buffer_too_small"
    SPEEDUP_UNCERTAIN = "speedup_uncertain"
    NO_REUSE = "no_reuse"
    RELOAD_BENEFIT_UNMEASURED = "reload_benefit_unmeasured"
    TIER_STILL_FILLING = "tier_still_filling"
    STORES_WITHOUT_REUSE_PCIE_BUSY = "stores_without_reuse_pcie_busy"
    STORES_NEVER_LOADED = "stores_never_loaded"
    BUFFER_LARGER_THAN_NEEDED = "buffer_larger_than_needed"
    PAYING_OFF = "paying_off"
    KV_EVENTS_OFF = "kv_events_off"
    NO_KV_PRESSURE = "no_kv_pressure"
    NO_RECOMPUTE_AFTER_EVICTION = "no_recompute_after_eviction"
    TRANSFER_RATE_UNKNOWN = "transfer_rate_unknown"
    RELOAD_NOT_FASTER_ESTIMATE = "reload_not_faster_estimate"
    WHATIF_NO_GAIN = "whatif_no_gain"
    RECOMPUTE_AFTER_EVICTION = "recompute_after_eviction"


class Tone(StrEnum):
    """How an action reads at a glance; the dashboards colour it (dashboards/panels.py)."""

    OK = "ok"  # nothing to change
    INFO = "info"  # worth doing, no harm meanwhile
    WARN = "warn"  # capacity or latency left on the table
    BAD = "bad"  # harm now: wasted resources or an OOM risk
    NEUTRAL = "neutral"  # no judgement yet


@dataclass(frozen=True, slots=True)
class ActionInfo:
    title: str  # the dashboards' value-mapping text
    tone: Tone
    meaning: str  # one line: docs/advisor.md's "when" column
    headline: str = ""  # what to do, as the status page's card and `advise` say it


@dataclass(frozen=True, slots=True)
class ReasonInfo:
    action: Action  # the one action rules.evaluate returns with this reason
    meaning: str  # one line for docs/advisor.md


# Everything generated from the vocabulary reads these two tables (scripts/gen.py:
# docs/advisor.md's tables and catalogue.csv's help of kvoffload_advice; dashboards/panels.py's
# value mappings); tests/test_generated.py checks them against the enums, rules.py and the
# generated files. In the enums' order.
ACTION_INFO: Mapping[Action, ActionInfo] = MappingProxyType(
    {
        Action.ENABLE_OFFLOAD: ActionInfo(
            "enable offload",
            Tone.WARN,
            "offload off; evicted prefixes are recomputed, a CPU tier of the recommended size "
            "would serve them, and reloading is clearly faster than recomputing",
            headline="Enable CPU offload",
        ),
        Action.GROW_BUFFER: ActionInfo(
            "grow buffer",
            Tone.WARN,
            "offload on; the what-if reaches a materially higher hit ratio with a larger buffer "
            "that fits the memory headroom",
            headline="Grow the CPU buffer",
        ),
        Action.SHRINK_BUFFER: ActionInfo(
            "shrink buffer",
            Tone.INFO,
            "offload on; a smaller buffer reaches about the same hit ratio",
            headline="Shrink the CPU buffer",
        ),
        Action.RAISE_STORE_THRESHOLD: ActionInfo(
            "raise store threshold",
            Tone.INFO,
            "offload on and paying; most stores are never loaded, and storing only prefixes "
            "seen twice would keep the hits",
            headline="Raise store_threshold",
        ),
        Action.DISABLE_OFFLOAD: ActionInfo(
            "disable offload",
            Tone.BAD,
            "offload on and it does not pay",
            headline="Turn offload off",
        ),
        Action.REDUCE_BUFFER_OOM_RISK: ActionInfo(
            "reduce buffer (OOM risk)",
            Tone.BAD,
            "the container is near its memory limit with a pinned pool",
            headline="Reduce the buffer: OOM risk",
        ),
        Action.KEEP: ActionInfo(
            "keep", Tone.OK, "offload on and it pays", headline="Keep offload as it is"
        ),
        Action.NO_ACTION: ActionInfo(
            "no action", Tone.OK, "offload off, and it would not help", headline="No change needed"
        ),
        Action.INSUFFICIENT_DATA: ActionInfo(
            "insufficient data",
            Tone.NEUTRAL,
            "the evidence is missing; the explanation says what is needed and how much more",
            headline="Not enough evidence yet",
        ),
    }
)

REASON_INFO: Mapping[Reason, ReasonInfo] = MappingProxyType(
    {
        Reason.TARGET_STALE: ReasonInfo(
            Action.INSUFFICIENT_DATA,
            "the target has not been scraped successfully for more than two intervals",
        ),
        Reason.WINDOW_TOO_SHORT: ReasonInfo(
            Action.INSUFFICIENT_DATA,
            "good scrapes cover less of the window than `min_window_seconds`",
        ),
        Reason.TOO_LITTLE_TRAFFIC: ReasonInfo(
            Action.INSUFFICIENT_DATA,
            "fewer prompt tokens in the window than `min_prompt_tokens`",
        ),
        Reason.MEMORY_NEAR_LIMIT: ReasonInfo(
            Action.REDUCE_BUFFER_OOM_RISK,
            "container memory at or above `memory_usage_high` of its limit, with offload on",
        ),
        Reason.RELOAD_SLOWER_THAN_RECOMPUTE: ReasonInfo(
            Action.DISABLE_OFFLOAD,
            "the TTFT fit (or, without one, the copy-time speedup) shows reloading does not "
            "beat recomputing",
        ),
        Reason.RELOAD_GAIN_TOO_SMALL: ReasonInfo(
            Action.DISABLE_OFFLOAD,
            "the measured speedup interval lies entirely below `transfer_speedup_min`",
        ),
        Reason.TTFT_SAVING_IMMATERIAL: ReasonInfo(
            Action.DISABLE_OFFLOAD,
            "the window's balance (TTFT the loaded tokens saved, minus the cost of storing "
            "every computed block) saves less than `ttft_saving_material` of TTFT even at "
            "the upper end of its interval",
        ),
        Reason.DELIVERED_SAVING_IMMATERIAL: ReasonInfo(
            Action.DISABLE_OFFLOAD,
            "since offload was enabled the summed TTFT is not `ttft_saving_material` below "
            "what the same requests and tokens cost the engine before (its TTFT fit with "
            "offload off), even at the upper end of that estimate",
        ),
        Reason.PREDICTED_SAVING_IMMATERIAL: ReasonInfo(
            Action.NO_ACTION,
            "offload off; the what-if's predicted TTFT saving, loads and stores of every "
            "computed block counted and the engine's queue not, is below "
            "`ttft_saving_material` of the window's TTFT at the size it would recommend, or, "
            "while the recompute cost is too uncertain to enable, at every simulated size even "
            "with that cost at the upper end of its interval",
        ),
        Reason.BUFFER_TOO_SMALL: ReasonInfo(
            Action.GROW_BUFFER,
            "the what-if reaches a materially higher hit ratio with a larger buffer that fits "
            "the memory headroom",
        ),
        Reason.SPEEDUP_UNCERTAIN: ReasonInfo(
            Action.INSUFFICIENT_DATA,
            "whether reloading clears `transfer_speedup_min` is not yet measured precisely "
            "enough to decide",
        ),
        Reason.NO_REUSE: ReasonInfo(
            Action.DISABLE_OFFLOAD,
            "almost no prompt tokens come back from the CPU tier and no larger buffer would help",
        ),
        Reason.RELOAD_BENEFIT_UNMEASURED: ReasonInfo(
            Action.INSUFFICIENT_DATA,
            "the CPU tier serves hits but the TTFT fit cannot yet show that a loaded token "
            "saves time, or the window's balance still reaches a cost at its lower end, or a "
            "material one (`ttft_saving_material`) with the stores at `store_cost_factor_max` "
            "times their copy time, or, where the engine decodes, with every load charged two "
            "engine steps at its inter-token latency",
        ),
        Reason.TIER_STILL_FILLING: ReasonInfo(
            Action.INSUFFICIENT_DATA,
            "offload on and, so far, saving too little or serving too few hits to keep, but the "
            "CPU tier has stored less than its size since the engine started: it has never "
            "been full, and its hits are still growing",
        ),
        Reason.STORES_WITHOUT_REUSE_PCIE_BUSY: ReasonInfo(
            Action.RAISE_STORE_THRESHOLD,
            "loaded bytes are below `reuse_ratio_low` of stored bytes while the PCIe link is busy",
        ),
        Reason.STORES_NEVER_LOADED: ReasonInfo(
            Action.RAISE_STORE_THRESHOLD,
            "offload pays, but at least `wasted_store_share_high` of the chunks the CPU tier "
            "dropped were never loaded (KV events), and the what-if with store_threshold 2 "
            "keeps the hit ratio",
        ),
        Reason.BUFFER_LARGER_THAN_NEEDED: ReasonInfo(
            Action.SHRINK_BUFFER,
            "the what-if reaches about the configured hit ratio with a smaller buffer",
        ),
        Reason.PAYING_OFF: ReasonInfo(
            Action.KEEP,
            "the CPU tier serves prompt tokens and reloads measurably beat recomputing",
        ),
        Reason.KV_EVENTS_OFF: ReasonInfo(
            Action.INSUFFICIENT_DATA,
            "GPU KV cache under pressure (usage, preemptions or more computed than it holds), "
            "but without KV cache events reuse cannot be judged",
        ),
        Reason.NO_KV_PRESSURE: ReasonInfo(
            Action.NO_ACTION,
            "GPU KV cache usage is low, nothing is preempted and the window computed less than "
            "the cache holds",
        ),
        Reason.NO_RECOMPUTE_AFTER_EVICTION: ReasonInfo(
            Action.NO_ACTION,
            "prefixes recomputed after eviction are below `recompute_share_material` of prompt "
            "tokens",
        ),
        Reason.TRANSFER_RATE_UNKNOWN: ReasonInfo(
            Action.INSUFFICIENT_DATA,
            "no transfer rate or recompute speed to compare (no NVML link, no "
            "--assumed-load-bandwidth, unknown KV bytes per token or recompute cost)",
        ),
        Reason.RELOAD_NOT_FASTER_ESTIMATE: ReasonInfo(
            Action.NO_ACTION,
            "the estimated speedup of reloading over recomputing is below `transfer_speedup_min`",
        ),
        Reason.WHATIF_NO_GAIN: ReasonInfo(
            Action.NO_ACTION,
            "no CPU tier that fits the memory headroom would reach a material hit ratio",
        ),
        Reason.RECOMPUTE_AFTER_EVICTION: ReasonInfo(
            Action.ENABLE_OFFLOAD,
            "evicted prefixes are recomputed and a CPU tier that fits would serve them, faster "
            "than recomputing",
        ),
    }
)


@dataclass(frozen=True, slots=True)
class NumberInfo:
    """One of the numbers behind an advice (`/advice`'s `numbers`)."""

    label: str  # as the status page's card and `advise` print it
    kind: str  # how they print it: n, s, seconds, us, ratio, bytes, tokens/s, x, bool
    meaning: str  # one line for docs/status-page.md


# The one list of what rules.evaluate may put in an advice's numbers: the card's labels and
# docs/status-page.md's table come from it, and tests/test_generated.py checks rules.py
# against it.
NUMBER_INFO: Mapping[str, NumberInfo] = MappingProxyType(
    {
        "window_covered_seconds": NumberInfo(
            "window covered", "s", "seconds of the window that good scrapes cover"
        ),
        "prompt_tokens": NumberInfo(
            "prompt tokens in the window", "n", "prompt tokens the engine took in the window"
        ),
        "kv_cache_usage_ratio": NumberInfo(
            "GPU KV cache usage", "ratio", "vLLM's GPU KV cache usage at the last scrape"
        ),
        "gpu_cache_turnover": NumberInfo(
            "GPU KV cache turnover",
            "x",
            "prompt tokens the GPU computed in the window over the tokens its KV cache holds "
            "(above 1: cached prefixes were evicted)",
        ),
        "gpu_prefix_hit_ratio": NumberInfo(
            "GPU prefix hit ratio", "ratio", "prompt tokens found in the GPU prefix cache"
        ),
        "offload_hit_ratio": NumberInfo(
            "offload hit ratio", "ratio", "prompt tokens loaded from the CPU tier"
        ),
        "offload_reuse_ratio": NumberInfo(
            "loaded / stored bytes", "ratio", "bytes loaded from the CPU tier over bytes stored"
        ),
        "recompute_tokens_per_second": NumberInfo(
            "marginal recompute",
            "tokens/s",
            "tokens per second of prefill at the margin (the prefill fit's slope)",
        ),
        "transfer_tokens_per_second": NumberInfo(
            "reload", "tokens/s", "tokens per second a reload moves (measured or estimated)"
        ),
        "transfer_speedup_ratio": NumberInfo(
            "reload / recompute speed", "x", "reload speed over marginal recompute speed"
        ),
        "engine_cuda_graphs": NumberInfo(
            "CUDA graphs",
            "bool",
            "whether the engine serves with CUDA graphs: 0 where its command line says "
            "--enforce-eager or cudagraph_mode NONE; absent where the command line is unknown",
        ),
        "decode_step_seconds": NumberInfo(
            "engine step while decoding",
            "seconds",
            "vLLM's mean inter-token latency over the window: the engine's step time while "
            "requests decode; absent where the window decoded too little to say",
        ),
        "transfer_rate_estimated": NumberInfo(
            "reload rate estimated, not measured",
            "bool",
            "1 where the reload rate is an estimate (link or --assumed-load-bandwidth)",
        ),
        "measured_saving_seconds_per_loaded_token": NumberInfo(
            "TTFT saved per loaded token",
            "us",
            "TTFT a loaded token saves against a computed one, by the offload fit",
        ),
        "offload_buffer_bytes": NumberInfo(
            "configured CPU buffer", "bytes", "the engine's --kv-offloading-size"
        ),
        "offload_stored_since_start_bytes": NumberInfo(
            "stored to the CPU tier since start",
            "bytes",
            "bytes the CPU tier stored since the engine started: it has filled once this "
            "reaches its size",
        ),
        "computed_token_floor_seconds": NumberInfo(
            "least a computed token costs",
            "us",
            "the model's weight bytes over the GPU's dense peak",
        ),
        "affordable_buffer_bytes": NumberInfo(
            "largest affordable buffer", "bytes", "the largest pinned buffer the memory allows"
        ),
        "pcie_utilization_ratio": NumberInfo(
            "PCIe utilisation", "ratio", "the busiest direction of the busiest GPU's link"
        ),
        "offload_delivered_saving_seconds": NumberInfo(
            "TTFT saved since enabling",
            "seconds",
            "summed TTFT the window's traffic cost before offload, less what it cost with it",
        ),
        "offload_delivered_saving_stderr_seconds": NumberInfo(
            "its standard error", "seconds", "of the TTFT saved since enabling"
        ),
        "offload_delivered_saving_share": NumberInfo(
            "TTFT saved since enabling, share",
            "ratio",
            "the same over the TTFT without offload (negative: a cost)",
        ),
        "offload_request_cost_seconds": NumberInfo(
            "TTFT the tier adds to each request",
            "seconds",
            "offload on, the TTFT fit from before enabling known: the per-request cost of the "
            "window's TTFT fit less that fit's, paid whether a request loads or not (the steps "
            "the tier adds)",
        ),
        "offload_request_cost_stderr_seconds": NumberInfo(
            "its standard error", "seconds", "of the TTFT the tier adds to each request"
        ),
        "offload_net_saving_seconds": NumberInfo(
            "TTFT saved net of stores",
            "seconds",
            "the window's balance: TTFT the loaded tokens saved less what the stores cost",
        ),
        "offload_net_saving_stderr_seconds": NumberInfo(
            "its standard error", "seconds", "of the balance, below it"
        ),
        "offload_net_saving_share": NumberInfo(
            "TTFT saved net of stores, share",
            "ratio",
            "the balance over the TTFT without offload (negative: a cost)",
        ),
        "offload_store_cost_seconds": NumberInfo(
            "TTFT the stores cost", "seconds", "the balance's store charge"
        ),
        "offload_load_steps_seconds": NumberInfo(
            "TTFT the loads' steps may cost",
            "seconds",
            "the window's loads at two engine steps each, a step at the decode step time: "
            "the bound a keep must survive (absent without a decode step time)",
        ),
        "recomputed_after_eviction_tokens": NumberInfo(
            "tokens recomputed after eviction",
            "n",
            "tokens the GPU computed again after evicting them",
        ),
        "whatif_configured_hit_ratio": NumberInfo(
            "what-if hit ratio at the configured size",
            "ratio",
            "the what-if's hit ratio at the configured buffer",
        ),
        "whatif_requests_per_step": NumberInfo(
            "requests sharing a computed token's step",
            "x",
            "offload off: prefills per engine step, weighted by tokens (KV events); the "
            "what-if charges each store that many times",
        ),
        "whatif_load_wait_share": NumberInfo(
            "a load's wait, share of a prefill",
            "ratio",
            "offload off: what a load would keep its request waiting beyond its copy, as a "
            "share of the mean prefill time per request",
        ),
        "whatif_launch_wait_seconds": NumberInfo(
            "a step's wait for the launch behind it",
            "seconds",
            "offload off: twice a step's fixed time (the prefill fit's time per request) less "
            "the mean prefill time per request, at least 0: what a step's output would wait "
            "for the engine to launch a loader's later step where launching outlasts "
            "computing",
        ),
        "whatif_launch_waiters_per_load": NumberInfo(
            "prefills waiting on a load's launch",
            "x",
            "offload off, where requests come in bursts (three or more prefills to a step): "
            "per load, the prefills of each loader's engine step but its first (KV events); "
            "each would wait the launch wait",
        ),
        "whatif_queue_utilisation": NumberInfo(
            "engine utilisation as a queue",
            "ratio",
            "offload off: summed TTFT per second over the requests sharing a step, as a "
            "processor-sharing queue's utilisation; the what-if's saving from hits grows "
            "by 1 / (1 - what is left of it)",
        ),
        "kv_event_batches_lost_ratio": NumberInfo(
            "KV-event batches lost",
            "ratio",
            "of the window's KV-event batches, the share lost before the what-if saw them "
            "(it then undercounts hits)",
        ),
        "cpu_tier_dropped_chunks": NumberInfo(
            "chunks the CPU tier dropped", "n", "chunks removed from the CPU tier"
        ),
        "wasted_store_ratio": NumberInfo(
            "dropped without a load",
            "ratio",
            "share of the dropped chunks that were never loaded",
        ),
        "wasted_store_bytes": NumberInfo(
            "bytes stored, never loaded", "bytes", "bytes of those chunks"
        ),
        "reuse_gap_bytes_half": NumberInfo(
            "half came back within",
            "bytes",
            "half the prefixes that came back after an eviction had been computed within "
            "this much KV before",
        ),
        "reuse_gap_bytes_most": NumberInfo(
            "90 % came back within", "bytes", "the same for 90 % of them"
        ),
        "memory_limit_bytes": NumberInfo(
            "container memory limit", "bytes", "the cgroup's memory limit"
        ),
        "memory_usage_bytes": NumberInfo(
            "container memory in use", "bytes", "the cgroup's memory use"
        ),
        "offload_pool_bytes": NumberInfo(
            "pinned offload pool", "bytes", "the engine's pinned CPU pool"
        ),
        "whatif_best_policy_hit_ratio": NumberInfo(
            "what-if hit ratio, best policy",
            "ratio",
            "the what-if's best hit ratio over the eviction policies and store thresholds "
            "at the size it simulates them",
        ),
    }
)


@dataclass(frozen=True, slots=True)
class WhatIfPoint:
    cpu_buffer_bytes: float
    hit_ratio: float  # hit tokens / all prompt tokens, comparable to the observed ratio
    ttft_saved_seconds_per_second: float | None = None
    # Offload off: the saving were a computed token to cost the upper end of its measured
    # ~95 % interval; what a "would not pay" must hold against.
    ttft_saved_upper_seconds_per_second: float | None = None
    # Offload on: the saving were a loaded token to save the lower end of its measured ~95 %
    # interval; what a "grow" must hold against (more pinned memory needs proof).
    ttft_saved_lower_seconds_per_second: float | None = None
    # Offload off: the saving without the engine's queue (the hits' saved work priced
    # linearly, whatif.simulator.queue_saving): never above the estimate, what an "enable"
    # must clear, since the queue's share rests on a model of how requests overlap.
    ttft_saved_linear_seconds_per_second: float | None = None
    # Where the engine decodes (EngineDerived.decode_step_seconds): the loads at this size
    # charged two engine steps each at that step time (balance.LOAD_STEPS), the bound an
    # "enable" or a "grow" must survive as a keep must; 0 without a decode step time.
    load_steps_seconds_per_second: float = 0.0


@dataclass(frozen=True, slots=True)
class WhatIfState:
    points: tuple[WhatIfPoint, ...]
    recomputed_after_eviction_tokens: float  # over the window
    configured_hit_ratio: float | None = None  # simulated at the configured buffer
    # Offload off: how the window's prefills shared their steps (whatif.view.StepSharing),
    # which prices the stores and the loads' wait; None with offload on (the balance does).
    requests_per_step: float | None = None
    load_wait_share: float | None = None
    # Of the window's KV-event batches, the share lost before the simulation saw them: their
    # blocks never stored, so never hits either; the curve undercounts.
    lost_batch_share: float = 0.0
    # Offload off: the engine's utilisation as a queue (whatif.view.queue_utilisation),
    # which makes the hits' saving more than linear; None with offload on or without TTFT.
    queue_utilisation: float | None = None
    # Offload off: what a step's output would wait for the launch of a loader's later step
    # (whatif.view.WhatIfView.launch_wait, at the window's prefill time), and how many
    # prefills per load would wait for it (StepSharing.launch_waiters_per_load).
    launch_wait_seconds: float | None = None
    launch_waiters_per_load: float | None = None


@dataclass(frozen=True, slots=True)
class TierEvidence:
    """What the KV events show about the CPU tier that vLLM does not export."""

    dropped_chunks: int  # chunks the CPU tier dropped (medium="CPU" BlockRemoved)
    wasted_share: float | None  # of those, the share never loaded while held
    wasted_bytes: float | None  # bytes stored and dropped unused (None: KV bytes unknown)
    # Bytes computed between a returning block's computation and its return, covering half
    # and 90% of returns: about the CPU tier that would have held them (None: no returns).
    reuse_gap_bytes_half: float | None = None
    reuse_gap_bytes_most: float | None = None


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
    # The same traffic replayed with each policy/threshold: explanations, and the check that
    # a store threshold keeps the hits before it is recommended.
    policy_alternatives: tuple[PolicyPoint, ...] = ()
    evidence: TierEvidence | None = None


@dataclass(frozen=True, slots=True)
class Advice:
    action: Action
    reason: Reason
    explanation: str
    recommended_buffer_bytes: float | None = None
    numbers: Mapping[str, float | None] = field(default_factory=dict)
    candidate: Action | None = None  # what the latest evaluation alone would say
