"""exporter/render/targets.py: kvoffload_target_* from a TargetSnapshot."""

from __future__ import annotations

from exporter.options import TargetConfig
from exporter.render.targets import target_families
from exporter.sources import ErrorKind, SourceState
from exporter.sources.vllm_http import TARGET_FAILURE_REASONS, TargetSnapshot
from exporter.vllm_metrics import EngineKey, EngineSample, TargetSample
from exporter.window import TargetWindow
from tests.render.common import by_name, series

CONFIG = TargetConfig(url="http://10.0.0.1:8000", name="prefill")


def health(up: bool, **kw: object) -> SourceState:
    fields: dict[str, object] = dict(
        name="vllm:prefill",
        up=up,
        started=True,
        last_success=None,
        last_attempt=None,
        duration=None,
        error_kind=None,
        error=None,
        errors_total={},
    )
    fields.update(kw)
    return SourceState(**fields)  # type: ignore[arg-type]


def window(*ts: float) -> TargetWindow:
    w = TargetWindow(300.0)
    for t in ts:
        w.add(TargetSample(t, {EngineKey("m", "0"): EngineSample({"prompt_tokens": t}, {})}))
    return w


def test_target_families_of_a_healthy_target() -> None:
    snap = TargetSnapshot(
        CONFIG,
        window(0.0, 5.0, 10.0),
        "0.26.0",
        7,
        health(
            True,
            last_success=1_700_000_000.0,
            duration=0.012,
            errors_total={ErrorKind.TIMEOUT: 3, ErrorKind.COUNTER_RESET: 1},
        ),
    )
    fams = list(target_families(snap))
    assert [f.definition.name for f in fams] == [
        "kvoffload_target_up",
        "kvoffload_target_scrape_duration_seconds",
        "kvoffload_target_scrape_failures_total",
        "kvoffload_target_last_success_timestamp_seconds",
        "kvoffload_target_resets_total",
        "kvoffload_target_series_dropped_total",
        "kvoffload_target_window_covered_seconds",
        "kvoffload_target_info",
    ]
    f = by_name(fams)
    assert series(f["kvoffload_target_up"]) == {("prefill",): 1.0}
    assert series(f["kvoffload_target_scrape_duration_seconds"]) == {("prefill",): 0.012}
    failures = series(f["kvoffload_target_scrape_failures_total"])
    assert set(failures) == {("prefill", str(k)) for k in TARGET_FAILURE_REASONS}
    assert failures[("prefill", "timeout")] == 3.0 and sum(failures.values()) == 3.0
    assert series(f["kvoffload_target_last_success_timestamp_seconds"]) == {
        ("prefill",): 1_700_000_000.0
    }
    assert series(f["kvoffload_target_resets_total"]) == {("prefill",): 1.0}
    assert series(f["kvoffload_target_series_dropped_total"]) == {("prefill",): 7.0}
    assert series(f["kvoffload_target_window_covered_seconds"]) == {
        ("prefill",): snap.window.covered_seconds()
    }
    assert snap.window.covered_seconds() > 0
    assert series(f["kvoffload_target_info"]) == {
        ("prefill", "http://10.0.0.1:8000", "0.26.0"): 1.0
    }


def test_a_target_never_scraped_has_no_duration_or_last_success_and_unknown_version() -> None:
    snap = TargetSnapshot(
        TargetConfig(url="http://h:1"), window(), None, 0, health(False, started=False)
    )
    f = by_name(target_families(snap))
    assert "kvoffload_target_scrape_duration_seconds" not in f
    assert "kvoffload_target_last_success_timestamp_seconds" not in f
    assert series(f["kvoffload_target_up"]) == {("h:1",): 0.0}
    assert series(f["kvoffload_target_window_covered_seconds"]) == {("h:1",): 0.0}
    assert series(f["kvoffload_target_info"]) == {("h:1", "http://h:1", "unknown"): 1.0}
