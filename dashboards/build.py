"""Spec -> grafana-foundation-sdk builders -> dashboard JSON.

Names are checked before anything is built: an exporter name missing from
exporter/catalogue.csv, or a vLLM name missing from exporter/vllm_metrics.py SERIES, fails
the generator unless the panel is listed in panels.PENDING (then it is skipped with
a warning).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, Self, TypeVar

from grafana_foundation_sdk.builders import barchart, stat, table, timeseries
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as pb
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

from dashboards import panels
from dashboards.spec import Color, Dashboard, Panel, Query, Step, Variable
from exporter.catalogue import CATALOGUE, MetricDef
from exporter.vllm_metrics import family_of

DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
GRID_WIDTH = 24


class GeneratorError(RuntimeError):
    """A dashboard cannot be generated honestly; the message says what to fix."""


def unknown_names(
    names: Iterable[str], catalogue: Mapping[str, MetricDef] = CATALOGUE
) -> frozenset[str]:
    return frozenset(
        n
        for n in names
        if (n.startswith("kvoffload_") and n not in catalogue)
        or (n.startswith("vllm:") and family_of(n) is None)
    )


@dataclass
class Selection:
    dashboard: Dashboard
    panels: list[Panel] = field(default_factory=list)
    skipped: dict[str, frozenset[str]] = field(default_factory=dict)  # key -> unknown names
    waiting_for: dict[str, str] = field(default_factory=dict)  # key -> PENDING's reason
    ready: list[str] = field(default_factory=list)  # pending keys whose names all exist now


def select(
    dash: Dashboard,
    catalogue: Mapping[str, MetricDef] = CATALOGUE,
    pending: Mapping[str, str] = panels.PENDING,
) -> Selection:
    """The panels to generate; raise GeneratorError for an unknown name not in PENDING."""
    sel = Selection(dash)
    errors = []
    for panel in dash.panels():
        missing = unknown_names(panel.metrics, catalogue)
        vllm_missing = {n for n in missing if n.startswith("vllm:")}
        if vllm_missing:
            errors.append(
                f"{panel.key}: vLLM names not in exporter/vllm_metrics.py SERIES: "
                f"{sorted(vllm_missing)}"
            )
        elif missing and panel.key in pending:
            sel.skipped[panel.key] = missing
            sel.waiting_for[panel.key] = pending[panel.key]
        elif missing:
            errors.append(
                f"{panel.key}: not in exporter/catalogue.csv: {sorted(missing)} "
                "(add the rows, or list the panel in dashboards/panels.py PENDING)"
            )
        else:
            if panel.key in pending:
                sel.ready.append(panel.key)
            sel.panels.append(panel)
    if errors:
        raise GeneratorError(f"dashboard {dash.uid}:\n  " + "\n  ".join(errors))
    return sel


def vllm_series(
    dashboards: Iterable[Dashboard] = panels.DASHBOARDS,
    variables: Iterable[Variable] = panels.VARIABLES,
) -> frozenset[str]:
    """The exporter/vllm_metrics.py SERIES entries the dashboards query (families, not the
    _bucket/_sum/_count samples); unknown names are select()'s error, left out here."""
    names = {n for d in dashboards for p in d.panels() for n in p.metrics}
    names |= {n for v in variables for n in v.metrics}
    return frozenset(f for n in names if n.startswith("vllm:") and (f := family_of(n)) is not None)


def check_variables(variables: Iterable[Variable]) -> None:
    bad = {v.name: sorted(unknown_names(v.metrics)) for v in variables if unknown_names(v.metrics)}
    if bad:
        raise GeneratorError(f"variables use unknown metric names: {bad}")


def warn(sel: Selection, stream: Any = None) -> None:
    stream = stream or sys.stderr
    for key, names in sel.skipped.items():
        print(
            f"dashboards: PENDING panel {key} skipped, waiting for {sel.waiting_for[key]}: "
            f"{', '.join(sorted(names))}",
            file=stream,
        )
    for key in sel.ready:
        print(
            f"dashboards: PENDING panel {key} is complete now; remove it from PENDING",
            file=stream,
        )


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Placed:
    panel: Panel | None  # None: a row header
    title: str
    id: int
    grid: dm.GridPos


def layout(dash: Dashboard, included: Iterable[Panel]) -> list[Placed]:
    """Rows stack vertically; panels flow left to right and wrap at 24 columns."""
    keep = {p.key for p in included}
    out: list[Placed] = []
    y = 0
    next_id = 1
    for row in dash.rows:
        panels = [p for p in row.panels if p.key in keep]
        if not panels:
            continue
        out.append(Placed(None, row.title, next_id, dm.GridPos(h=1, w=GRID_WIDTH, x=0, y=y)))
        next_id += 1
        y += 1
        x = 0
        line_height = 0
        for p in panels:
            if x + p.width > GRID_WIDTH:
                y += line_height
                x, line_height = 0, 0
            out.append(Placed(p, p.title, next_id, dm.GridPos(h=p.height, w=p.width, x=x, y=y)))
            next_id += 1
            x += p.width
            line_height = max(line_height, p.height)
        y += line_height
    return out


# ----------------------------------------------------------------------------- builders


def _thresholds(steps: tuple[Step, ...]) -> db.ThresholdsConfig:
    steps = steps or (Step(None, Color.OK),)
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=s.value, color=str(s.color)) for s in steps])
    )


def _mappings(panel: Panel) -> list[dm.ValueMapping]:
    if not panel.mappings:
        return []
    return [
        dm.ValueMap(
            options={
                m.value: dm.ValueMappingResult(
                    text=m.text, color=str(m.color) if m.color else None, index=i
                )
                for i, m in enumerate(panel.mappings)
            }
        )
    ]


def _target(q: Query, ref: str) -> pb.Dataquery:
    t = pb.Dataquery().expr(q.expr).ref_id(ref).legend_format(q.legend or "__auto")
    t = t.instant() if q.instant else t.range()
    if q.table:
        t = t.format(pm.PromQueryFormat.TABLE)
    return t


def _links(panel: Panel) -> list[cogbuilder.Builder[dm.DashboardLink]]:
    links: list[cogbuilder.Builder[dm.DashboardLink]] = [
        db.DashboardLink(f"Runbook: {alert}")
        .type(dm.DashboardLinkType.LINK)
        .url(f"{panels.RUNBOOKS_URL}#{alert.lower()}")
        .target_blank(True)
        .tooltip(f"What to do when {alert} fires")
        for alert in panel.runbooks
    ]
    by_uid = {d.uid: d for d in panels.DASHBOARDS}
    links += [
        db.DashboardLink(by_uid[uid].title)
        .type(dm.DashboardLinkType.LINK)
        .url(f"/d/{uid}?${{__url_time_range}}&${{__all_variables}}")
        .tooltip("Open the dashboard with the same time range and variables")
        for uid in panel.see_also
    ]
    return links


class _PanelBuilder(Protocol):
    """What _common() sets on a panel; the SDK's panel builders (stat, table, timeseries,
    barchart) each have these methods without sharing a base class."""

    def id(self, id_val: int) -> Self: ...
    def title(self, title: str) -> Self: ...
    def description(self, description: str) -> Self: ...
    def datasource(self, datasource: dm.DataSourceRef) -> Self: ...
    def grid_pos(self, grid_pos: dm.GridPos) -> Self: ...
    def unit(self, unit: str) -> Self: ...
    def thresholds(self, thresholds: cogbuilder.Builder[dm.ThresholdsConfig]) -> Self: ...
    def min(self, min_val: float) -> Self: ...
    def max(self, max_val: float) -> Self: ...
    def decimals(self, decimals: float) -> Self: ...
    def mappings(self, mappings: list[dm.ValueMapping]) -> Self: ...
    def links(self, links: list[cogbuilder.Builder[dm.DashboardLink]]) -> Self: ...
    def with_target(self, target: cogbuilder.Builder[cogvariants.Dataquery]) -> Self: ...


_B = TypeVar("_B", bound=_PanelBuilder)


def _common(b: _B, placed: Placed) -> _B:
    p = placed.panel
    assert p is not None
    b = (
        b.id(placed.id)
        .title(p.title)
        .description(p.description)
        .datasource(DS)
        .grid_pos(placed.grid)
        .unit(p.unit)
        .thresholds(_thresholds(p.steps))
    )
    if p.min is not None:
        b = b.min(p.min)
    if p.max is not None:
        b = b.max(p.max)
    if p.decimals is not None:
        b = b.decimals(p.decimals)
    if p.mappings:
        b = b.mappings(_mappings(p))
    links = _links(p)
    if links:
        b = b.links(links)
    for i, q in enumerate(p.queries):
        b = b.with_target(_target(q, chr(ord("A") + i)))
    return b


def _legend() -> cb.VizLegendOptions:
    return (
        cb.VizLegendOptions()
        .show_legend(True)
        .display_mode(common.LegendDisplayMode.LIST)
        .placement(common.LegendPlacement.BOTTOM)
        .calcs([])
    )


def _timeseries(placed: Placed) -> timeseries.Panel:
    p = placed.panel
    assert p is not None
    b = _common(timeseries.Panel(), placed)
    b = (
        b.legend(_legend())
        .tooltip(
            cb.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
        .line_width(1)
        .fill_opacity(30 if p.stack else 10)
        .show_points(common.VisibilityMode.NEVER)
        .span_nulls(False)
    )
    if p.threshold_lines:
        b = b.thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED)
        )
    if p.stack:
        b = b.stacking(cb.StackingConfig().mode(common.StackingMode.NORMAL).group("A"))
    if p.log_scale:
        b = b.scale_distribution(
            cb.ScaleDistributionConfig().type(common.ScaleDistribution.LOG).log(10)
        )
    if p.axis_label:
        b = b.axis_label(p.axis_label)
    return b


def _stat(placed: Placed) -> stat.Panel:
    p = placed.panel
    assert p is not None
    b = _common(stat.Panel(), placed)
    return (
        b.reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .color_mode(common.BigValueColorMode.VALUE)
        .graph_mode(common.BigValueGraphMode.NONE)
        .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
        .justify_mode(common.BigValueJustifyMode.AUTO)
        .orientation(common.VizOrientation.HORIZONTAL)
    )


def _organize(hidden: Iterable[str]) -> dm.DataTransformerConfig:
    return dm.DataTransformerConfig(
        id_val="organize", options={"excludeByName": dict.fromkeys(hidden, True)}
    )


def _table(placed: Placed) -> table.Panel:
    p = placed.panel
    assert p is not None
    b = _common(table.Panel(), placed)
    b = b.with_transformation(_organize(p.hidden_columns)).cell_height(common.TableCellHeight.SM)
    if p.mappings:
        # Mapped cells get their mapping's colour; every other cell the transparent base.
        # (Field overrides would be the usual way, but the schema's MatcherConfig rejects
        # the string options of Grafana's byName matcher.)
        b = b.cell_options(
            common.TableColoredBackgroundCellOptions(
                mode=common.TableCellBackgroundDisplayMode.BASIC, apply_to_row=False
            )
        ).thresholds(
            db.ThresholdsConfig()
            .mode(dm.ThresholdsMode.ABSOLUTE)
            .steps([dm.Threshold(value=None, color="transparent")])
        )
    return b


def _barchart(placed: Placed) -> barchart.Panel:
    """Bars per label value of x_field, ordered numerically (labels are strings) or as text."""
    p = placed.panel
    assert p is not None
    b = _common(barchart.Panel(), placed)

    def convert(to: str) -> dm.DataTransformerConfig:
        return dm.DataTransformerConfig(
            id_val="convertFieldType",
            options={"conversions": [{"targetField": p.x_field, "destinationType": to}]},
        )

    sort = dm.DataTransformerConfig(id_val="sortBy", options={"sort": [{"field": p.x_field}]})
    b = (
        b.x_field(p.x_field)
        .legend(_legend())
        .show_value(common.VisibilityMode.AUTO)
        .axis_label(p.axis_label)
        .with_transformation(_organize(("Time",)))
    )
    if not p.x_numeric:
        return b.with_transformation(sort)
    return (
        b.with_transformation(convert("number"))
        .with_transformation(sort)
        .with_transformation(convert("string"))
    )


BUILDERS = {
    "timeseries": _timeseries,
    "stat": _stat,
    "table": _table,
    "barchart": _barchart,
}


def _variables(b: db.Dashboard, variables: Iterable[Variable]) -> db.Dashboard:
    b = b.with_variable(
        db.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .current(dm.VariableOption(selected=True, text="Prometheus", value=panels.DATASOURCE_UID))
    )
    for v in variables:
        b = b.with_variable(
            db.QueryVariable(v.name)
            .label(v.label)
            .description(v.description)
            .datasource(DS)
            .query(v.query)
            .definition(v.query)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
        )
    return b


def build(sel: Selection, variables: Iterable[Variable] = panels.VARIABLES) -> dict[str, Any]:
    dash = sel.dashboard
    b = (
        db.Dashboard(dash.title)
        .uid(dash.uid)
        .description(dash.description)
        .tags(list(dash.tags))
        .refresh("30s")
        .time(dash.time_from, "now")
        .timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .link(
            db.DashboardLink("KV offload dashboards")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags(["kv-offload"])
            .as_dropdown(False)
            .include_vars(True)
            .keep_time(True)
        )
        .link(
            db.DashboardLink("Runbooks")
            .type(dm.DashboardLinkType.LINK)
            .url(panels.RUNBOOKS_URL)
            .icon("doc")
            .target_blank(True)
        )
    )
    b = _variables(b, variables)
    for placed in layout(dash, sel.panels):
        if placed.panel is None:
            b = b.with_row(db.Row(placed.title).id(placed.id).grid_pos(placed.grid))
        else:
            b = b.with_panel(BUILDERS[placed.panel.kind](placed))
    out: dict[str, Any] = json.loads(json.dumps(b.build(), cls=JSONEncoder))
    _drop_link_placement(out)
    return out


def _drop_link_placement(node: Any) -> None:
    """The SDK puts every link in the controls menu ("inControlsMenu"); Grafana's default
    (no placement) shows dashboard links above the panels, where people see them."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "links" and isinstance(value, list):
                for link in value:
                    if isinstance(link, dict):
                        link.pop("placement", None)
            _drop_link_placement(value)
    elif isinstance(node, list):
        for item in node:
            _drop_link_placement(item)


def to_json(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
