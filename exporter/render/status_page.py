"""The status page at `/` and the terminal card of `advise`: text from typed view values.

Pure: `render_html(StatusView)` and `render_text(Card)` read nothing but their argument.
A `Card` is built from one item of the `/advice` JSON (`card_from_json`), by the page and
by `kv-offload-exporter advise --url`, so both show the same card. The page is one HTML
document: inline CSS (light and dark through prefers-color-scheme), inline SVG charts, a
meta refresh, no script and nothing fetched from anywhere.
"""

from __future__ import annotations

import math
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from exporter.model.advisor.types import ACTION_INFO, NUMBER_INFO, Action, Tone
from exporter.render.svg import (
    GIB,
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


@dataclass(frozen=True, slots=True)
class CurvePoint:
    size_bytes: float
    hit_ratio: float
    ttft_saved_seconds_per_second: float | None = None


@dataclass(frozen=True, slots=True)
class Card:
    target: str
    model_name: str
    engine: str
    action: str
    reason: str
    explanation: str
    recommended_bytes: float | None
    configured_bytes: float | None  # None: offload off
    offload_enabled: bool
    since: float | None  # unix seconds the action has stood since
    pending_action: str | None
    numbers: tuple[tuple[str, float], ...]
    curve: tuple[CurvePoint, ...] = ()
    configured_hit_ratio: float | None = None
    assumed_load_bandwidth: float | None = None  # the reload rate is this assumption


@dataclass(frozen=True, slots=True)
class Chart:
    title: str
    unit: str  # ratio | tokens/s | bytes
    lines: tuple[Line, ...]
    marks: tuple[Mark, ...] = ()
    no_data: str = ""  # why every series is absent (shown instead of an empty chart)
    log: bool = False


@dataclass(frozen=True, slots=True)
class EngineView:
    card: Card
    charts: tuple[Chart, ...]


@dataclass(frozen=True, slots=True)
class SourceRow:
    name: str
    up: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class StatusView:
    version: str
    now: float
    window_seconds: float
    interval_seconds: float
    cycles: int
    refresh_seconds: int
    targets: tuple[SourceRow, ...]
    engines: tuple[EngineView, ...]
    collectors: tuple[SourceRow, ...] = ()


# ------------------------------------------------------------------------------ the card

# Card colour by what the operator should do: change something, heed a warning, keep, wait.
_CARD_TONE = {Tone.INFO: "change", Tone.WARN: "change", Tone.BAD: "warn", Tone.OK: "ok"}


def action_text(action: str) -> str:
    """The card's headline for an action (exporter/model/advisor/types.py ACTION_INFO)."""
    try:
        return ACTION_INFO[Action(action)].headline
    except ValueError:  # an /advice document from another version: show the code
        return action


def action_tone(action: str) -> str:
    try:
        return _CARD_TONE.get(ACTION_INFO[Action(action)].tone, "wait")
    except ValueError:
        return "wait"


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def card_from_json(item: Mapping[str, Any]) -> Card:
    """A card from one `/advice` item (see exporter.status.card_extras)."""
    numbers = item.get("numbers") or {}
    curve = tuple(
        CurvePoint(
            float(p["cpu_buffer_bytes"]),
            float(p["hit_ratio"]),
            _num(p.get("ttft_saved_seconds_per_second")),
        )
        for p in item.get("whatif") or ()
        if _num(p.get("cpu_buffer_bytes")) is not None and _num(p.get("hit_ratio")) is not None
    )
    enabled = bool(item.get("offload_enabled", _num(numbers.get("offload_buffer_bytes"))))
    return Card(
        target=str(item.get("target", "")),
        model_name=str(item.get("model_name", "")),
        engine=str(item.get("engine", "")),
        action=str(item.get("action", "")),
        reason=str(item.get("reason", "")),
        explanation=str(item.get("explanation", "")),
        recommended_bytes=_num(item.get("recommended_buffer_bytes")),
        configured_bytes=_num(item.get("configured_buffer_bytes"))
        if "configured_buffer_bytes" in item
        else _num(numbers.get("offload_buffer_bytes")),
        offload_enabled=enabled,
        since=_num(item.get("since")),
        pending_action=str(item["pending_action"]) if item.get("pending_action") else None,
        numbers=tuple((str(k), x) for k, v in numbers.items() if (x := _num(v)) is not None),
        curve=curve,
        configured_hit_ratio=_num(numbers.get("whatif_configured_hit_ratio")),
        assumed_load_bandwidth=_num(item.get("assumed_load_bandwidth_bytes_per_second")),
    )


def kv_offloading_size(size: float) -> str:
    """The vLLM flag value (GiB, as --kv-offloading-size takes it)."""
    return f"{size / GIB:.4g}"


def fmt_number(key: str, v: float) -> tuple[str, str]:
    info = NUMBER_INFO.get(key)
    # A key from another version's /advice: its name, as a plain number.
    label, kind = (info.label, info.kind) if info is not None else (key.replace("_", " "), "n")
    if kind == "ratio":
        text = fmt_ratio(v)
    elif kind == "bytes":
        text = fmt_bytes(v)
    elif kind == "tokens/s":
        text = f"{v:,.0f} tokens/s"
    elif kind == "s":
        text = f"{v:,.0f} s"
    elif kind == "seconds":
        text = f"{v:,.3g} s"
    elif kind == "x":
        text = f"{v:,.2f}x"
    elif kind == "bool":
        text = "yes" if v else "no"
    elif kind == "us":
        text = f"{v * 1e6:,.2f} us"
    else:
        text = f"{v:,.6g}"
    return label, text


def _ago(now: float, t: float) -> str:
    s = max(0.0, now - t)
    if s < 120:
        return f"{s:.0f} s ago"
    if s < 7200:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def _buffers(card: Card) -> tuple[str, str]:
    configured = fmt_bytes(card.configured_bytes) if card.configured_bytes else "off"
    recommended = (
        f"{fmt_bytes(card.recommended_bytes)} (--kv-offloading-size "
        f"{kv_offloading_size(card.recommended_bytes)})"
        if card.recommended_bytes is not None
        else "no change"
    )
    return configured, recommended


def _curve_marks(card: Card) -> list[tuple[float, str]]:
    out = []
    if card.configured_bytes:
        out.append((card.configured_bytes, "configured"))
    if card.recommended_bytes is not None:
        out.append((card.recommended_bytes, "recommended"))
    return out


def _tags(card: Card, size: float) -> list[str]:
    """Which of the configured and recommended sizes a curve point is: the closest point
    within 0.1% (a flag of 1.14286 GiB is simulated as whole blocks)."""
    out = []
    for mark, name in _curve_marks(card):
        best = min(card.curve, key=lambda p: abs(p.size_bytes - mark))
        if best.size_bytes == size and abs(size - mark) <= 1e-3 * mark:
            out.append(name)
    return out


# ------------------------------------------------------------------------------ terminal


def render_text(card: Card, now: float | None = None, width: int = 96) -> str:
    """The card for a terminal: what to do, why, the what-if curve and the numbers."""
    now = time.time() if now is None else now
    lines = [f"{card.target}  {card.model_name}  engine {card.engine}"]
    head = f"  {action_text(card.action)}: {card.action} ({card.reason})"
    if card.since is not None:
        head += f", since {fmt_clock(card.since)} UTC ({_ago(now, card.since)})"
    lines.append(head)
    if card.pending_action:
        lines.append(f"  pending change: {card.pending_action} (waiting out the hysteresis)")
    configured, recommended = _buffers(card)
    lines.append(f"  CPU buffer: configured {configured}; recommended {recommended}")
    lines.append(
        textwrap.fill(card.explanation, width=width, initial_indent="  ", subsequent_indent="  ")
    )
    if card.assumed_load_bandwidth is not None:
        lines.append(
            f"  reload rate assumed: {card.assumed_load_bandwidth / 1e9:.3g} GB/s "
            "(--assumed-load-bandwidth; nothing was measured)"
        )
    if card.curve:
        lines.append("  what-if: CPU buffer -> predicted offload hit ratio, prefill time saved")
        for p in card.curve:
            saved = (
                f"{p.ttft_saved_seconds_per_second:8.4f} s/s"
                if p.ttft_saved_seconds_per_second is not None
                else "       n/a"
            )
            tags = _tags(card, p.size_bytes)
            tag = f"  <- {', '.join(tags)}" if tags else ""
            lines.append(
                f"    {fmt_bytes(p.size_bytes):>10s}  {fmt_ratio(p.hit_ratio):>7s}  {saved}{tag}"
            )
    if card.numbers:
        lines.append("  numbers:")
        for key, v in card.numbers:
            label, text = fmt_number(key, v)
            lines.append(f"    {label:42s} {text}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ HTML

CSS = """
:root{color-scheme:light dark;--bg:#fff;--fg:#1d2329;--mute:#5b6570;--line:#d5dae0;
--card:#f6f8fa;--s0:#1f77b4;--s1:#d95f02;--s2:#2a9d3f;--s3:#7b3fb5;--mark:#b3261e;
--rec:#2a9d3f;--cfg:#1f77b4;--change:#1f6feb;--warn:#c2410c;--ok:#2a9d3f;--wait:#8a6d00}
@media (prefers-color-scheme:dark){:root{--bg:#111418;--fg:#e3e7eb;--mute:#9aa5b1;
--line:#2e353d;--card:#1a1f25;--s0:#6cb6ff;--s1:#ffa657;--s2:#7ee787;--s3:#d2a8ff;
--mark:#ff7b72;--rec:#7ee787;--cfg:#6cb6ff;--change:#58a6ff;--warn:#ffa657;--ok:#7ee787;
--wait:#e3b341}}
*{box-sizing:border-box}
body{margin:0;padding:1.2rem 2rem;background:var(--bg);color:var(--fg);
font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif}
header,main>section,footer{max-width:1180px}
h1{font-size:1.35rem;margin:.2rem 0}h2{font-size:1.15rem;margin:1.4rem 0 .4rem}
h3{font-size:.95rem;margin:.3rem 0}
a{color:var(--change)}nav a{margin-right:.9rem}
.muted,.tick,figcaption{color:var(--mute)}
.card{background:var(--card);border:1px solid var(--line);border-left:6px solid var(--tone);
border-radius:6px;padding:.8rem 1rem;margin:.6rem 0}
.card.change{--tone:var(--change)}.card.warn{--tone:var(--warn)}.card.ok{--tone:var(--ok)}
.card.wait{--tone:var(--wait)}
.action{font-size:1.25rem;font-weight:600;color:var(--tone)}
.reason{font-family:ui-monospace,monospace;font-size:.85rem;color:var(--mute)}
dl.buffers{display:grid;grid-template-columns:max-content 1fr;gap:.15rem 1rem;margin:.5rem 0}
dl.buffers dt{color:var(--mute)}dl.buffers dd{margin:0}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(370px,1fr));gap:.8rem}
figure{margin:0;background:var(--card);border:1px solid var(--line);border-radius:6px;
padding:.5rem}
svg.chart{display:block;max-width:100%;height:auto}
svg .grid{stroke:var(--line);stroke-width:1}svg .axis{stroke:var(--mute);stroke-width:1}
svg .tick{fill:var(--mute);font-size:10px}
svg .series{fill:none;stroke-width:2}svg .dot{stroke:none}
svg .s0{stroke:var(--s0);fill:var(--s0)}svg .s1{stroke:var(--s1);fill:var(--s1)}
svg .s2{stroke:var(--s2);fill:var(--s2)}svg .s3{stroke:var(--s3);fill:var(--s3)}
svg polyline.series{fill:none}
svg .dashed{stroke-dasharray:5 3}
svg .mark{stroke:var(--mark);stroke-width:1;stroke-dasharray:3 3}
svg .recommended{stroke:var(--rec);stroke-width:2}svg .configured{stroke:var(--cfg);
stroke-width:2;stroke-dasharray:6 3}
ul.legend{list-style:none;padding:0;margin:.2rem 0 0;font-size:.8rem;display:flex;
flex-wrap:wrap;gap:.2rem .9rem}
.key{display:inline-block;width:14px;height:0;border-top:3px solid;margin-right:.35rem;
vertical-align:middle}
.key.s0{border-color:var(--s0)}.key.s1{border-color:var(--s1)}.key.s2{border-color:var(--s2)}
.key.s3{border-color:var(--s3)}.key.dashed{border-top-style:dashed}
.key.mark{border-color:var(--mark);border-top-style:dotted}
.key.recommended{border-color:var(--rec)}.key.configured{border-color:var(--cfg);
border-top-style:dashed}
.nodata{color:var(--mute);font-style:italic}.latest{color:var(--mute)}
p.nodata{margin:2.5rem 0;text-align:center}
table{border-collapse:collapse;font-size:.85rem}
td,th{padding:.15rem .6rem;border-bottom:1px solid var(--line);text-align:right}
th:first-child,td:first-child{text-align:left}
details summary{cursor:pointer;color:var(--mute)}
.up{color:var(--ok)}.down{color:var(--warn)}
"""


def _saved(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def _curve_figure(card: Card) -> str:
    title = "What-if: CPU buffer size -> predicted offload hit ratio"
    if not card.curve:
        why = (
            "no data: the what-if needs vLLM's KV events (--kv-events-config with a zmq "
            "publisher) reaching the exporter"
        )
        return (
            f'<figure class="curve"><h3>{escape(title)}</h3>'
            f'<p class="nodata">{escape(why)}</p></figure>'
        )
    pts = tuple((p.size_bytes, p.hit_ratio) for p in card.curve)
    sizes = [p.size_bytes for p in card.curve]
    marks = []
    if card.configured_bytes:
        marks.append(
            Mark(
                f"configured {fmt_bytes(card.configured_bytes)}",
                card.configured_bytes,
                True,
                "configured",
            )
        )
    if card.recommended_bytes is not None:
        marks.append(
            Mark(
                f"recommended {fmt_bytes(card.recommended_bytes)}",
                card.recommended_bytes,
                True,
                "recommended",
            )
        )
    lo = min([*sizes, *(m.value for m in marks)])
    hi = max([*sizes, *(m.value for m in marks)])
    x = Axis(lo / 1.3, hi * 1.3, log=True)
    y = (
        value_axis([v for _, v in pts], unit_max=1.0)
        if max(v for _, v in pts) > 0.5
        else (value_axis([v for _, v in pts]))
    )
    lines = (Line("predicted offload hit ratio (share of prompt tokens)", pts),)
    svg = chart(
        title,
        lines,
        x,
        y,
        x_fmt=fmt_bytes,
        y_fmt=fmt_ratio,
        marks=marks,
        x_ticks=sizes,
        dots=True,
        width=760,
        height=210,
    )
    rows = "".join(
        f"<tr><td>{escape(fmt_bytes(p.size_bytes))}</td><td>{escape(fmt_ratio(p.hit_ratio))}</td>"
        f"<td>{_saved(p.ttft_saved_seconds_per_second)}</td>"
        f"<td>{escape(', '.join(_tags(card, p.size_bytes)))}</td></tr>"
        for p in card.curve
    )
    table = (
        "<table><thead><tr><th>CPU buffer</th><th>hit ratio</th>"
        "<th>prefill s saved per s</th><th></th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )
    return (
        f'<figure class="curve"><h3>{escape(title)}</h3>{svg}{legend(lines, marks)}'
        f"<details><summary>the curve as a table</summary>{table}</details></figure>"
    )


def _chart_figure(c: Chart, t0: float, t1: float) -> str:
    head = f"<h3>{escape(c.title)}</h3>"
    if not any(line.points for line in c.lines):
        why = escape(c.no_data or "no data")
        return (
            f'<figure class="series">{head}<p class="nodata">{why}</p>'
            f"{legend(c.lines, c.marks)}</figure>"
        )
    values = [v for line in c.lines for _, v in line.points] + [m.value for m in c.marks]
    if c.unit == "ratio":
        y = value_axis(values, unit_max=1.0) if max(values) > 0.3 else value_axis(values)
        y_fmt = fmt_ratio
    elif c.unit == "bytes":
        y, y_fmt = value_axis(values), fmt_bytes
    else:
        y, y_fmt = value_axis(values, log=c.log), fmt_rate
    svg = chart(
        c.title,
        c.lines,
        Axis(t0, t1),
        y,
        x_fmt=fmt_clock,
        y_fmt=y_fmt,
        marks=c.marks,
        x_ticks=(t0, (t0 + t1) / 2, t1),
    )
    return f'<figure class="series">{head}{svg}{legend(c.lines, c.marks, y_fmt)}</figure>'


def _card_html(card: Card, now: float) -> str:
    tone = action_tone(card.action)
    configured, recommended = _buffers(card)
    since = (
        f'<time datetime="{escape(_iso(card.since))}">{escape(fmt_clock(card.since))} UTC</time>'
        f" ({escape(_ago(now, card.since))})"
        if card.since is not None
        else "&mdash;"
    )
    # Out of insufficient_data the evaluations decide alone; a decision also takes the seconds.
    over = (
        "" if card.action == "insufficient_data" else f" over {escape('--advice-confirm-seconds')}"
    )
    pending = (
        f"{escape(card.pending_action)} (must win {escape('--advice-confirm-cycles')} "
        f"evaluations in a row{over})"
        if card.pending_action
        else "none"
    )
    assumed = (
        f'<p class="muted">Reload rate assumed: {card.assumed_load_bandwidth / 1e9:.3g} GB/s '
        "(<code>--assumed-load-bandwidth</code>); nothing was measured.</p>"
        if card.assumed_load_bandwidth is not None
        else ""
    )
    nums = "".join(
        f"<tr><td>{escape(label)}</td><td>{escape(text)}</td></tr>"
        for label, text in (fmt_number(k, v) for k, v in card.numbers)
    )
    return (
        f'<article class="card {tone}" data-action="{escape(card.action)}">'
        f'<p class="action">{escape(action_text(card.action))}</p>'
        f"<p><code>{escape(card.action)}</code> "
        f'<span class="reason">{escape(card.reason)}</span></p>'
        '<dl class="buffers">'
        f"<dt>configured CPU buffer</dt><dd>{escape(configured)}</dd>"
        f"<dt>recommended</dt><dd>{escape(recommended)}</dd>"
        f"<dt>since</dt><dd>{since}</dd>"
        f"<dt>pending change</dt><dd>{pending}</dd></dl>"
        f'<p class="explanation">{escape(card.explanation)}</p>{assumed}'
        f"<details><summary>the numbers behind it</summary><table>{nums}</table></details>"
        "</article>"
    )


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _rows(rows: Sequence[SourceRow]) -> str:
    return "".join(
        f'<tr><td>{escape(r.name)}</td><td class="{"up" if r.up else "down"}">'
        f"{'up' if r.up else 'down'}</td><td>{escape(r.detail)}</td></tr>"
        for r in rows
    )


def render_html(view: StatusView) -> str:
    t1 = view.now
    t0 = t1 - view.window_seconds
    sections = []
    for ev in view.engines:
        c = ev.card
        charts = "".join(_chart_figure(ch, t0, t1) for ch in ev.charts)
        sections.append(
            f'<section class="engine" aria-label="{escape(c.model_name)} '
            f'engine {escape(c.engine)}">'
            f"<h2>{escape(c.model_name)} &middot; engine {escape(c.engine)} "
            f'<span class="muted">on {escape(c.target)}</span></h2>'
            f"{_card_html(c, view.now)}"
            f"{_curve_figure(c)}"
            f'<h3 class="muted">Last {view.window_seconds:g} s</h3>'
            f'<div class="grid">{charts}</div></section>'
        )
    if not sections:
        sections.append(
            '<section><p class="nodata">No engine yet: no vLLM target has been scraped '
            "successfully (see the targets below).</p></section>"
        )
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{view.refresh_seconds}">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        '<meta name="color-scheme" content="light dark">'
        "<title>kv-offload-exporter: does CPU KV offload pay off?</title>"
        f"<style>{CSS}</style></head><body>"
        "<header><h1>Does CPU KV-cache offloading pay off?</h1>"
        f'<p class="muted">kv-offload-exporter {escape(view.version)} &middot; window '
        f"{view.window_seconds:g} s &middot; interval {view.interval_seconds:g} s &middot; "
        f"{view.cycles} cycles &middot; updated {escape(fmt_clock(view.now))} UTC, "
        f"refreshes every {view.refresh_seconds} s</p>"
        '<nav><a href="/metrics">/metrics</a><a href="/advice">advice JSON</a>'
        '<a href="/api/v1/status">status JSON</a><a href="/healthz">/healthz</a>'
        '<a href="/readyz">/readyz</a></nav></header>'
        f"<main>{''.join(sections)}"
        "<section><h2>Sources</h2><table><thead><tr><th>source</th><th>state</th>"
        f"<th>detail</th></tr></thead><tbody>{_rows(view.targets)}{_rows(view.collectors)}"
        "</tbody></table></section></main>"
        '<footer><p class="muted">Rendered by the exporter; no script, nothing loaded from '
        "elsewhere. Grafana dashboards and alert rules show the same numbers over longer "
        "ranges.</p></footer></body></html>\n"
    )
