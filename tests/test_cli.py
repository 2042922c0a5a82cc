"""exporter.cli: the `advise` subcommand against a running exporter, and a dead URL."""

from __future__ import annotations

import asyncio
import json

from exporter.cli import main
from testbed.browser import served_replay
from testbed.procs import free_port


async def test_advise_prints_the_status_pages_card(capsys) -> None:
    async with served_replay("large-b") as (url, _):
        rc = await asyncio.to_thread(main, ["advise", "--url", url, "--timeout", "5"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "target large-b (http://127.0.0.1:" in out and "): up" in out
    assert "Grow the CPU buffer: grow_buffer (buffer_too_small)" in out
    assert "CPU buffer: configured 1.14 GiB; recommended 4.57 GiB (--kv-offloading-size" in out
    assert "<- configured" in out and "<- recommended" in out
    assert "numbers:" in out


async def test_advise_json_is_the_advice_document(capsys) -> None:
    async with served_replay("large-b") as (url, _):
        rc = await asyncio.to_thread(main, ["advise", "--url", url, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert doc["advice"][0]["action"] == "grow_buffer" and doc["advice"][0]["whatif"]


def test_advise_on_a_dead_url_says_so(capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    rc = main(["advise", "--url", url, "--timeout", "2"])
    captured = capsys.readouterr()
    assert rc == 1
    assert f"no answer from an exporter at {url}" in captured.err and "refused" in captured.err
    assert captured.out == ""
