"""exporter/model/whatif/view.py: simulated hits joined with the window's prompt tokens;
the policy comparison on recorded H200 runs through the exporter's own steps."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from exporter.catalogue import Family
from exporter.model.advisor.types import PolicyPoint
from exporter.model.derive.backends import BackendConfig, BackendDerived
from exporter.model.derive.balance import offload_balance
from exporter.model.derive.engines import DeriveSettings, EngineDerived, derive_engine
from exporter.model.derive.fits import OffloadFit, PrefillFit
from exporter.model.whatif.engine import (
    FLOORS,
    POLICY_COMBOS,
    Bucket,
    EngineSnapshot,
    PolicyBucket,
    SimConfig,
    WhatIf,
    WhatIfSettings,
)
from exporter.model.whatif.plan import sim_config, ttft_cost_per_token
from exporter.model.whatif.simulator import queue_saving, ttft_saved_seconds_per_second
from exporter.model.whatif.view import (
    StepSharing,
    WhatIfView,
    engine_rank,
    floor_fit,
    policy_points,
    prompt_span,
    queue_utilisation,
    step_sharing,
    whatif_state,
    window_view,
)
from exporter.options import TargetConfig
from exporter.render.whatif import whatif_families
from exporter.sources.vllm_http import VllmTarget
from exporter.thresholds import DEFAULT
from exporter.vllm_cmdline import LaunchConfig, launch_config
from exporter.vllm_metrics import EngineKey, EngineSample, TargetSample
from exporter.window import TargetWindow
from testbed.replay import ReplayServer, Reply
from tests.helpers import (
    E0,
    GIB,
    KV_BYTES_PER_TOKEN,
    balance_sums,
    gpu_events,
    gpu_metrics,
    gpu_scrapes,
    items_until,
    raw,
    recorded_cmd,
)
from tests.model.whatif.common import EK, derived, window

WINDOW = window((0.0, 0.0), (10.0, 1000.0), (20.0, 3000.0))


def snapshot(**kw: object) -> EngineSnapshot:
    defaults: dict[str, object] = dict(
        rank=0,
        events={},
        batches=5,
        gpu_resident=0,
        cpu_resident=0,
        recomputed_tokens=0,
        stored_tokens=0,
        tracked_blocks=0,
        capacities=(4, 8),
        configured_blocks=None,
        sim_start=10.0,
        buckets=(
            Bucket(5.0, 1.0, 0.0, 1.0, (1.0, 1.0)),  # before the covered intervals
            Bucket(10.0, 100.0, 0.0, 50.0, (200.0, 400.0)),
            Bucket(12.0, 7.0, 0.0, 7.0, (7.0,)),  # another curve (reconfigured)
            Bucket(15.0, 60.0, 0.0, 25.0, (100.0, 100.0)),
            Bucket(20.0, 9.0, 0.0, 9.0, (9.0, 9.0)),  # after the window's last scrape
        ),
    )
    defaults.update(kw)
    return EngineSnapshot(**defaults)  # type: ignore[arg-type]


def test_engine_rank() -> None:
    assert engine_rank(EngineKey("m", "3")) == 3
    assert engine_rank(EngineKey("m", "prefill-0")) is None


def test_prompt_span_starts_at_the_simulation() -> None:
    assert prompt_span(WINDOW, EK, 0.0) == (3000.0, 0.0, 20.0)
    assert prompt_span(WINDOW, EK, 10.0) == (2000.0, 10.0, 20.0)
    assert prompt_span(WINDOW, EK, 10.5) is None
    assert prompt_span(WINDOW, EngineKey("m", "1"), 0.0) is None


def test_window_view_sums_the_covered_buckets_of_the_current_curve() -> None:
    assert window_view(snapshot(), WINDOW, EK) == WhatIfView(
        2000.0, 10.0, (300.0, 500.0), None, 160.0, t0=10.0, t1=20.0
    )
    conf = window_view(snapshot(configured_blocks=4), WINDOW, EK)
    assert conf is not None and conf.configured_hits == 75.0
    assert window_view(None, WINDOW, EK) is None
    assert window_view(snapshot(capacities=None), WINDOW, EK) is None
    assert window_view(snapshot(sim_start=None), WINDOW, EK) is None
    # Lost KV-event batches: of the covered buckets' batches and losses together.
    lossy = snapshot(
        buckets=(
            Bucket(5.0, 1.0, 0.0, 1.0, (1.0, 1.0), batches=9, lost_batches=9),  # not covered
            Bucket(10.0, 100.0, 0.0, 50.0, (200.0, 400.0), batches=7, lost_batches=1),
            Bucket(15.0, 60.0, 0.0, 25.0, (100.0, 100.0), batches=11, lost_batches=1),
        )
    )
    view = window_view(lossy, WINDOW, EK)
    assert view is not None and (view.batches, view.lost_batches) == (18.0, 2.0)
    assert view.lost_share == pytest.approx(0.1)
    assert WhatIfView(1.0, 1.0, (), None, 0.0).lost_share == 0.0


def test_loads_scale_with_the_share_of_recomputed_prefixes_served() -> None:
    """Every request that recomputed an evicted prefix loads once where the tier holds them
    all; a tier serving a quarter of those tokens, a quarter as many loads."""
    buckets = (Bucket(10.0, 100.0, 0.0, 0.0, (25.0, 100.0), 4.0),)
    view = window_view(snapshot(buckets=buckets), WINDOW, EK)
    assert view is not None and view.recomputing_requests == 4.0
    assert [view.loads(h) for h in view.hits] == [1.0, 4.0]
    assert view.loads(500.0) == 4.0  # never more loads than requests that recomputed
    assert WhatIfView(1.0, 1.0, (0.0,), None, 0.0).loads(10.0) == 0.0
    # Each load waits a share of the mean prefill with the tier on: here 0.1 of 2 s over 20
    # prefills in the covered intervals, less the prefill time the hits save at the engine's
    # 1/23000 s per token; 1 and 4 loads over 10 s.
    w = TargetWindow(3600.0)
    for ts, prompt, pre_s, pre_n in (
        (0.0, 0.0, 0.0, 0.0),
        (10.0, 1e3, 1.0, 9.0),
        (20.0, 3e3, 3.0, 29.0),
    ):
        counters = {"prompt_tokens": prompt, "prefill_seconds": pre_s, "prefill_requests": pre_n}
        w.add(TargetSample(ts=ts, engines={EK: EngineSample(counters=counters, gauges={})}))
    snap = snapshot(buckets=buckets)
    free = whatif_state(snap, w, derived(), (1000, 2000))
    waited = whatif_state(snap, w, derived(load_wait_share=0.1), (1000, 2000))
    assert free is not None and waited is not None
    saved = [
        (a.ttft_saved_seconds_per_second or 0.0) - (b.ttft_saved_seconds_per_second or 0.0)
        for a, b in zip(free.points, waited.points, strict=True)
    ]
    wait = [0.1 * (2.0 - h / 23_000) / 20 for h in (25.0, 100.0)]
    assert saved == pytest.approx([1 * wait[0] / 10, 4 * wait[1] / 10])
    assert WhatIfView(1.0, 1.0, (0.0,), None, 0.0).load_wait(0.2, 0.0) == 0.0  # no prefills
    # A saving larger than the prefill time leaves no step to wait on.
    assert (
        WhatIfView(
            1.0, 1.0, (0.0,), None, 0.0, prefill_seconds=1.0, prefill_requests=2.0
        ).load_wait(0.2, 5.0)
        == 0.0
    )


def test_whatif_state_points_per_size() -> None:
    d = derived()
    state = whatif_state(snapshot(configured_blocks=4), WINDOW, d, (1000, 2000))
    assert state is not None
    assert [(p.cpu_buffer_bytes, p.hit_ratio) for p in state.points] == [
        (1000.0, 0.15),
        (2000.0, 0.25),
    ]
    # No breakdown of prompt tokens by source in this window: only the loads are charged, at
    # the prefill fit's marginal cost (the engine has no TTFT fit).
    assert state.points[0].ttft_saved_seconds_per_second == ttft_saved_seconds_per_second(
        30.0, 1 / 23_000.0, 110_000.0
    )
    assert state.recomputed_after_eviction_tokens == 160.0
    assert state.configured_hit_ratio == pytest.approx(75.0 / 2000.0)
    assert whatif_state(snapshot(sim_start=None), WINDOW, d, (1000, 2000)) is None
    with pytest.raises(ValueError):
        whatif_state(snapshot(), WINDOW, d, (1000,))  # sizes and curve must match


def test_whatif_saving_charges_every_computed_token_once_at_the_ttft_cost() -> None:
    """With prompt tokens by source, every token computed without offload crosses the link
    once (hits loaded, the rest stored), and a TTFT fit prices the hits."""
    w = TargetWindow(3600.0)
    for ts, prompt, computed in ((0.0, 0.0, 0.0), (10.0, 1000.0, 600.0), (20.0, 3000.0, 1800.0)):
        counters = {"prompt_tokens": prompt, "prompt_by_source:local_compute": computed}
        w.add(TargetSample(ts=ts, engines={EK: EngineSample(counters=counters, gauges={})}))
    view = window_view(snapshot(), w, EK)
    assert view is not None and view.computed_tokens == 1200.0  # from the simulation's start
    plain = window_view(snapshot(), WINDOW, EK)
    assert plain is not None and plain.computed_tokens is None
    d = derived(ttft_fit=PrefillFit(0.01, 50e-6, 30, 0.9, 5e-6))
    state = whatif_state(snapshot(), w, d, (1000, 2000))
    assert state is not None
    # 300 hit tokens over 10 s at 50 us, minus 1200 computed tokens over 10 s at 110k/s.
    assert state.points[0].ttft_saved_seconds_per_second == pytest.approx(
        30.0 * 50e-6 - 120.0 / 110_000.0
    )


def test_whatif_saving_with_offload_on_is_priced_as_the_balance() -> None:
    """Offload on: a hit saves what a loaded token measurably saves, and every token computed
    without offload costs the measured store time per token, as in the window's balance."""
    w = TargetWindow(3600.0)
    rows = ((0.0, 0.0, 0.0, 0.0), (10.0, 1000.0, 500.0, 100.0), (20.0, 3000.0, 1500.0, 300.0))
    for ts, prompt, computed, loaded in rows:
        counters = {
            "prompt_tokens": prompt,
            "prompt_by_source:local_compute": computed,
            "prompt_by_source:external_kv_transfer": loaded,
        }
        w.add(TargetSample(ts=ts, engines={EK: EngineSample(counters=counters, gauges={})}))
    fit = OffloadFit(0.0, 40e-6, 10e-6, 60, 0.9, 1e-6, 1e-6, 1e-6)
    bal = offload_balance(fit, balance_sums(loaded=200.0, computed=1000.0, store=0.012, ttft=4.0))
    d = derived(offload_enabled=True, offload_fit=fit, balance=bal)
    state = whatif_state(snapshot(), w, d, (1000, 2000))
    assert state is not None and bal is not None
    # Over 10 s: 300 hits x 30 us - 1200 tokens x the store time per computed token
    # (0.012 s over the balance's 1000 computed tokens).
    assert state.points[0].ttft_saved_seconds_per_second == pytest.approx(
        (300 * 30e-6 - 1200 * 0.012 / 1000) / 10.0
    )
    # What a "grow" holds against: the saving per loaded token at the lower end of its
    # interval (30 - 2 x 1 us); no upper bound with offload on.
    assert state.points[0].ttft_saved_lower_seconds_per_second == pytest.approx(
        (300 * 28e-6 - 1200 * 0.012 / 1000) / 10.0
    )
    assert state.points[0].ttft_saved_upper_seconds_per_second is None
    # A computed token at its floor (45 us, no store in it): a hit saves 45 - 10 us and only
    # the 900 tokens still computed are stored, as in the balance.
    floored = dataclasses.replace(fit, computed_seconds_per_token=45e-6, computed_floor=True)
    sums = balance_sums(loaded=200.0, computed=1000.0, store=0.012, ttft=4.0)
    at_floor = offload_balance(floored, sums, floor=45e-6)
    d = derived(offload_enabled=True, offload_fit=floored, balance=at_floor)
    state = whatif_state(snapshot(), w, d, (1000, 2000))
    assert state is not None
    assert state.points[0].ttft_saved_seconds_per_second == pytest.approx(
        (300 * 35e-6 - 900 * 0.012 / 1000) / 10.0
    )


def test_policy_points_at_the_planned_size_only() -> None:
    hits = (100.0, 200.0, 50.0, 5000.0)
    es = snapshot(
        policy_blocks=292,
        policy_start=10.0,
        policy_buckets=(PolicyBucket(0.0, (9.0,) * 4), PolicyBucket(10.0, hits)),
    )
    arc = BackendDerived(BackendConfig("OffloadingConnector", "CPU", "arc", "2", "", "cmdline"))
    d = derived(offload_enabled=True, offload_buffer_bytes=5e8, backend=arc)
    planned = SimConfig((4, 8), 285, 292, "arc", 2)
    got = policy_points(es, WINDOW, d, planned, None)
    assert got == tuple(
        PolicyPoint(p, t, 5e8, min(1.0, h / 2000.0), (p, t) == ("arc", 2))
        for (p, t), h in zip(POLICY_COMBOS, hits, strict=True)
    )
    assert got[3].hit_ratio == 1.0
    moved = dataclasses.replace(planned, policy_blocks=300)
    assert policy_points(es, WINDOW, d, moved, None) == ()  # not simulated yet
    assert policy_points(es, WINDOW, d, None, None) == ()
    assert policy_points(snapshot(), WINDOW, d, planned, None) == ()
    # offload off: the comparison runs at the recommendation, and none is configured
    off = derived()
    points = policy_points(es, WINDOW, off, planned, 5e8)
    assert [p.configured for p in points] == [False] * 4
    assert policy_points(es, WINDOW, off, planned, None) == ()


# --- the policy comparison on the real ARC run and at a recommended size (H200, vLLM 0.26) --


class _Whatif:
    """One target's what-if as the exporter's pipeline steps, plans and reads it."""

    def __init__(self, target: VllmTarget, settings: WhatIfSettings, recommended: float | None):
        self.target = target
        self.label = target.config.label
        self.sim = WhatIf(settings)
        self.recommended = recommended

    def plan(self, d: EngineDerived) -> None:
        rank = engine_rank(d.key)
        cfg = sim_config(d, self.sim.settings, self.recommended)
        if rank is not None and cfg is not None:
            self.sim.configure(rank, cfg)  # applied by the next step

    def policy_points(self, d: EngineDerived) -> tuple[PolicyPoint, ...]:
        rank = engine_rank(d.key)
        assert rank is not None
        es = self.sim.snapshots().get(rank)
        planned = self.sim.planned(rank)
        return policy_points(es, self.target.window, d, planned, self.recommended)

    def whatif_families(self, d: EngineDerived) -> list[Family]:
        """The rendered what-if, planned first as the pipeline does before rendering."""
        self.plan(d)
        rank = engine_rank(d.key)
        es = self.sim.snapshots().get(rank) if rank is not None else None
        state = whatif_state(es, self.target.window, d, self.sim.settings.sizes_bytes)
        return whatif_families(self.label, [(d.key, state, self.policy_points(d))])


async def _replay_exporter(
    config: str, launch: LaunchConfig | None, recommended: float | None
) -> tuple[VllmTarget, _Whatif, EngineDerived]:
    """The recorded 1 s scrapes and KV events through VllmTarget, derive and the what-if."""
    scrapes = gpu_scrapes(config)
    msgs = gpu_events(config)
    now = [0.0]
    server = ReplayServer(replies=[Reply(body=s["body"].encode()) for s in scrapes])
    target = VllmTarget(
        TargetConfig(url=server.url, name=config, kv_bytes_per_token=KV_BYTES_PER_TOKEN),
        window_seconds=300.0,
        timeout=5.0,
        max_body_bytes=1 << 24,
        clock=lambda: now[0],
    )
    source = _Whatif(target, WhatIfSettings(sizes_bytes=(GIB // 4, GIB // 2)), recommended)
    fed = 0
    d: EngineDerived | None = None
    with server:
        await target.start()
        try:
            for s in scrapes:
                t = float(s["t"])
                items, fed = items_until(msgs, fed, t)
                source.sim.step(items)  # the config planned last cycle first
                now[0] = t
                await target.collect()
                ds = DeriveSettings(
                    stale_after=3.0, kv_bytes_per_token=KV_BYTES_PER_TOKEN, launch=launch
                )
                d = derive_engine(target.window, E0, t, ds)
                assert d is not None
                source.plan(d)
        finally:
            await target.stop()
    assert d is not None
    return target, source, d


def _policy_ratios(source: _Whatif, d: EngineDerived) -> dict[tuple[str, str], float]:
    fams = {f.definition.name: f for f in source.whatif_families(d)}
    return {
        (labels[3], labels[4]): v for labels, v in fams["kvoffload_whatif_policy_hit_ratio"].samples
    }


def test_exporter_policy_whatif_on_the_real_arc_run() -> None:
    """small-arc replayed through the exporter: its ARC is the configured point and wins.

    With offload on, the GPU event stream already carries the CPU tier's effect (loaded
    blocks re-enter the GPU cache), which the request rebuild follows less exactly than a
    no-offload stream: on these runs the configured-size simulation lands within 0.02 of
    what vLLM observed (0.0725 against 0.0551 for ARC; docs/backends.md has all four).
    """
    launch = launch_config(*recorded_cmd("small-arc"))
    _, source, d = asyncio.run(_replay_exporter("small-arc", launch, None))
    points = source.policy_points(d)
    assert [(p.policy, p.store_threshold) for p in points] == list(POLICY_COMBOS)
    (configured,) = [p for p in points if p.configured]
    assert (configured.policy, configured.store_threshold) == ("arc", 0)
    assert configured.cpu_buffer_bytes == 0.25 * GIB
    assert d.offload_hit_ratio is not None
    assert abs(configured.hit_ratio - d.offload_hit_ratio) <= 0.02
    ratios = _policy_ratios(source, d)
    assert ratios[("arc", "0")] == configured.hit_ratio
    assert ratios[("arc", "0")] > ratios[("lru", "0")] + DEFAULT.whatif_gain_material
    # the configured-size simulation uses the engine's own policy, not --whatif-policy (lru)
    fams = {f.definition.name: f for f in source.whatif_families(d)}
    ((_, conf),) = fams["kvoffload_whatif_configured_hit_ratio"].samples
    assert conf == pytest.approx(configured.hit_ratio)


def test_exporter_policy_whatif_without_offload_at_the_recommended_size() -> None:
    """small-a (offload off) with a recommendation of 0.25 GiB: ARC at 0.25 GiB predicts
    what the real ARC run of the same prompts observed, LRU what the LRU run observed."""
    _, source, d = asyncio.run(_replay_exporter("small-a", None, 0.25 * GIB))
    ratios = _policy_ratios(source, d)
    assert set(ratios) == {(p, str(t)) for p, t in POLICY_COMBOS}
    assert all(not p.configured for p in source.policy_points(d))

    def share(config: str) -> float:
        first, last = gpu_metrics(config, "before", "W1"), gpu_metrics(config, "after", "W2")
        ext = "vllm:prompt_tokens_by_source_total"
        num = raw(last, ext, source="external_kv_transfer") - raw(
            first, ext, source="external_kv_transfer"
        )
        return num / (
            raw(last, "vllm:prompt_tokens_total") - raw(first, "vllm:prompt_tokens_total")
        )

    assert abs(ratios[("arc", "0")] - share("small-arc")) <= 0.01
    assert abs(ratios[("lru", "0")] - share("small-c025")) <= 0.01
    assert ratios[("arc", "0")] > ratios[("lru", "0")] + DEFAULT.whatif_gain_material


def test_tier_evidence_puts_bytes_on_the_engine_counts() -> None:
    from exporter.model.whatif.engine import EngineSnapshot
    from exporter.model.whatif.simulator import REUSE_GAP_BLOCK_EDGES
    from exporter.model.whatif.view import tier_evidence
    from tests.model.advisor.common import base

    gaps = [0] * (len(REUSE_GAP_BLOCK_EDGES) + 1)
    gaps[4], gaps[6] = 5, 5  # half within 16 blocks computed since, all within 64
    es = EngineSnapshot(
        rank=0,
        events={},
        batches=1,
        gpu_resident=0,
        cpu_resident=0,
        recomputed_tokens=0,
        stored_tokens=0,
        tracked_blocks=0,
        capacities=None,
        configured_blocks=None,
        sim_start=None,
        buckets=(),
        cpu_stored=50,
        cpu_removed=40,
        wasted_stores=30,
        wasted_store_tokens=480,
        reuse_gap_blocks=tuple(gaps),
        block_size=16,
    )
    d = base(kv_bytes_per_token=1000.0)
    ev = tier_evidence(es, d)
    assert ev is not None
    assert (ev.dropped_chunks, ev.wasted_share, ev.wasted_bytes) == (40, 0.75, 480_000.0)
    assert (ev.reuse_gap_bytes_half, ev.reuse_gap_bytes_most) == (16 * 16_000.0, 64 * 16_000.0)
    unknown = tier_evidence(es, base(kv_bytes_per_token=None))
    assert unknown is not None and unknown.wasted_bytes is None
    assert unknown.reuse_gap_bytes_half is None and unknown.wasted_share == 0.75
    assert tier_evidence(None, d) is None


def _hinge_window(floor: int, per_token: float) -> tuple[TargetWindow, EngineSnapshot]:
    """40 one-second intervals of three prefills each (200-3000 computed tokens, a third of
    them back after an eviction), each request's TTFT 20 ms + per_token x max(N, floor)."""

    rng = random.Random(7)
    w = TargetWindow(3600.0)
    prefills: list[tuple[float, int, int, tuple[float, ...]]] = []
    sums = (0.0,) * len(FLOORS)
    requests = ttft = 0.0
    w.add(TargetSample(ts=0.0, engines={EK: EngineSample(counters=_ttft(0, 0), gauges={})}))
    for i in range(40):
        for j in range(3):
            n = rng.randrange(200, 3000)
            sums = tuple(c + max(n, f) for c, f in zip(sums, FLOORS, strict=True))
            prefills.append((i + 0.1 + 0.3 * j, n, n // 3, sums))
            requests += 1
            ttft += 0.02 + per_token * max(n, floor) + rng.gauss(0.0, 0.0005)
        sample = EngineSample(counters=_ttft(requests, ttft), gauges={})
        w.add(TargetSample(ts=i + 1.0, engines={EK: sample}))
    return w, snapshot(sim_start=0.0, prefills=tuple(prefills))


def _ttft(requests: float, seconds: float) -> dict[str, float]:
    return {"prompt_tokens": 1000.0 * requests, "ttft_requests": requests, "ttft_seconds": seconds}


def test_floor_fit_finds_the_floor_a_short_prefill_costs() -> None:
    """Requests whose TTFT stops falling below 1024 computed tokens: the fit says so, and a
    load that leaves a short suffix is priced only down to the floor."""
    w, snap = _hinge_window(1024, 25e-6)
    floor = floor_fit(snap, w, EK)
    assert floor is not None and floor.floor_tokens == 1024
    assert floor.fit.seconds_per_token == pytest.approx(25e-6, rel=0.05)
    share = floor.share_above(snap.prefills, 0.0, 40.0)
    expected = sum(max(n, 1024) - max(n - r, 1024) for _, n, r, _ in snap.prefills) / sum(
        r for _, _, r, _ in snap.prefills
    )
    assert share == pytest.approx(expected) and 0.2 < share < 0.9


def test_floor_fit_keeps_the_linear_model_without_a_floor() -> None:
    w, snap = _hinge_window(0, 25e-6)
    assert floor_fit(snap, w, EK) is None
    assert floor_fit(snapshot(sim_start=0.0), w, EK) is None  # no prefills recorded


def test_the_whatif_prices_hits_down_to_the_floor() -> None:
    w, snap = _hinge_window(1024, 25e-6)
    snap = dataclasses.replace(snap, buckets=(Bucket(10.0, 100.0, 0.0, 0.0, (25.0, 100.0), 4.0),))
    floor = floor_fit(snap, w, EK)
    assert floor is not None
    d = derived()
    state = whatif_state(snap, w, d, (1000, 2000))
    view = window_view(snap, w, EK)
    assert state is not None and view is not None
    share = floor.share_above(snap.prefills, view.t0, view.t1)
    rho = queue_utilisation(w, EK, view.t0, view.t1, 1.0)  # one prefill per step
    assert rho is not None and state.queue_utilisation == pytest.approx(rho)
    for point, hits in zip(state.points, view.hits, strict=True):
        args = (
            hits / view.seconds,
            floor.fit.seconds_per_token,
            d.transfer_tokens_per_second,
            None,
            view.loads(hits) / view.seconds,
            view.load_wait(d.load_wait_share, hits * share * floor.fit.seconds_per_token),
            hits * share / view.seconds,
        )
        queued = ttft_saved_seconds_per_second(*args, utilisation=rho)
        assert point.ttft_saved_seconds_per_second == pytest.approx(queued)
        assert point.ttft_saved_linear_seconds_per_second == pytest.approx(
            ttft_saved_seconds_per_second(*args)
        )
    # The same traffic without a floor: every hit priced in full, at the engine's own cost.
    w0, snap0 = _hinge_window(0, 25e-6)
    snap0 = dataclasses.replace(snap0, buckets=snap.buckets)
    plain = whatif_state(snap0, w0, d, (1000, 2000))
    assert plain is not None and plain.queue_utilisation is not None
    assert plain.points[1].ttft_saved_seconds_per_second == pytest.approx(
        ttft_saved_seconds_per_second(
            100.0 / view.seconds,
            1 / 23_000.0,
            110_000.0,
            None,
            0.4,
            0.0,
            utilisation=plain.queue_utilisation,
        )
    )


def test_step_sharing_weights_each_step_by_the_requests_in_it() -> None:
    """One KV-event batch is one engine step: a computed token is shared by the prefills of
    its batch, and a prefill that recomputed an evicted prefix (a load, with a tier) leaves
    its step and waits out the others' part of it, at least the base share."""
    none = (0.0,)
    prefills = (
        (0.5, 999, 999, none),  # before the span
        (1.0, 100, 0, none),
        (1.0, 200, 200, none),  # a loader: 400 of its step's 600 tokens are the others'
        (1.0, 300, 0, none),
        (2.0, 600, 300, none),  # a loader alone in its step
        (3.0, 999, 999, none),  # at the span's end: not in it
    )
    got = step_sharing(prefills, 1.0, 3.0, 0.2)
    assert got is not None
    assert got.requests_per_step == pytest.approx((600 * 3 + 600 * 1) / 1200)
    assert got.load_wait_share == pytest.approx((400 / 600 + 0.2) / 2)
    # Two prefills to a step: requests one at a time, nobody waits for the launch a load adds.
    assert got.launch_waiters_per_load == 0.0
    # Bursts of four: every prefill of a loader's step but the first waits for it (3), a
    # loader alone in its step leaves nobody waiting: 3 over 2 loads.
    burst = (
        *((1.0, 100, 50 if j == 0 else 0, none) for j in range(4)),
        *((2.0, 100, 0, none) for _ in range(4)),
        (3.0, 100, 50, none),
    )
    bursts = step_sharing(burst, 0.0, 9.0, 0.2)
    assert bursts is not None and bursts.requests_per_step == pytest.approx(33 / 9)
    assert bursts.launch_waiters_per_load == pytest.approx(1.5)
    # Nobody shares a step: the stores are paid once, and a load waits the base share.
    alone = step_sharing(((1.0, 100, 50, none), (2.0, 300, 0, none)), 0.0, 9.0, 0.2)
    assert alone == StepSharing(1.0, 0.2)
    assert step_sharing(((1.0, 100, 0, none),), 0.0, 9.0, 0.2) == StepSharing(1.0, 0.2)
    assert step_sharing(prefills, 10.0, 20.0, 0.2) is None


def test_a_store_is_paid_by_every_request_sharing_its_step() -> None:
    """Hits are loaded once for their own request; every other computed token is stored,
    and the store delays each request whose prefill shares its step."""
    alone = ttft_saved_seconds_per_second(100.0, 50e-6, 1000.0, 500.0)
    shared = ttft_saved_seconds_per_second(100.0, 50e-6, 1000.0, 500.0, requests_per_store=3.0)
    assert alone == pytest.approx(100 * 50e-6 - 500 / 1000)
    assert shared == pytest.approx(100 * 50e-6 - (100 + 400 * 3) / 1000)


def test_the_hits_saving_is_a_processor_sharing_queues() -> None:
    """The engine as a processor-sharing queue of jobs (the requests sharing a step): its
    summed TTFT per second is k rho / (1 - rho), so work the linear price says saves L
    saves L / (1 - rho') once rho' is what is left: more than linear, most where the
    engine is busiest (32B chat on the H200: +0.42 s/s predicted at 16 GiB where the
    linear what-if said +0.27, +0.48 measured)."""
    rho, k, linear = 0.5, 2.0, 0.2
    left = rho - linear * (1 - rho) / k  # the work the price says is gone
    before, after = k * rho / (1 - rho), k * left / (1 - left)
    assert queue_saving(linear, rho, k) == pytest.approx(before - after)
    assert linear < queue_saving(linear, rho, k) < linear / (1 - rho)
    # No queue, nothing saved, or more work removed than there is: linear.
    assert queue_saving(linear, 0.0, k) == linear
    assert queue_saving(-0.1, rho, k) == -0.1
    assert queue_saving(5.0, 0.1, 1.0) == 5.0
    # Only the hits' saving: the copies and waits are charged as they were.
    plain = ttft_saved_seconds_per_second(100.0, 50e-6, 1000.0, 500.0, 2.0, 0.01)
    queued = ttft_saved_seconds_per_second(100.0, 50e-6, 1000.0, 500.0, 2.0, 0.01, utilisation=rho)
    assert queued - plain == pytest.approx(queue_saving(100 * 50e-6, rho) - 100 * 50e-6)


def test_queue_utilisation_is_littles_law_over_the_requests_sharing_a_step() -> None:
    """Summed TTFT per second is the mean number of requests waiting for their first token;
    k of them to a step are one job, and a processor-sharing queue with rho / (1 - rho)
    jobs in it is at rho."""
    w = TargetWindow(3600.0)
    for i in range(11):  # 3 requests a second, 0.1 s of TTFT each: 0.3 waiting on average
        w.add(TargetSample(ts=float(i), engines={EK: EngineSample(_ttft(3.0 * i, 0.3 * i), {})}))
    assert queue_utilisation(w, EK, 0.0, 10.0, 1.0) == pytest.approx(0.3 / 1.3)
    assert queue_utilisation(w, EK, 0.0, 10.0, 3.0) == pytest.approx(0.1 / 1.1)
    assert queue_utilisation(w, EK, 0.0, 10.0, 0.5) == pytest.approx(0.3 / 1.3)  # at least 1
    assert queue_utilisation(w, EK, 20.0, 30.0, 1.0) is None  # no interval in the span


def test_the_whatif_prices_a_burst_by_its_steps() -> None:
    """The same prefills, hits and TTFT, once one request per step and once three to a step
    (a burst): the burst's stores are paid by the three, and its loads wait out the others'
    part of their step (8B bursts on the H200: predicted +0.12-0.20 s/s with the stores
    paid once and a load waiting a fifth of a prefill, +0.004-0.069 measured)."""
    _, snap = _hinge_window(0, 25e-6)
    w = TargetWindow(3600.0)
    for i in range(41):  # three requests a second, 1500 tokens computed, 0.1 s of prefill
        counters = {
            **_ttft(3.0 * i, 0.2 * i),
            "prompt_by_source:local_compute": 1500.0 * i,
            "prefill_seconds": 0.1 * i,
            "prefill_requests": 3.0 * i,
        }
        w.add(TargetSample(ts=float(i), engines={EK: EngineSample(counters=counters, gauges={})}))
    burst = tuple((float(int(ts)) + 0.5, n, r, f) for ts, n, r, f in snap.prefills)
    snap = dataclasses.replace(snap, buckets=(Bucket(10.0, 100.0, 0.0, 4.0, (25.0, 100.0)),))
    d = derived(prefill_fit=PrefillFit(0.02, 25e-6, 120, 0.9, 1e-6))
    one = whatif_state(snap, w, d, (1000, 2000))
    three = whatif_state(dataclasses.replace(snap, prefills=burst), w, d, (1000, 2000))
    view = window_view(snap, w, EK)
    assert one is not None and three is not None and view is not None
    assert one.requests_per_step == pytest.approx(1.0)
    assert one.load_wait_share == pytest.approx(d.load_wait_share)
    assert three.requests_per_step == pytest.approx(3.0)
    sharing = step_sharing(burst, view.t0, view.t1, d.load_wait_share)
    assert sharing is not None and sharing.load_wait_share > 0.5
    assert three.load_wait_share == pytest.approx(sharing.load_wait_share)
    assert view.computed_tokens is not None and d.transfer_tokens_per_second is not None
    for a, b, hits in zip(one.points, three.points, view.hits, strict=True):
        assert a.ttft_saved_seconds_per_second is not None
        assert b.ttft_saved_seconds_per_second is not None
        loads = view.loads(hits) / view.seconds
        extra_wait = view.load_wait(sharing.load_wait_share, hits * 25e-6) - view.load_wait(
            d.load_wait_share, hits * 25e-6
        )
        assert extra_wait > 0
        stores = (view.computed_tokens - hits) / view.seconds / d.transfer_tokens_per_second
        # The hits' saving is a queue's of the jobs that share steps: three requests to a
        # job make a third as many jobs waiting, so less of a queue.
        assert one.queue_utilisation is not None and three.queue_utilisation is not None
        assert three.queue_utilisation < one.queue_utilisation
        cost = ttft_cost_per_token(d)
        assert cost is not None
        linear = hits / view.seconds * cost
        queue = queue_saving(linear, three.queue_utilisation, 3.0) - queue_saving(
            linear, one.queue_utilisation, 1.0
        )
        assert b.ttft_saved_seconds_per_second == pytest.approx(
            a.ttft_saved_seconds_per_second - loads * extra_wait - 2 * stores + queue
        )


def test_a_launch_bound_engines_loads_keep_their_step_waiting() -> None:
    """vLLM launches the step behind a step before taking that step's output back. Where a
    step's fixed time (the prefill fit's time per request) is most of a prefill, as on 0.6B
    served eager, the launch of a loader's later step is not hidden under the step's compute,
    and in a burst every prefill of the loader's step but the first waits for it: 2 x fixed -
    prefill each (the 0.6B bursts' requests that did not load waited 15-35 ms more with the
    tier, one launch, docs/whatif.md). Where the step's compute covers two launches, nothing."""
    view = WhatIfView(1.0, 10.0, (0.0,), None, 0.0, prefill_seconds=2.0, prefill_requests=100.0)
    assert view.launch_wait(0.018, 0.0) == pytest.approx(2 * 0.018 - 0.02)
    assert view.launch_wait(0.018, 0.5) == pytest.approx(2 * 0.018 - 0.015)  # the tier's hits
    assert view.launch_wait(0.008, 0.0) == 0.0  # compute covers both launches
    assert view.launch_wait(0.0, 0.0) == 0.0
    assert WhatIfView(1.0, 1.0, (0.0,), None, 0.0).launch_wait(0.02, 0.0) == 0.0  # no prefills
    # A burst of three a second, one of them back after an eviction: with a step's fixed
    # time 30 ms of the 33 ms prefill the saving falls by each load's two waiting prefills
    # (all but the burst's first) times the launch wait; with 10 ms it is the saving of an
    # engine whose compute hides the launch.
    w = TargetWindow(3600.0)
    prefills: list[tuple[float, int, int, tuple[float, ...]]] = []
    sums = (0.0,) * len(FLOORS)
    for i in range(41):
        counters = {
            **_ttft(3.0 * i, 0.2 * i),
            "prompt_by_source:local_compute": 1500.0 * i,
            "prefill_seconds": 0.1 * i,
            "prefill_requests": 3.0 * i,
        }
        w.add(TargetSample(ts=float(i), engines={EK: EngineSample(counters=counters, gauges={})}))
        for j in range(3):
            sums = tuple(c + max(600, f) for c, f in zip(sums, FLOORS, strict=True))
            prefills.append((i + 0.5, 600, 300 if j == 0 else 0, sums))
    snap = snapshot(
        sim_start=0.0,
        prefills=tuple(prefills),
        buckets=(Bucket(10.0, 100.0, 0.0, 0.0, (25.0, 100.0), 4.0),),
    )
    hidden = derived(prefill_fit=PrefillFit(0.01, 25e-6, 120, 0.9, 1e-6))
    bound = derived(prefill_fit=PrefillFit(0.03, 25e-6, 120, 0.9, 1e-6))
    a, b = whatif_state(snap, w, hidden, (1000, 2000)), whatif_state(snap, w, bound, (1000, 2000))
    view = window_view(snap, w, EK)
    assert a is not None and b is not None and view is not None
    assert a.launch_waiters_per_load == b.launch_waiters_per_load == pytest.approx(2.0)
    assert a.launch_wait_seconds == 0.0
    assert b.launch_wait_seconds == pytest.approx(2 * 0.03 - 0.1 / 3)
    assert a.load_wait_share == b.load_wait_share and a.requests_per_step == b.requests_per_step
    for p, q, hits in zip(a.points, b.points, view.hits, strict=True):
        assert p.ttft_saved_seconds_per_second is not None
        assert q.ttft_saved_seconds_per_second is not None
        saved_prefill = hits * 25e-6  # every hit above any floor: priced whole
        waits = view.loads(hits) / view.seconds * 2.0 * view.launch_wait(0.03, saved_prefill)
        assert waits > 0
        assert q.ttft_saved_seconds_per_second == pytest.approx(
            p.ttft_saved_seconds_per_second - waits
        )


def test_offload_off_points_carry_the_saving_at_the_upper_end_of_the_cost() -> None:
    """With offload off each point also states its saving were a computed token to cost the
    TTFT fit's slope plus two standard errors: the hits times that difference, per second.
    Without a standard error there is no bound, and with offload on none is needed."""
    snap = snapshot()
    fit = PrefillFit(0.01, 40e-6, 20, 0.9, stderr=5e-6)
    state = whatif_state(snap, WINDOW, derived(ttft_fit=fit), (1000, 2000))
    view = window_view(snap, WINDOW, EK)
    assert state is not None and view is not None
    for point, hits in zip(state.points, view.hits, strict=True):
        assert point.ttft_saved_seconds_per_second is not None
        assert point.ttft_saved_upper_seconds_per_second == pytest.approx(
            point.ttft_saved_seconds_per_second + hits / view.seconds * 2 * 5e-6
        )
    plain = whatif_state(snap, WINDOW, derived(), (1000, 2000))
    assert plain is not None
    assert all(p.ttft_saved_upper_seconds_per_second is None for p in plain.points)
    assert all(p.ttft_saved_lower_seconds_per_second is None for p in state.points)
