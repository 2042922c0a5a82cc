"""exporter/sources/kv_events/discovery.py: streams from explicit endpoints and from vLLM's
GET /kv_event_sources."""

from __future__ import annotations

import pytest
from aiohttp import web

from exporter.sources import CollectError, ErrorKind
from exporter.sources.kv_events.discovery import (
    StreamSpec,
    discover,
    streams_from,
    streams_from_sources,
)
from testbed.procs import free_port


def test_streams_from_kv_event_sources() -> None:
    doc = {
        "0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5560", "topic": "kv"},
        "1": {"endpoint": "tcp://*:5558", "replay_endpoint": None},
        "2": {"endpoint": "tcp://exporter:5559"},
        "3": {"endpoint": "inproc://cache_dp3"},
    }
    streams = streams_from_sources(doc, "10.1.2.3")
    assert streams == [
        StreamSpec(0, "tcp://10.1.2.3:5557", False, "tcp://10.1.2.3:5560"),
        StreamSpec(1, "tcp://10.1.2.3:5558", False, None),
        StreamSpec(2, "tcp://exporter:5559", True, None),
    ]
    assert streams_from_sources({}, "h") == []
    with pytest.raises(ValueError):
        streams_from_sources({"x": {"endpoint": "tcp://*:1"}}, "h")


def test_streams_from_sources_ipv6_host_and_ipc() -> None:
    doc = {"0": {"endpoint": "tcp://*:5557"}, "1": {"endpoint": "ipc:///tmp/kv1"}}
    assert streams_from_sources(doc, "::1") == [
        StreamSpec(0, "tcp://[::1]:5557", False, None),
        StreamSpec(1, "ipc:///tmp/kv1", False, None),
    ]


def test_streams_from_explicit_endpoints_pair_replay_by_rank() -> None:
    got = streams_from(("tcp://h:1", "tcp://h:2"), (), ("tcp://h:9",))
    assert got == [
        StreamSpec(0, "tcp://h:1", False, "tcp://h:9"),
        StreamSpec(1, "tcp://h:2", False),
    ]
    assert streams_from((), ("tcp://0.0.0.0:7",), ()) == [StreamSpec(0, "tcp://0.0.0.0:7", True)]


async def _serve(*answers: web.StreamResponse) -> tuple[web.AppRunner, str]:
    pending = list(answers)

    async def sources(_: web.Request) -> web.StreamResponse:
        return pending.pop(0)

    app = web.Application()
    app.router.add_get("/kv_event_sources", sources)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_discover_absent_404_empty_and_unreadable() -> None:
    runner, url = await _serve(
        web.Response(status=404),
        web.json_response({}),
        web.Response(status=500),
        web.Response(text="not json"),
        web.json_response({"0": {"endpoint": "tcp://*:5557"}}),
    )
    try:
        for kind, absent in (
            (ErrorKind.UNAVAILABLE, True),  # older vLLM
            (ErrorKind.UNAVAILABLE, True),  # events off
            (ErrorKind.HTTP_STATUS, False),
            (ErrorKind.PARSE, False),
        ):
            with pytest.raises(CollectError) as err:
                await discover(url, url, 5.0)
            assert (err.value.kind, err.value.absent) == (kind, absent)
        assert await discover(url, url, 5.0) == [StreamSpec(0, "tcp://127.0.0.1:5557", False)]
    finally:
        await runner.cleanup()


async def test_discover_connect_failure_is_absent() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(CollectError) as err:
        await discover(url, url, 2.0)
    assert err.value.kind == ErrorKind.CONNECT and err.value.absent
