"""Per-engine what-if simulation state, stepped by the Pipeline (pure: no threads, no clock).

`WhatIf` owns one `EngineSim` per DP rank. Each engine rebuilds requests from the GPU
events (`TraceBuilder`), replays them through the curve model (one size per
`--whatif-sizes` entry), the configured-size simulator (offload on) and the policy
comparison (`POLICY_COMBOS` at one size), and keeps the results in time buckets so that
the view (`view.py`) can join them with the scrape window.

The order of one cycle (the timing of configuration is part of the behaviour; it is the
one the former simulator thread had, made explicit):

1. `step(items)`: first the configurations given to `configure()` since the last step are
   applied (the last one per rank wins), then the cycle's items (messages and publisher
   restarts, in arrival order) are processed. Snapshots describe the state after this.
2. The advisor reads the views of these snapshots. Before it does, the Pipeline plans each
   engine with the previous cycle's recommended buffer (`plan.sim_config`) and calls
   `configure()`; the policy points it reads use that planned config.
3. After the advice, the Pipeline plans again with this cycle's recommendation and calls
   `configure()` before rendering; the rendered policy points use that plan.
4. Whatever was configured last in steps 2-3 is applied at the start of the next `step()`,
   before that cycle's events.

`configure()` ignores a config equal to the last one given for that rank. Applying a
config that differs only in `policy_blocks` restarts the policy comparison and keeps the
curve and its history; any other change restarts every simulator of the engine (the
request rebuild and its counters are kept).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

from exporter.kvevents_codec import Message
from exporter.model.whatif.simulator import (
    DEFAULT_SIZES_BYTES,
    Model,
    TraceBuilder,
    VllmCpuTier,
    make_model,
)

# Candidate TTFT floors, in tokens computed by one prefill (view.floor_fit): below its floor a
# prefill costs its request the same however few tokens it computes (kernel launches and
# weight reads, not FLOPs, bound a short prefill), so a load that leaves a shorter suffix
# saves only down to the floor. 0 first: no floor.
FLOORS: tuple[int, ...] = (0, 128, 256, 512, 1024, 2048, 4096)

# Eviction policies and store thresholds replayed side by side at one size (the configured
# buffer, or the recommended one with offload off): the advisor says which serves more.
POLICY_COMBOS: tuple[tuple[str, int], ...] = (("lru", 0), ("arc", 0), ("lru", 2), ("arc", 2))


@dataclass(frozen=True, slots=True)
class WhatIfSettings:
    """The simulation part of the what-if flags (--whatif-*)."""

    sizes_bytes: tuple[int, ...] = DEFAULT_SIZES_BYTES
    policy: str = "lru"
    store_threshold: int = 0
    sample_rate: float = 1.0
    model: str = "vllm"
    blocks_per_chunk: int = 1
    bucket_seconds: float = 0.5
    history_seconds: float = 900.0
    # Prefills kept for the TTFT floor fit (view.floor_fit), newest last: 4096 of them are
    # 7 minutes of 10 new requests a second, ~420 B each (1.7 MB per engine at most); the fit
    # uses the window's intervals they cover.
    prefill_history: int = 4096


@dataclass(frozen=True, slots=True)
class SimConfig:
    capacities: tuple[int, ...]
    configured_blocks: int | None
    policy_blocks: int | None = None  # size of the policy comparison (None: not run)
    # The engine's own policy and threshold for the configured-size simulation, when its
    # command line says them (None: --whatif-policy / --whatif-store-threshold).
    policy: str | None = None
    store_threshold: int | None = None


@dataclass(frozen=True, slots=True)
class Bucket:
    """Tokens of the batches stamped in [start, start + bucket_seconds)."""

    start: float
    recomputed_tokens: float
    stored_tokens: float
    configured_hits: float  # at the configured buffer (0 without one)
    hits: tuple[float, ...]  # one per SimConfig.capacities entry at the time
    recomputing_requests: float = 0.0  # requests that recomputed an evicted block
    # Batches processed, and batches missing before them in the stream's sequence numbers
    # (lost at the publisher or the exporter's queue, never recovered): steps whose blocks
    # the simulation never saw.
    batches: float = 0.0
    lost_batches: float = 0.0


@dataclass(frozen=True, slots=True)
class PolicyBucket:
    start: float
    hits: tuple[float, ...]  # one per POLICY_COMBOS entry


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
    buckets: tuple[Bucket, ...]
    policy_blocks: int | None = None
    policy_start: float | None = None
    policy_buckets: tuple[PolicyBucket, ...] = ()
    # The CPU tier's own events (offload on): chunks stored, dropped, dropped unloaded.
    cpu_stored: int = 0
    cpu_removed: int = 0
    wasted_stores: int = 0
    wasted_store_tokens: int = 0
    # Blocks back after a GPU eviction, counted per bucket of REUSE_GAP_*_EDGES.
    reuse_gap_blocks: tuple[int, ...] = ()
    reuse_gap_seconds: tuple[int, ...] = ()
    block_size: int = 0  # tokens per GPU block, once an event said it
    # Per prefill, oldest first: (ts, tokens computed, of them recomputed after an eviction,
    # running sums of max(tokens computed, F) for F in FLOORS, this prefill included).
    prefills: tuple[tuple[float, int, int, tuple[float, ...]], ...] = ()


class StreamItemLike(Protocol):
    """One item of a KV-event stream, in arrival order (the source's StreamItem)."""

    @property
    def rank(self) -> int: ...  # the stream's DP rank

    @property
    def message(self) -> Message | None: ...  # None: the publisher restarted


class _Open:
    """The newest bucket, still being added to."""

    __slots__ = (
        "batches",
        "configured",
        "hits",
        "lost",
        "recomputed",
        "recomputing",
        "start",
        "stored",
    )

    def __init__(self, start: float, width: int) -> None:
        self.start = start
        self.recomputed = 0.0
        self.recomputing = 0.0
        self.stored = 0.0
        self.configured = 0.0
        self.hits = [0.0] * width
        self.batches = 0.0
        self.lost = 0.0

    def bucket(self) -> Bucket:
        return Bucket(
            self.start,
            self.recomputed,
            self.stored,
            self.configured,
            tuple(self.hits),
            self.recomputing,
            self.batches,
            self.lost,
        )

    def policy_bucket(self) -> PolicyBucket:
        return PolicyBucket(self.start, tuple(self.hits))


T = TypeVar("T")


class _History(Generic[T]):
    """The last `maxlen` buckets: the closed ones frozen, only the newest one open."""

    def __init__(self, maxlen: int, freeze: Callable[[_Open], T]) -> None:
        self.closed: deque[T] = deque(maxlen=maxlen - 1)
        self.open: _Open | None = None
        self.freeze = freeze

    def push(self, b: _Open) -> _Open:
        if self.open is not None:
            self.closed.append(self.freeze(self.open))
        self.open = b
        return b

    def clear(self) -> None:
        self.closed.clear()
        self.open = None

    def snapshot(self) -> tuple[T, ...]:
        if self.open is None:
            return tuple(self.closed)
        return (*self.closed, self.freeze(self.open))


class EngineSim:
    def __init__(self, rank: int, settings: WhatIfSettings) -> None:
        self.rank = rank
        self.settings = settings
        self.builder = TraceBuilder(settings.blocks_per_chunk)
        self.config: SimConfig | None = None
        self.model: Model | None = None
        self.configured: VllmCpuTier | None = None
        self.sim_start: float | None = None  # simulated hits are complete from here on
        self.last_ts: float | None = None
        self.last_seq: int | None = None  # the stream's newest sequence number
        self.batches = 0
        maxlen = max(8, int(settings.history_seconds / settings.bucket_seconds))
        self.buckets: _History[Bucket] = _History(maxlen, _Open.bucket)
        self.policy_sims: list[VllmCpuTier] = []
        self.policy_start: float | None = None
        self.policy_buckets: _History[PolicyBucket] = _History(maxlen, _Open.policy_bucket)
        self.prefills: deque[tuple[float, int, int, tuple[float, ...]]] = deque(
            maxlen=settings.prefill_history
        )
        self._floor_sums: tuple[float, ...] = (0.0,) * len(FLOORS)

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
        self.last_seq = None  # a new publisher counts from 0
        cfg, self.config = self.config, None  # everything starts cold, the curve included
        if cfg is not None:
            self.configure(cfg)

    def _bucket(self, ts: float) -> _Open:
        step = self.settings.bucket_seconds
        start = math.floor(ts / step) * step
        width = len(self.config.capacities) if self.config else 0
        newest = self.buckets.open
        if newest is not None and newest.start == start and len(newest.hits) == width:
            return newest
        if newest is not None and newest.start > start:
            return newest  # clock went back: fold into the newest bucket
        return self.buckets.push(_Open(start, width))

    def process(self, msg: Message) -> None:
        st = self.builder.stats
        rec0, stored0, reqs0 = st.recomputed_tokens, st.stored_tokens, st.recomputing_requests
        accesses = self.builder.process(msg.batch, msg.seq)
        self.batches += 1
        # Sequence numbers the stream skipped are batches that never arrived (the source
        # recovers what vLLM's replay endpoint still holds before passing a batch on, and
        # announces a new publisher, so a jump here is a loss). Records without a number
        # carry -1.
        last, self.last_seq = self.last_seq, msg.seq
        lost = msg.seq - last - 1 if last is not None and last >= 0 else 0
        ts = msg.batch.ts
        for n, r in self.builder.prefills:
            # Running sums: an interval's sum is a difference of two, not a pass per floor.
            self._floor_sums = tuple(
                c + max(n, f) for c, f in zip(self._floor_sums, FLOORS, strict=True)
            )
            self.prefills.append((ts, n, r, self._floor_sums))
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
        b.recomputed += st.recomputed_tokens - rec0
        b.recomputing += st.recomputing_requests - reqs0
        b.stored += st.stored_tokens - stored0
        b.configured += conf
        b.batches += 1
        b.lost += max(lost, 0)
        for i, h in enumerate(hits[: len(b.hits)]):
            b.hits[i] += h
        if self.policy_sims:
            if self.policy_start is None:
                self.policy_start = ts
            pb = self._policy_bucket(ts)
            for i, sim in enumerate(self.policy_sims):
                pb.hits[i] += sim.process_batch(ts, accesses)[0]

    def _policy_bucket(self, ts: float) -> _Open:
        step = self.settings.bucket_seconds
        start = math.floor(ts / step) * step
        newest = self.policy_buckets.open
        if newest is not None and newest.start >= start:
            return newest  # the same bucket, or the clock went back: fold into the newest
        return self.policy_buckets.push(_Open(start, len(POLICY_COMBOS)))

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
            buckets=self.buckets.snapshot(),
            policy_blocks=self.config.policy_blocks if self.config and self.policy_sims else None,
            policy_start=self.policy_start,
            policy_buckets=self.policy_buckets.snapshot(),
            cpu_stored=st.cpu_stored,
            cpu_removed=st.cpu_removed,
            wasted_stores=st.wasted,
            wasted_store_tokens=st.wasted_tokens,
            reuse_gap_blocks=tuple(st.reuse_gap_blocks.counts),
            reuse_gap_seconds=tuple(st.reuse_gap_seconds.counts),
            block_size=self.builder.block_size,
            prefills=tuple(self.prefills),
        )


class WhatIf:
    """The what-if simulation of one target's engines; see the module doc for the order."""

    def __init__(self, settings: WhatIfSettings) -> None:
        self.settings = settings
        self.engines: dict[int, EngineSim] = {}
        self.processed = 0  # messages processed since the start
        self._planned: dict[int, SimConfig] = {}
        self._pending: dict[int, SimConfig] = {}
        self._snapshots: Mapping[int, EngineSnapshot] | None = {}

    def configure(self, rank: int, cfg: SimConfig) -> bool:
        """Plan `cfg` for engine `rank`, applied at the start of the next `step()`.
        False (and nothing planned) when it equals the last config given for that rank."""
        if cfg == self._planned.get(rank):
            return False
        self._planned[rank] = cfg
        self._pending[rank] = cfg
        return True

    def planned(self, rank: int) -> SimConfig | None:
        """The last config given to `configure()` for `rank` (applied or not yet)."""
        return self._planned.get(rank)

    def _engine(self, rank: int) -> EngineSim:
        e = self.engines.get(rank)
        if e is None:
            e = self.engines[rank] = EngineSim(rank, self.settings)
        return e

    def step(self, items: Iterable[StreamItemLike]) -> None:
        """Apply the planned configs, then process the items in order."""
        pending, self._pending = self._pending, {}
        for rank, cfg in pending.items():
            self._engine(rank).configure(cfg)
        for item in items:
            msg = item.message
            if msg is None:
                self._engine(item.rank).restart()
                continue
            rank = item.rank if msg.batch.dp_rank is None else msg.batch.dp_rank
            self._engine(rank).process(msg)
            self.processed += 1
        self._snapshots = None

    def snapshots(self) -> Mapping[int, EngineSnapshot]:
        """Every engine's state after the last `step()`."""
        if self._snapshots is None:
            self._snapshots = {r: e.snapshot() for r, e in self.engines.items()}
        return self._snapshots
