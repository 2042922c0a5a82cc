"""exporter.render.svg: chart primitives."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from exporter.render.svg import (
    Axis,
    Line,
    Mark,
    chart,
    fmt_bytes,
    fmt_clock,
    fmt_rate,
    fmt_ratio,
    legend,
    value_axis,
)

NS = "{http://www.w3.org/2000/svg}"


def test_formatters() -> None:
    assert fmt_bytes(1.5 * (1 << 30)) == "1.5 GiB"
    assert fmt_bytes(32 << 20) == "32 MiB"
    assert fmt_bytes(100) == "100 B"
    assert fmt_ratio(0.123) == "12.3%"
    assert fmt_rate(13_671_875) == "13.7M"
    assert fmt_clock(3600 * 25 + 61) == "01:01:01"


def test_linear_axis_ticks_are_round_and_inside() -> None:
    ticks = Axis(0.0, 1.0).ticks()
    assert ticks == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(0 <= t <= 93.1 for t in value_axis([84.6]).ticks())


def test_log_axis_spans_whole_decades() -> None:
    a = value_axis([15_400.0, 13_671_875.0], log=True)
    assert (a.lo, a.hi) == (10_000.0, 100_000_000.0)
    assert a.ticks() == [1e4, 1e5, 1e6, 1e7, 1e8]
    assert a.frac(1e6) == 0.5


def test_ratio_axis_stays_at_one_when_asked() -> None:
    assert (value_axis([0.4, 0.6], unit_max=1.0).hi) == 1.0
    assert value_axis([1.5], unit_max=1.0).hi > 1.5


def test_chart_is_valid_svg_with_escaped_text() -> None:
    svg = chart(
        "a <b> & c",
        [Line("x<y", ((0.0, 0.0), (1.0, 1.0))), Line("empty", ())],
        Axis(0.0, 1.0),
        Axis(0.0, 1.0),
        x_fmt=str,
        y_fmt=fmt_ratio,
        marks=[Mark("limit <80%>", 0.8)],
    )
    root = ET.fromstring(svg)  # well-formed XML, so every text was escaped
    assert root.find(f"{NS}title").text == "a <b> & c"
    (poly,) = root.iter(f"{NS}polyline")
    assert poly.find(f"{NS}title").text == "x<y"
    xs, ys = zip(*(map(float, p.split(",")) for p in poly.get("points").split()), strict=True)
    assert xs[0] < xs[1] and ys[0] > ys[1]  # up and to the right on screen
    (mark,) = [ln for ln in root.iter(f"{NS}line") if ln.get("class") == "mark"]
    assert mark.get("y1") == mark.get("y2")


def test_vertical_marks_sit_at_their_x_and_single_points_get_dots() -> None:
    svg = chart(
        "curve",
        [Line("hit", ((1.0, 0.1),))],
        Axis(1.0, 100.0, log=True),
        Axis(0.0, 1.0),
        x_fmt=str,
        y_fmt=fmt_ratio,
        marks=[Mark("recommended", 10.0, vertical=True, css="recommended")],
    )
    root = ET.fromstring(svg)
    (mark,) = [ln for ln in root.iter(f"{NS}line") if ln.get("class") == "recommended"]
    left, right = 52, 360 - 10
    assert float(mark.get("x1")) == (left + right) / 2  # 10 is halfway on a log 1..100 axis
    assert len(list(root.iter(f"{NS}circle"))) == 1
    assert not list(root.iter(f"{NS}polyline"))


def test_tick_labels_too_close_together_are_left_out() -> None:
    svg = chart(
        "c",
        [],
        Axis(1.0, 1000.0, log=True),
        Axis(0.0, 1.0),
        x_fmt=lambda v: f"{v:.0f}",
        y_fmt=str,
        x_ticks=[1.0, 1.001, 1000.0],
    )
    labels = re.findall(r'y="144" text-anchor="\w+">([^<]*)<', svg)
    assert labels == ["1", "1000"]


def test_legend_names_series_with_latest_value_or_no_data() -> None:
    html = legend(
        [Line("<a>", ((0.0, 0.5), (1.0, 0.25))), Line("b", ())], [Mark("m", 1.0)], fmt_ratio
    )
    assert '&lt;a&gt; <span class="latest">25%</span>' in html
    assert 'b <span class="nodata">no data</span>' in html
    assert html.count("<li>") == 3
