"""exporter.status: the card extras of /advice and the status page's view value, on the
real exporter replaying a recorded H200 run (testbed.gpu_replay)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from exporter.model.history import EngineRef
from exporter.render.status_page import Card, _card_html
from exporter.status import advice_items, card_extras, engine_charts, status_view
from testbed.browser import served_replay

GIB = 1 << 30


def get(url: str) -> tuple[str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.headers["Content-Type"], resp.read()


async def test_advice_items_carry_the_card_extras() -> None:
    async with served_replay("large-b") as (url, r):
        exp = r.exporter
        ((label, [(key, advice)]),) = exp.advice.items()
        extras = card_extras(exp, label, key)
        _, body = await asyncio.to_thread(get, url + "advice")
    (item,) = json.loads(body)["advice"]
    assert item["action"] == str(advice.action) != "insufficient_data"
    assert {k: item[k] for k in extras} == json.loads(json.dumps(extras))
    assert extras["offload_enabled"] is True
    assert extras["configured_buffer_bytes"] == 1.14286 * GIB  # --kv-offloading-size 1.14286
    inp = exp.inputs[(label, key)]
    assert inp.whatif is not None
    assert [p["hit_ratio"] for p in extras["whatif"]] == [p.hit_ratio for p in inp.whatif.points]
    # Offload on: the reload rate is measured, not assumed.
    assert extras["assumed_load_bandwidth_bytes_per_second"] is None
    # Since: the cycle the standing action first won, in the exporter's (recorded) clock.
    ref = EngineRef(label, key.model_name, key.engine)
    changes = [
        p.t
        for a, p in zip(exp.history.points(ref), exp.history.points(ref)[1:], strict=False)
        if a.action != p.action
    ]
    assert extras["since"] == changes[-1]


async def test_status_view_has_one_engine_with_five_charts_from_history() -> None:
    async with served_replay("large-b") as (url, r):
        exp = r.exporter
        ((_, [(_, advice)]),) = exp.advice.items()
        v = status_view(exp, exp.clock(), advice_items(exp))
        ctype, page = await asyncio.to_thread(get, url)
    assert ctype.startswith("text/html")
    assert v.cycles == len(r.recording.vllm)
    (engine,) = v.engines
    assert engine.card.action == str(advice.action)
    assert len(engine.charts) == 5
    hits = engine.charts[0]
    assert [ln.label for ln in hits.lines] == ["offload hit ratio", "GPU prefix hit ratio"]
    # Every point lies in the window ending now, one per cycle at most.
    for ch in engine.charts:
        for ln in ch.lines:
            assert all(v.now - v.window_seconds <= t <= v.now for t, _ in ln.points)
            assert len(ln.points) <= v.cycles
    assert [s.name for s in v.collectors] == [
        "nvml",
        "procfs:large-b",
        "cgroup:large-b",
        "kv_events:large-b",
    ]
    assert f'data-action="{advice.action}"'.encode() in page


def test_engine_charts_of_an_unknown_engine_say_no_data() -> None:
    from exporter.model.history import History
    from exporter.thresholds import DEFAULT

    charts = engine_charts(History(60.0), EngineRef("t", "m", "0"), DEFAULT)
    assert all(not ln.points for c in charts for ln in c.lines)
    assert all(c.no_data.startswith("no data") for c in charts)


def test_a_pending_change_names_the_hysteresis_it_must_pass() -> None:
    """Out of insufficient_data the evaluations decide alone; a standing decision also
    takes --advice-confirm-seconds (docs/advisor.md, "Hysteresis")."""

    def card(action: str) -> Card:
        return Card("t", "m", "0", action, "r", "x", None, None, False, None, "enable_offload", ())

    waiting = _card_html(card("insufficient_data"), 0.0)
    decided = _card_html(card("no_action"), 0.0)
    assert "evaluations in a row)" in waiting and "--advice-confirm-seconds" not in waiting
    assert "evaluations in a row over --advice-confirm-seconds)" in decided
