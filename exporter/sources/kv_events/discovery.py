"""Where the KV events come from: explicit endpoints, or vLLM's GET /kv_event_sources.

vLLM's ZmqEventPublisher binds wildcard and ipc/inproc endpoints and connects to the rest,
so a stream is either connected to (vLLM binds) or bound by the exporter (vLLM connects).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from exporter.sources import CollectError, ErrorKind

MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class StreamSpec:
    rank: int
    address: str
    bind: bool
    replay: str | None = None


def streams_from(
    endpoints: Sequence[str], bind: Sequence[str], replay_endpoints: Sequence[str]
) -> list[StreamSpec]:
    """Explicit endpoints, rank = position; replay endpoints pair up by position."""
    out: list[StreamSpec] = []
    replay = list(replay_endpoints)
    for rank, addr in enumerate(endpoints):
        out.append(StreamSpec(rank, addr, False, replay[rank] if rank < len(replay) else None))
    for rank, addr in enumerate(bind):
        out.append(StreamSpec(rank, addr, True, replay[rank] if rank < len(replay) else None))
    return out


def _swap_host(endpoint: str, host: str) -> str:
    scheme, _, rest = endpoint.partition("://")
    _, _, port = rest.rpartition(":")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def _vllm_binds(endpoint: str) -> bool:
    # vLLM's ZmqEventPublisher binds wildcard and ipc/inproc endpoints, connects to the rest.
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def streams_from_sources(doc: Any, vllm_host: str) -> list[StreamSpec]:
    """Streams from vLLM's GET /kv_event_sources: {rank: KVEventsConfig}."""
    if not isinstance(doc, dict):
        raise ValueError("expected a JSON object of DP rank -> KV events config")
    out: list[StreamSpec] = []
    for key, cfg in doc.items():
        try:
            rank = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"DP rank {key!r} is not an integer") from None
        if not isinstance(cfg, dict) or not isinstance(cfg.get("endpoint"), str):
            raise ValueError(f"rank {rank}: no endpoint")
        if cfg.get("publisher", "zmq") not in ("zmq", None):
            continue
        endpoint = cfg["endpoint"]
        replay = cfg.get("replay_endpoint")
        if endpoint.startswith("inproc://"):
            continue  # in-process only: unreachable from another process
        if _vllm_binds(endpoint):
            address = endpoint if endpoint.startswith("ipc://") else _swap_host(endpoint, vllm_host)
            out.append(StreamSpec(rank, address, False, _replay_address(replay, vllm_host)))
        else:
            out.append(StreamSpec(rank, endpoint, True, _replay_address(replay, vllm_host)))
    return sorted(out, key=lambda s: s.rank)


def _replay_address(replay: Any, vllm_host: str) -> str | None:
    if not isinstance(replay, str) or not replay:
        return None
    # The replay ROUTER always binds on the vLLM side.
    if replay.startswith("ipc://"):
        return replay
    return _swap_host(replay, vllm_host) if _vllm_binds(replay) else replay


async def discover(vllm_url: str, base_url: str, timeout: float) -> list[StreamSpec]:
    """GET {base_url}/kv_event_sources -> the streams; CollectError when there are none."""
    url = base_url + "/kv_event_sources"
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    try:
        async with (
            aiohttp.ClientSession(timeout=client_timeout) as session,
            session.get(url) as resp,
        ):
            if resp.status == 404:
                raise CollectError(
                    ErrorKind.UNAVAILABLE,
                    f"GET {url}: 404 (vLLM older than 0.32?): give --kv-events-endpoint",
                    absent=True,
                )
            if resp.status != 200:
                raise CollectError(ErrorKind.HTTP_STATUS, f"GET {url}: HTTP {resp.status}")
            body = await resp.content.read(MAX_BODY_BYTES)
    except TimeoutError:
        raise CollectError(ErrorKind.TIMEOUT, f"GET {url}: no answer", absent=True) from None
    except aiohttp.ClientError as exc:
        raise CollectError(ErrorKind.CONNECT, f"GET {url}: {exc}", absent=True) from None
    try:
        doc = json.loads(body)
        host = urlsplit(vllm_url).hostname or "127.0.0.1"
        streams = streams_from_sources(doc, host)
    except ValueError as exc:
        raise CollectError(ErrorKind.PARSE, f"GET {url}: {exc}") from None
    if not streams:
        raise CollectError(
            ErrorKind.UNAVAILABLE,
            "vLLM publishes no KV events: start it with --kv-events-config "
            '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\'',
            absent=True,
        )
    return streams
