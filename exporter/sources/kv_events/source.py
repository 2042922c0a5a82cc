"""KV-event source: consume vLLM's ZMQ KV-cache events and run the what-if simulator.

Two threads per target, neither touching asyncio:

- the receiver owns the ZMQ sockets (a SUB per DP rank, connecting to a vLLM that
  binds or binding for a vLLM that connects, and a DEALER per replay endpoint). It
  only checks sequence numbers and queues raw frames, so it keeps up with any
  publisher; on a gap it asks vLLM's replay ROUTER for the missing batches and counts
  what did not come back; a sequence number going backwards is a publisher restart.
- the simulator drains the bounded queue (full: the batch is dropped and counted, the
  publisher is never slowed), decodes, optionally records, rebuilds requests and
  replays them through the CPU-tier models, and publishes a frozen snapshot.

`collect()` only reads counters and the latest snapshot. The what-if families need
the target's window of prompt tokens and the derived recompute and transfer rates, so
they come from `derived_families()`, which the exporter calls after deriving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
import zmq

from exporter.catalogue import Family
from exporter.kvevents_codec import (
    DecodeError,
    Message,
    decode_payload,
    encode_record,
)
from exporter.logs import log_event
from exporter.model.advisor.rules import PolicyPoint, WhatIfPoint, WhatIfState
from exporter.model.derive.engines import EngineDerived
from exporter.model.whatif.simulator import (
    DEFAULT_SIZES_BYTES,
    Model,
    TraceBuilder,
    VllmCpuTier,
    blocks_for_bytes,
    make_model,
    ttft_saved_seconds_per_second,
)
from exporter.sources import Clock, CollectError, ErrorKind, Health
from exporter.sources.vllm_http import TargetConfig, VllmTarget
from exporter.vllm_metrics import EngineKey

if TYPE_CHECKING:
    from exporter.config import Config

log = logging.getLogger("kvoe.kv_events")

# A forward jump this large is not a gap that replay could fill: treat it as a restart.
MAX_GAP = 1 << 24
# Eviction policies and store thresholds replayed side by side at one size (the configured
# buffer, or the recommended one with offload off): the advisor says which serves more.
POLICY_COMBOS: tuple[tuple[str, int], ...] = (("lru", 0), ("arc", 0), ("lru", 2), ("arc", 2))
# A vLLM without KV events (or without /kv_event_sources) is asked again this often.
DISCOVERY_RETRY_SECONDS = 30.0
RECORD_FLUSH_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class KvEventsSettings:
    endpoints: tuple[str, ...] = ()  # vLLM binds, the exporter connects (one per DP rank)
    bind: tuple[str, ...] = ()  # vLLM connects, the exporter binds (one per DP rank)
    replay_endpoints: tuple[str, ...] = ()  # vLLM's replay ROUTER per DP rank
    queue_size: int = 10_000
    record_path: str = ""
    sizes_bytes: tuple[int, ...] = DEFAULT_SIZES_BYTES
    policy: str = "lru"
    store_threshold: int = 0
    sample_rate: float = 1.0
    model: str = "vllm"
    blocks_per_chunk: int = 1
    topic: str = ""
    replay_timeout: float = 1.0
    bucket_seconds: float = 0.5
    history_seconds: float = 900.0
    discovery_timeout: float = 5.0


@dataclass(frozen=True, slots=True)
class StreamSpec:
    rank: int
    address: str
    bind: bool
    replay: str | None = None


def _engine_policy(d: EngineDerived) -> tuple[str | None, int | None]:
    """The engine's eviction policy and active store threshold, where its command line
    gives them; (None, None) leaves the configured-size simulation to the --whatif-* flags."""
    b = d.backend
    if b is None or b.config.source != "cmdline" or b.config.connector != "OffloadingConnector":
        return None, None
    policy = b.config.eviction_policy
    threshold = int(b.config.store_threshold) if b.config.store_threshold.isdigit() else None
    return (policy if policy in ("lru", "arc") else None), threshold


def _policy_size(d: EngineDerived, recommended: float | None) -> float | None:
    """The size the policy comparison runs at: the configured CPU buffer of a native
    OffloadingConnector (the only backend with these policies), else with offload off
    the advisor's recommendation; None where no comparison applies."""
    connector = d.backend.config.connector if d.backend is not None else "unknown"
    if d.offload_enabled:
        if connector in ("OffloadingConnector", "unknown") and d.offload_buffer_bytes:
            return d.offload_buffer_bytes
        return None
    return recommended or None


def _recompute_rate(d: EngineDerived) -> float | None:
    """Marginal recompute tokens/s; infinite when the per-token cost is below the noise."""
    return math.inf if d.recompute_negligible else d.recompute_tokens_per_second


def streams_from(settings: KvEventsSettings) -> list[StreamSpec]:
    """Explicit endpoints, rank = position; replay endpoints pair up by position."""
    out: list[StreamSpec] = []
    replay = list(settings.replay_endpoints)
    for rank, addr in enumerate(settings.endpoints):
        out.append(StreamSpec(rank, addr, False, replay[rank] if rank < len(replay) else None))
    for rank, addr in enumerate(settings.bind):
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


@dataclass(slots=True)
class StreamCounters:
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0
    restarts: int = 0


@dataclass(slots=True)
class ReceiverCounters:
    """Written by the receiver thread only; plain ints, read racily but never torn."""

    streams: dict[int, StreamCounters] = field(default_factory=dict)
    dropped: int = 0
    bad_frames: int = 0
    error: str | None = None
    running: bool = False

    def stream(self, rank: int) -> StreamCounters:
        c = self.streams.get(rank)
        if c is None:
            c = self.streams[rank] = StreamCounters()
        return c


# Queue items: (rank, seq, topic, payload) or (rank, -1, b"", b"") for a restart.
QueueItem = tuple[int, int, bytes, bytes]
RESTART = -1


class Receiver(threading.Thread):
    def __init__(
        self,
        ctx: zmq.Context[Any],
        streams: Sequence[StreamSpec],
        out: queue.Queue[QueueItem],
        counters: ReceiverCounters,
        stop: threading.Event,
        *,
        topic: str = "",
        replay_timeout: float = 1.0,
        rcvhwm: int = 100_000,
        name: str = "kvoe-kv-receiver",
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.ctx = ctx
        self.specs = list(streams)
        self.out = out
        self.counters = counters
        self.stop_event = stop
        self.topic = topic.encode()
        self.replay_timeout = replay_timeout
        self.rcvhwm = rcvhwm
        self.ready = threading.Event()
        self._subs: list[tuple[StreamSpec, zmq.Socket[Any]]] = []
        self._dealers: dict[int, zmq.Socket[Any]] = {}
        self._expected: dict[int, int] = {}

    def _open(self) -> None:
        for spec in self.specs:
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic)
            self._subs.append((spec, sock))
            if spec.bind:
                sock.bind(spec.address)
            else:
                sock.connect(spec.address)

    def _close(self) -> None:
        for _, sock in self._subs:
            sock.close(linger=0)
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._subs.clear()
        self._dealers.clear()

    def run(self) -> None:
        try:
            self._open()
        except zmq.ZMQError as exc:
            self.counters.error = f"cannot open KV-event sockets: {exc}"
            self._close()
            self.ready.set()
            return
        self.counters.running = True
        self.ready.set()
        poller = zmq.Poller()
        for _, sock in self._subs:
            poller.register(sock, zmq.POLLIN)
        try:
            while not self.stop_event.is_set():
                ready = dict(poller.poll(200))
                for spec, sock in self._subs:
                    if sock not in ready:
                        continue
                    for _ in range(1000):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.on_frames(spec, frames)
        except zmq.ZMQError as exc:
            self.counters.error = f"KV-event socket failed: {exc}"
        finally:
            self.counters.running = False
            self._close()

    def _put(self, item: QueueItem) -> None:
        try:
            self.out.put_nowait(item)
        except queue.Full:
            self.counters.dropped += 1

    def on_frames(self, spec: StreamSpec, frames: Sequence[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counters.bad_frames += 1
            return
        seq = int.from_bytes(frames[1], "big")
        c = self.counters.stream(spec.rank)
        expected = self._expected.get(spec.rank)
        if expected is not None and seq != expected:
            if expected < seq <= expected + MAX_GAP:
                c.gaps += 1
                got = self.replay(spec, expected, seq) if spec.replay else []
                for s, topic, payload in got:
                    self._put((spec.rank, s, topic, payload))
                c.replayed += len(got)
                c.lost += seq - expected - len(got)
                c.batches += len(got)
            else:
                # Sequence numbers restart at 0 with a new publisher: caches are cold again.
                c.restarts += 1
                self._put((spec.rank, RESTART, b"", b""))
        self._expected[spec.rank] = seq + 1
        c.batches += 1
        self._put((spec.rank, seq, frames[0], frames[2]))

    def _dealer(self, spec: StreamSpec) -> zmq.Socket[Any]:
        sock = self._dealers.get(spec.rank)
        if sock is None:
            assert spec.replay is not None
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(spec.replay)
            self._dealers[spec.rank] = sock
        return sock

    def replay(self, spec: StreamSpec, start: int, stop: int) -> list[tuple[int, bytes, bytes]]:
        """Batches start..stop-1 from vLLM's replay buffer, in order; missing ones skipped."""
        got: dict[int, tuple[bytes, bytes]] = {}
        try:
            sock = self._dealer(spec)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                    # A late answer would confuse the next request: start a fresh socket.
                    self._dealers.pop(spec.rank).close(linger=0)
                    break
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:
                    topic, seq_frame, payload = frames
                elif len(frames) == 2:  # older vLLM: (seq, payload) without the topic
                    topic, (seq_frame, payload) = b"", frames
                else:
                    self.counters.bad_frames += 1
                    continue
                if len(seq_frame) != 8:
                    self.counters.bad_frames += 1
                    continue
                seq = int.from_bytes(seq_frame, "big", signed=True)
                if seq == -1:
                    break
                if start <= seq < stop:
                    got[seq] = (topic, payload)
        except zmq.ZMQError as exc:
            log_event(log, logging.WARNING, "kv_events_replay_failed", error=str(exc))
            broken = self._dealers.pop(spec.rank, None)
            if broken is not None:
                broken.close(linger=0)
        return [(s, *got[s]) for s in sorted(got)]


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    rank: int
    events: Mapping[tuple[str, str], int]
    batches: int
    gpu_resident: int
    cpu_resident: int
    recomputed_tokens: int
    stored_tokens: int
    tracked_blocks: int
    capacities: tuple[int, ...] | None
    configured_blocks: int | None
    sim_start: float | None
    # (bucket start, recomputed tokens, stored tokens, configured-size hits, hits per size...)
    buckets: tuple[tuple[float, ...], ...]
    policy_blocks: int | None = None
    policy_start: float | None = None
    # (bucket start, hits of each POLICY_COMBOS entry...)
    policy_buckets: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class SimConfig:
    capacities: tuple[int, ...]
    configured_blocks: int | None
    policy_blocks: int | None = None  # size of the policy comparison (None: not run)
    # The engine's own policy and threshold for the configured-size simulation, when its
    # command line says them (None: --whatif-policy / --whatif-store-threshold).
    policy: str | None = None
    store_threshold: int | None = None


class _EngineSim:
    def __init__(self, rank: int, settings: KvEventsSettings) -> None:
        self.rank = rank
        self.settings = settings
        self.builder = TraceBuilder(settings.blocks_per_chunk)
        self.config: SimConfig | None = None
        self.model: Model | None = None
        self.configured: VllmCpuTier | None = None
        self.sim_start: float | None = None  # simulated hits are complete from here on
        self.last_ts: float | None = None
        self.batches = 0
        maxlen = max(8, int(settings.history_seconds / settings.bucket_seconds))
        self.buckets: deque[list[float]] = deque(maxlen=maxlen)
        self.policy_sims: list[VllmCpuTier] = []
        self.policy_start: float | None = None
        self.policy_buckets: deque[list[float]] = deque(maxlen=maxlen)

    def _configure_policies(self, blocks: int | None) -> None:
        self.policy_sims = (
            [VllmCpuTier(blocks, policy=p, store_threshold=t) for p, t in POLICY_COMBOS]
            if blocks
            else []
        )
        self.policy_buckets.clear()
        self.policy_start = None if self.last_ts is None else self.last_ts + 1e-6

    def configure(self, cfg: SimConfig) -> None:
        s = self.settings
        old, self.config = self.config, cfg
        if old is not None and replace(old, policy_blocks=cfg.policy_blocks) == cfg:
            # Only the comparison size moved: the curve and its history stay.
            self._configure_policies(cfg.policy_blocks)
            return
        self._configure_policies(cfg.policy_blocks)
        self.model = make_model(
            s.model,
            cfg.capacities,
            policy=s.policy,
            store_threshold=s.store_threshold,
            sample_rate=s.sample_rate,
        )
        self.configured = (
            VllmCpuTier(
                cfg.configured_blocks,
                policy=cfg.policy or s.policy,
                store_threshold=(
                    cfg.store_threshold if cfg.store_threshold is not None else s.store_threshold
                ),
            )
            if cfg.configured_blocks is not None
            else None
        )
        # Every batch after the last one the new simulators did not see is simulated.
        self.sim_start = None if self.last_ts is None else self.last_ts + 1e-6

    def restart(self) -> None:
        self.builder.reset()
        cfg, self.config = self.config, None  # everything starts cold, the curve included
        if cfg is not None:
            self.configure(cfg)

    def _bucket(self, ts: float) -> list[float]:
        step = self.settings.bucket_seconds
        start = math.floor(ts / step) * step
        width = 4 + (len(self.config.capacities) if self.config else 0)
        if self.buckets and self.buckets[-1][0] == start and len(self.buckets[-1]) == width:
            return self.buckets[-1]
        if self.buckets and self.buckets[-1][0] > start:
            return self.buckets[-1]  # clock went back: fold into the newest bucket
        b = [start] + [0.0] * (width - 1)
        self.buckets.append(b)
        return b

    def process(self, msg: Message) -> None:
        st = self.builder.stats
        rec0, stored0 = st.recomputed_tokens, st.stored_tokens
        accesses = self.builder.process(msg.batch, msg.seq)
        self.batches += 1
        ts = msg.batch.ts
        hits: list[float] = []
        conf = 0.0
        if self.model is not None:
            if self.sim_start is None:
                self.sim_start = ts
            hits = self.model.process_batch(ts, accesses)
            if self.configured is not None:
                conf = self.configured.process_batch(ts, accesses)[0]
        self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)
        b = self._bucket(ts)
        b[1] += st.recomputed_tokens - rec0
        b[2] += st.stored_tokens - stored0
        b[3] += conf
        for i, h in enumerate(hits[: len(b) - 4]):
            b[4 + i] += h
        if self.policy_sims:
            if self.policy_start is None:
                self.policy_start = ts
            pb = self._policy_bucket(ts)
            for i, sim in enumerate(self.policy_sims):
                pb[1 + i] += sim.process_batch(ts, accesses)[0]

    def _policy_bucket(self, ts: float) -> list[float]:
        step = self.settings.bucket_seconds
        start = math.floor(ts / step) * step
        pbs = self.policy_buckets
        if pbs and pbs[-1][0] >= start:
            return pbs[-1]  # the same bucket, or the clock went back: fold into the newest
        b = [start] + [0.0] * len(POLICY_COMBOS)
        pbs.append(b)
        return b

    def snapshot(self) -> EngineSnapshot:
        st = self.builder.stats
        tracked = self.model.tracked_blocks if self.model is not None else 0
        if self.configured is not None:
            tracked += self.configured.tracked_blocks
        tracked += sum(p.tracked_blocks for p in self.policy_sims)
        return EngineSnapshot(
            rank=self.rank,
            events=dict(st.events),
            batches=self.batches,
            gpu_resident=self.builder.gpu_resident,
            cpu_resident=self.builder.cpu_resident,
            recomputed_tokens=st.recomputed_tokens,
            stored_tokens=st.stored_tokens,
            tracked_blocks=tracked,
            capacities=self.config.capacities if self.config else None,
            configured_blocks=self.config.configured_blocks if self.config else None,
            sim_start=self.sim_start,
            buckets=tuple(tuple(b) for b in self.buckets),
            policy_blocks=self.config.policy_blocks if self.config and self.policy_sims else None,
            policy_start=self.policy_start,
            policy_buckets=tuple(tuple(b) for b in self.policy_buckets),
        )


class Simulator(threading.Thread):
    def __init__(
        self,
        q: queue.Queue[QueueItem],
        settings: KvEventsSettings,
        stop: threading.Event,
        *,
        name: str = "kvoe-kv-simulator",
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.q = q
        self.settings = settings
        self.stop_event = stop
        self.engines: dict[int, _EngineSim] = {}
        self.bad_payloads = 0
        self.record_errors = 0
        self.snapshots: Mapping[int, EngineSnapshot] = {}
        self._lock = threading.Lock()
        self._pending: dict[int, SimConfig] = {}
        self._record: IO[str] | None = None
        self._record_failed = False
        self._last_flush = 0.0
        self.processed = 0

    def configure(self, rank: int, cfg: SimConfig) -> None:
        """Called from the event loop; applied by the simulator thread."""
        with self._lock:
            self._pending[rank] = cfg

    def _apply_config(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for rank, cfg in pending.items():
            self._engine(rank).configure(cfg)

    def _engine(self, rank: int) -> _EngineSim:
        e = self.engines.get(rank)
        if e is None:
            e = self.engines[rank] = _EngineSim(rank, self.settings)
        return e

    def _write(self, msg: Message) -> None:
        if not self.settings.record_path or self._record_failed:
            return
        try:
            if self._record is None:
                # Kept open across batches and closed when the thread ends.
                self._record = Path(self.settings.record_path).open("a", encoding="utf-8")  # noqa: SIM115
            self._record.write(encode_record(msg) + "\n")
            now = time.monotonic()
            if now - self._last_flush > RECORD_FLUSH_SECONDS:
                self._record.flush()
                self._last_flush = now
        except (OSError, TypeError, ValueError) as exc:
            self._record_failed = True
            self.record_errors += 1
            log_event(
                log,
                logging.ERROR,
                "record_events_failed",
                path=self.settings.record_path,
                error=str(exc),
            )

    def handle(self, item: QueueItem) -> None:
        rank, seq, topic, payload = item
        if seq == RESTART:
            self._engine(rank).restart()
            return
        try:
            batch, raw = decode_payload(payload, keep_raw=bool(self.settings.record_path))
        except DecodeError:
            self.bad_payloads += 1
            return
        msg = Message(topic.decode("utf-8", "replace"), seq, batch, raw)
        self._write(msg)
        self._engine(rank if batch.dp_rank is None else batch.dp_rank).process(msg)
        self.processed += 1

    def publish(self) -> None:
        self.snapshots = {r: e.snapshot() for r, e in self.engines.items()}

    def run(self) -> None:
        last_publish = 0.0
        try:
            while not self.stop_event.is_set():
                self._apply_config()
                try:
                    item = self.q.get(timeout=0.2)
                except queue.Empty:
                    item = None
                if item is not None:
                    self.handle(item)
                now = time.monotonic()
                if now - last_publish >= 1.0 or (item is None and self.engines):
                    self.publish()
                    last_publish = now
        finally:
            self.publish()
            if self._record is not None:
                with contextlib.suppress(OSError):
                    self._record.close()


@dataclass(frozen=True, slots=True)
class WhatIfView:
    """Simulated hits over the part of the window the simulator covered."""

    prompt_tokens: float
    seconds: float
    hits: tuple[float, ...]
    configured_hits: float | None
    recomputed_tokens: float


class KvEventsSource:
    """One vLLM target's KV-event stream(s) and its what-if simulation."""

    def __init__(
        self,
        target: VllmTarget,
        settings: KvEventsSettings,
        *,
        clock: Clock = time.time,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.target = target
        self.settings = settings
        self.label = target.config.label
        self.name = f"kv_events:{self.label}"
        self.health = Health(self.name, clock)
        self._clock = clock
        self._ctx = context
        self._own_ctx = context is None
        self.queue: queue.Queue[QueueItem] = queue.Queue(maxsize=max(1, settings.queue_size))
        self.counters = ReceiverCounters()
        self._stop = threading.Event()
        self.receiver: Receiver | None = None
        self.simulator: Simulator | None = None
        self.streams: list[StreamSpec] = streams_from(settings)
        self._seen_gaps = 0
        self._seen_bad = 0
        self._configs: dict[int, SimConfig] = {}
        self._recommended: dict[EngineKey, float | None] = {}
        self._discovery_error: CollectError | None = None
        self._discover_after = 0.0

    # --- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        self.health.started = True
        if self.streams:
            await self._launch(self.streams)

    async def _launch(self, streams: list[StreamSpec]) -> None:
        if self._ctx is None:
            self._ctx = zmq.Context()
        self._stop.clear()
        self.streams = streams
        self.simulator = Simulator(self.queue, self.settings, self._stop)
        self.simulator.start()
        self.receiver = Receiver(
            self._ctx,
            streams,
            self.queue,
            self.counters,
            self._stop,
            topic=self.settings.topic,
            replay_timeout=self.settings.replay_timeout,
            rcvhwm=max(1000, self.settings.queue_size),
        )
        self.receiver.start()
        await asyncio.to_thread(self.receiver.ready.wait, 5.0)
        log_event(
            log,
            logging.INFO,
            "kv_events_streams",
            target=self.label,
            streams=[(s.rank, s.address, "bind" if s.bind else "connect") for s in streams],
        )

    async def stop(self) -> None:
        self._stop.set()
        for t in (self.receiver, self.simulator):
            if t is not None and t.is_alive():
                await asyncio.to_thread(t.join, 5.0)
        alive = any(t is not None and t.is_alive() for t in (self.receiver, self.simulator))
        if self._own_ctx and self._ctx is not None and not alive:
            self._ctx.term()
            self._ctx = None

    async def _discover(self) -> list[StreamSpec]:
        url = self.target.config.base_url + "/kv_event_sources"
        timeout = aiohttp.ClientTimeout(total=self.settings.discovery_timeout)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
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
                body = await resp.content.read(1 << 20)
        except TimeoutError:
            raise CollectError(ErrorKind.TIMEOUT, f"GET {url}: no answer", absent=True) from None
        except aiohttp.ClientError as exc:
            raise CollectError(ErrorKind.CONNECT, f"GET {url}: {exc}", absent=True) from None
        try:
            doc = json.loads(body)
            host = urlsplit(self.target.config.url).hostname or "127.0.0.1"
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

    async def collect(self) -> None:
        if self.receiver is None:
            if self._discovery_error is not None and time.monotonic() < self._discover_after:
                raise self._discovery_error
            try:
                streams = await self._discover()
            except CollectError as err:
                self._discovery_error = err
                self._discover_after = time.monotonic() + DISCOVERY_RETRY_SECONDS
                raise
            self._discovery_error = None
            await self._launch(streams)
        if self.counters.error is not None:
            raise CollectError(ErrorKind.UNAVAILABLE, self.counters.error)
        if self.receiver is not None and not self.receiver.is_alive():
            raise CollectError(ErrorKind.UNAVAILABLE, "KV-event receiver stopped")
        # list() copies in one step: the receiver thread may add a stream meanwhile.
        gaps = sum(c.gaps for c in list(self.counters.streams.values()))
        for _ in range(gaps - self._seen_gaps):
            self.health.count(ErrorKind.SEQ_GAP)
        self._seen_gaps = gaps
        bad = self.counters.bad_frames + (self.simulator.bad_payloads if self.simulator else 0)
        for _ in range(bad - self._seen_bad):
            self.health.count(ErrorKind.PARSE)
        self._seen_bad = bad

    # --- families ---------------------------------------------------------------------

    def _engine_key(self, rank: int) -> EngineKey | None:
        latest = self.target.window.latest
        if latest is None:
            return None
        for ek in latest.engines:
            if ek.engine == str(rank):
                return ek
        return None

    def _snapshots(self) -> Mapping[int, EngineSnapshot]:
        return self.simulator.snapshots if self.simulator is not None else {}

    def families(self) -> Iterable[Family]:
        t = self.label
        dropped = Family("kvoffload_kv_events_dropped_total")
        depth = Family("kvoffload_kv_event_queue_depth")
        gaps = Family("kvoffload_kv_event_gaps_total")
        replayed = Family("kvoffload_kv_events_replayed_total")
        lost = Family("kvoffload_kv_events_lost_total")
        restarts = Family("kvoffload_kv_event_publisher_restarts_total")
        if self.receiver is not None:
            dropped.add([t], self.counters.dropped)
            depth.add([t], self.queue.qsize())
            for rank, c in sorted(list(self.counters.streams.items())):
                gaps.add([t, str(rank)], c.gaps)
                replayed.add([t, str(rank)], c.replayed)
                lost.add([t, str(rank)], c.lost)
                restarts.add([t, str(rank)], c.restarts)
        events = Family("kvoffload_kv_events_total")
        batches = Family("kvoffload_kv_event_batches_total")
        resident = Family("kvoffload_kv_resident_blocks")
        recomputed = Family("kvoffload_recomputed_after_eviction_tokens_total")
        tracked = Family("kvoffload_whatif_tracked_blocks")
        for rank, es in sorted(self._snapshots().items()):
            ek = self._engine_key(rank)
            if ek is None:
                continue  # model_name unknown until the first scrape: no guessed labels
            labels = [t, ek.model_name, ek.engine]
            for (kind, medium), n in sorted(es.events.items()):
                events.add([*labels, kind, medium], n)
            batches.add(labels, es.batches)
            resident.add([*labels, "GPU"], es.gpu_resident)
            resident.add([*labels, "CPU"], es.cpu_resident)
            recomputed.add(labels, es.recomputed_tokens)
            if es.capacities is not None:
                tracked.add(labels, es.tracked_blocks)
        return [
            dropped,
            depth,
            gaps,
            replayed,
            lost,
            restarts,
            events,
            batches,
            resident,
            recomputed,
            tracked,
        ]

    def _sim_config(self, d: EngineDerived) -> SimConfig | None:
        if not d.kv_bytes_per_token or not d.block_size:
            return None
        per_block = round(d.kv_bytes_per_token * d.block_size)
        if per_block <= 0:
            return None
        bpc = self.settings.blocks_per_chunk
        caps = tuple(blocks_for_bytes(b, per_block, bpc) for b in self.settings.sizes_bytes)
        configured = None
        if d.offload_enabled and d.offload_buffer_bytes:
            configured = blocks_for_bytes(int(d.offload_buffer_bytes), per_block, bpc)
        policy, threshold = _engine_policy(d)
        size = _policy_size(d, self._recommended.get(d.key))
        # Four more exact simulators at one size; --whatif-model stack is chosen to save
        # exactly that, so the comparison runs with the exact (vllm) model only.
        exact = self.settings.model == "vllm"
        policy_blocks = blocks_for_bytes(int(size), per_block, bpc) if size and exact else None
        return SimConfig(caps, configured, policy_blocks, policy, threshold)

    def note_recommended(self, label: str, key: EngineKey, size: float | None) -> None:
        """The advisor's recommended buffer (Exporter.advise): with offload off, the policy
        comparison runs at this size (reconfigured on the next cycle)."""
        if label == self.label:
            self._recommended[key] = size

    def observe(self, derived: Mapping[str, Sequence[EngineDerived]]) -> None:
        """(Re)size the simulators once the KV bytes per block are known or change."""
        if self.simulator is None:
            return
        for d in derived.get(self.label, ()):
            try:
                rank = int(d.key.engine)
            except ValueError:
                continue
            cfg = self._sim_config(d)
            if cfg is None or cfg == self._configs.get(rank):
                continue
            self._configs[rank] = cfg
            self.simulator.configure(rank, cfg)
            log_event(
                log,
                logging.INFO,
                "whatif_configured",
                target=self.label,
                engine=rank,
                capacities_blocks=list(cfg.capacities),
                configured_blocks=cfg.configured_blocks,
            )

    def window_view(self, d: EngineDerived) -> WhatIfView | None:
        try:
            rank = int(d.key.engine)
        except ValueError:
            return None
        es = self._snapshots().get(rank)
        if es is None or es.capacities is None or es.sim_start is None:
            return None
        span = self._prompt_span(d.key, es.sim_start)
        if span is None:
            return None
        prompt, t0, t1 = span
        k = len(es.capacities)
        hits = [0.0] * k
        conf = 0.0
        recomputed = 0.0
        for b in es.buckets:
            if t0 <= b[0] < t1 and len(b) == 4 + k:
                recomputed += b[1]
                conf += b[3]
                for i in range(k):
                    hits[i] += b[4 + i]
        return WhatIfView(
            prompt,
            t1 - t0,
            tuple(hits),
            conf if es.configured_blocks is not None else None,
            recomputed,
        )

    def _prompt_span(self, key: EngineKey, start: float) -> tuple[float, float, float] | None:
        """Prompt tokens and the time span of the window's intervals from `start` on."""
        prompt = 0.0
        t0 = math.inf
        t1 = -math.inf
        for iv in self.target.window.intervals():
            if iv.t0 < start:
                continue  # the simulator had not started: its hits would be missing
            deltas = iv.deltas.get(key)
            if not deltas or "prompt_tokens" not in deltas:
                continue
            prompt += deltas["prompt_tokens"]
            t0, t1 = min(t0, iv.t0), max(t1, iv.t1)
        if prompt <= 0 or t1 <= t0:
            return None
        return prompt, t0, t1

    def policy_points(self, d: EngineDerived) -> tuple[PolicyPoint, ...]:
        """Hit ratio of each POLICY_COMBOS entry at the comparison size, over the window."""
        try:
            rank = int(d.key.engine)
        except ValueError:
            return ()
        es = self._snapshots().get(rank)
        cfg = self._configs.get(rank)
        if es is None or cfg is None or es.policy_blocks is None or es.policy_start is None:
            return ()
        if es.policy_blocks != cfg.policy_blocks:
            return ()  # the new size is not simulated yet
        size = _policy_size(d, self._recommended.get(d.key))
        span = self._prompt_span(d.key, es.policy_start)
        if span is None or not size:
            return ()
        prompt, t0, t1 = span
        hits = [0.0] * len(POLICY_COMBOS)
        for b in es.policy_buckets:
            if t0 <= b[0] < t1 and len(b) == 1 + len(POLICY_COMBOS):
                for i in range(len(POLICY_COMBOS)):
                    hits[i] += b[1 + i]
        policy, threshold = _engine_policy(d)
        own = (policy, threshold or 0) if d.offload_enabled and policy is not None else None
        return tuple(
            PolicyPoint(p, t, float(size), min(1.0, h / prompt), (p, t) == own)
            for (p, t), h in zip(POLICY_COMBOS, hits, strict=True)
        )

    def policy_state(
        self, label: str, key: EngineKey, d: EngineDerived
    ) -> tuple[PolicyPoint, ...] | None:
        """The advisor's policy comparison (Exporter._hook); only for this target."""
        if label != self.label:
            return None
        return self.policy_points(d) or None

    def derived_families(self, derived: Mapping[str, Sequence[EngineDerived]]) -> Iterable[Family]:
        self.observe(derived)
        policy_ratio = Family("kvoffload_whatif_policy_hit_ratio")
        for d in derived.get(self.label, ()):
            for p in self.policy_points(d):
                policy_ratio.add(
                    [self.label, d.key.model_name, d.key.engine, p.policy, str(p.store_threshold)],
                    p.hit_ratio,
                )
        ratio = Family("kvoffload_whatif_offload_hit_ratio")
        saved = Family("kvoffload_whatif_ttft_saved_seconds_per_second")
        configured = Family("kvoffload_whatif_configured_hit_ratio")
        for d in derived.get(self.label, ()):
            view = self.window_view(d)
            if view is None:
                continue
            labels = [self.label, d.key.model_name, d.key.engine]
            for size, hits in zip(self.settings.sizes_bytes, view.hits, strict=True):
                ratio.add([*labels, str(size)], min(1.0, hits / view.prompt_tokens))
                ttft = ttft_saved_seconds_per_second(
                    hits / view.seconds, _recompute_rate(d), d.transfer_tokens_per_second
                )
                if ttft is not None:
                    saved.add([*labels, str(size)], ttft)
            if view.configured_hits is not None:
                configured.add(labels, min(1.0, view.configured_hits / view.prompt_tokens))
        return [ratio, saved, configured, policy_ratio]

    def whatif_state(self, label: str, key: EngineKey, d: EngineDerived) -> WhatIfState | None:
        """The advisor's view (Exporter._hook); answers only for this source's target."""
        if label != self.label:
            return None
        self.observe({label: [d]})
        view = self.window_view(d)
        if view is None:
            return None
        points = tuple(
            WhatIfPoint(
                float(size),
                min(1.0, hits / view.prompt_tokens),
                ttft_saved_seconds_per_second(
                    hits / view.seconds, _recompute_rate(d), d.transfer_tokens_per_second
                ),
            )
            for size, hits in zip(self.settings.sizes_bytes, view.hits, strict=True)
        )
        conf = (
            min(1.0, view.configured_hits / view.prompt_tokens)
            if view.configured_hits is not None
            else None
        )
        return WhatIfState(points, view.recomputed_tokens, conf)


def settings_for(cfg: Config, target: TargetConfig) -> KvEventsSettings:
    per = cfg.kv_events_targets.get(target.label, {})
    single = len(cfg.targets) == 1
    return KvEventsSettings(
        endpoints=tuple(
            per.get("kv_events_endpoint") or (cfg.kv_events_endpoint if single else ())
        ),
        bind=tuple(per.get("kv_events_bind") or (cfg.kv_events_bind if single else ())),
        replay_endpoints=tuple(
            per.get("kv_events_replay_endpoint")
            or (cfg.kv_events_replay_endpoint if single else ())
        ),
        queue_size=cfg.kv_events_queue,
        record_path=_record_path(cfg.record_events, target.label, single),
        sizes_bytes=tuple(int(b) for b in cfg.whatif_sizes),
        policy=cfg.whatif_policy,
        store_threshold=cfg.whatif_store_threshold,
        sample_rate=cfg.whatif_sample_rate,
        model=cfg.whatif_model,
        history_seconds=cfg.window + 120.0,
    )


def _record_path(path: str, label: str, single: bool) -> str:
    if not path or single:
        return path
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{safe}{p.suffix}"))


def kv_event_sources(
    cfg: Config, sources: Sequence[object], clock: Clock = time.time
) -> list[KvEventsSource]:
    """One KV-event source per vLLM target (endpoints configured or discovered)."""
    if not cfg.kv_events:
        return []
    return [
        KvEventsSource(s, settings_for(cfg, s.config), clock=clock)
        for s in sources
        if isinstance(s, VllmTarget)
    ]
