"""The panel-spec layer: dashboards as plain data, independent of the Grafana SDK.

A panel declares its queries, unit, how to read it, its thresholds and the scenarios
in which it must show data. The metric names it needs are read from its queries, so
a panel cannot use a name without the generator noticing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class Scenario(StrEnum):
    """The data a panel is proven against (tests/integration/test_dashboard_queries.py)."""

    LIVE = "live"  # real vLLM CPU (offload off) + the exporter + Prometheus scraping both
    OFFLOAD = "offload"  # recorded H200 offload run, replayed through the exporter, backfilled
    GPU = "gpu"  # recorded GPU runs with NVML and /proc data (tests/fixtures/gpu/)
    # KV transfer backends: recorded vLLM 0.26 runs (tiering, 32B prefill) and vLLM 0.32 /
    # LMCache expositions synthesized from the upstream definitions, replayed and backfilled
    BACKENDS = "backends"


# Label filters every query carries. Exporter series (job $job) name the vLLM server in
# `target`; vLLM's own series, scraped directly (often by another job), in `instance`.
# GPU series carry neither, so they are joined on the exporter's instance.
ENGINE = 'job=~"$job", target=~"$target", model_name=~"$model_name", engine=~"$engine"'
TARGET = 'job=~"$job", target=~"$target"'
TARGET_ENGINE = 'job=~"$job", target=~"$target", engine=~"$engine"'
VLLM = 'instance=~"$instance", model_name=~"$model_name", engine=~"$engine"'
EXPORTER_OF_TARGET = 'kvoffload_target_up{job=~"$job", target=~"$target"}'


def on_exporter(expr: str) -> str:
    """Keep host-level series of the exporters that watch the selected targets."""
    return f"({expr}) and on (instance) {EXPORTER_OF_TARGET}"


def rate(name: str, selector: str = ENGINE, window: str = "$__rate_interval") -> str:
    return f"rate({name}{{{selector}}}[{window}])"


class Color(StrEnum):
    OK = "green"
    WARN = "orange"
    BAD = "red"
    INFO = "blue"
    NEUTRAL = "text"


@dataclass(frozen=True, slots=True)
class Step:
    """A threshold step: from `value` upwards the colour is `color` (None = the base)."""

    value: float | None
    color: Color


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False  # tables, bar charts and "current value" stats
    table: bool = False  # format "table": one row per series, labels as columns


@dataclass(frozen=True, slots=True)
class Mapping:
    """Value -> text (and colour) for stats and tables, e.g. 1 -> "on"."""

    value: str
    text: str
    color: Color | None = None


PanelKind = str  # "timeseries" | "stat" | "table" | "barchart"
KINDS = ("timeseries", "stat", "table", "barchart")

_METRIC_RE = re.compile(r"(?<![A-Za-z0-9_:$])(kvoffload_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def metric_names(expr: str) -> frozenset[str]:
    """Every exporter or vLLM metric name in a PromQL expression or variable query."""
    return frozenset(_METRIC_RE.findall(expr))


@dataclass(frozen=True, slots=True)
class Panel:
    key: str  # stable identifier: PENDING, docs and tests refer to it
    title: str
    kind: PanelKind
    unit: str
    description: str  # what it shows and how to read it (Grafana shows it as the (i) tooltip)
    queries: tuple[Query, ...]
    scenarios: frozenset[Scenario]  # where it must not be empty
    width: int = 12
    height: int = 8
    steps: tuple[Step, ...] = ()  # thresholds; the first step is the base colour
    threshold_lines: bool = False  # draw thresholds as dashed lines (timeseries)
    min: float | None = None
    max: float | None = None
    decimals: int | None = None
    stack: bool = False
    log_scale: bool = False
    axis_label: str = ""
    mappings: tuple[Mapping, ...] = ()
    x_field: str = ""  # barchart: the label that becomes the x axis
    x_numeric: bool = True  # barchart: order the x labels as numbers (sizes), else as text
    hidden_columns: tuple[str, ...] = ()  # table: columns to hide
    runbooks: tuple[str, ...] = ()  # alert names whose runbook section this panel backs
    see_also: tuple[str, ...] = ()  # uids of dashboards that go deeper
    preview: Scenario | None = None  # the scenario its preview picture is drawn from

    @property
    def metrics(self) -> frozenset[str]:
        out: set[str] = set()
        for q in self.queries:
            out |= metric_names(q.expr)
        return frozenset(out)


@dataclass(frozen=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    label: str
    query: str  # label_values(<selector>, <label>)
    description: str

    @property
    def metrics(self) -> frozenset[str]:
        return metric_names(self.query)


@dataclass(frozen=True, slots=True)
class Dashboard:
    uid: str
    title: str
    description: str
    file: str  # dashboards/json/<file>
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = ("kv-offload",)
    time_from: str = "now-1h"

    def panels(self) -> list[Panel]:
        return [p for r in self.rows for p in r.panels]
