"""The advisor: one current action per engine, with the reason and the numbers behind it.

Pure decision logic over what the exporter already derived (window ratios, the
marginal prefill fit, the TTFT fit of loaded tokens, the what-if curve, memory
headroom, PCIe load). The only state is hysteresis: a new action must win several
evaluations in a row before it replaces the current one, so advice does not flap.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from exporter.derive import EngineDerived
from exporter.thresholds import DEFAULT, Thresholds
from exporter.vllm_metrics import EngineKey

GIB = 1 << 30


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
    reason: str
    explanation: str
    recommended_buffer_bytes: float | None = None
    numbers: Mapping[str, float | None] = field(default_factory=dict)
    candidate: Action | None = None  # what the latest evaluation alone would say


# Reasons after which a better eviction policy changes nothing: reloads do not pay at all,
# or the evidence is missing.
_NO_POLICY_NOTE = frozenset(
    {"reload_slower_than_recompute", "reload_gain_too_small", "memory_near_limit"}
)


def _policy_label(p: PolicyPoint) -> str:
    return f"eviction_policy {p.policy}" + (
        f", store_threshold {p.store_threshold}" if p.store_threshold >= 2 else ""
    )


def _policy_note(inp: AdvisorInput, th: Thresholds, action: Action, reason: str) -> str:
    """A sentence naming a policy/threshold the what-if says serves materially more."""
    alts = inp.policy_alternatives
    if not alts or action == Action.INSUFFICIENT_DATA or reason in _NO_POLICY_NOTE:
        return ""
    # Ties go to the simpler setting: LRU, then no threshold.
    best = max(alts, key=lambda p: (p.hit_ratio, p.policy == "lru", -p.store_threshold))
    base = next((p for p in alts if p.configured), None)
    if base is None:
        if action != Action.ENABLE_OFFLOAD:
            return ""
        base = next((p for p in alts if p.policy == "lru" and p.store_threshold < 2), None)
    if base is None or best.hit_ratio - base.hit_ratio < th.whatif_gain_material:
        return ""
    extra: dict[str, object] = {"eviction_policy": best.policy}
    if best.store_threshold != base.store_threshold:
        extra["store_threshold"] = best.store_threshold
    which = "the configured" if base.configured else "vLLM's default"
    return (
        f" The what-if replay at {_gib(best.cpu_buffer_bytes)} serves "
        f"{_pct(best.hit_ratio)} of prompt tokens with {_policy_label(best)} against "
        f"{_pct(base.hit_ratio)} with {which} {_policy_label(base)}: set "
        f"kv_connector_extra_config {json.dumps(extra)}."
    )


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _gib(x: float | None) -> str:
    if x is not None and 0 < x < GIB:  # 32 MiB, not "0.03 GiB"
        return f"{x / (1 << 20):.0f} MiB"
    return "n/a" if x is None else f"{x / GIB:.2f} GiB"


def _rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f} tokens/s"


# Pinned pools cost more than the flag says: vLLM 0.26 rounds each per-layer tensor up to a
# power of two (0.5 GiB became 896 MiB on the H200); assume the worst when not measured.
DEFAULT_POOL_OVERHEAD = 2.0


def _headroom_for_buffer(inp: AdvisorInput, th: Thresholds) -> float | None:
    """Largest CPU buffer (flag bytes) that keeps memory under the high-water mark."""
    mem = inp.memory
    if mem is None or mem.limit_bytes is None or mem.usage_bytes is None:
        return None
    overhead = mem.pool_to_buffer_ratio or DEFAULT_POOL_OVERHEAD
    current_pool = mem.pool_bytes or 0.0
    allowed_pool = th.memory_usage_high * mem.limit_bytes - (mem.usage_bytes - current_pool)
    return max(0.0, allowed_pool / overhead)


def _knee(points: Sequence[WhatIfPoint], limit: float | None, share: float) -> WhatIfPoint | None:
    """Smallest affordable size reaching `share` of the best affordable hit ratio."""
    fits = [p for p in points if limit is None or p.cpu_buffer_bytes <= limit]
    if not fits:
        return None
    best = max(p.hit_ratio for p in fits)
    for p in sorted(fits, key=lambda p: p.cpu_buffer_bytes):
        if p.hit_ratio >= share * best:
            return p
    return None


def evaluate(inp: AdvisorInput, th: Thresholds = DEFAULT) -> Advice:
    """The advice for one engine from one evaluation, without hysteresis."""
    d = inp.derived
    w = d.window
    prompt = w.get("prompt_tokens")
    speedup = d.transfer_speedup
    ofit = d.offload_fit
    saving = ofit.saving_seconds_per_token if ofit is not None else None
    headroom = _headroom_for_buffer(inp, th)
    numbers: dict[str, float | None] = {
        "window_covered_seconds": inp.covered_seconds,
        "prompt_tokens": prompt,
        "kv_cache_usage_ratio": d.kv_usage,
        "gpu_prefix_hit_ratio": d.gpu_prefix_hit_ratio,
        "offload_hit_ratio": d.offload_hit_ratio,
        "offload_reuse_ratio": d.reuse_ratio,
        "recompute_tokens_per_second": d.recompute_tokens_per_second,
        "transfer_tokens_per_second": d.transfer_tokens_per_second,
        "transfer_speedup_ratio": speedup,
        "transfer_rate_estimated": 1.0 if d.transfer_estimated else 0.0,
        "measured_saving_seconds_per_loaded_token": saving,
        "offload_buffer_bytes": d.offload_buffer_bytes,
        "affordable_buffer_bytes": headroom,
        "pcie_utilization_ratio": inp.pcie_utilization,
    }
    if inp.whatif is not None:
        numbers["recomputed_after_eviction_tokens"] = inp.whatif.recomputed_after_eviction_tokens
        numbers["whatif_configured_hit_ratio"] = inp.whatif.configured_hit_ratio
    if inp.memory is not None:
        numbers["memory_limit_bytes"] = inp.memory.limit_bytes
        numbers["memory_usage_bytes"] = inp.memory.usage_bytes
        numbers["offload_pool_bytes"] = inp.memory.pool_bytes

    def advice(action: Action, reason: str, text: str, rec: float | None = None) -> Advice:
        return Advice(action, reason, text + _policy_note(inp, th, action, reason), rec, numbers)

    best = max(inp.policy_alternatives, key=lambda p: p.hit_ratio, default=None)
    if best is not None:
        numbers["whatif_best_policy_hit_ratio"] = best.hit_ratio

    if not d.fresh:
        return advice(
            Action.INSUFFICIENT_DATA,
            "target_stale",
            "The target has not been scraped successfully for more than two "
            "intervals; no advice is given from stale data.",
        )
    if inp.covered_seconds < th.min_window_seconds:
        need = th.min_window_seconds - inp.covered_seconds
        return advice(
            Action.INSUFFICIENT_DATA,
            "window_too_short",
            f"Only {inp.covered_seconds:.0f} s of data; {need:.0f} s more are needed "
            "before the ratios are worth acting on.",
        )
    if prompt is None or prompt < th.min_prompt_tokens:
        seen = prompt or 0.0
        return advice(
            Action.INSUFFICIENT_DATA,
            "too_little_traffic",
            f"{seen:,.0f} prompt tokens in the window; at least "
            f"{th.min_prompt_tokens:,.0f} are needed ({th.min_prompt_tokens - seen:,.0f} "
            "more) before hit ratios say anything.",
        )

    if d.offload_enabled:
        return _evaluate_on(inp, th, advice, headroom, saving)
    return _evaluate_off(inp, th, advice, headroom)


def _evaluate_on(
    inp: AdvisorInput,
    th: Thresholds,
    advice: Callable[..., Advice],
    headroom: float | None,
    saving: float | None,
) -> Advice:
    d = inp.derived
    mem = inp.memory
    if (
        mem is not None
        and mem.limit_bytes
        and mem.usage_bytes is not None
        and mem.usage_bytes >= th.memory_usage_high * mem.limit_bytes
    ):
        rec = min(headroom, d.offload_buffer_bytes or headroom) if headroom is not None else None
        return advice(
            Action.REDUCE_BUFFER_OOM_RISK,
            "memory_near_limit",
            f"The container uses {_pct(mem.usage_bytes / mem.limit_bytes)} of its memory limit "
            f"({_gib(mem.limit_bytes)}); the pinned offload pool ({_gib(mem.pool_bytes)}) is "
            "never swapped or reclaimed, so the next allocation risks an OOM kill. Reduce "
            f"--kv-offloading-size to at most {_gib(rec)} or raise the limit.",
            rec,
        )
    ofit = d.offload_fit
    if ofit is not None:
        bounds = ofit.saving_bounds()
        costs = (
            f"a token loaded from the CPU tier costs {ofit.loaded_seconds_per_token * 1e6:.2f} us "
            f"of TTFT and a recomputed one {ofit.computed_seconds_per_token * 1e6:.2f} us"
        )
        slower = bounds is not None and bounds[1] <= 0 and ofit.reload_significantly_costly
        interval = ofit.speedup_bounds() if ofit.valid else None
        if slower or (interval is not None and interval[1] < 1.0):
            return advice(
                Action.DISABLE_OFFLOAD,
                "reload_slower_than_recompute",
                f"Measured from TTFT across the window, {costs}: reloading does not beat "
                "recomputing on this model and GPU (fixed per-request cost dominates). Offload "
                "only adds PCIe traffic and pinned memory here; turn it off.",
            )
        if interval is not None and interval[1] < th.transfer_speedup_min:
            return advice(
                Action.DISABLE_OFFLOAD,
                "reload_gain_too_small",
                f"Measured from TTFT across the window, {costs}: reloading is at most "
                f"{interval[1]:.2f}x faster than recomputing (needs "
                f"{th.transfer_speedup_min:.1f}x), too little to pay for the pinned memory and "
                "PCIe traffic; turn it off.",
            )
    if (ofit is None or not ofit.valid) and (
        d.transfer_speedup is not None and d.transfer_speedup < 1.0
    ):
        return advice(
            Action.DISABLE_OFFLOAD,
            "reload_slower_than_recompute",
            f"The CPU tier reloads {_rate(d.transfer_tokens_per_second)} but "
            + (
                "recomputing costs no measurable time per token on this engine"
                if d.recompute_negligible
                else f"this engine recomputes {_rate(d.recompute_tokens_per_second)} at the margin"
            )
            + f" (speedup {d.transfer_speedup:.2f}): every reload is slower than recomputing. "
            "Turn offload off.",
        )
    whatif = inp.whatif
    hit = d.offload_hit_ratio
    if hit is not None and hit < th.offload_hit_ratio_material:
        grow = _bigger_size(inp, th, headroom)
        # Too few hits to measure what a reload costs: a bigger buffer is only worth
        # suggesting when the estimate (as for enabling) clears the same margin.
        pays = (
            ofit is not None
            and ofit.proves_gain
            and (ofit.measured_speedup or math.inf) >= th.transfer_speedup_min
        ) or (
            d.transfer_speedup_lower is not None
            and d.transfer_speedup_lower >= th.transfer_speedup_min
        )
        if grow is not None and pays:
            return advice(
                Action.GROW_BUFFER,
                "buffer_too_small",
                f"Only {_pct(hit)} of prompt tokens come back from the CPU tier, but the "
                f"what-if replay of this traffic reaches {_pct(grow.hit_ratio)} with "
                f"{_gib(grow.cpu_buffer_bytes)}, which fits the memory headroom.",
                grow.cpu_buffer_bytes,
            )
        upper = _estimate_upper(d)
        if grow is not None and (upper is None or upper >= th.transfer_speedup_min):
            # A bigger buffer would catch traffic, and a reload may or may not pay: neither
            # growing nor removing the tier is justified yet.
            return advice(
                Action.INSUFFICIENT_DATA,
                "speedup_uncertain",
                f"Only {_pct(hit)} of prompt tokens come back from the CPU tier; the what-if "
                f"replay reaches {_pct(grow.hit_ratio)} with {_gib(grow.cpu_buffer_bytes)}, but "
                "whether reloads beat recomputing here is not measured precisely enough yet to "
                "recommend growing the buffer or removing it.",
            )
        return advice(
            Action.DISABLE_OFFLOAD,
            "no_reuse",
            f"Only {_pct(hit)} of prompt tokens come back from the CPU tier and "
            f"{_pct(d.reuse_ratio)} of the bytes stored are ever loaded: offloaded prefixes "
            "are not reused, so offload costs PCIe bandwidth and pinned memory for nothing.",
        )
    if (
        ofit is None
        or not ofit.proves_gain
        or (ofit.measured_speedup or math.inf) < th.transfer_speedup_min
    ):
        # The copy-time counter alone cannot show that offload pays (the H200 lesson):
        # wait for the TTFT fit to separate loaded from computed tokens with confidence.
        why = (
            "the scrape intervals do not yet vary enough in loaded and computed tokens to "
            "separate their costs"
            if ofit is None or not ofit.valid or ofit.saving_stderr is None
            else f"the measured saving per loaded token, {ofit.saving_seconds_per_token * 1e6:.1f} "
            f"+- {2 * (ofit.saving_stderr or 0) * 1e6:.1f} us, is not yet distinguishable "
            "from zero"
        )
        return advice(
            Action.INSUFFICIENT_DATA,
            "reload_benefit_unmeasured",
            f"{_pct(hit)} of prompt tokens come back from the CPU tier, but whether that makes "
            f"requests faster is not measured yet: {why}. vLLM's copy-time counter alone "
            f"(speedup {d.transfer_speedup or float('nan'):.2f}) leaves out per-load costs.",
        )
    if (
        d.reuse_ratio is not None
        and d.reuse_ratio < th.reuse_ratio_low
        and inp.pcie_utilization is not None
        and inp.pcie_utilization >= th.pcie_utilization_high
    ):
        return advice(
            Action.RAISE_STORE_THRESHOLD,
            "stores_without_reuse_pcie_busy",
            f"Loads are {_pct(d.reuse_ratio)} of stores while PCIe runs at "
            f"{_pct(inp.pcie_utilization)} of the link: most stores are never read back. Set "
            "kv_connector_extra_config store_threshold to 2 or more so only prefixes seen "
            "repeatedly are offloaded.",
        )
    if whatif is not None and whatif.configured_hit_ratio is not None:
        grow = _bigger_size(inp, th, headroom)
        if grow is not None:
            return advice(
                Action.GROW_BUFFER,
                "buffer_too_small",
                f"The what-if replay reaches {_pct(grow.hit_ratio)} with "
                f"{_gib(grow.cpu_buffer_bytes)} against {_pct(whatif.configured_hit_ratio)} "
                f"with the configured {_gib(d.offload_buffer_bytes)}.",
                grow.cpu_buffer_bytes,
            )
        shrink = _smaller_size(inp, th)
        if shrink is not None:
            return advice(
                Action.SHRINK_BUFFER,
                "buffer_larger_than_needed",
                f"The what-if replay reaches {_pct(shrink.hit_ratio)} with only "
                f"{_gib(shrink.cpu_buffer_bytes)}, about what the configured "
                f"{_gib(d.offload_buffer_bytes)} gives ({_pct(whatif.configured_hit_ratio)}); "
                "the rest of the pinned pool is wasted memory.",
                shrink.cpu_buffer_bytes,
            )
    gain = ""
    if saving is not None:
        gain = f" Each loaded token saves {saving * 1e6:.2f} us of TTFT (measured)."
    return advice(
        Action.KEEP,
        "paying_off",
        f"{_pct(hit)} of prompt tokens are served from the CPU tier and reloads beat "
        f"recomputing (speedup {d.transfer_speedup or float('nan'):.2f}).{gain} Keep it.",
    )


def _estimate_upper(d: EngineDerived) -> float | None:
    """Upper end of the estimated copy-based speedup (transfer rate x recompute cost)."""
    fit = d.prefill_fit
    if fit is None or fit.upper is None or d.transfer_tokens_per_second is None:
        return None
    return max(fit.upper, 0.0) * d.transfer_tokens_per_second


def _bigger_size(inp: AdvisorInput, th: Thresholds, headroom: float | None) -> WhatIfPoint | None:
    d, w = inp.derived, inp.whatif
    if w is None or not w.points or d.offload_buffer_bytes is None:
        return None
    current = w.configured_hit_ratio
    if current is None:
        current = d.offload_hit_ratio or 0.0
    bigger = [p for p in w.points if p.cpu_buffer_bytes > d.offload_buffer_bytes]
    knee = _knee(bigger, headroom, th.whatif_knee_share)
    if knee is not None and knee.hit_ratio - current >= th.whatif_gain_material:
        return knee
    return None


def _smaller_size(inp: AdvisorInput, th: Thresholds) -> WhatIfPoint | None:
    d, w = inp.derived, inp.whatif
    if w is None or w.configured_hit_ratio is None or d.offload_buffer_bytes is None:
        return None
    enough = [
        p
        for p in w.points
        if p.cpu_buffer_bytes < d.offload_buffer_bytes
        and p.hit_ratio >= w.configured_hit_ratio - th.whatif_gain_material / 2
    ]
    return min(enough, key=lambda p: p.cpu_buffer_bytes) if enough else None


def _evaluate_off(
    inp: AdvisorInput, th: Thresholds, advice: Callable[..., Advice], headroom: float | None
) -> Advice:
    d = inp.derived
    w = d.window
    prompt = w.get("prompt_tokens") or 0.0
    pressure = (d.kv_usage is not None and d.kv_usage >= th.kv_usage_high) or (
        w.get("preemptions", 0.0) > 0
    )
    whatif = inp.whatif
    if whatif is None:
        if pressure:
            return advice(
                Action.INSUFFICIENT_DATA,
                "kv_events_off",
                f"GPU KV cache is under pressure (usage {_pct(d.kv_usage)}, "
                f"{w.get('preemptions', 0):.0f} preemptions) but without KV cache events the "
                "exporter cannot tell whether evicted prefixes come back. Enable "
                "--kv-events-config and point it at the exporter.",
            )
        return advice(
            Action.NO_ACTION,
            "no_kv_pressure",
            f"GPU KV cache usage is {_pct(d.kv_usage)} with no preemptions: "
            "offload would have nothing to catch.",
        )
    share = whatif.recomputed_after_eviction_tokens / prompt if prompt else 0.0
    numbers_share = f"{_pct(share)} of prompt tokens"
    if share < th.recompute_share_material:
        return advice(
            Action.NO_ACTION,
            "no_recompute_after_eviction",
            f"Prefixes evicted from GPU KV and then needed again are {numbers_share} "
            f"(below {_pct(th.recompute_share_material)}): offload would rarely hit.",
        )
    if d.transfer_speedup is None:
        why = (
            "no GPU/PCIe link is visible (NVML unavailable) and no --assumed-load-bandwidth is set"
        )
        if d.kv_bytes_per_token is None:
            why = "the KV bytes per token are unknown (set --kv-bytes-per-token)"
        elif d.recompute_tokens_per_second is None:
            why = (
                "the marginal recompute speed is not identified yet (needs varied request "
                "sizes across scrape intervals)"
            )
        return advice(
            Action.INSUFFICIENT_DATA,
            "transfer_rate_unknown",
            f"Evicted prefixes are recomputed ({numbers_share}), so a CPU tier could catch "
            f"them, but whether reloading beats recomputing cannot be judged: {why}. Note that "
            "vLLM's CPU offload needs a CUDA or XPU GPU.",
        )
    if d.transfer_speedup < th.transfer_speedup_min:
        return advice(
            Action.NO_ACTION,
            "reload_not_faster_estimate",
            f"Evicted prefixes are recomputed ({numbers_share}), but reloading would run at "
            f"{_rate(d.transfer_tokens_per_second)} against {_rate(d.recompute_tokens_per_second)} "
            f"of marginal recompute (speedup {d.transfer_speedup:.2f}, below "
            f"{th.transfer_speedup_min:.1f} with fixed per-load costs not yet counted): "
            "offload would not make TTFT better on this model and GPU.",
        )
    lower = d.transfer_speedup_lower
    if lower is None or lower < th.transfer_speedup_min:
        fit = d.prefill_fit
        spread = (
            f" (per-token recompute cost {fit.seconds_per_token * 1e6:.1f} +- "
            f"{2 * fit.stderr * 1e6:.1f} us over {fit.points} intervals)"
            if fit is not None and fit.stderr is not None
            else ""
        )
        return advice(
            Action.INSUFFICIENT_DATA,
            "speedup_uncertain",
            f"Evicted prefixes are recomputed ({numbers_share}) and the best estimate says "
            f"reloading would be {d.transfer_speedup:.1f}x faster than recomputing, but the "
            f"marginal recompute cost is not yet measured precisely enough{spread} to be sure "
            f"it clears {th.transfer_speedup_min:.1f}x; more traffic with varied prompt sizes "
            "narrows it.",
        )
    knee = _knee(whatif.points, headroom, th.whatif_knee_share)
    if knee is None or knee.hit_ratio < th.offload_hit_ratio_material:
        best = max((p.hit_ratio for p in whatif.points), default=0.0)
        return advice(
            Action.NO_ACTION,
            "whatif_no_gain",
            f"The what-if replay of this traffic reaches at most {_pct(best)} from a CPU tier "
            f"that fits the memory headroom ({_gib(headroom)}): not worth the pinned memory.",
        )
    saved = knee.ttft_saved_seconds_per_second
    extra = f", saving about {saved:.3f} s of TTFT per second" if saved is not None else ""
    return advice(
        Action.ENABLE_OFFLOAD,
        "recompute_after_eviction",
        f"{numbers_share} are prefixes recomputed after GPU eviction; a CPU tier of "
        f"{_gib(knee.cpu_buffer_bytes)} would have served {_pct(knee.hit_ratio)} of prompt "
        f"tokens{extra}, and reloading runs {d.transfer_speedup:.1f}x faster than recomputing. "
        f"Start vLLM with --kv-offloading-size {knee.cpu_buffer_bytes / GIB:g} "
        "--kv-offloading-backend native.",
        knee.cpu_buffer_bytes,
    )


class Advisor:
    """Applies hysteresis over evaluations, per engine."""

    def __init__(self, thresholds: Thresholds = DEFAULT, confirm: int = 3) -> None:
        self.thresholds = thresholds
        self.confirm = max(1, confirm)
        self._current: dict[tuple[str, EngineKey], Advice] = {}
        self._pending: dict[tuple[str, EngineKey], tuple[Action, int]] = {}

    def update(self, target: str, inp: AdvisorInput) -> Advice:
        key = (target, inp.derived.key)
        fresh = evaluate(inp, self.thresholds)
        current = self._current.get(key)
        if (
            current is None
            or fresh.action == current.action
            or fresh.action in URGENT
            or current.action == Action.INSUFFICIENT_DATA
        ):
            self._pending.pop(key, None)
            self._current[key] = fresh
            return fresh
        action, count = self._pending.get(key, (fresh.action, 0))
        count = count + 1 if action == fresh.action else 1
        self._pending[key] = (fresh.action, count)
        if count >= self.confirm:
            self._pending.pop(key, None)
            self._current[key] = fresh
            return fresh
        # Keep the standing advice; refresh its numbers, say what is pending.
        held = Advice(
            current.action,
            current.reason,
            current.explanation,
            current.recommended_buffer_bytes,
            fresh.numbers,
            fresh.action,
        )
        self._current[key] = held
        return held

    def forget_missing(self, present: set[tuple[str, EngineKey]]) -> None:
        for key in [k for k in self._current if k not in present]:
            self._current.pop(key, None)
            self._pending.pop(key, None)


def advice_json(target: str, key: EngineKey, a: Advice, th: Thresholds) -> dict[str, Any]:
    def clean(v: float | None) -> float | None:
        return None if v is None or not math.isfinite(v) else v

    return {
        "target": target,
        "model_name": key.model_name,
        "engine": key.engine,
        "action": str(a.action),
        "reason": a.reason,
        "explanation": a.explanation,
        "recommended_buffer_bytes": clean(a.recommended_buffer_bytes),
        "pending_action": str(a.candidate) if a.candidate else None,
        "numbers": {k: clean(v) for k, v in a.numbers.items()},
        "thresholds": {f: getattr(th, f) for f in th.__dataclass_fields__},
    }
