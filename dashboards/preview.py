"""Draw each dashboard's panels to PNG (matplotlib) from the Prometheus data they query.

Every panel is drawn from its preview scenario (else the first it is proven in), with the
queries of the committed JSON run through dashboards.grafana (variables on All), on Grafana's
24-column grid. It is a preview of what the dashboard shows, not a Grafana renderer:
colours, fonts and legends are approximate, numbers and shapes are the data's.

    python -m dashboards.preview [--out docs/img/dashboards]

starts a vLLM CPU server for the live scenario and backfills the offload scenario
(about two minutes), then writes <uid>.png per dashboard.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, NullFormatter

from dashboards.grafana import Emulator, TargetResult
from dashboards.panels import DASHBOARDS
from dashboards.scenarios import Data
from dashboards.spec import Dashboard, Panel, Scenario

REPO = Path(__file__).resolve().parent.parent
JSON_DIR = REPO / "dashboards" / "json"
ORDER = (Scenario.LIVE, Scenario.OFFLOAD, Scenario.GPU, Scenario.BACKENDS)
SCENARIO_NOTE = {
    Scenario.LIVE: "live vLLM CPU",
    Scenario.OFFLOAD: "H200 offload replay",
    Scenario.GPU: "GPU recording",
    Scenario.BACKENDS: "backends replay",
}
COLORS = {
    "green": "#56a64b",
    "orange": "#ff9830",
    "red": "#e02f44",
    "blue": "#3274d9",
    "text": "#5a5f66",
    "transparent": "#888888",
}
BG = "#181b1f"
PANEL_BG = "#111217"
FG = "#d8d9da"
SERIES = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#fade2a"]
COL_PX = 80  # Grafana at 1920 px: 24 columns of 80 px
ROW_PX = 36  # one grid unit: 30 px plus the 6 px gap
DPI = 100


# ----------------------------------------------------------------------------- units

_SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
_IEC = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def _num(v: float) -> str:
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 0.01:
        return f"{v:.2f}"
    return f"{v:.2g}"


def _si(v: float, suffix: str) -> str:
    for size, prefix in _SI:
        if abs(v) >= size:
            return f"{_num(v / size)} {prefix}{suffix}".rstrip()
    return f"{_num(v)} {suffix}".rstrip()


def _iec(value: float) -> str:
    for size, name in _IEC:
        if abs(value) >= size:
            return f"{_num(value / size)} {name}"
    return f"{_num(value)} B"


def _seconds(value: float) -> str:
    if value != 0 and abs(value) < 1e-3:
        return f"{_num(value * 1e6)} µs"
    if value != 0 and abs(value) < 1:
        return f"{_num(value * 1e3)} ms"
    return f"{_num(value)} s"


# Grafana unit -> how it writes a value; "si:X" and "suffix:X" units are handled in fmt().
_FORMATS: dict[str, Callable[[float], str]] = {
    "percentunit": lambda v: f"{_num(v * 100)}%",
    "bytes": _iec,
    "Bps": lambda v: _si(v, "B/s"),
    "ops": lambda v: _si(v, "ops/s"),
    "s": _seconds,
}


def fmt(value: float, unit: str) -> str:
    """Roughly how Grafana writes a value in a unit."""
    if math.isnan(value):
        return "NaN"
    by_unit = _FORMATS.get(unit)
    if by_unit is not None:
        return by_unit(value)
    if unit.startswith("si:"):
        return _si(value, unit[3:])
    if unit.startswith("suffix:"):
        return f"{_num(value)}{unit[7:]}"
    return _si(value, "")


# ----------------------------------------------------------------------------- drawing

_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def legend(fmt_text: str, labels: Mapping[str, str]) -> str:
    if not fmt_text or fmt_text == "__auto":
        inner = ", ".join(f'{k}="{v}"' for k, v in labels.items() if k != "__name__")
        return f"{labels.get('__name__', '')}{{{inner}}}"
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt_text).strip()


def _style(ax: Axes) -> None:
    ax.set_facecolor(PANEL_BG)
    for spine in ax.spines.values():
        spine.set_color("#2c3235")
    ax.tick_params(colors=FG, labelsize=7)


def _no_data(ax: Axes, why: str) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(
        0.5,
        0.5,
        why,
        color="#8e8e8e",
        ha="center",
        va="center",
        fontsize=9,
        transform=ax.transAxes,
        wrap=True,
    )


def _thresholds(panel: Mapping[str, Any]) -> list[tuple[float | None, str]]:
    steps = panel["fieldConfig"]["defaults"].get("thresholds", {}).get("steps", [])
    return [(s.get("value"), s["color"]) for s in steps]


def _color_for(value: float, panel: Mapping[str, Any]) -> str:
    for m in panel["fieldConfig"]["defaults"].get("mappings", []):
        hit = m["options"].get(_num(value)) or m["options"].get(
            str(int(value)) if value == int(value) else ""
        )
        if hit and hit.get("color"):
            mapped = str(hit["color"])
            return COLORS.get(mapped, mapped)
    color = "green"
    for v, c in _thresholds(panel):
        if v is None or value >= v:
            color = c
    return COLORS.get(color, color)


def _mapped_text(value: str, panel: Mapping[str, Any]) -> tuple[str, str | None]:
    for m in panel["fieldConfig"]["defaults"].get("mappings", []):
        hit = m["options"].get(value)
        if hit:
            return str(hit.get("text", value)), hit.get("color")
    return value, None


_Line = tuple[str, list[dt.datetime], list[float]]  # legend, times, values


def _series_lines(panel: Mapping[str, Any], results: Sequence[TargetResult]) -> list[_Line]:
    """One line per series with finite points, named by its target's legend format."""
    lines: list[_Line] = []
    targets = {t["refId"]: t for t in panel["targets"]}
    for r in results:
        for s in r.series:
            pts = [(float(t), float(v)) for t, v in s["values"] if math.isfinite(float(v))]
            if not pts:
                continue
            name = legend(targets[r.ref_id].get("legendFormat", ""), s["metric"])
            xs = [dt.datetime.fromtimestamp(t, dt.UTC) for t, _ in pts]
            lines.append((name, xs, [v for _, v in pts]))
    return lines


def _y_axis(ax: Axes, panel: Mapping[str, Any], custom: Mapping[str, Any]) -> None:
    """Threshold lines, log scale and the y range as the panel sets them."""
    if custom.get("thresholdsStyle", {}).get("mode") in ("dashed", "line"):
        for v, c in _thresholds(panel):
            if v is not None:
                ax.axhline(v, color=COLORS.get(c, c), linestyle="--", linewidth=0.9)
    if custom.get("scaleDistribution", {}).get("type") == "log":
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())
    defaults = panel["fieldConfig"]["defaults"]
    if "min" in defaults and custom.get("scaleDistribution", {}).get("type") != "log":
        ax.set_ylim(bottom=defaults["min"])
    if "max" in defaults:
        ax.set_ylim(top=defaults["max"] * 1.02)


def draw_timeseries(ax: Axes, panel: Mapping[str, Any], results: Sequence[TargetResult]) -> bool:
    unit = panel["fieldConfig"]["defaults"].get("unit", "none")
    custom = panel["fieldConfig"]["defaults"].get("custom", {})
    stacked = custom.get("stacking", {}).get("mode") == "normal"
    lines = _series_lines(panel, results)
    if not lines:
        return False
    if stacked:
        times = sorted({x for _, xs, _ in lines for x in xs})
        ys = []
        for _, xs, vs in lines:
            m = dict(zip(xs, vs, strict=True))
            ys.append([m.get(t, 0.0) for t in times])
        ax.stackplot(
            times,  # type: ignore[arg-type]  # datetimes use matplotlib's date units; stubs say numbers
            ys,
            labels=[n for n, _, _ in lines],
            colors=SERIES,
            alpha=0.55,
        )
    else:
        for i, (name, xs, vs) in enumerate(lines):
            ax.plot(
                xs,  # type: ignore[arg-type]  # datetimes: as for stackplot above
                vs,
                label=name,
                color=SERIES[i % len(SERIES)],
                linewidth=1.2,
            )
    _y_axis(ax, panel, custom)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v, unit)))
    ax.xaxis.set_major_formatter(
        mdates.DateFormatter("%H:%M:%S")  # type: ignore[no-untyped-call]  # unannotated in matplotlib
    )
    ax.grid(color="#2c3235", linewidth=0.5)
    ax.legend(loc="upper left", fontsize=6, frameon=False, labelcolor=FG, ncol=1)
    return True


def draw_stat(ax: Axes, panel: Mapping[str, Any], results: Sequence[TargetResult]) -> bool:
    unit = panel["fieldConfig"]["defaults"].get("unit", "none")
    targets = {t["refId"]: t for t in panel["targets"]}
    items = []
    for r in results:
        for s in r.series:
            v = float(s["value"][1]) if "value" in s else float(s["values"][-1][1])
            name = legend(targets[r.ref_id].get("legendFormat", ""), s["metric"])
            items.append((name, v))
    if not items:
        return False
    ax.set_xticks([])
    ax.set_yticks([])
    n = len(items)
    for i, (name, v) in enumerate(items):
        text, _ = _mapped_text(str(int(v)) if v == int(v) else _num(v), panel)
        shown = text if text != (str(int(v)) if v == int(v) else _num(v)) else fmt(v, unit)
        y = 1 - (i + 0.5) / n
        ax.text(0.03, y, name, color=FG, fontsize=7, va="center", transform=ax.transAxes)
        ax.text(
            0.97,
            y,
            shown,
            color=_color_for(v, panel),
            fontsize=15,
            fontweight="bold",
            ha="right",
            va="center",
            transform=ax.transAxes,
        )
    return True


def draw_table(ax: Axes, panel: Mapping[str, Any], results: Sequence[TargetResult]) -> bool:
    hidden = set()
    for t in panel.get("transformations", []):
        if t["id"] == "organize":
            hidden |= {k for k, v in t["options"].get("excludeByName", {}).items() if v}
    rows = [s["metric"] for r in results for s in r.series]
    if not rows:
        return False
    cols = [c for c in sorted({k for r in rows for k in r}) if c not in hidden | {"__name__"}]
    first = [c for c in ("target", "model_name", "engine") if c in cols]
    cols = first + [c for c in cols if c not in first and c not in ("job", "instance")]
    cells, colours = [], []
    for r in rows:
        line, line_colours = [], []
        for c in cols:
            text, color = _mapped_text(r.get(c, ""), panel)
            line.append(text)
            line_colours.append(COLORS.get(color, PANEL_BG) if color else PANEL_BG)
        cells.append(line)
        colours.append(line_colours)
    ax.set_xticks([])
    ax.set_yticks([])
    table = ax.table(
        cellText=cells,
        colLabels=cols,
        cellColours=colours,
        loc="upper center",
        cellLoc="left",
        colLoc="left",
    )
    table.auto_set_font_size(False)
    table.set_fontsize(7)
    for cell in table.get_celld().values():
        cell.set_edgecolor("#2c3235")
        cell.get_text().set_color(FG)
    for j in range(len(cols)):
        table[0, j].set_facecolor("#22252b")
    return True


def draw_barchart(ax: Axes, panel: Mapping[str, Any], results: Sequence[TargetResult]) -> bool:
    x_field = panel["options"]["xField"]
    unit = panel["fieldConfig"]["defaults"].get("unit", "none")
    numeric = any(
        t["id"] == "convertFieldType"
        and t["options"]["conversions"][0]["destinationType"] == "number"
        for t in panel.get("transformations", [])
    )
    bars = sorted(
        (float(s["metric"][x_field]) if numeric else s["metric"][x_field], float(s["value"][1]))
        for r in results
        for s in r.series
        if x_field in s["metric"]
    )
    if not bars:
        return False
    labels = [_mapped_text(f"{int(x)}" if numeric else str(x), panel)[0] for x, _ in bars]
    ax.bar(labels, [v for _, v in bars], color=SERIES[0], width=0.6)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v, unit)))
    ax.grid(axis="y", color="#2c3235", linewidth=0.5)
    ax.set_xlabel(x_field, color="#8e8e8e", fontsize=7)
    return True


DRAW = {
    "timeseries": draw_timeseries,
    "stat": draw_stat,
    "table": draw_table,
    "barchart": draw_barchart,
}


def render(
    dash: Dashboard,
    doc: Mapping[str, Any],
    data: Mapping[Scenario, Data],
    out: Path,
) -> dict[str, Scenario | None]:
    """Draw one dashboard; returns the scenario each panel was drawn from (None: empty)."""
    specs = {p.title: p for p in dash.panels()}
    grid_h = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in doc["panels"])
    header_px = 60
    width_px, height_px = 24 * COL_PX, grid_h * ROW_PX + header_px
    fig = plt.figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI, facecolor=BG)
    fig.text(0.01, 1 - 22 / height_px, doc["title"], color=FG, fontsize=14, va="center")
    fig.text(
        0.99,
        1 - 22 / height_px,
        "preview from real Prometheus data · variables: All",
        color="#8e8e8e",
        fontsize=8,
        ha="right",
        va="center",
    )
    drawn: dict[str, Scenario | None] = {}

    def rect(x: float, y: float, w: float, h: float) -> tuple[float, float, float, float]:
        """Pixels from the top left -> figure fractions (left, bottom, width, height)."""
        return (x / width_px, 1 - (y + h) / height_px, w / width_px, h / height_px)

    for panel in doc["panels"]:
        g = panel["gridPos"]
        x0, y0 = g["x"] * COL_PX + 3, header_px + g["y"] * ROW_PX + 3
        pw, ph = g["w"] * COL_PX - 6, g["h"] * ROW_PX - 6
        if panel["type"] == "row":
            fig.text(
                x0 / width_px,
                1 - (y0 + ph / 2) / height_px,
                panel["title"],
                color=FG,
                fontsize=11,
                fontweight="bold",
                va="center",
            )
            continue
        fig.patches.append(
            Rectangle(
                rect(x0, y0, pw, ph)[:2],
                pw / width_px,
                ph / height_px,
                transform=fig.transFigure,
                facecolor=PANEL_BG,
                edgecolor="#2c3235",
                zorder=-1,
            )
        )
        spec = specs[panel["title"]]
        if panel["type"] in ("timeseries", "barchart"):
            bottom = 44 if panel["type"] == "barchart" else 26
            ax = fig.add_axes(rect(x0 + 64, y0 + 30, pw - 76, ph - 30 - bottom))
        else:
            ax = fig.add_axes(rect(x0 + 6, y0 + 28, pw - 12, ph - 34))
        _style(ax)
        scenario = _scenario_for(spec, data)
        ok = False
        if scenario is not None:
            d = data[scenario]
            emu = Emulator(d.api, doc, d.scrape_interval, d.start, d.end)
            ok = DRAW[panel["type"]](ax, panel, emu.run_panel(panel, emu.all_chosen()))
            if ok and panel["type"] == "timeseries":  # the dashboard's time range, as Grafana
                ax.set_xlim(  # datetimes: matplotlib's date units, as in draw_timeseries
                    dt.datetime.fromtimestamp(d.start, dt.UTC),  # type: ignore[arg-type]
                    dt.datetime.fromtimestamp(d.end, dt.UTC),  # type: ignore[arg-type]
                )
        if not ok:
            _no_data(ax, "No data" + ("" if scenario else "\n(shown with a GPU recording)"))
        drawn[spec.key] = scenario if ok else None
        note = SCENARIO_NOTE[scenario] if scenario and ok else ""
        fig.text(
            (x0 + 8) / width_px,
            1 - (y0 + 14) / height_px,
            panel["title"],
            color=FG,
            fontsize=9,
            fontweight="bold",
            va="center",
        )
        fig.text(
            (x0 + pw - 8) / width_px,
            1 - (y0 + 14) / height_px,
            note,
            color="#8e8e8e",
            fontsize=7,
            ha="right",
            va="center",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI, facecolor=BG, metadata={"Software": None})
    plt.close(fig)
    return drawn


def _scenario_for(panel: Panel, data: Mapping[Scenario, Data]) -> Scenario | None:
    if panel.preview in panel.scenarios and panel.preview in data:
        return panel.preview
    for s in ORDER:
        if s in panel.scenarios and s in data:
            return s
    return None


def render_all(
    data: Mapping[Scenario, Data], out_dir: Path
) -> dict[str, dict[str, Scenario | None]]:
    out = {}
    for dash in DASHBOARDS:
        doc = json.loads((JSON_DIR / dash.file).read_text())
        out[dash.uid] = render(dash, doc, data, out_dir / f"{dash.uid}.png")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from dashboards import scenarios
    from testbed.procs import free_port
    from testbed.vllm_cpu import VllmServer

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "dashboards")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvoe-preview-"))
    with ExitStack() as stack:
        data: dict[Scenario, Data] = {}
        data[Scenario.OFFLOAD] = stack.enter_context(scenarios.offload(work / "offload"))
        data[Scenario.BACKENDS] = stack.enter_context(scenarios.backends(work / "backends"))
        data[Scenario.GPU] = stack.enter_context(scenarios.gpu(work / "gpu"))
        vllm = VllmServer(work / "vllm", kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}").start(
            timeout=900
        )
        stack.callback(vllm.stop)
        data[Scenario.LIVE] = stack.enter_context(scenarios.live(work / "live", vllm))
        for uid, panels in render_all(data, args.out).items():
            empty = [k for k, s in panels.items() if s is None]
            print(f"{args.out / (uid + '.png')}: {len(panels)} panels, empty: {empty or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
