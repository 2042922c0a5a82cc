"""The status page in a real browser: headless Chromium on the exporter's `/`, fed by a
recorded H200 run (testbed.gpu_replay: large-b). The page is checked against what the exporter
itself decided (its /advice), not against an action written into the test.

Checks the DOM Chromium built (the card, the what-if curve with the configured and
recommended sizes marked, the five time series), that the page needs nothing from
elsewhere, and renders it light and dark (the screenshots the docs show come from
`python -m testbed.browser`, the same code).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.request

import pytest
from PIL import Image, ImageStat

from exporter.model.advisor.types import ACTION_INFO, Action
from testbed.browser import dump_dom, parse, screenshot, served_replay
from tests.conftest import need

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def chromium() -> None:
    need(shutil.which("chromium") is not None, "chromium (Debian package)")


def _advice(url: str) -> dict:
    with urllib.request.urlopen(url + "advice", timeout=10) as resp:
        (item,) = json.loads(resp.read())["advice"]
    return item


async def test_page_of_a_recorded_run_in_chromium(chromium, tmp_path) -> None:
    async with served_replay() as (url, replayed):
        item = await asyncio.to_thread(_advice, url)
        dom = parse(await asyncio.to_thread(dump_dom, url))
        light = await asyncio.to_thread(screenshot, url, tmp_path / "light.png")
        dark = await asyncio.to_thread(screenshot, url, tmp_path / "dark.png", dark=True)
    action = Action(item["action"])
    assert action != Action.INSUFFICIENT_DATA  # the recorded run decides: a full card to show

    # The card: what to do, why, the buffers, since when.
    (card,) = dom.iter("article", "card")
    assert card.attrs["data-action"] == str(action)
    text = card.text()
    assert ACTION_INFO[action].headline in text and item["reason"] in text
    assert item["explanation"] in text
    gib = item["recommended_buffer_bytes"] / 2**30
    assert f"--kv-offloading-size {gib:.4g}" in text
    assert "configured CPU buffer 1.14 GiB" in text
    assert "since" in text and "pending change none" in text

    # The what-if curve: one dot per simulated size, the two sizes marked.
    (curve,) = dom.iter("figure", "curve")
    (svg,) = curve.iter("svg")
    assert len(svg.iter("circle")) == len(item["whatif"]) > 1
    assert [
        m.attrs["class"]
        for m in svg.iter("line")
        if m.attrs["class"] in ("configured", "recommended")
    ] == ["configured", "recommended"]
    rows = curve.iter("tbody")[0].iter("tr")
    assert len(rows) == len(item["whatif"])

    # The time series over the window: each chart drawn from the recorded cycles.
    charts = dom.iter("figure", "series")
    titles = [c.iter("h3")[0].text() for c in charts]
    assert titles == [
        "Offload hit ratio vs GPU prefix hit ratio",
        "Recompute after eviction (share of prompt tokens)",
        "Reload vs recompute speed (tokens/s)",
        "PCIe utilisation (busiest direction)",
        "Pinned memory vs container limit",
    ]
    cycles = len(replayed.recording.vllm)
    for c in charts:
        polylines = c.iter("polyline")
        assert polylines, c.iter("h3")[0].text()
        assert all(1 < len(p.attrs["points"].split()) <= cycles for p in polylines)

    # Air-gapped: no script, nothing loaded from another origin.
    assert not dom.iter("script")
    for el in dom.iter():
        for attr in ("src", "href"):
            assert not el.attrs.get(attr, "").startswith(("http:", "https:", "//")), el.attrs

    # Light and dark: the same page, dark when the browser prefers it.
    def brightness(path) -> float:
        with Image.open(path) as img:
            return float(ImageStat.Stat(img.convert("L")).mean[0])

    assert Image.open(light).size == Image.open(dark).size == (1280, 1600)
    assert brightness(light) > 200 > 60 > brightness(dark)


async def test_page_says_no_data_where_a_series_is_absent(chromium) -> None:
    # The run without offload: no offload hit ratio; the recorded host has no GPU counters
    # before the first poll, but every engine still gets its card and curve.
    async with served_replay("large-a") as (url, _):
        item = await asyncio.to_thread(_advice, url)
        dom = parse(await asyncio.to_thread(dump_dom, url))
    (card,) = dom.iter("article", "card")
    assert card.attrs["data-action"] == item["action"] != "insufficient_data"
    first = dom.iter("figure", "series")[0]
    legend = first.iter("ul")[0].text()
    assert "offload hit ratio (offload off) no data" in legend
