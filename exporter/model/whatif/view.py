"""The what-if results over the scrape window (pure): simulated hits joined with the
prompt tokens of the window's intervals that the simulation covered."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from exporter.model.advisor.types import PolicyPoint, TierEvidence, WhatIfPoint, WhatIfState
from exporter.model.derive.balance import LOAD_STEPS
from exporter.model.derive.engines import EngineDerived
from exporter.model.derive.fits import PrefillFit, prefill_fit
from exporter.model.whatif.engine import FLOORS, POLICY_COMBOS, EngineSnapshot, SimConfig
from exporter.model.whatif.plan import (
    engine_policy,
    policy_size,
    ttft_cost_per_token,
    ttft_cost_stderr,
)
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
    t0: float = 0.0  # the span of the intervals joined: seconds = t1 - t0
    t1: float = 0.0
    prefill_seconds: float = 0.0  # vLLM's prefill time and prefills over the same span
    prefill_requests: float = 0.0
    batches: float = 0.0  # KV-event batches simulated, and lost before them (Bucket)
    lost_batches: float = 0.0

    @property
    def lost_share(self) -> float:
        """Of the span's KV-event batches, the share that never arrived."""
        total = self.batches + self.lost_batches
        return self.lost_batches / total if total > 0 else 0.0

    def loads(self, hits: float) -> float:
        """Loads from a CPU tier serving `hits` tokens: every request that recomputed an
        evicted prefix loads it once at the size that holds them all (hits = recomputed);
        a smaller tier serves a share of those prefixes, as many loads of the same mean size."""
        if self.recomputed_tokens <= 0:
            return 0.0
        return self.recomputing_requests * min(1.0, hits / self.recomputed_tokens)

    def load_wait(self, share: float, saved_prefill_seconds: float) -> float:
        """Seconds a load keeps its request waiting beyond the copy: `share` of the mean
        prefill time per request with the tier on, which is shorter than now by the prefill
        time its hits save (a load is seen done at the end of a step of other work)."""
        if self.prefill_requests <= 0:
            return 0.0
        left = max(self.prefill_seconds - saved_prefill_seconds, 0.0)
        return share * left / self.prefill_requests

    def launch_wait(self, step_seconds: float, saved_prefill_seconds: float) -> float:
        """Seconds a step's output waits, with the tier on, for the engine to launch the step
        behind it: twice a step's fixed time less the mean prefill time per request with the
        tier on (what the step takes anyway), none where that covers both launches.

        vLLM 0.26 (async scheduling, two steps in flight) launches the next step before it
        takes a step's output back, and launching is CPU time on the engine's one thread
        (`step_seconds`, the prefill fit's time per request: what a step costs however few
        tokens it computes). Without offload a burst's last step has nothing behind it; with
        a load in it the loader's own later step is (docs/whatif.md). On a GPU-bound engine
        the launch hides under the step's compute, on a launch-bound one (0.6B served eager:
        a step's fixed time 0.7-0.9 of the prefill) it does not."""
        if self.prefill_requests <= 0 or step_seconds <= 0:
            return 0.0
        left = max(self.prefill_seconds - saved_prefill_seconds, 0.0) / self.prefill_requests
        return max(0.0, 2.0 * step_seconds - left)


def engine_rank(key: EngineKey) -> int | None:
    """The DP rank of an engine label (the key of WhatIf.snapshots()); None if not a rank."""
    try:
        return int(key.engine)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class _Span:
    prompt: float
    computed: float | None  # None when vLLM does not break prompt tokens down by source
    t0: float
    t1: float
    prefill_seconds: float
    prefill_requests: float


def _span(window: TargetWindow, key: EngineKey, start: float) -> _Span | None:
    """Prompt tokens, tokens computed or loaded from a CPU tier, vLLM's prefill time and
    prefills, and the time span of the window's intervals from `start` on."""
    prompt = 0.0
    computed: float | None = None
    prefill_seconds = prefill_requests = 0.0
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
        prefill_seconds += deltas.get("prefill_seconds", 0.0)
        prefill_requests += deltas.get("prefill_requests", 0.0)
        t0, t1 = min(t0, iv.t0), max(t1, iv.t1)
    if prompt <= 0 or t1 <= t0:
        return None
    return _Span(prompt, computed, t0, t1, prefill_seconds, prefill_requests)


def prompt_span(
    window: TargetWindow, key: EngineKey, start: float
) -> tuple[float, float, float] | None:
    """Prompt tokens and the time span of the window's intervals from `start` on."""
    span = _span(window, key, start)
    return None if span is None else (span.prompt, span.t0, span.t1)


def window_view(
    es: EngineSnapshot | None, window: TargetWindow, key: EngineKey
) -> WhatIfView | None:
    """The curve's hits over the window; None until simulated and joined with prompts."""
    if es is None or es.capacities is None or es.sim_start is None:
        return None
    span = _span(window, key, es.sim_start)
    if span is None:
        return None
    t0, t1 = span.t0, span.t1
    k = len(es.capacities)
    hits = [0.0] * k
    conf = 0.0
    recomputed = 0.0
    recomputing = 0.0
    batches = lost = 0.0
    for b in es.buckets:
        if t0 <= b.start < t1 and len(b.hits) == k:
            recomputed += b.recomputed_tokens
            recomputing += b.recomputing_requests
            batches += b.batches
            lost += b.lost_batches
            conf += b.configured_hits
            for i in range(k):
                hits[i] += b.hits[i]
    return WhatIfView(
        span.prompt,
        t1 - t0,
        tuple(hits),
        conf if es.configured_blocks is not None else None,
        recomputed,
        span.computed,
        recomputing,
        t0,
        t1,
        span.prefill_seconds,
        span.prefill_requests,
        batches,
        lost,
    )


# Prefills per step (StepSharing.requests_per_step) from which requests come in bursts, and
# the launch a load adds keeps the others of its step waiting: in 0.6B's bursts of twelve
# (11.7-12 per step) the requests that loaded nothing waited 15-35 ms more where one loaded,
# one launch; where requests came one at a time (chat and RAG-Zipf: 1.2-1.8 per step) those
# whose wait overlapped a loader's came back -4 to +9 ms later on 0.6B, where the launch wait
# would be 23-38 ms (docs/whatif.md, "The launch a load adds").
BURST_PREFILLS = 3.0


@dataclass(frozen=True, slots=True)
class StepSharing:
    """How the prefills of a span shared their engine steps (vLLM publishes one KV-event
    batch per step, so the prefills of one batch ran in one step)."""

    # Prefills in a computed token's step, weighted by tokens: every request whose prefill
    # is in a step waits out whatever delays that step (1 when requests run one at a time).
    requests_per_step: float
    # What a load keeps its request waiting beyond its copy, as a share of the mean prefill
    # time per request: a prefill that recomputed an evicted prefix would have loaded it and
    # left its step, so it waits out the others' part of that step, and at least `base`.
    load_wait_share: float
    # Per load, the prefills that would be taken back only after the engine launched the step
    # the load adds (WhatIfView.launch_wait): where requests come in bursts (BURST_PREFILLS),
    # every prefill of a loader's step but its first, the loaders included. vLLM publishes a
    # KV-event batch when it takes a step's output back, having planned the step behind it,
    # so a batch is that step and the one behind: the first prefill's output is back before
    # the launch, the others' after it.
    launch_waiters_per_load: float = 0.0


def step_sharing(
    prefills: Sequence[tuple[float, int, int, tuple[float, ...]]],
    t0: float,
    t1: float,
    base: float,
) -> StepSharing | None:
    """The sharing of the prefills stamped in [t0, t1) (EngineSnapshot.prefills, the newest
    WhatIfSettings.prefill_history: time, tokens computed, of them recomputed after an
    eviction); None when none is there.

    8B bursts on the H200 (twelve requests sent at once, one step for all): 11.7 requests
    per computed token's step; a loader's step was 0.79 others' tokens, and with the tier
    on a load waited 79-100 ms of queue time against 107 ms of prefill per request. Where
    requests come one at a time and sometimes overlap: 1.2-1.8 and 0.23-0.46."""
    kept = [(ts, n, r) for ts, n, r, _ in prefills if t0 <= ts < t1]
    if not kept:
        return None
    steps: dict[float, list[int]] = {}  # step -> [tokens, prefills, loaders]
    for ts, n, r in kept:
        step = steps.setdefault(ts, [0, 0, 0])
        step[0] += n
        step[1] += 1
        step[2] += r > 0
    tokens = sum(t for t, _, _ in steps.values())
    weighted = sum(t * k for t, k, _ in steps.values())
    shares = [max(base, 1.0 - n / steps[ts][0]) for ts, n, r in kept if r > 0 and steps[ts][0]]
    per_step = weighted / tokens if tokens > 0 else 1.0
    bursts = per_step >= BURST_PREFILLS
    waiting = sum(k - 1 for _, k, loaders in steps.values() if loaders and bursts)
    return StepSharing(
        per_step,
        sum(shares) / len(shares) if shares else base,
        waiting / len(shares) if shares else 0.0,
    )


def queue_utilisation(
    window: TargetWindow, key: EngineKey, t0: float, t1: float, requests_per_job: float
) -> float | None:
    """The engine's utilisation as a processor-sharing queue over the intervals in
    [t0, t1): summed TTFT per second is the mean number of requests waiting for their first
    token (Little), `requests_per_job` of them sharing their steps as one job, and such a
    queue holds rho / (1 - rho) jobs; None without TTFT over the span.

    On the H200 matrix: 0.39-0.41 for 32B chat (1.2-1.3 requests waiting, 1.8 to a step),
    0.13 in the 32B bursts (twelve to a step), 0.04-0.33 elsewhere."""
    seconds = ttft = 0.0
    for iv in window.intervals():
        deltas = iv.deltas.get(key)
        if t0 <= iv.t0 < t1 and deltas and "ttft_seconds" in deltas:
            ttft += deltas["ttft_seconds"]
            seconds += iv.t1 - iv.t0
    if seconds <= 0:
        return None
    jobs = ttft / seconds / max(requests_per_job, 1.0)
    return jobs / (1.0 + jobs)


# Choosing a floor takes more intervals than one fit does.
FLOOR_MIN_INTERVALS = 12


@dataclass(frozen=True, slots=True)
class FloorFit:
    """Summed TTFT = overhead x requests + seconds_per_token x sum(max(N, floor_tokens)) over
    the prefills of each scrape interval (N: the tokens a prefill computed)."""

    floor_tokens: int
    fit: PrefillFit

    def share_above(
        self, prefills: Sequence[tuple[float, int, int, tuple[float, ...]]], t0: float, t1: float
    ) -> float:
        """Of the tokens recomputed after an eviction by the prefills stamped in [t0, t1), the
        share a load would have saved computing: what lies above the floor."""
        f = self.floor_tokens
        back = saved = 0
        for ts, n, r, _ in prefills:
            if r and t0 <= ts < t1:
                back += r
                saved += max(n, f) - max(n - r, f)
        return saved / back if back else 1.0


def _ols(points: Sequence[tuple[float, float, float]]) -> tuple[float, float, float] | None:
    """y on (requests, tokens), no intercept: (per request, per token, residual sum of
    squares); None when the two columns are collinear."""
    snn = snt = stt = sny = sty = syy = 0.0
    for n, t, y in points:
        snn += n * n
        snt += n * t
        stt += t * t
        sny += n * y
        sty += t * y
        syy += y * y
    det = snn * stt - snt * snt
    if snn <= 0 or stt <= 0 or det <= 1e-9 * snn * stt:
        return None
    a = (sny * stt - sty * snt) / det
    b = (sty * snn - sny * snt) / det
    return a, b, max(0.0, syy - a * sny - b * sty)


def _floor_points(
    es: EngineSnapshot, window: TargetWindow, key: EngineKey
) -> list[list[tuple[float, float, float]]]:
    """Per FLOORS entry: (requests, sum of max(N, floor) over the interval's prefills, summed
    TTFT) per interval with requests that the kept prefills cover."""
    pre = es.prefills
    out: list[list[tuple[float, float, float]]] = [[] for _ in FLOORS]
    if not pre or es.sim_start is None:
        return out
    first = max(es.sim_start, pre[0][0])
    times = [p[0] for p in pre]
    before = tuple(c - max(pre[0][1], f) for c, f in zip(pre[0][3], FLOORS, strict=True))
    for iv in window.intervals():
        d = iv.deltas.get(key)
        if iv.t0 < first or not d or d.get("ttft_requests", 0.0) <= 0 or "ttft_seconds" not in d:
            continue
        i, j = bisect_left(times, iv.t0), bisect_left(times, iv.t1)
        hi = pre[j - 1][3] if j > 0 else before
        lo = pre[i - 1][3] if i > 0 else before
        for k, col in enumerate(out):
            col.append((d["ttft_requests"], hi[k] - lo[k], d["ttft_seconds"]))
    return out


def _best_floor(points: list[list[tuple[float, float, float]]]) -> int | None:
    """Index of the floor that beats the linear model (points[0]) by more than choosing among
    the candidates explains, with costs that make sense; None: no floor."""
    linear = _ols(points[0])
    best: tuple[float, int] | None = None
    for k in range(1, len(points)):
        got = _ols(points[k])
        if got is not None and got[0] >= 0 and got[1] > 0 and (best is None or got[2] < best[0]):
            best = (got[2], k)
    if linear is None or best is None or best[0] >= linear[2]:
        return None
    gain = len(points[0]) * math.log(linear[2] / best[0]) if best[0] > 0 else math.inf
    return best[1] if gain > 2 * math.log(len(FLOORS) - 1) else None


def floor_fit(es: EngineSnapshot | None, window: TargetWindow, key: EngineKey) -> FloorFit | None:
    """Offload off: the TTFT floor the window's intervals fit better than no floor, or None.

    Each prefill joins the scrape interval its event time falls in (the KV-event and scrape
    clocks agree: 98 % of computed tokens on the H200 matrix). A floor is taken only where it
    beats the linear model by more than choosing among the candidates explains (the
    likelihood ratio of Gaussian residuals, n ln(SSR_linear / SSR_floor), above 2 ln of the
    number of candidates), with a non-negative cost per request and a significant cost per
    token above it. 8B multi-turn chat on the H200: 1024 tokens, 28 us above (linear 21.5 us);
    every other recorded family: no floor (docs/whatif.md)."""
    if es is None or es.sim_start is None or not es.prefills:
        return None
    points = _floor_points(es, window, key)
    if len(points[0]) < FLOOR_MIN_INTERVALS:
        return None
    k = _best_floor(points)
    fit = prefill_fit([tuple(p) for p in points[k]], FLOOR_MIN_INTERVALS) if k else None
    if k is None or fit is None or not fit.significant:
        return None
    return FloorFit(FLOORS[k], fit)


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
    bal = d.balance
    # Offload off with a TTFT floor: a hit saves computing only down to the floor, priced at
    # the floor fit's cost per token above it.
    floor = floor_fit(es, window, d.key) if not d.offload_enabled else None
    share = 1.0
    stderr = ttft_cost_stderr(d)
    if floor is not None and es is not None:
        share = floor.share_above(es.prefills, view.t0, view.t1)
        cost, stderr = floor.fit.seconds_per_token, floor.fit.stderr
    upper_cost = (
        cost + 2 * stderr
        if cost is not None and stderr is not None and not d.offload_enabled
        else None
    )
    least = d.computed_token_floor
    if least is not None and cost is not None and not d.offload_enabled:
        # No fit prices a computed token below the GPU time its weights take (on RAG-Zipf
        # the TTFT fits do: 14B at 21.0 +- 8.2 us against 29.9 us on the H200). A lower
        # bound: it lifts the estimate and the interval's ends up to it, never beyond. With
        # offload on the offload fit has the bound already.
        cost = max(cost, least)
        upper_cost = max(upper_cost, least) if upper_cost is not None else None
    # The hits shorten the prefills a load waits on by the prefill time they save.
    pf = d.prefill_fit
    per_token = pf.seconds_per_token if pf is not None and pf.seconds_per_token > 0 else cost
    # How the window's prefills shared their steps: a store is paid by every request in its
    # step, and a load that leaves a shared step waits out the rest of it.
    sharing = (
        step_sharing(es.prefills, view.t0, view.t1, d.load_wait_share) if es is not None else None
    )
    wait_share = sharing.load_wait_share if sharing is not None else d.load_wait_share
    per_store = sharing.requests_per_step if sharing is not None else 1.0
    # In a burst a load keeps its step's other prefills waiting for the launch of the
    # loader's own later step too (WhatIfView.launch_wait): the prefill fit's time per
    # request is what a step costs however little it computes.
    waiters = sharing.launch_waiters_per_load if sharing is not None else 0.0
    step_seconds = pf.overhead_seconds if pf is not None else 0.0
    on = bal is not None and computed is not None
    # Offload off: the hits' saving is a queue's (simulator.queue_saving); with offload on
    # the balance prices the window's own hits.
    rho = None if on else queue_utilisation(window, d.key, view.t0, view.t1, per_store)

    def saved(hits: float, cost: float | None, z: float = 0.0, queue: bool = True) -> float | None:
        if bal is not None and computed is not None:
            # Offload on: the hits and the tokens computed without offload at the window's
            # prices, the balance's own (at the configured size the two agree).
            return bal.net(z, tokens=(hits, computed)) / view.seconds
        priced = hits * share
        saved_prefill = priced * (per_token or 0.0)
        return ttft_saved_seconds_per_second(
            hits / view.seconds,
            cost,
            d.transfer_tokens_per_second,
            computed / view.seconds if computed is not None else None,
            view.loads(hits) / view.seconds,
            view.load_wait(wait_share, saved_prefill)
            + waiters * view.launch_wait(step_seconds, saved_prefill),
            priced / view.seconds,
            per_store,
            (rho or 0.0) if queue else 0.0,
        )

    # On an engine that decodes each load keeps its request two engine steps, each as long as
    # the decode makes it (balance.LOAD_STEPS): offload off, the loads the simulation counts
    # at a size; on, the window's own loads' charge in proportion to the hits.
    step = d.decode_step_seconds

    def load_steps(hits: float) -> float:
        if step is None or view is None:
            return 0.0
        if bal is None:
            return LOAD_STEPS * view.loads(hits) * step / view.seconds
        return bal.load_step_seconds * hits / bal.loaded_tokens / view.seconds

    points = tuple(
        WhatIfPoint(
            float(size),
            min(1.0, hits / view.prompt_tokens),
            saved(hits, cost),
            saved(hits, upper_cost) if upper_cost is not None else None,
            saved(hits, cost, -2.0) if on else None,
            saved(hits, cost, queue=False) if not on else None,
            load_steps(hits),
        )
        for size, hits in zip(sizes_bytes, view.hits, strict=True)
    )
    conf = (
        min(1.0, view.configured_hits / view.prompt_tokens)
        if view.configured_hits is not None
        else None
    )
    return WhatIfState(
        points,
        view.recomputed_tokens,
        conf,
        sharing.requests_per_step if sharing is not None and not on else None,
        wait_share if sharing is not None and not on else None,
        view.lost_share,
        rho if not on else None,
        view.launch_wait(step_seconds, 0.0) if sharing is not None and not on else None,
        waiters if sharing is not None and not on else None,
    )


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
