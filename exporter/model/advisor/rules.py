"""The advisor's rules: one action per engine from one evaluation, with the reason and the
numbers behind it.

Pure decision logic over what the exporter already derived (window ratios, the marginal
prefill fit, the TTFT fit of loaded tokens, the what-if curve, memory headroom, PCIe load).
Hysteresis over evaluations is exporter.model.advisor.hysteresis.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence

from exporter.model.advisor.text import GIB, gib, pct, rate
from exporter.model.advisor.types import (
    Action,
    Advice,
    AdvisorInput,
    PolicyPoint,
    Reason,
    TierEvidence,
    WhatIfPoint,
)
from exporter.model.derive.balance import LOAD_STEPS, SAME_LOAD, DeliveredSaving, OffloadBalance
from exporter.model.derive.engines import EngineDerived
from exporter.thresholds import DEFAULT, Thresholds

# Reasons after which a better eviction policy changes nothing: reloads do not pay at all,
# or the evidence is missing.
_NO_POLICY_NOTE = frozenset(
    {
        Reason.RELOAD_SLOWER_THAN_RECOMPUTE,
        Reason.RELOAD_GAIN_TOO_SMALL,
        Reason.TTFT_SAVING_IMMATERIAL,
        Reason.MEMORY_NEAR_LIMIT,
        Reason.STORES_NEVER_LOADED,  # its text is the policy comparison already
    }
)


def _policy_label(p: PolicyPoint) -> str:
    return f"eviction_policy {p.policy}" + (
        f", store_threshold {p.store_threshold}" if p.store_threshold >= 2 else ""
    )


def _policy_note(inp: AdvisorInput, th: Thresholds, action: Action, reason: Reason) -> str:
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
        f" The what-if replay at {gib(best.cpu_buffer_bytes)} serves "
        f"{pct(best.hit_ratio)} of prompt tokens with {_policy_label(best)} against "
        f"{pct(base.hit_ratio)} with {which} {_policy_label(base)}: set "
        f"kv_connector_extra_config {json.dumps(extra)}."
    )


# Reasons given before any evidence is weighed: a note on the evidence says nothing there.
_NO_EVIDENCE_NOTE = frozenset(
    {Reason.TARGET_STALE, Reason.WINDOW_TOO_SHORT, Reason.TOO_LITTLE_TRAFFIC}
)


def _lost_events_note(inp: AdvisorInput, reason: Reason) -> str:
    """A sentence saying the what-if missed KV-event batches in the window, if it did.

    Not a threshold: a block whose store was lost can never come back as a hit, so every
    loss biases the curve down, and the advice built on it towards leaving the tier off or
    smaller (H200 matrix with 10 % of messages lost: 14B RAG-Zipf left off where 32 GiB
    paid, 8B long-context sized at 8 GiB instead of 16; bench/perturb_replay.py)."""
    w = inp.whatif
    if w is None or w.lost_batch_share <= 0 or reason in _NO_EVIDENCE_NOTE:
        return ""
    return (
        f" {pct(w.lost_batch_share)} of the window's KV-event batches were lost before the "
        "exporter saw them (kvoffload_kv_events_lost_total, _dropped_total): the what-if "
        "never saw their blocks, so it undercounts what a CPU tier would catch."
    )


def _eager_note(d: EngineDerived, action: Action) -> str:
    """A caution on an enable or a grow for an engine without CUDA graphs.

    Not a rule: nothing a window without offload shows prices it. Such an engine launches
    every kernel of every step from its one thread, and each request that loads adds a step
    of its own; on the eager matrix recordings the enables the what-if predicted to save
    saved less (8B bursts: +0.117 s/s predicted, +0.028 measured) or cost (4B bursts:
    +0.066 predicted, 38.9 % more TTFT measured), where with CUDA graphs the same traffic
    paid (docs/advisor.md, "Where enabling is wrong")."""
    if d.cuda_graphs is not False or action not in (Action.ENABLE_OFFLOAD, Action.GROW_BUFFER):
        return ""
    return (
        " This engine runs without CUDA graphs (--enforce-eager or cudagraph_mode NONE): "
        "there a CPU tier has saved less than predicted before enabling, or cost. Watch "
        "kvoffload_offload_delivered_ttft_saved_seconds_per_second once it is on: the advice "
        "turns offload off when the same traffic is not faster than before."
    )


def _decode_note(d: EngineDerived) -> str:
    """A caution on the balance of an engine that decodes (one whose window timed a decode
    step).

    Not a rule: on both decoding recordings with CUDA graphs the balance ran well above what
    the pair of runs measured (8B bursts on two hosts: 27.13 s against 12.48 s, 36.33 s
    against 21.66 s), where the one-token pair on the second host came close (21.46 s against
    19.67 s; docs/whatif.md, "What batch 40 measured"). The saving
    predicted before enabling came within on the second host, so the enable says nothing."""
    if d.decode_step_seconds is None:
        return ""
    return (
        " This engine decodes: on the recordings whose requests decode, this balance ran "
        "1.7 to 2.2 times what enabling delivered to the same traffic; what settles it is the "
        "delivered saving, measured once the exporter has seen this traffic with offload off "
        "(kvoffload_offload_delivered_ttft_saved_seconds_per_second)."
    )


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


def _numbers(inp: AdvisorInput, headroom: float | None) -> dict[str, float | None]:
    """The numbers behind an advice (types.NUMBERS says what each is)."""
    d = inp.derived
    prompt = d.window.get("prompt_tokens")
    speedup = d.transfer_speedup
    ofit = d.offload_fit
    saving = ofit.saving_seconds_per_token if ofit is not None else None
    numbers: dict[str, float | None] = {
        "window_covered_seconds": inp.covered_seconds,
        "prompt_tokens": prompt,
        "kv_cache_usage_ratio": d.kv_usage,
        "gpu_cache_turnover": d.gpu_cache_turnover,
        "gpu_prefix_hit_ratio": d.gpu_prefix_hit_ratio,
        "offload_hit_ratio": d.offload_hit_ratio,
        "offload_reuse_ratio": d.reuse_ratio,
        "recompute_tokens_per_second": d.recompute_tokens_per_second,
        "transfer_tokens_per_second": d.transfer_tokens_per_second,
        "transfer_speedup_ratio": speedup,
        "transfer_rate_estimated": 1.0 if d.transfer_estimated else 0.0,
        "engine_cuda_graphs": None if d.cuda_graphs is None else float(d.cuda_graphs),
        "decode_step_seconds": d.decode_step_seconds,
        "offload_load_steps_seconds": (
            d.balance.load_step_seconds
            if d.balance is not None and d.decode_step_seconds is not None
            else None
        ),
        "measured_saving_seconds_per_loaded_token": saving,
        "offload_buffer_bytes": d.offload_buffer_bytes,
        "offload_stored_since_start_bytes": d.offload_stored_bytes,
        "computed_token_floor_seconds": d.computed_token_floor,
        "affordable_buffer_bytes": headroom,
        "pcie_utilization_ratio": inp.pcie_utilization,
    }
    if d.delivered is not None:
        numbers["offload_delivered_saving_seconds"] = d.delivered.net_seconds
        numbers["offload_delivered_saving_stderr_seconds"] = d.delivered.stderr_seconds
        numbers["offload_delivered_saving_share"] = d.delivered.share()
        # Measured where the delivered saving is, from the same fit before enabling.
        cost, cost_se = d.request_cost or (None, None)
        numbers["offload_request_cost_seconds"] = cost
        numbers["offload_request_cost_stderr_seconds"] = cost_se
    if d.balance is not None:
        _, stores = d.balance.priced()
        numbers["offload_net_saving_seconds"] = d.balance.net_seconds
        numbers["offload_net_saving_stderr_seconds"] = d.balance.net_stderr_seconds
        numbers["offload_net_saving_share"] = d.balance.share()
        numbers["offload_store_cost_seconds"] = stores
    if inp.whatif is not None:
        numbers["recomputed_after_eviction_tokens"] = inp.whatif.recomputed_after_eviction_tokens
        numbers["whatif_configured_hit_ratio"] = inp.whatif.configured_hit_ratio
        numbers["whatif_requests_per_step"] = inp.whatif.requests_per_step
        numbers["whatif_load_wait_share"] = inp.whatif.load_wait_share
        numbers["whatif_queue_utilisation"] = inp.whatif.queue_utilisation
        numbers["whatif_launch_wait_seconds"] = inp.whatif.launch_wait_seconds
        numbers["whatif_launch_waiters_per_load"] = inp.whatif.launch_waiters_per_load
        numbers["kv_event_batches_lost_ratio"] = inp.whatif.lost_batch_share
    if inp.evidence is not None:
        ev = inp.evidence
        numbers["cpu_tier_dropped_chunks"] = float(ev.dropped_chunks)
        numbers["wasted_store_ratio"] = ev.wasted_share
        numbers["wasted_store_bytes"] = ev.wasted_bytes
        numbers["reuse_gap_bytes_half"] = ev.reuse_gap_bytes_half
        numbers["reuse_gap_bytes_most"] = ev.reuse_gap_bytes_most
    if inp.memory is not None:
        numbers["memory_limit_bytes"] = inp.memory.limit_bytes
        numbers["memory_usage_bytes"] = inp.memory.usage_bytes
        numbers["offload_pool_bytes"] = inp.memory.pool_bytes

    best = max(inp.policy_alternatives, key=lambda p: p.hit_ratio, default=None)
    if best is not None:
        numbers["whatif_best_policy_hit_ratio"] = best.hit_ratio
    return numbers


def evaluate(inp: AdvisorInput, th: Thresholds = DEFAULT) -> Advice:
    """The advice for one engine from one evaluation, without hysteresis."""
    d = inp.derived
    prompt = d.window.get("prompt_tokens")
    ofit = d.offload_fit
    saving = ofit.saving_seconds_per_token if ofit is not None else None
    headroom = _headroom_for_buffer(inp, th)
    numbers = _numbers(inp, headroom)

    def advice(action: Action, reason: Reason, text: str, rec: float | None = None) -> Advice:
        note = (
            _policy_note(inp, th, action, reason)
            + _lost_events_note(inp, reason)
            + _eager_note(d, action)
        )
        return Advice(action, reason, text + note, rec, numbers)

    if not d.fresh:
        return advice(
            Action.INSUFFICIENT_DATA,
            Reason.TARGET_STALE,
            "The target has not been scraped successfully for more than two "
            "intervals; no advice is given from stale data.",
        )
    if inp.covered_seconds < th.min_window_seconds:
        need = th.min_window_seconds - inp.covered_seconds
        return advice(
            Action.INSUFFICIENT_DATA,
            Reason.WINDOW_TOO_SHORT,
            f"Only {inp.covered_seconds:.0f} s of data; {need:.0f} s more are needed "
            "before the ratios are worth acting on.",
        )
    if prompt is None or prompt < th.min_prompt_tokens:
        seen = prompt or 0.0
        return advice(
            Action.INSUFFICIENT_DATA,
            Reason.TOO_LITTLE_TRAFFIC,
            f"{seen:,.0f} prompt tokens in the window; at least "
            f"{th.min_prompt_tokens:,.0f} are needed ({th.min_prompt_tokens - seen:,.0f} "
            "more) before hit ratios say anything.",
        )

    if d.offload_enabled:
        return _evaluate_on(inp, th, advice, headroom, saving)
    return _evaluate_off(inp, th, advice, headroom)


def _evaluate_on(  # noqa: PLR0911, PLR0912, PLR0915  a decision list: rule order is the policy, read top to bottom
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
            Reason.MEMORY_NEAR_LIMIT,
            f"The container uses {pct(mem.usage_bytes / mem.limit_bytes)} of its memory limit "
            f"({gib(mem.limit_bytes)}); the pinned offload pool ({gib(mem.pool_bytes)}) is "
            "never swapped or reclaimed, so the next allocation risks an OOM kill. Reduce "
            f"--kv-offloading-size to at most {gib(rec)} or raise the limit.",
            rec,
        )
    # What enabling delivered on this engine, against its own TTFT before: it sees every
    # cost offload adds, so it overrules the per-token fits, both ways.
    delivered = d.delivered
    most = delivered.share(2.0) if delivered is not None else None
    if delivered is not None and most is not None and most < th.ttft_saving_material:
        at_size = f"Since offload was enabled {_delivered_text(delivered)}: a saving of at most "
        # As with the balance: too small a buffer is not a tier that cannot pay.
        bigger = _grow_that_pays(inp, th, headroom, delivered.without_seconds)
        if bigger is not None:
            return _grow_advice(
                inp,
                advice,
                bigger,
                f"{at_size}{pct(most)} at the configured {gib(d.offload_buffer_bytes)}",
            )
        return advice(
            Action.DISABLE_OFFLOAD,
            Reason.DELIVERED_SAVING_IMMATERIAL,
            f"{at_size}{pct(most)} (it pays from {pct(th.ttft_saving_material)})."
            + _request_cost_note(d)
            + " The pinned memory and the PCIe traffic buy nothing here; turn it off.",
        )
    least = delivered.share(-2.0) if delivered is not None else None
    proven = least is not None and least >= th.ttft_saving_material
    ofit = d.offload_fit
    if ofit is not None and not proven:
        bounds = ofit.saving_bounds()
        costs = (
            f"a token loaded from the CPU tier costs {ofit.loaded_seconds_per_token * 1e6:.2f} us "
            f"of TTFT and a recomputed one {ofit.computed_seconds_per_token * 1e6:.2f} us"
        )
        # The two costs' intervals apart, not only their difference's: a fit whose computed
        # token costs less than nothing (32B chat with 48 GiB, where nearly every request
        # loads and computes a similar few hundred tokens: -45 +- 65 us) has a difference
        # that looks certain while it identifies nothing.
        slower = (
            bounds is not None
            and bounds[1] <= 0
            and ofit.reload_significantly_costly
            and ofit.reload_dearer_beyond_doubt
        )
        interval = ofit.speedup_bounds() if ofit.valid else None
        if slower or (interval is not None and interval[1] < 1.0):
            return advice(
                Action.DISABLE_OFFLOAD,
                Reason.RELOAD_SLOWER_THAN_RECOMPUTE,
                f"Measured from TTFT across the window, {costs}: reloading does not beat "
                "recomputing on this model and GPU (fixed per-request cost dominates). Offload "
                "only adds PCIe traffic and pinned memory here; turn it off.",
            )
        if interval is not None and interval[1] < th.transfer_speedup_min:
            return advice(
                Action.DISABLE_OFFLOAD,
                Reason.RELOAD_GAIN_TOO_SMALL,
                f"Measured from TTFT across the window, {costs}: reloading is at most "
                f"{interval[1]:.2f}x faster than recomputing (needs "
                f"{th.transfer_speedup_min:.1f}x), too little to pay for the pinned memory and "
                "PCIe traffic; turn it off.",
            )
    # Without a usable TTFT fit the copy-time speedup decides, at the upper end of its
    # interval: a point estimate below 1 from a slope that is not significant is no proof.
    upper_copy = _estimate_upper(d)
    if (
        not proven
        and (ofit is None or not ofit.valid)
        and upper_copy is not None
        and upper_copy < 1.0
    ):
        return advice(
            Action.DISABLE_OFFLOAD,
            Reason.RELOAD_SLOWER_THAN_RECOMPUTE,
            f"The CPU tier reloads {rate(d.transfer_tokens_per_second)} but "
            + (
                "recomputing costs no measurable time per token on this engine"
                if d.recompute_negligible
                else f"this engine recomputes {rate(d.recompute_tokens_per_second)} at the margin"
            )
            + f" (speedup at most {upper_copy:.2f}): every reload is slower than recomputing. "
            "Turn offload off.",
        )
    whatif = inp.whatif
    hit = d.offload_hit_ratio
    # Checked even with a proven delivered saving: a tier that serves almost no tokens cannot
    # be what made requests faster (drift between the two windows can).
    if hit is not None and hit < th.offload_hit_ratio_material:
        grow = _bigger_size(inp, th, headroom)
        # Too few hits to measure what a reload costs: a bigger buffer is only worth
        # suggesting when the estimate (as for enabling) clears the same margin.
        pays = (
            proven
            or (
                ofit is not None
                and ofit.proves_gain
                and (ofit.measured_speedup or math.inf) >= th.transfer_speedup_min
            )
            or (
                d.transfer_speedup_lower is not None
                and d.transfer_speedup_lower >= th.transfer_speedup_min
            )
        )
        if grow is not None and pays:
            return advice(
                Action.GROW_BUFFER,
                Reason.BUFFER_TOO_SMALL,
                f"Only {pct(hit)} of prompt tokens come back from the CPU tier, but the "
                f"what-if replay of this traffic reaches {pct(grow.hit_ratio)} with "
                f"{gib(grow.cpu_buffer_bytes)}, which fits the memory headroom.",
                grow.cpu_buffer_bytes,
            )
        upper = _estimate_upper(d)
        if grow is not None and (upper is None or upper >= th.transfer_speedup_min):
            # A bigger buffer would catch traffic, and a reload may or may not pay: neither
            # growing nor removing the tier is justified yet.
            return advice(
                Action.INSUFFICIENT_DATA,
                Reason.SPEEDUP_UNCERTAIN,
                f"Only {pct(hit)} of prompt tokens come back from the CPU tier; the what-if "
                f"replay reaches {pct(grow.hit_ratio)} with {gib(grow.cpu_buffer_bytes)}, but "
                "whether reloads beat recomputing here is not measured precisely enough yet to "
                "recommend growing the buffer or removing it.",
            )
        if d.tier_filling:
            return _still_filling(
                d, advice, f"only {pct(hit)} of prompt tokens come back from the CPU tier"
            )
        return advice(
            Action.DISABLE_OFFLOAD,
            Reason.NO_REUSE,
            f"Only {pct(hit)} of prompt tokens come back from the CPU tier and "
            f"{pct(d.reuse_ratio)} of the bytes stored are ever loaded: offloaded prefixes "
            "are not reused, so offload costs PCIe bandwidth and pinned memory for nothing.",
        )
    bal = d.balance
    immaterial = (
        _balance_rule(inp, th, advice, headroom, hit) if bal is not None and not proven else None
    )
    if immaterial is not None:
        return immaterial
    # A balance that saves a material share even at its lower end has measured the per-load
    # and store costs the speedup margin stands in for; so has a delivered saving.
    lower = bal.share(-2.0) if bal is not None else None
    balance_pays = proven or (lower is not None and lower >= th.ttft_saving_material)
    if (
        ofit is not None
        and ofit.proves_gain
        and (ofit.measured_speedup or math.inf) < th.transfer_speedup_min
        and not balance_pays
    ):
        # A reload measurably saves time, but by less than the margin so far: whether it
        # clears the margin is what is uncertain, not whether it saves anything.
        bounds = ofit.speedup_bounds()
        spread = (
            f" (interval {bounds[0]:.2f}-{bounds[1]:.2f}x)"
            if bounds is not None and math.isfinite(bounds[1])
            else ""
        )
        return advice(
            Action.INSUFFICIENT_DATA,
            Reason.SPEEDUP_UNCERTAIN,
            f"{pct(hit)} of prompt tokens come back from the CPU tier and, measured from TTFT "
            f"across the window, a loaded token is {ofit.measured_speedup or 0:.2f}x cheaper "
            f"than a recomputed one{spread}: a gain, but not yet clearly above the "
            f"{th.transfer_speedup_min:.1f}x that pays for the pinned memory, the PCIe traffic "
            "and the stores of every computed block. More traffic narrows it.",
        )
    if not proven and (
        ofit is None
        or not ofit.proves_gain
        or ((ofit.measured_speedup or math.inf) < th.transfer_speedup_min and not balance_pays)
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
            Reason.RELOAD_BENEFIT_UNMEASURED,
            f"{pct(hit)} of prompt tokens come back from the CPU tier, but whether that makes "
            f"requests faster is not measured yet: {why}. vLLM's copy-time counter alone "
            f"(speedup {d.transfer_speedup or float('nan'):.2f}) leaves out per-load costs. "
            + _MEASURE_BEFORE,
        )
    if not proven and bal is not None and lower is not None and lower < 0:
        # The speedup margin stands in for what the per-token fits do not see; the balance
        # charges the stores, and where even it may end in a cost, keeping or resizing the
        # tier is a guess (0.6B long-context with 21 GiB on the H200: a loaded token 2x
        # cheaper by the fit, the balance -1 to +10 %, offload measured 19 % slower).
        return advice(
            Action.INSUFFICIENT_DATA,
            Reason.RELOAD_BENEFIT_UNMEASURED,
            f"{pct(hit)} of prompt tokens come back from the CPU tier, but over the window "
            f"{_balance_text(bal)}: from a cost of {pct(-lower)} to a saving of "
            f"{pct(bal.share(2.0))} of TTFT. Whether offload pays here is not measured "
            "precisely enough yet to keep the tier or resize it; more traffic narrows it.",
        )
    cautious = bal.share(-2.0, th.store_cost_factor_max) if bal is not None else None
    if (
        not proven
        and bal is not None
        and (cautious is None or cautious <= -th.ttft_saving_material)
    ):
        # With offload on every computed block is stored, so no window separates what a
        # store costs the computing requests from what a computed token costs: the balance
        # charges the copy time, and a computed token that got dearer than that prices each
        # loaded token's recompute too high (0.6B long-context with 7 GiB on the H200: kept
        # at +0.64 s, measured -0.57 s; 0.6B chat with 21 GiB: shrink at +27 %, measured a
        # 28 % cost). With the stores at store_cost_factor_max times their copy time, the
        # balance's lower end must stay short of a cost: of the material share that makes
        # offload cost by the truth's definition, which is what makes a keep harmful. The
        # saving itself is proven above, at the copy time.
        at_least = f", a saving of at least {pct(lower)} of TTFT" if lower is not None else ""
        cost = "a cost" if cautious is None else f"a cost of {pct(-cautious)} of TTFT"
        return advice(
            Action.INSUFFICIENT_DATA,
            Reason.RELOAD_BENEFIT_UNMEASURED,
            f"{pct(hit)} of prompt tokens come back from the CPU tier and over the window "
            f"{_balance_text(bal)}{at_least}. But storing every computed block may slow the "
            "computing requests by more than its copy time: at "
            f"{th.store_cost_factor_max:g}x the copy time the balance reaches {cost} (a "
            f"material cost from {pct(th.ttft_saving_material)}). Whether "
            "offload pays here is not measured precisely enough yet to keep the tier or "
            "resize it. " + _MEASURE_BEFORE,
        )
    stepped = bal.share(-2.0, load_steps=True) if bal is not None else None
    if (
        not proven
        and bal is not None
        and bal.load_step_seconds > 0
        and (stepped is None or stepped <= -th.ttft_saving_material)
    ):
        # The TTFT fit prices a loaded token, and the wait for a load's steps is a cost per
        # load: where loads carry similar prefixes it may land in the per-request cost
        # instead, and while requests decode every step is as long as the decode makes it.
        # 4B's bursts with 32 tokens decoded (eager, H100): the balance kept the tier at
        # +9.9 +- 6.5 s, where the same requests took 12.4 % more TTFT with 16 GiB than
        # without; its loaders waited 49.5 ms more, two steps at 22 ms. As with the stores,
        # a bound on the side that makes a keep harmful: with every load charged its steps,
        # the balance's lower end must stay short of a material cost.
        assert d.decode_step_seconds is not None
        at_least = f", a saving of at least {pct(lower)} of TTFT" if lower is not None else ""
        cost = "a cost" if stepped is None else f"a cost of {pct(-stepped)} of TTFT"
        loads = d.window.get("load_ops")
        return advice(
            Action.INSUFFICIENT_DATA,
            Reason.RELOAD_BENEFIT_UNMEASURED,
            f"{pct(hit)} of prompt tokens come back from the CPU tier and over the window "
            f"{_balance_text(bal)}{at_least}. But a request that loads is computed "
            f"{LOAD_STEPS} engine steps after its load goes out, and while requests decode "
            f"this engine steps every {d.decode_step_seconds * 1e3:.1f} ms (vLLM's "
            f"inter-token latency): "
            + (f"the window's {loads:,.0f} loads" if loads is not None else "the loads")
            + f" may have waited {bal.load_step_seconds:.2f} s, and with them the balance "
            f"reaches {cost} (a material cost from {pct(th.ttft_saving_material)}). Whether "
            "offload pays here is not measured precisely enough yet to keep the tier or "
            "resize it. " + _MEASURE_BEFORE,
        )
    if (
        d.reuse_ratio is not None
        and d.reuse_ratio < th.reuse_ratio_low
        and inp.pcie_utilization is not None
        and inp.pcie_utilization >= th.pcie_utilization_high
    ):
        return advice(
            Action.RAISE_STORE_THRESHOLD,
            Reason.STORES_WITHOUT_REUSE_PCIE_BUSY,
            f"Loads are {pct(d.reuse_ratio)} of stores while PCIe runs at "
            f"{pct(inp.pcie_utilization)} of the link: most stores are never read back. Set "
            "kv_connector_extra_config store_threshold to 2 or more so only prefixes seen "
            "repeatedly are offloaded.",
        )
    threshold = _threshold_keeps_hits(inp, th)
    if threshold is not None:
        ev, base, with_threshold = threshold
        assert ev.wasted_share is not None
        wasted = f" ({gib(ev.wasted_bytes)})" if ev.wasted_bytes is not None else ""
        return advice(
            Action.RAISE_STORE_THRESHOLD,
            Reason.STORES_NEVER_LOADED,
            f"Offload pays, but {pct(ev.wasted_share)} of the {ev.dropped_chunks:,} chunks the "
            f"CPU tier dropped were never loaded{wasted}: PCIe traffic and pinned memory spent "
            f"for nothing. The what-if replay with {_policy_label(with_threshold)} serves "
            f"{pct(with_threshold.hit_ratio)} of prompt tokens against "
            f"{pct(base.hit_ratio)} now. Set kv_connector_extra_config "
            f'{{"store_threshold": {with_threshold.store_threshold}}} so only prefixes seen '
            "again are offloaded.",
        )
    # Why the tier pays, said with a resize too: a size is worth changing only because it does.
    gain = ""
    if saving is not None:
        how = (
            "measured, a computed token at the cost measured before offload was enabled: this "
            "window does not separate it"
            if ofit is not None and ofit.computed_before
            else "measured, a computed token at its floor, the model's weight bytes over the "
            "GPU's peak: this window prices it lower"
            if ofit is not None and ofit.computed_floor
            else "measured"
        )
        gain = f" Each loaded token saves {saving * 1e6:.2f} us of TTFT ({how})."
    if proven and delivered is not None:
        gain = (
            f" Since offload was enabled {_delivered_text(delivered)}: a saving of at least "
            f"{pct(least)}." + _request_cost_note(d)
        )
    elif bal is not None and (share := bal.share()) is not None:
        gain += f" Over the window {_balance_text(bal)} ({pct(share)} of TTFT)." + _decode_note(d)
    if whatif is not None and whatif.configured_hit_ratio is not None:
        grow = _bigger_size(inp, th, headroom)
        if grow is not None:
            return advice(
                Action.GROW_BUFFER,
                Reason.BUFFER_TOO_SMALL,
                f"The what-if replay reaches {pct(grow.hit_ratio)} with "
                f"{gib(grow.cpu_buffer_bytes)} against {pct(whatif.configured_hit_ratio)} "
                f"with the configured {gib(d.offload_buffer_bytes)}." + _reuse_gap_note(inp) + gain,
                grow.cpu_buffer_bytes,
            )
        shrink = _smaller_size(inp, th)
        if shrink is not None:
            return advice(
                Action.SHRINK_BUFFER,
                Reason.BUFFER_LARGER_THAN_NEEDED,
                f"The what-if replay reaches {pct(shrink.hit_ratio)} with only "
                f"{gib(shrink.cpu_buffer_bytes)}, about what the configured "
                f"{gib(d.offload_buffer_bytes)} gives ({pct(whatif.configured_hit_ratio)}); "
                "the rest of the pinned pool is wasted memory." + gain,
                shrink.cpu_buffer_bytes,
            )
    beat = (
        f"reloads beat recomputing (speedup {d.transfer_speedup or float('nan'):.2f})"
        if not proven
        else "requests are faster than before it was enabled"
    )
    return advice(
        Action.KEEP,
        Reason.PAYING_OFF,
        f"{pct(hit)} of prompt tokens are served from the CPU tier and {beat}.{gain} Keep it.",
    )


# Where the window alone cannot price offload (a traffic shape whose intervals never separate
# the costs waits however long it runs), the operator can give it what decides: on the H200
# recordings, seven of the nine offload runs that waited alone decided, all agreeing, once
# their engine's cost with offload off was known (docs/gpu-acceptance.md).
_MEASURE_BEFORE = (
    "What this traffic cost the engine with offload off decides it: run the engine without "
    "--kv-offloading-size for a few minutes of similar traffic (a request rate within "
    f"{1 + SAME_LOAD:g}x), "
    "watched by this exporter (with --state-file where the exporter restarts with vLLM), "
    "then enable it again (docs/advisor.md, what enabling delivered)."
)


def _balance_rule(
    inp: AdvisorInput,
    th: Thresholds,
    advice: Callable[..., Advice],
    headroom: float | None,
    hit: float | None,
) -> Advice | None:
    """Offload on: the window's balance saves too little even at its upper end. Grow when a
    larger buffer that fits is predicted to pay, else turn the tier off; None otherwise."""
    d = inp.derived
    bal = d.balance
    assert bal is not None
    upper = bal.share(2.0)
    if upper is not None and upper < th.ttft_saving_material:
        # Too small a buffer saves too little; a larger one the what-if says would pay is
        # the answer then, not turning the tier off.
        grown = _grow_that_pays(inp, th, headroom, bal.ttft_seconds + bal.net_seconds)
        if grown is not None:
            return _grow_advice(
                inp,
                advice,
                grown,
                f"At the configured {gib(d.offload_buffer_bytes)} {_balance_text(bal)}, "
                f"at most {pct(upper)} of TTFT",
            )
        if d.tier_filling:
            return _still_filling(
                d, advice, f"over the window {_balance_text(bal)}: at most {pct(upper)} of TTFT"
            )
        return advice(
            Action.DISABLE_OFFLOAD,
            Reason.TTFT_SAVING_IMMATERIAL,
            f"{pct(hit)} of prompt tokens come back from the CPU tier, but over the window "
            f"{_balance_text(bal)}: at most {pct(upper)} of the TTFT this traffic would "
            f"have without offload (it pays from {pct(th.ttft_saving_material)}). The "
            "pinned memory and the PCIe traffic buy nothing here; turn it off.",
        )
    return None


def _still_filling(d: EngineDerived, advice: Callable[..., Advice], so_far: str) -> Advice:
    """Instead of turning off a tier that has never filled: what it saves is still growing.
    A window that starts with the tier empty measures less than the tier will serve (14B
    RAG-Zipf with 32 GiB on the H200: two minutes in, 28 of its 32 GiB stored, the balance
    said at most 1.2 % of TTFT; over the run offload saved 6.4 %)."""
    return advice(
        Action.INSUFFICIENT_DATA,
        Reason.TIER_STILL_FILLING,
        f"So far {so_far}, but the CPU tier has stored {gib(d.offload_stored_bytes)} of its "
        f"{gib(d.offload_buffer_bytes)} since the engine started: it has never been full, so "
        "more of the traffic finds its prefix in it as it fills. Whether it pays is judged "
        "once it has filled.",
    )


def _grow_advice(
    inp: AdvisorInput,
    advice: Callable[..., Advice],
    grown: tuple[WhatIfPoint, float],
    at_size: str,
) -> Advice:
    """grow_buffer to the size _grow_that_pays found; `at_size` says what this size saves."""
    point, share = grown
    return advice(
        Action.GROW_BUFFER,
        Reason.BUFFER_TOO_SMALL,
        f"{at_size}; the what-if replay of this traffic reaches {pct(point.hit_ratio)} with "
        f"{gib(point.cpu_buffer_bytes)} (fits the memory headroom), saving at least "
        f"{pct(share)} of TTFT." + _reuse_gap_note(inp),
        point.cpu_buffer_bytes,
    )


def _grow_that_pays(
    inp: AdvisorInput, th: Thresholds, headroom: float | None, without: float
) -> tuple[WhatIfPoint, float] | None:
    """The larger buffer that fits and that the what-if predicts to save a material share of
    `without` (the window's TTFT without offload) even with a loaded token saving the lower
    end of its measured interval, with that share; None otherwise. More pinned memory needs
    the lower end: at the point estimate the 8B chat engine with 9 GiB swung between grow
    and disable every few cycles."""
    grow = _bigger_size(inp, th, headroom)
    saved = grow.ttft_saved_lower_seconds_per_second if grow is not None else None
    if grow is None or saved is None or without <= 0 or inp.covered_seconds <= 0:
        return None
    # With its loads' steps charged where the engine decodes (WhatIfPoint).
    share = (saved - grow.load_steps_seconds_per_second) * inp.covered_seconds / without
    return (grow, share) if share >= th.ttft_saving_material else None


def _request_cost_note(d: EngineDerived) -> str:
    """What the tier adds to every request, where the two TTFT fits put it above nothing
    beyond doubt; told with the advice that rests on what enabling delivered, a disable or
    a keep it proved. It is the part of offload's bill apart from what its loads save and
    its stores cost (the steps the tier adds to a request's way, paid at the engine's step
    time; docs/whatif.md, "What a tier costs every request")."""
    if d.request_cost is None:
        return ""
    cost, stderr = d.request_cost
    requests = d.window.get("ttft_requests") or 0.0
    if cost - 2 * stderr <= 0 or requests <= 0:
        return ""
    return (
        f" Every request, whether it loaded or not, took {cost * 1e3:.1f} +- "
        f"{2 * stderr * 1e3:.1f} ms more TTFT than before (the two TTFT fits' cost per "
        f"request; {cost * requests:.2f} s over the window's {requests:.0f} requests): the "
        "engine steps the tier adds to a request's way, not its copies."
    )


def _delivered_text(dv: DeliveredSaving) -> str:
    return (
        f"this window's requests took {dv.ttft_seconds:.2f} s of summed TTFT against "
        f"{dv.without_seconds:.2f} +- "
        f"{2 * dv.stderr_seconds:.2f} s that the same requests and tokens cost this engine "
        "before offload was enabled (its TTFT fit then)"
    )


def _balance_text(bal: OffloadBalance) -> str:
    saved, stores = bal.priced()
    net = saved - stores
    below, above = net - bal.net(-2.0), bal.net(2.0) - net
    # Wider above where a computed token's cost sits on its floor (one-sided below).
    spread = (
        f"+- {below:.2f} s" if f"{below:.2f}" == f"{above:.2f}" else f"-{below:.2f}/+{above:.2f} s"
    )
    return (
        f"the loaded tokens saved {saved:.2f} s of TTFT and storing every computed "
        f"block cost {stores:.2f} s: net {net:+.2f} {spread}"
    )


def _threshold_keeps_hits(
    inp: AdvisorInput, th: Thresholds
) -> tuple[TierEvidence, PolicyPoint, PolicyPoint] | None:
    """(evidence, the configured setting, the same policy with a store threshold) when most
    dropped chunks were never loaded and the threshold keeps the hit ratio in the what-if."""
    ev = inp.evidence
    if (
        ev is None
        or ev.wasted_share is None
        or ev.dropped_chunks < th.min_dropped_chunks
        or ev.wasted_share < th.wasted_store_share_high
    ):
        return None
    base = next((p for p in inp.policy_alternatives if p.configured), None)
    if base is None or base.store_threshold >= 2:
        return None  # not simulated, or a threshold is already on
    with_threshold = next(
        (p for p in inp.policy_alternatives if p.policy == base.policy and p.store_threshold >= 2),
        None,
    )
    if with_threshold is None or with_threshold.hit_ratio < base.hit_ratio - (
        th.whatif_gain_material / 2
    ):
        return None
    return ev, base, with_threshold


def _upper_saving_share(inp: AdvisorInput) -> float | None:
    """The largest share of the window's TTFT any simulated size would save with a computed
    token at the upper end of its cost's interval; None where a point lacks that bound."""
    ttft = inp.derived.window.get("ttft_seconds")
    whatif = inp.whatif
    if whatif is None or not whatif.points or not ttft or inp.covered_seconds <= 0:
        return None
    uppers = [p.ttft_saved_upper_seconds_per_second for p in whatif.points]
    if any(u is None for u in uppers):
        return None
    return max(u for u in uppers if u is not None) * inp.covered_seconds / ttft


def _immaterial_at_upper_cost(
    inp: AdvisorInput, th: Thresholds, advice: Callable[..., Advice], numbers_share: str
) -> Advice | None:
    """Offload off: no_action where no simulated size saves a material share of TTFT even
    with a computed token at the upper end of its cost's interval (the mirror of enabling
    only at the lower end); None otherwise."""
    upper = _upper_saving_share(inp)
    if upper is None or upper >= th.ttft_saving_material:
        return None
    return advice(
        Action.NO_ACTION,
        Reason.PREDICTED_SAVING_IMMATERIAL,
        f"Evicted prefixes are recomputed ({numbers_share}), but even were a computed "
        "token to cost the upper end of its measured interval, no simulated CPU tier "
        f"would save more than {pct(max(upper, 0.0))} of the TTFT now (it pays from "
        f"{pct(th.ttft_saving_material)}) once the loads and the stores of every "
        "computed block are counted: offload would not make TTFT materially better.",
    )


def _reuse_gap_note(inp: AdvisorInput) -> str:
    """Where the returning blocks were: a size check on the recommendation."""
    ev = inp.evidence
    if ev is None or ev.reuse_gap_bytes_half is None:
        return ""
    most = (
        f", 90% within {gib(ev.reuse_gap_bytes_most)}"
        if ev.reuse_gap_bytes_most is not None and math.isfinite(ev.reuse_gap_bytes_most)
        else ""
    )
    half = ev.reuse_gap_bytes_half
    if not math.isfinite(half):
        return ""
    return (
        f" Half of the prefixes that came back after an eviction were computed within the "
        f"last {gib(half)} of KV{most}."
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


def _evaluate_off(  # noqa: PLR0911, PLR0912  a decision list: rule order is the policy, read top to bottom
    inp: AdvisorInput, th: Thresholds, advice: Callable[..., Advice], headroom: float | None
) -> Advice:
    d = inp.derived
    w = d.window
    prompt = w.get("prompt_tokens") or 0.0
    turnover = d.gpu_cache_turnover
    # A window that computed more than the GPU cache holds evicted cached prefixes, whatever
    # the usage gauge read at the last scrape (engines.gpu_cache_turnover).
    turned_over = turnover is not None and turnover > 1.0
    pressure = (
        (d.kv_usage is not None and d.kv_usage >= th.kv_usage_high)
        or w.get("preemptions", 0.0) > 0
        or turned_over
    )
    whatif = inp.whatif
    if whatif is None:
        cache = (
            f"the window computed {turnover:.1f} times the prompt tokens the GPU KV cache holds"
            if turnover is not None
            else "the GPU KV cache's size is unknown"
        )
        if pressure:
            return advice(
                Action.INSUFFICIENT_DATA,
                Reason.KV_EVENTS_OFF,
                f"GPU KV cache is under pressure (usage {pct(d.kv_usage)}, "
                f"{w.get('preemptions', 0):.0f} preemptions; {cache}) but without KV cache "
                "events the exporter cannot tell whether evicted prefixes come back. Enable "
                "--kv-events-config and point it at the exporter.",
            )
        evicted = f" and {cache}: nothing was evicted, so" if turnover is not None else ":"
        return advice(
            Action.NO_ACTION,
            Reason.NO_KV_PRESSURE,
            f"GPU KV cache usage is {pct(d.kv_usage)} with no preemptions{evicted} offload "
            "would have nothing to catch.",
        )
    share = whatif.recomputed_after_eviction_tokens / prompt if prompt else 0.0
    numbers_share = f"{pct(share)} of prompt tokens"
    if share < th.recompute_share_material:
        return advice(
            Action.NO_ACTION,
            Reason.NO_RECOMPUTE_AFTER_EVICTION,
            f"Prefixes evicted from GPU KV and then needed again are {numbers_share} "
            f"(below {pct(th.recompute_share_material)}): offload would rarely hit.",
        )
    if d.transfer_speedup is None:
        # A recompute cost too imprecise to state a speedup still bounds the saving: where
        # even its upper end saves nothing material, leaving offload off needs no speedup.
        immaterial = _immaterial_at_upper_cost(inp, th, advice, numbers_share)
        if immaterial is not None:
            return immaterial
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
            Reason.TRANSFER_RATE_UNKNOWN,
            f"Evicted prefixes are recomputed ({numbers_share}), so a CPU tier could catch "
            f"them, but whether reloading beats recomputing cannot be judged: {why}. Note that "
            "vLLM's CPU offload needs a CUDA or XPU GPU.",
        )
    if d.transfer_speedup < th.transfer_speedup_min:
        return advice(
            Action.NO_ACTION,
            Reason.RELOAD_NOT_FASTER_ESTIMATE,
            f"Evicted prefixes are recomputed ({numbers_share}), but reloading would run at "
            f"{rate(d.transfer_tokens_per_second)} against {rate(d.recompute_tokens_per_second)} "
            f"of marginal recompute (speedup {d.transfer_speedup:.2f}, below "
            f"{th.transfer_speedup_min:.1f} with fixed per-load costs not yet counted): "
            "offload would not make TTFT better on this model and GPU.",
        )
    lower = d.transfer_speedup_lower
    if lower is None or lower < th.transfer_speedup_min:
        # Enabling waits for the cost's lower end to clear the margin; not enabling needs the
        # mirror: the saving stays immaterial at every size even at the cost's upper end.
        immaterial = _immaterial_at_upper_cost(inp, th, advice, numbers_share)
        if immaterial is not None:
            return immaterial
        fit = d.prefill_fit
        spread = (
            f" (per-token recompute cost {fit.seconds_per_token * 1e6:.1f} +- "
            f"{2 * fit.stderr * 1e6:.1f} us over {fit.points} intervals)"
            if fit is not None and fit.stderr is not None
            else ""
        )
        return advice(
            Action.INSUFFICIENT_DATA,
            Reason.SPEEDUP_UNCERTAIN,
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
            Reason.WHATIF_NO_GAIN,
            f"The what-if replay of this traffic reaches at most {pct(best)} from a CPU tier "
            f"that fits the memory headroom ({gib(headroom)}): not worth the pinned memory.",
        )
    saved = knee.ttft_saved_seconds_per_second
    # Enabling must pay without the queue's share of the saving (WhatIfPoint).
    linear = knee.ttft_saved_linear_seconds_per_second
    gate = linear if linear is not None and saved is not None else saved
    queued = gate is not None and saved is not None and f"{gate:.3f}" != f"{saved:.3f}"
    ttft = d.window.get("ttft_seconds")
    # As a keep must (the balance's bounds), an enable must survive its loads' steps on an
    # engine that decodes: 4B's eager decoding bursts, told at 5 s to enable 16 GiB at
    # +0.020 s/s where that size cost 12.4 %.
    steps = knee.load_steps_seconds_per_second
    if gate is not None and saved is not None and ttft and inp.covered_seconds > 0:
        share = (gate - steps) * inp.covered_seconds / ttft
        if share < th.ttft_saving_material:
            parts = [f"{gate:.3f} s without the engine's queue"] if queued else []
            if steps > 0:
                parts.append(
                    f"{gate - steps:.3f} s with each load waiting {LOAD_STEPS} engine steps of "
                    f"{(d.decode_step_seconds or 0.0) * 1e3:.1f} ms (the inter-token latency)"
                )
            pays = f"it pays from {pct(th.ttft_saving_material)}" + (
                " without the queue" if queued else ""
            )
            queue = "".join(f", {p}" for p in parts) + (
                f": {pct(share)} of the TTFT now ({pays})"
                if parts
                else f", {pct(share)} of the TTFT now ({pays})"
            )
            return advice(
                Action.NO_ACTION,
                Reason.PREDICTED_SAVING_IMMATERIAL,
                f"A CPU tier of {gib(knee.cpu_buffer_bytes)} would have served "
                f"{pct(knee.hit_ratio)} of prompt tokens, but with the loads and the stores of "
                f"every computed block counted it would save about {saved:.3f} s of TTFT per "
                f"second{queue}: not worth the pinned memory.",
            )
    extra = f", saving about {saved:.3f} s of TTFT per second" if saved is not None else ""
    if extra and queued and gate is not None:
        extra += f" ({gate:.3f} s of it without the engine's queue)"
    return advice(
        Action.ENABLE_OFFLOAD,
        Reason.RECOMPUTE_AFTER_EVICTION,
        f"{numbers_share} are prefixes recomputed after GPU eviction; a CPU tier of "
        f"{gib(knee.cpu_buffer_bytes)} would have served {pct(knee.hit_ratio)} of prompt "
        f"tokens{extra}, and reloading runs {d.transfer_speedup:.1f}x faster than recomputing. "
        f"Start vLLM with --kv-offloading-size {knee.cpu_buffer_bytes / GIB:g} "
        "--kv-offloading-backend native." + _reuse_gap_note(inp),
        knee.cpu_buffer_bytes,
    )
