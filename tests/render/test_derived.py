"""exporter/render/derived.py: the derived families from hand-built EngineDerived values."""

from __future__ import annotations

from dataclasses import replace

import pytest

from exporter.model.derive.balance import DeliveredSaving, offload_balance
from exporter.model.derive.fits import OffloadFit, PrefillFit
from exporter.render.derived import _DERIVED_COUNTERS, _DERIVED_GAUGES, derived_families
from exporter.vllm_metrics import EngineKey
from tests.helpers import balance_sums
from tests.model.advisor.common import base
from tests.render.common import by_name, series

LABELS = ("t", "qwen3-dummy", "0")


def empty(**kw: object):
    """An engine that knows nothing: every optional value None, no totals."""
    d = base(**kw)
    nothing = {attr: None for _, attr in _DERIVED_GAUGES}
    return replace(d, **nothing, prefill_fit=None, offload_fit=None, totals={}, window={})


def test_every_family_once_in_a_fixed_order_even_when_empty() -> None:
    fams = derived_families([])
    names = [f.definition.name for f in fams]
    assert names[0] == "kvoffload_offload_enabled"
    assert names[1 : 1 + len(_DERIVED_GAUGES)] == [n for n, _ in _DERIVED_GAUGES]
    assert len(set(names)) == len(names)
    assert all(len(f) == 0 for f in fams)


def test_unknown_values_give_no_sample_never_zero() -> None:
    f = by_name(derived_families([("t", [empty()])]))
    assert series(f["kvoffload_offload_enabled"]) == {LABELS: 0.0}
    # the fit-point count is always there: 0 points is a fact, not an unknown
    assert series(f["kvoffload_prefill_fit_points"]) == {LABELS: 0.0}
    present = {n for n, fam in f.items() if len(fam)}
    assert present == {"kvoffload_offload_enabled", "kvoffload_prefill_fit_points"}


def test_known_values_each_in_its_family_with_the_engine_labels() -> None:
    d = base(
        offload_enabled=True,
        offload_buffer_bytes=0.5 * 2**30,
        offload_hit_ratio=0.184,
        load_bandwidth=3.1e10,
        prefill_fit=PrefillFit(0.012, 2e-6, 40, 0.98),
        offload_fit=OffloadFit(0.0, 40e-6, 10e-6, 60, 0.99),
        totals={
            "load_bytes": 8.4e8,
            "stores_skipped": 5.0,
            "prompt_by_source:external_kv_transfer": 7360.0,
            "prompt_by_source:local_compute": 100.0,
            "prefix_hits": 1.0,  # not re-exported
        },
        window={"prompt_by_source:external_kv_transfer": 3000.0},
    )
    f = by_name(derived_families([("t", [d])], covered={"t": 60.0}))
    assert series(f["kvoffload_offload_enabled"]) == {LABELS: 1.0}
    for name, attr in _DERIVED_GAUGES:
        value = getattr(d, attr)
        assert series(f[name]) == ({} if value is None else {LABELS: value}), name
    assert series(f["kvoffload_offload_load_bytes_total"]) == {LABELS: 8.4e8}
    assert series(f["kvoffload_offload_stores_skipped_total"]) == {LABELS: 5.0}
    assert series(f["kvoffload_offload_store_bytes_total"]) == {}
    assert {n for n, _ in _DERIVED_COUNTERS} <= set(f)
    assert series(f["kvoffload_prompt_tokens_total"]) == {
        (*LABELS, "local_compute"): 100.0,
        (*LABELS, "external_kv_transfer"): 7360.0,
    }
    assert series(f["kvoffload_transfer_rate_estimated"]) == {LABELS: 1.0}
    assert series(f["kvoffload_prefill_request_overhead_seconds"]) == {LABELS: 0.012}
    assert series(f["kvoffload_prefill_fit_points"]) == {LABELS: 40.0}
    saving = d.offload_fit.saving_seconds_per_token  # type: ignore[union-attr]
    assert saving == pytest.approx(30e-6)
    assert series(f["kvoffload_offload_saving_seconds_per_token"]) == {LABELS: saving}
    # Without a balance (no store timing) there is no net saving to state.
    assert series(f["kvoffload_offload_ttft_saved_seconds_per_second"]) == {}


def test_ttft_saved_is_the_balance_per_covered_second() -> None:
    fit = OffloadFit(0.0, 40e-6, 10e-6, 60, 0.99, 1e-6, 1e-6, 1e-6)
    bal = offload_balance(fit, balance_sums(loaded=3000.0, computed=1000.0, store=0.01, ttft=5.0))
    assert bal is not None
    d = base(offload_enabled=True, offload_fit=fit, balance=bal)
    name = "kvoffload_offload_ttft_saved_seconds_per_second"
    (saved,) = series(by_name(derived_families([("t", [d])], covered={"t": 60.0}))[name]).values()
    # (30 us x 3000 loaded - 0.01 s x 4000 / 1000 stored) / 60 s
    assert saved == pytest.approx((30e-6 * 3000.0 - 0.04) / 60.0)
    assert len(by_name(derived_families([("t", [d])]))[name]) == 0  # no coverage known
    assert len(by_name(derived_families([("t", [d])], covered={"t": 0.0}))[name]) == 0
    no_balance = replace(d, balance=None)
    assert len(by_name(derived_families([("t", [no_balance])], covered={"t": 60.0}))[name]) == 0


def test_what_enabling_delivered_is_its_net_seconds_per_covered_second() -> None:
    """The same window priced at the engine's TTFT fit from before offload (51.7 s) against
    the 77.6 s measured: offload made requests slower, a negative rate."""
    d = base(offload_enabled=True, delivered=DeliveredSaving(51.74, 77.63, 1.6))
    name = "kvoffload_offload_delivered_ttft_saved_seconds_per_second"
    (rate,) = series(by_name(derived_families([("t", [d])], covered={"t": 120.0}))[name]).values()
    assert rate == pytest.approx((51.74 - 77.63) / 120.0)
    assert len(by_name(derived_families([("t", [d])], covered={"t": 0.0}))[name]) == 0
    nothing_before = replace(d, delivered=None)
    assert len(by_name(derived_families([("t", [nothing_before])], covered={"t": 60.0}))[name]) == 0


def test_what_the_tier_adds_to_every_request_is_exported_without_its_error() -> None:
    """The 4B eager tier of `-rep2`, after its run without offload: 74.4 ms a request."""
    d = base(offload_enabled=True, request_cost=(0.0744, 0.0114))
    name = "kvoffload_offload_request_ttft_cost_seconds"
    assert series(by_name(derived_families([("t", [d])]))[name]) == {
        ("t", "qwen3-dummy", "0"): 0.0744
    }
    unknown = replace(d, request_cost=None)
    assert len(by_name(derived_families([("t", [unknown])]))[name]) == 0


def test_engines_of_several_targets_are_told_apart() -> None:
    e1 = base(key=EngineKey("qwen3-dummy", "1"), kv_usage=0.5)
    f = by_name(derived_families([("a", [base(kv_usage=0.9), e1]), ("b", [base(kv_usage=0.1)])]))
    assert series(f["kvoffload_kv_cache_usage_ratio"]) == {
        ("a", "qwen3-dummy", "0"): 0.9,
        ("a", "qwen3-dummy", "1"): 0.5,
        ("b", "qwen3-dummy", "0"): 0.1,
    }
