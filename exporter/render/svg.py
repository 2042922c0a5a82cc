"""Chart primitives: inline SVG strings from numbers (pure, no JavaScript, no fonts fetched).

Colours are CSS classes (`s0`..`s3` for series, `mark`, `axis`, `grid`), so the page's
stylesheet decides them for light and dark. Every text node is escaped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

Fmt = Callable[[float], str]

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Line:
    label: str
    points: tuple[tuple[float, float], ...]  # (x, y); only measured values
    dashed: bool = False


@dataclass(frozen=True, slots=True)
class Mark:
    """A labelled rule across the chart: horizontal at y (threshold) or vertical at x."""

    label: str
    value: float
    vertical: bool = False
    css: str = "mark"


def fmt_bytes(v: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(v) >= size:
            return f"{v / size:.3g} {unit}"
    return f"{v:.0f} B"


def fmt_ratio(v: float) -> str:
    return f"{100 * v:.3g}%"


def fmt_rate(v: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= size:
            return f"{v / size:.3g}{unit}"
    return f"{v:.3g}"


def fmt_clock(t: float) -> str:
    s = int(t) % 86400
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


@dataclass(frozen=True, slots=True)
class Axis:
    lo: float
    hi: float
    log: bool = False

    def frac(self, v: float) -> float:
        if self.log:
            v, lo, hi = math.log10(max(v, 1e-300)), math.log10(self.lo), math.log10(self.hi)
        else:
            lo, hi = self.lo, self.hi
        return 0.5 if hi <= lo else (v - lo) / (hi - lo)

    def ticks(self, n: int = 4) -> list[float]:
        if self.log:
            a, b = math.floor(math.log10(self.lo)), math.ceil(math.log10(self.hi))
            step = max(1, math.ceil((b - a) / n))
            return [10.0**e for e in range(a, b + 1, step) if self.lo <= 10.0**e <= self.hi]
        if self.hi <= self.lo:
            return [self.lo]
        raw = (self.hi - self.lo) / n
        mag = 10 ** math.floor(math.log10(raw))
        step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
        first = math.ceil(self.lo / step) * step
        return [first + i * step for i in range(n + 2) if first + i * step <= self.hi + 1e-12]


def value_axis(
    values: Sequence[float], *, log: bool = False, unit_max: float | None = None
) -> Axis:
    """An axis from 0 (or the smallest decade, log) to a little above the largest value."""
    if log:
        pos = [v for v in values if v > 0]
        if not pos:
            return Axis(1.0, 10.0, True)
        lo = 10 ** math.floor(math.log10(min(pos)))
        hi = 10 ** math.ceil(math.log10(max(pos)))
        return Axis(lo, hi if hi > lo else lo * 10, True)
    top = max(values, default=0.0)
    if unit_max is not None and top <= unit_max:
        return Axis(0.0, unit_max)
    return Axis(0.0, top * 1.1 if top > 0 else 1.0)


W, H = 360, 150
PAD_L, PAD_R, PAD_T, PAD_B = 52, 10, 10, 22


def chart(
    title: str,
    lines: Sequence[Line],
    x: Axis,
    y: Axis,
    *,
    x_fmt: Fmt,
    y_fmt: Fmt,
    marks: Sequence[Mark] = (),
    x_ticks: Sequence[float] | None = None,
    dots: bool = False,
    width: int = W,
    height: int = H,
) -> str:
    """One chart: axes, grid, series polylines (or dots), marks. Returns `<svg>` markup."""
    pw, ph = width - PAD_L - PAD_R, height - PAD_T - PAD_B

    def px(v: float) -> float:
        return PAD_L + pw * min(max(x.frac(v), 0.0), 1.0)

    def py(v: float) -> float:
        return PAD_T + ph * (1 - min(max(y.frac(v), 0.0), 1.0))

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" class="chart">',
        f"<title>{escape(title)}</title>",
    ]
    for t in y.ticks():
        yy = py(t)
        out.append(
            f'<line class="grid" x1="{PAD_L}" x2="{width - PAD_R}" y1="{yy:.1f}" y2="{yy:.1f}"/>'
            f'<text class="tick" x="{PAD_L - 4}" y="{yy + 3:.1f}" text-anchor="end">'
            f"{escape(y_fmt(t))}</text>"
        )
    drawn: list[float] = []
    for t in x.ticks(3) if x_ticks is None else x_ticks:
        xx = px(t)
        if any(abs(xx - d) < 44 for d in drawn):
            continue  # labels would overlap
        drawn.append(xx)
        anchor = "start" if xx - PAD_L < 20 else "end" if width - PAD_R - xx < 20 else "middle"
        out.append(
            f'<text class="tick" x="{xx:.1f}" y="{height - 6}" text-anchor="{anchor}">'
            f"{escape(x_fmt(t))}</text>"
        )
    out.append(
        f'<line class="axis" x1="{PAD_L}" x2="{PAD_L}" y1="{PAD_T}" y2="{PAD_T + ph}"/>'
        f'<line class="axis" x1="{PAD_L}" x2="{width - PAD_R}" y1="{PAD_T + ph}" '
        f'y2="{PAD_T + ph}"/>'
    )
    for m in marks:
        if m.vertical:
            xx = px(m.value)
            out.append(
                f'<line class="{escape(m.css)}" x1="{xx:.1f}" x2="{xx:.1f}" y1="{PAD_T}" '
                f'y2="{PAD_T + ph}"><title>{escape(m.label)}</title></line>'
            )
        else:
            yy = py(m.value)
            out.append(
                f'<line class="{escape(m.css)}" x1="{PAD_L}" x2="{width - PAD_R}" '
                f'y1="{yy:.1f}" y2="{yy:.1f}"><title>{escape(m.label)}</title></line>'
            )
    for i, line in enumerate(lines):
        if not line.points:
            continue
        cls = f"s{i % 4}" + (" dashed" if line.dashed else "")
        pts = " ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in line.points)
        label = escape(line.label)
        if len(line.points) > 1:
            out.append(
                f'<polyline class="series {cls}" points="{pts}"><title>{label}</title></polyline>'
            )
        if dots or len(line.points) == 1:
            out.extend(
                f'<circle class="dot {cls}" cx="{px(a):.1f}" cy="{py(b):.1f}" r="3">'
                f"<title>{label}: {escape(y_fmt(b))}</title></circle>"
                for a, b in line.points
            )
    out.append("</svg>")
    return "".join(out)


def legend(lines: Sequence[Line], marks: Sequence[Mark] = (), fmt: Fmt | None = None) -> str:
    """An HTML list naming each series with its latest value (`fmt`), or "no data"."""
    items = []
    for i, line in enumerate(lines):
        if not line.points:
            missing = ' <span class="nodata">no data</span>'
        elif fmt is not None:
            missing = f' <span class="latest">{escape(fmt(line.points[-1][1]))}</span>'
        else:
            missing = ""
        items.append(
            f'<li><span class="key s{i % 4}{" dashed" if line.dashed else ""}"></span>'
            f"{escape(line.label)}{missing}</li>"
        )
    items.extend(
        f'<li><span class="key {escape(m.css)}"></span>{escape(m.label)}</li>' for m in marks
    )
    return f'<ul class="legend">{"".join(items)}</ul>'
