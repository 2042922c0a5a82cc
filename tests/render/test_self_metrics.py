"""exporter/render/self_metrics.py: build info, window, and per-collector health."""

from __future__ import annotations

from exporter.render.self_metrics import COLLECTOR_ERROR_KINDS, self_families
from exporter.sources import ErrorKind, SourceState
from tests.render.common import by_name, series


def state(name: str, up: bool, **kw: object) -> SourceState:
    fields: dict[str, object] = dict(
        name=name,
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


def test_self_families_in_order_with_build_info_and_window() -> None:
    fams = list(self_families("1.2.3", "3.11.9", 300.0, []))
    assert [f.definition.name for f in fams] == [
        "kvoffload_build_info",
        "kvoffload_window_seconds",
        "kvoffload_collector_up",
        "kvoffload_collector_duration_seconds",
        "kvoffload_collector_last_success_timestamp_seconds",
        "kvoffload_collector_errors_total",
    ]
    f = by_name(fams)
    assert series(f["kvoffload_build_info"]) == {("1.2.3", "3.11.9"): 1.0}
    assert series(f["kvoffload_window_seconds"]) == {(): 300.0}
    assert [len(x) for x in fams[2:]] == [0, 0, 0, 0]


def test_collector_health_absent_values_give_no_sample_and_every_kind_is_counted() -> None:
    ok = state("nvml", True, last_success=1000.0, duration=0.02)
    never = state(
        "procfs:a",
        False,
        error_kind=ErrorKind.UNAVAILABLE,
        errors_total={ErrorKind.TIMEOUT: 2, ErrorKind.PARSE: 1},
    )
    f = by_name(self_families("v", "p", 60.0, [ok, never]))
    assert series(f["kvoffload_collector_up"]) == {("nvml",): 1.0, ("procfs:a",): 0.0}
    assert series(f["kvoffload_collector_duration_seconds"]) == {("nvml",): 0.02}
    assert series(f["kvoffload_collector_last_success_timestamp_seconds"]) == {("nvml",): 1000.0}
    errors = series(f["kvoffload_collector_errors_total"])
    # Every kind of the closed set for every collector, zeros included: rate() needs them.
    assert len(errors) == 2 * len(ErrorKind) and set(COLLECTOR_ERROR_KINDS) == set(ErrorKind)
    assert errors[("procfs:a", "timeout")] == 2.0
    assert errors[("procfs:a", "parse")] == 1.0
    assert errors[("procfs:a", "unavailable")] == 0.0  # a state, not a counted error
    assert sum(v for k, v in errors.items() if k[0] == "nvml") == 0.0
