"""What Grafana does to a dashboard query before Prometheus sees it, without Grafana.

Followed from Grafana's sources (pkg/promlib/models/query.go, the frontend's
rangeutil.calculateInterval and the Prometheus datasource's interpolateQueryExpr):

- The frontend picks intervalMs = max(data source scrape interval,
  roundInterval(range / maxDataPoints)); maxDataPoints is the panel's width in pixels.
- The backend's step = max(intervalMs, roundInterval(range / 11000)), aligned: start and
  end are rounded down to a multiple of the step.
- $__interval = step (Grafana's FormatInterval: "15s", "1m"); $__interval_ms likewise;
  $__rate_interval = max(intervalMs + scrape interval, 4 x scrape interval), written as a
  Go duration ("1m0s"); $__range = the range in whole seconds + "s".
- Template variables: a multi-value/include-all variable is regex-escaped, several values
  are joined as (a|b), and "All" becomes the variable's allValue verbatim.
- label_values(selector, label) asks /api/v1/label/<label>/values?match[]=selector for
  the time range, after substituting the variables already chosen.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SAFE_RESOLUTION = 11000
VIEWPORT_PX = 1920  # a full-HD browser window: a panel of width w (of 24) is w*80 px wide

# (upper bound of the raw interval, rounded interval), milliseconds; Grafana's roundInterval.
_ROUND_MS: tuple[tuple[float, float], ...] = (
    (10, 1),
    (15, 10),
    (35, 20),
    (75, 50),
    (150, 100),
    (350, 200),
    (750, 500),
    (1500, 1000),
    (3500, 2000),
    (7500, 5000),
    (12500, 10000),
    (17500, 15000),
    (25000, 20000),
    (45000, 30000),
    (90000, 60000),
    (210000, 120000),
    (450000, 300000),
    (750000, 600000),
    (1050000, 900000),
    (1500000, 1200000),
    (2700000, 1800000),
    (5400000, 3600000),
    (9000000, 7200000),
    (16200000, 10800000),
    (32400000, 21600000),
    (86400000, 43200000),
    (604800000, 86400000),
    (1814400000, 604800000),
    (3628800000, 2592000000),
)


def round_interval_ms(ms: float) -> float:
    for bound, rounded in _ROUND_MS:
        if ms <= bound:
            return rounded
    return 31536000000.0  # 1y


def format_interval(ms: float) -> str:
    """gtime.FormatInterval: the largest whole unit."""
    for unit, size in (("y", 31536000000), ("d", 86400000), ("h", 3600000), ("m", 60000)):
        if ms >= size:
            return f"{int(ms // size)}{unit}"
    if ms >= 1000:
        return f"{int(ms // 1000)}s"
    return f"{max(int(ms), 1)}ms"


def go_duration(ms: float) -> str:
    """Go's time.Duration.String() for whole milliseconds: 4s, 1m0s, 1h30m0s, 500ms."""
    ms = round(ms)
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3600000)
    minutes, rest = divmod(rest, 60000)
    seconds = rest / 1000
    sec = f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{sec}"
    if minutes:
        return f"{minutes}m{sec}"
    return sec


@dataclass(frozen=True, slots=True)
class Timing:
    start: float  # unix seconds, aligned to the step
    end: float
    step: float  # seconds
    interval_ms: float  # the frontend's intervalMs
    rate_interval_ms: float
    range_s: int

    @property
    def builtins(self) -> dict[str, str]:
        step_ms = self.step * 1000
        return {
            "__rate_interval_ms": str(int(self.rate_interval_ms)),
            "__rate_interval": go_duration(self.rate_interval_ms),
            "__interval_ms": str(int(step_ms)),
            "__interval": format_interval(step_ms),
            "__range_ms": str(self.range_s * 1000),
            "__range_s": str(self.range_s),
            "__range": f"{self.range_s}s",
        }


def timing(start: float, end: float, scrape_interval: float, max_data_points: int) -> Timing:
    range_ms = (end - start) * 1000
    scrape_ms = scrape_interval * 1000
    interval_ms = max(scrape_ms, round_interval_ms(range_ms / max_data_points))
    calculated = interval_ms
    if range_ms / max_data_points >= interval_ms:
        calculated = round_interval_ms(range_ms / max_data_points)
    step_ms = max(calculated, round_interval_ms(range_ms / SAFE_RESOLUTION))
    rate_ms = max(interval_ms + scrape_ms, 4 * scrape_ms)
    step = step_ms / 1000
    return Timing(
        start=math.floor(start / step) * step,
        end=math.floor(end / step) * step,
        step=step,
        interval_ms=interval_ms,
        rate_interval_ms=rate_ms,
        range_s=round(range_ms / 1000),
    )


def max_data_points(panel: Mapping[str, Any]) -> int:
    if panel.get("maxDataPoints"):
        return int(panel["maxDataPoints"])
    return int(panel["gridPos"]["w"] * VIEWPORT_PX / 24)


# ----------------------------------------------------------------------------- variables

ALL = "$__all"
_REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|]")
_VAR_RE = re.compile(r"\$\{(\w+)\}|\$(\w+)|\[\[(\w+)\]\]")


def regex_escape(value: str) -> str:
    """prometheusSpecialRegexEscape: as it must appear inside a PromQL "..." regex."""
    value = value.replace("\\", "\\\\\\\\")
    return _REGEX_SPECIAL.sub(lambda m: "\\\\" + m.group(0), value)


def regular_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\\\'")


def format_variable(variable: Mapping[str, Any], values: Sequence[str]) -> str:
    if list(values) == [ALL]:
        if variable.get("allValue"):
            return str(variable["allValue"])
        raise ValueError(f"variable {variable['name']}: All without allValue is not emulated")
    if not variable.get("multi") and not variable.get("includeAll"):
        return regular_escape(values[0])
    escaped = [regex_escape(v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def interpolate(
    expr: str,
    variables: Sequence[Mapping[str, Any]],
    chosen: Mapping[str, Sequence[str]],
    builtins: Mapping[str, str] | None = None,
) -> str:
    """Replace $__builtins and $variables as Grafana does; unknown $names are an error."""
    by_name = {v["name"]: v for v in variables}
    builtins = builtins or {}

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name in builtins:
            return builtins[name]
        if name in by_name and name in chosen:
            return format_variable(by_name[name], chosen[name])
        raise KeyError(f"${name} in {expr!r} has no value")

    # Longest built-in names first, so $__rate_interval_ms is not read as $__rate_interval.
    return _VAR_RE.sub(sub, expr)


_LABEL_VALUES = re.compile(
    r"^\s*label_values\(\s*(?:(?P<sel>.*),\s*)?(?P<label>\w+)\s*\)\s*$", re.S
)


def parse_label_values(query: str) -> tuple[str | None, str]:
    m = _LABEL_VALUES.match(query)
    if not m:
        raise ValueError(f"not a label_values() query: {query!r}")
    return m.group("sel"), m.group("label")


# ----------------------------------------------------------------------------- running

Api = Callable[..., Any]  # api("query_range", query=..., start=...) -> Prometheus "data"


@dataclass
class TargetResult:
    ref_id: str
    expr: str  # as sent to Prometheus
    instant: bool
    series: list[dict[str, Any]] = field(default_factory=list)

    def finite_points(self) -> int:
        n = 0
        for s in self.series:
            values = s.get("values") or ([s["value"]] if "value" in s else [])
            n += sum(1 for _, v in values if math.isfinite(float(v)))
        return n


@dataclass
class Emulator:
    """Runs a dashboard's variable and panel queries the way Grafana would."""

    api: Api
    dashboard: Mapping[str, Any]
    scrape_interval: float
    start: float
    end: float

    @property
    def variables(self) -> list[Mapping[str, Any]]:
        return [v for v in self.dashboard["templating"]["list"] if v["type"] == "query"]

    def variable_options(
        self, variable: Mapping[str, Any], chosen: Mapping[str, Sequence[str]]
    ) -> list[str]:
        selector, label = parse_label_values(str(variable["query"]))
        params: dict[str, str] = {"start": f"{self.start:.3f}", "end": f"{self.end:.3f}"}
        if selector:
            params["match[]"] = interpolate(selector, self.variables, chosen)
        return sorted(str(v) for v in self.api(f"label/{label}/values", **params))

    def all_chosen(self) -> dict[str, list[str]]:
        return {v["name"]: [ALL] for v in self.variables}

    def run_panel(
        self, panel: Mapping[str, Any], chosen: Mapping[str, Sequence[str]]
    ) -> list[TargetResult]:
        t = timing(self.start, self.end, self.scrape_interval, max_data_points(panel))
        out = []
        for target in panel.get("targets", []):
            expr = interpolate(target["expr"], self.variables, chosen, t.builtins)
            instant = bool(target.get("instant")) and not target.get("range")
            if instant:
                data = self.api("query", query=expr, time=f"{self.end:.3f}")
            else:
                data = self.api(
                    "query_range",
                    query=expr,
                    start=f"{t.start:.3f}",
                    end=f"{t.end:.3f}",
                    step=f"{t.step:g}",
                )
            result = data["result"] if data["resultType"] in ("matrix", "vector") else []
            out.append(TargetResult(target["refId"], expr, instant, list(result)))
        return out
