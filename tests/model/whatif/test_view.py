"""exporter/model/whatif/view.py: simulated hits joined with the window's prompt tokens."""

from __future__ import annotations

import dataclasses

import pytest

from exporter.model.advisor.types import PolicyPoint
from exporter.model.derive.backends import BackendConfig, BackendDerived
from exporter.model.whatif.engine import (
    POLICY_COMBOS,
    Bucket,
    EngineSnapshot,
    PolicyBucket,
    SimConfig,
)
from exporter.model.whatif.simulator import ttft_saved_seconds_per_second
from exporter.model.whatif.view import (
    WhatIfView,
    engine_rank,
    policy_points,
    prompt_span,
    whatif_state,
    window_view,
)
from exporter.vllm_metrics import EngineKey
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
        2000.0, 10.0, (300.0, 500.0), None, 160.0
    )
    conf = window_view(snapshot(configured_blocks=4), WINDOW, EK)
    assert conf is not None and conf.configured_hits == 75.0
    assert window_view(None, WINDOW, EK) is None
    assert window_view(snapshot(capacities=None), WINDOW, EK) is None
    assert window_view(snapshot(sim_start=None), WINDOW, EK) is None


def test_whatif_state_points_per_size() -> None:
    d = derived()
    state = whatif_state(snapshot(configured_blocks=4), WINDOW, d, (1000, 2000))
    assert state is not None
    assert [(p.cpu_buffer_bytes, p.hit_ratio) for p in state.points] == [
        (1000.0, 0.15),
        (2000.0, 0.25),
    ]
    assert state.points[0].ttft_saved_seconds_per_second == ttft_saved_seconds_per_second(
        30.0, 23_000.0, 110_000.0
    )
    assert state.recomputed_after_eviction_tokens == 160.0
    assert state.configured_hit_ratio == pytest.approx(75.0 / 2000.0)
    assert whatif_state(snapshot(sim_start=None), WINDOW, d, (1000, 2000)) is None
    with pytest.raises(ValueError):
        whatif_state(snapshot(), WINDOW, d, (1000,))  # sizes and curve must match


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
