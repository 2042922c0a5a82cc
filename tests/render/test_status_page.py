"""exporter.render.status_page: the page and the terminal card from view values (pure)."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from exporter.model.advisor.rules import evaluate
from exporter.model.advisor.types import WhatIfState
from exporter.render.advice_json import advice_json
from exporter.render.status_page import (
    Card,
    Chart,
    EngineView,
    SourceRow,
    StatusView,
    card_from_json,
    render_html,
    render_text,
)
from exporter.render.svg import Line, Mark
from exporter.thresholds import DEFAULT
from tests.model.advisor.common import CURVE, EK, GIB, base, inp

NOW = 1_800_000_000.0


def enable_item(**extra: object) -> dict:
    """/advice item of a real evaluation (enable_offload at 0.5 GiB) plus card extras."""
    a = evaluate(inp(base(), whatif=WhatIfState(CURVE, recomputed_after_eviction_tokens=7e4)))
    item = advice_json("vllm:8000", EK, a, DEFAULT)
    item.update(
        since=NOW - 300,
        offload_enabled=False,
        configured_buffer_bytes=None,
        whatif=[
            {
                "cpu_buffer_bytes": p.cpu_buffer_bytes,
                "hit_ratio": p.hit_ratio,
                "ttft_saved_seconds_per_second": None,
            }
            for p in CURVE
        ],
        assumed_load_bandwidth_bytes_per_second=14e9,
    )
    item.update(extra)
    return item


def view(*engines: EngineView, **kw: object) -> StatusView:
    fields: dict[str, object] = dict(
        version="0.1.0",
        now=NOW,
        window_seconds=300.0,
        interval_seconds=5.0,
        cycles=60,
        refresh_seconds=10,
        targets=(SourceRow("vLLM vllm:8000", True, "http://vllm:8000"),),
        engines=engines,
    )
    fields.update(kw)
    return StatusView(**fields)  # type: ignore[arg-type]


def series_chart(title: str, *lines: Line, no_data: str = "") -> Chart:
    return Chart(title, "ratio", lines, (Mark("material 5%", 0.05),), no_data=no_data)


class Checker(HTMLParser):
    """Well-nested tags (void elements aside) and every tag/attribute seen."""

    VOID = frozenset({"meta", "br", "link", "img", "input", "hr"})

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (tag, self.stack[-5:])
        self.stack.pop()


def check(html: str) -> Checker:
    c = Checker()
    c.feed(html)
    assert c.stack == ["html"] or c.stack == [], c.stack
    return c


def test_card_from_json_reads_an_advice_item() -> None:
    card = card_from_json(enable_item())
    assert card.action == "enable_offload" and card.reason == "recompute_after_eviction"
    assert card.recommended_bytes == 0.5 * GIB
    assert card.configured_bytes is None and not card.offload_enabled
    assert card.since == NOW - 300 and card.pending_action is None
    assert [p.size_bytes for p in card.curve] == [p.cpu_buffer_bytes for p in CURVE]
    assert card.assumed_load_bandwidth == 14e9
    assert dict(card.numbers)["prompt_tokens"] == 400_000.0
    assert "offload_hit_ratio" not in dict(card.numbers)  # None numbers are left out


def test_card_from_json_of_an_older_exporter_without_extras() -> None:
    item = enable_item()
    for key in ("since", "whatif", "offload_enabled", "configured_buffer_bytes"):
        del item[key]
    card = card_from_json(item)
    assert card.curve == () and card.since is None and card.configured_bytes is None


def test_terminal_card_has_the_action_buffers_curve_and_numbers() -> None:
    text = render_text(card_from_json(enable_item(pending_action="no_action")), now=NOW)
    assert text.splitlines()[0] == "vllm:8000  qwen3-dummy  engine 0"
    assert "enable_offload (recompute_after_eviction)" in text
    assert "(5 min ago)" in text
    assert "pending change: no_action" in text
    assert "configured off; recommended 512 MiB (--kv-offloading-size 0.5)" in text
    assert "reload rate assumed: 14 GB/s" in text
    rows = [ln for ln in text.splitlines() if "<- recommended" in ln]
    assert len(rows) == 1 and "512 MiB" in rows[0] and "17%" in rows[0]
    assert re.search(r"prompt tokens in the window\s+400,000", text)


def test_page_shows_card_curve_and_charts() -> None:
    card = card_from_json(enable_item())
    charts = (
        series_chart("Hits", Line("GPU prefix hit ratio", ((NOW - 10, 0.2), (NOW, 0.3)))),
        series_chart("PCIe", Line("PCIe", ()), no_data="no data: no GPU visible to NVML"),
    )
    html = render_html(view(EngineView(card, charts)))
    c = check(html)
    tags = [t for t, _ in c.tags]
    assert ("meta", {"http-equiv": "refresh", "content": "10"}) in c.tags
    assert "script" not in tags
    assert "@media (prefers-color-scheme:dark)" in html
    assert 'data-action="enable_offload"' in html
    assert tags.count("svg") == 2  # the curve and the one chart with data
    assert "no data: no GPU visible to NVML" in html
    assert 'class="recommended"' in html and 'class="configured"' not in html
    # Nothing to fetch: the only URLs are this exporter's own paths and the SVG namespace.
    urls = re.findall(r"(?:href|src)=\"([^\"]*)\"", html)
    assert urls and all(u.startswith("/") for u in urls)
    assert "url(" not in html and "@import" not in html  # nor from the stylesheet


def test_page_escapes_every_text_it_did_not_write() -> None:
    evil = "<script>alert(1)</script>"
    item = enable_item(model_name=evil, target=evil, explanation=evil, reason=evil)
    charts = (series_chart(evil, Line(evil, ((NOW - 1, 0.1), (NOW, 0.2)))),)
    html = render_html(
        view(EngineView(card_from_json(item), charts), targets=(SourceRow(evil, False, evil),))
    )
    assert "<script" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    check(html)


def test_page_without_engines_says_so() -> None:
    html = render_html(view(targets=(SourceRow("vLLM x", False, "connect: refused"),)))
    check(html)
    assert "No engine yet" in html and "connect: refused" in html


def test_curve_without_kv_events_says_what_is_missing() -> None:
    card = Card(
        "t", "m", "0", "no_action", "no_kv_pressure", "x", None, None, False, None, None, ()
    )
    html = render_html(view(EngineView(card, ())))
    assert "the what-if needs vLLM&#x27;s KV events" in html
