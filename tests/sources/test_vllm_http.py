"""exporter/sources/vllm_http.py: VllmTarget scrapes one vLLM /metrics into its window.

Most cases inject `fetch` (what `replay` does with a recording); the size cap of the HTTP
path is checked against a real server. HTTP faults under load: tests/faults/test_http_faults.py.
"""

from __future__ import annotations

import asyncio

import pytest

from exporter.options import TargetConfig
from exporter.sources import CollectError, ErrorKind, execute
from exporter.sources.vllm_http import VllmTarget
from exporter.vllm_metrics import EngineKey
from testbed.replay import ReplayServer, Reply
from tests.conftest import H200

BEFORE = (H200 / "b_offload" / "metrics_before.txt").read_bytes()
AFTER = (H200 / "b_offload" / "metrics_after.txt").read_bytes()
EK = EngineKey("qwen3-dummy", "0")
CONFIG = TargetConfig(url="http://vllm:8000", name="t")
LIMIT = 1 << 20


class Fetcher:
    """Answers /metrics from a script of bodies (or errors) and /version with `version`."""

    def __init__(self, *bodies: bytes | CollectError, version: bytes = b'{"version": "0.26.0"}'):
        self.bodies = list(bodies)
        self.version = version
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, url: str, limit: int) -> bytes:
        self.calls.append((url, limit))
        if url.endswith("/version"):
            return self.version
        body = self.bodies.pop(0)
        if isinstance(body, CollectError):
            raise body
        return body


def target(fetch: Fetcher, now: list[float]) -> VllmTarget:
    return VllmTarget(
        CONFIG,
        window_seconds=300.0,
        timeout=5.0,
        max_body_bytes=LIMIT,
        clock=lambda: now[0],
        fetch=fetch,
    )


def run(t: VllmTarget, *times: float, now: list[float]) -> list[bool]:
    async def go() -> list[bool]:
        await t.start()
        out = []
        try:
            for ts in times:
                now[0] = ts
                out.append(await execute(t, 5.0))
        finally:
            await t.stop()
        return out

    return asyncio.run(go())


def test_vllm_target_parses_each_body_into_its_window_at_the_clocks_time() -> None:
    now = [0.0]
    fetch = Fetcher(BEFORE, AFTER)
    t = target(fetch, now)
    assert t.name == "vllm:t"
    assert run(t, 100.0, 105.0, now=now) == [True, True]
    assert t.window.engines() == [EK]
    assert t.window.last_seen[EK] == 105.0
    assert t.window.covered_seconds() == 5.0
    (iv,) = t.window.intervals()
    assert iv.deltas[EK]["prompt_tokens"] > 0  # counters of the body, differenced
    # /metrics with the body cap, /version (small cap) once after the first good scrape
    assert fetch.calls == [
        ("http://vllm:8000/metrics", LIMIT),
        ("http://vllm:8000/version", 1 << 14),
        ("http://vllm:8000/metrics", LIMIT),
    ]


def test_vllm_target_snapshot_has_what_the_scrapes_left() -> None:
    now = [0.0]
    t = target(Fetcher(BEFORE), now)
    run(t, 50.0, now=now)
    snap = t.snapshot()
    assert snap.config is CONFIG and snap.window is t.window
    assert snap.version == "0.26.0" and snap.body == BEFORE
    assert snap.series_dropped_total == 0
    assert snap.health.name == "vllm:t" and snap.health.up and snap.health.started
    assert snap.health.last_success == 50.0 and snap.health.errors_total == {}


def test_vllm_target_reads_the_version_again_after_a_counter_reset() -> None:
    now = [0.0]
    fetch = Fetcher(AFTER, AFTER, BEFORE, version=b'{"version": "0.27.0"}')
    t = target(fetch, now)
    assert run(t, 1.0, 2.0, 3.0, now=now) == [True, True, True]
    assert [u for u, _ in fetch.calls].count("http://vllm:8000/version") == 2
    state = t.snapshot().health
    assert state.errors_total == {ErrorKind.COUNTER_RESET: 1} and state.up
    assert t.snapshot().version == "0.27.0"


@pytest.mark.parametrize("version", [b"not json", b"[1]", b"{}"])
def test_vllm_target_without_a_readable_version_still_scrapes(version: bytes) -> None:
    now = [0.0]
    t = target(Fetcher(BEFORE, version=version), now)
    assert run(t, 1.0, now=now) == [True]
    assert t.snapshot().version is None


def test_vllm_target_too_large_body_is_a_too_large_failure() -> None:
    now = [0.0]
    big = CollectError(ErrorKind.TOO_LARGE, "GET x: body exceeds 1048576 bytes")
    t = target(Fetcher(BEFORE, big), now)
    assert run(t, 1.0, 2.0, now=now) == [True, False]
    snap = t.snapshot()
    assert not snap.health.up and snap.health.error_kind == ErrorKind.TOO_LARGE
    assert snap.health.errors_total == {ErrorKind.TOO_LARGE: 1}
    assert snap.body is None  # the last scrape failed: no body to record
    assert snap.health.last_success == 1.0 and t.window.last_seen[EK] == 1.0


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"\xff\xfe garbage", "not UTF-8"),
        (b'# HELP other_metric x\nother_metric{a="1"} 1\n', "no vllm:* series"),
        (b"", "no vllm:* series"),
    ],
)
def test_vllm_target_garbage_is_a_parse_failure(body: bytes, needle: str) -> None:
    now = [0.0]
    t = target(Fetcher(body), now)
    assert run(t, 1.0, now=now) == [False]
    h = t.snapshot().health
    assert h.error_kind == ErrorKind.PARSE and needle in (h.error or "")
    assert h.errors_total == {ErrorKind.PARSE: 1}
    assert t.window.engines() == []


@pytest.mark.parametrize(
    "reply",
    [Reply(body=b"x" * 5000), Reply(stream_bytes=5000)],
    ids=["content_length", "streamed"],
)
def test_vllm_target_http_body_over_the_cap_is_too_large(reply: Reply) -> None:
    async def go(url: str) -> ErrorKind | None:
        t = VllmTarget(TargetConfig(url=url), window_seconds=60.0, timeout=5.0, max_body_bytes=4096)
        await t.start()
        try:
            assert not await execute(t, 10.0)
        finally:
            await t.stop()
        return t.snapshot().health.error_kind

    with ReplayServer([reply]) as srv:
        assert asyncio.run(go(srv.url)) == ErrorKind.TOO_LARGE


def test_vllm_target_http_reads_metrics_and_version() -> None:
    async def go(url: str) -> tuple[bool, str | None]:
        t = VllmTarget(
            TargetConfig(url=url), window_seconds=60.0, timeout=5.0, max_body_bytes=LIMIT
        )
        await t.start()
        try:
            ok = await execute(t, 10.0)
        finally:
            await t.stop()
        return ok, t.snapshot().version

    with ReplayServer([Reply(body=BEFORE)], version="0.26.0") as srv:
        assert asyncio.run(go(srv.url)) == (True, "0.26.0")
        assert srv.requests == 1
