"""What-if simulator: how many prompt tokens a CPU KV tier of each size would have served.

Pure module: KV-event batches in, hit tokens out; no sockets, no clock, no files.

Three layers:

1. `TraceBuilder` turns one engine's GPU event stream into request accesses. vLLM
   publishes no request ids, so requests are rebuilt from the block chain: a
   BlockStored event whose parent is not the tail of a running request starts a
   request whose GPU prefix-cache hit is the resident chain up to that parent; the
   stored blocks are what the GPU missed and computed. A one-block extension of a
   running request's tail is a decode-filled block (never offloaded with vLLM's
   default offload_prompt_only); a multi-block extension in the next engine step is a
   chunked-prefill continuation.
2. `VllmCpuTier` replays those accesses through a model of vLLM 0.26's
   OffloadingConnector scheduler and CPUOffloadingManager, one simulator per size:
   the lookup runs only over the blocks after the GPU hit and stops at the first
   miss; every lookup touches all of the request's blocks in reverse order (first
   block most recent); loaded blocks are pinned, then re-queued in Python set order;
   prompt blocks are offered for store as they are computed (all of them, GPU hits
   included, unless the lookup hit), stores evict from the LRU end skipping the
   offered blocks, become evictable only when the copy completes (in set order,
   one engine step later under load) and are touched again after the store; a store
   that cannot allocate is offered again in the request's finishing step (an idle
   step before the next batch's lookups when the engine was not busy);
   store_threshold counts lookups. ARC follows the same scheduler with vLLM's ARC
   policy. Set order depends on PYTHONHASHSEED, so it is modelled as a seeded
   random permutation.
3. `StackModel` computes the whole LRU curve in one pass (Mattson et al.'s stack
   algorithm with one boundary marker per candidate size) for the simplified
   request-aware LRU (lookup-contiguous hits, reverse-order touch of every request
   block), optionally on a SHARDS spatial sample of the block hashes (Waldspurger
   et al., FAST'15) to bound memory. `StackReference` is the same model one
   OrderedDict per size, the exact simulation it is checked against.

Hit tokens are counted the way vLLM counts external_prefix_cache_hits: whole chunks
of the lookup run, in tokens.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from exporter.kvevents_codec import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Message,
)

GIB = 1 << 30
DEFAULT_SIZES_BYTES: tuple[int, ...] = tuple(int(g * GIB) for g in (0.25, 0.5, 1, 2, 4, 8, 16))
# Stores of one step complete (become evictable) before the next event batch unless that
# batch is the very next engine step; gaps longer than this mean idle steps ran between.
DEFAULT_COMPLETION_LAG = 0.03
_SAMPLE_BITS = 24
_SAMPLE_MASK = (1 << _SAMPLE_BITS) - 1


@dataclass(frozen=True, slots=True)
class Access:
    """One request's share of one engine step, as rebuilt from a BlockStored event."""

    req: int
    keys: tuple[int, ...]  # offload chunk keys of the request known so far, prefix order
    start: int  # first chunk after the GPU hit (first event) or first new chunk
    first: bool  # the request's lookup happens here
    tokens_per_chunk: int
    computed_tokens: int  # tokens before `start` that the GPU already holds or computed


@dataclass(slots=True)
class GapHistogram:
    """Counts of eviction-to-reuse gaps in fixed buckets (upper edges, the last one open)."""

    edges: tuple[float, ...]
    counts: list[int]

    @classmethod
    def of(cls, edges: tuple[float, ...]) -> GapHistogram:
        return cls(edges, [0] * (len(edges) + 1))

    def add(self, value: float) -> None:
        self.counts[bisect_left(self.edges, value)] += 1

    @property
    def total(self) -> int:
        return sum(self.counts)

    def quantile(self, q: float) -> float | None:
        return bucket_quantile(self.edges, self.counts, q)


def bucket_quantile(edges: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """The upper edge of the bucket holding the q-quantile (inf past the last edge); None
    without observations. An upper bound: a tier that large would have caught that share."""
    total = sum(counts)
    if total == 0:
        return None
    need = q * total
    seen = 0
    for i, n in enumerate(counts):
        seen += n
        if n and seen >= need:
            return edges[i] if i < len(edges) else math.inf
    return math.inf


# Gaps of blocks that come back after a GPU eviction: in GPU block stores since the block
# was computed (what a CPU tier offloading every computed block must hold to still have it),
# and in seconds since the eviction. Powers of two; 0.1 s to about 3 hours.
REUSE_GAP_BLOCK_EDGES: tuple[float, ...] = tuple(float(1 << i) for i in range(31))
REUSE_GAP_SECOND_EDGES: tuple[float, ...] = tuple(0.1 * (1 << i) for i in range(17))


@dataclass(slots=True)
class TraceStats:
    """Per-engine accounting of the GPU and CPU event streams."""

    stored_blocks: int = 0
    stored_tokens: int = 0
    decode_blocks: int = 0
    loaded_blocks: int = 0
    recomputed_blocks: int = 0
    recomputed_tokens: int = 0
    # Requests that recomputed at least one evicted block: each would have waited for one
    # load from a CPU tier, the what-if's count of loads.
    recomputing_requests: int = 0
    requests: int = 0
    continuations: int = 0
    unknown_parent: int = 0
    overflow: int = 0
    events: dict[tuple[str, str], int] = field(default_factory=dict)
    # The CPU tier (medium="CPU" events, offload on): chunks stored, chunks dropped, and of
    # those dropped the ones no request loaded while they were held (stores for nothing).
    cpu_stored: int = 0
    cpu_removed: int = 0
    wasted: int = 0
    wasted_tokens: int = 0
    reuse_gap_blocks: GapHistogram = field(
        default_factory=lambda: GapHistogram.of(REUSE_GAP_BLOCK_EDGES)
    )
    reuse_gap_seconds: GapHistogram = field(
        default_factory=lambda: GapHistogram.of(REUSE_GAP_SECOND_EDGES)
    )


class TraceBuilder:
    """Rebuilds request accesses from one engine's event stream (one DP rank)."""

    def __init__(
        self,
        blocks_per_chunk: int = 1,
        *,
        max_resident: int = 1 << 21,
        max_evicted: int = 1 << 17,
        max_open: int = 1 << 13,
        max_chain: int = 1 << 18,
    ) -> None:
        if blocks_per_chunk < 1:
            raise ValueError("blocks_per_chunk must be at least 1")
        self.bpc = blocks_per_chunk
        self.max_resident = max_resident
        self.max_evicted = max_evicted
        self.max_open = max_open
        self.max_chain = max_chain
        # GPU-resident block -> parent; a prefix hit needs its whole chain resident, so
        # the GPU hit of a new request is the chain that ends at its first block's parent.
        self.parent: dict[int, int | None] = {}
        self.gpu_refs: dict[int, int] = {}  # copies of a hash beyond the first
        self.cpu: dict[int, int] = {}
        self.cpu_loaded: set[int] = set()  # CPU-held keys a request loaded since stored
        # GPU block -> the count of GPU block stores when it was computed (its age in stores)
        self.born: dict[int, int] = {}
        # evicted block -> (eviction time, its birth in stores), oldest first
        self.evicted: OrderedDict[int, tuple[float, int]] = OrderedDict()
        self.tails: OrderedDict[int, tuple[int, int]] = OrderedDict()  # tail -> (req, seq)
        self.stats = TraceStats()
        self._next_req = 0
        self._last_recomputing = -1
        # The last process() call's prefills: (tokens computed, of them recomputed after an
        # eviction) per GPU store that was not a decode block, for the TTFT floor fit.
        self.prefills: list[tuple[int, int]] = []
        self._block_size = 0

    @property
    def gpu_resident(self) -> int:
        return len(self.parent)

    @property
    def cpu_resident(self) -> int:
        return len(self.cpu)

    @property
    def block_size(self) -> int:
        """Tokens per GPU block, from the last GPU store that said it (0 before one)."""
        return self._block_size

    def reset(self) -> None:
        """A publisher restart: the engine's caches are empty again."""
        self.parent.clear()
        self.gpu_refs.clear()
        self.cpu.clear()
        self.cpu_loaded.clear()
        self.born.clear()
        self.tails.clear()

    def _count(self, kind: str, medium: str) -> None:
        key = (kind, medium)
        self.stats.events[key] = self.stats.events.get(key, 0) + 1

    def _chain(self, parent: int | None) -> list[int]:
        chain: list[int] = []
        h = parent
        limit = self.max_chain
        while h is not None and h in self.parent and len(chain) < limit:
            chain.append(h)
            h = self.parent[h]
        if h is not None:
            self.stats.unknown_parent += 1
        chain.reverse()
        return chain

    def _add_gpu(self, hashes: Sequence[int], parent: int | None) -> None:
        prev = parent
        for h in hashes:
            if h in self.parent:
                self.gpu_refs[h] = self.gpu_refs.get(h, 0) + 1
            elif len(self.parent) < self.max_resident:
                self.parent[h] = prev
                self.born[h] = self.stats.stored_blocks
            else:
                self.stats.overflow += 1
            prev = h

    def _remove_gpu(self, h: int, ts: float) -> None:
        extra = self.gpu_refs.get(h)
        if extra:
            if extra == 1:
                del self.gpu_refs[h]
            else:
                self.gpu_refs[h] = extra - 1
            return
        if self.parent.pop(h, _MISSING) is _MISSING:
            return
        self.evicted[h] = (ts, self.born.pop(h, self.stats.stored_blocks))
        self.evicted.move_to_end(h)
        if len(self.evicted) > self.max_evicted:
            self.evicted.popitem(last=False)

    def _keys(self, blocks: list[int]) -> tuple[int, ...]:
        if self.bpc == 1:
            return tuple(blocks)
        return tuple(blocks[self.bpc - 1 :: self.bpc])

    def process(self, batch: EventBatch, seq: int) -> list[Access]:
        out: list[Access] = []
        self.prefills.clear()
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._count("BlockStored", ev.medium)
                if ev.medium == MEDIUM_GPU:
                    access = self._stored_gpu(ev, seq, batch.ts)
                    if access is not None:
                        out.append(access)
                elif ev.medium == MEDIUM_CPU:
                    for h in ev.hashes:
                        self.cpu[h] = self.cpu.get(h, 0) + 1
                        self.stats.cpu_stored += 1
            elif isinstance(ev, BlockRemoved):
                self._count("BlockRemoved", ev.medium)
                if ev.medium == MEDIUM_GPU:
                    for h in ev.hashes:
                        self._remove_gpu(h, batch.ts)
                        self.tails.pop(h, None)
                elif ev.medium == MEDIUM_CPU:
                    for h in ev.hashes:
                        self._remove_cpu(h)
            elif isinstance(ev, AllBlocksCleared):
                self._count("AllBlocksCleared", ev.medium or "none")
                # A prefix-cache reset is not a capacity eviction: nothing joins `evicted`.
                self.parent.clear()
                self.born.clear()
                self.gpu_refs.clear()
                self.tails.clear()
        return out

    def _remove_cpu(self, h: int) -> None:
        n = self.cpu.get(h, 0)
        if n > 1:
            self.cpu[h] = n - 1
            return
        if self.cpu.pop(h, None) is None:
            return  # stored before the stream started: its history is unknown
        st = self.stats
        st.cpu_removed += 1
        if h in self.cpu_loaded:
            self.cpu_loaded.discard(h)
        else:
            st.wasted += 1
            st.wasted_tokens += self._block_size * self.bpc

    def _stored_gpu(self, ev: BlockStored, seq: int, ts: float) -> Access | None:
        hashes = ev.hashes
        n = len(hashes)
        if n == 0:
            return None
        bs = ev.block_size or self._block_size
        self._block_size = bs
        st = self.stats
        st.stored_blocks += n
        st.stored_tokens += n * bs
        evicted, cpu = self.evicted, self.cpu
        recomputed = 0
        for h in hashes:
            if h in evicted and h not in self.parent:
                if h in cpu:
                    # With offload on, a block the CPU tier holds came back by transfer.
                    st.loaded_blocks += 1
                    self.cpu_loaded.add(h)
                else:
                    recomputed += 1
                    st.recomputed_blocks += 1
                    st.recomputed_tokens += bs
                evicted_at, born = evicted.pop(h)
                st.reuse_gap_blocks.add(st.stored_blocks - born)
                st.reuse_gap_seconds.add(max(0.0, ts - evicted_at))
        cont = self.tails.pop(ev.parent, None) if ev.parent is not None else None
        if cont is not None and n == 1 and seq != cont[1]:
            # A running request grew by one full block: decode output, not offloaded.
            st.decode_blocks += 1
            self._add_gpu(hashes, ev.parent)
            self._open(hashes[-1], cont[0], seq)
            return None
        prefix = self._chain(ev.parent)
        self._add_gpu(hashes, ev.parent)
        if cont is not None and seq <= cont[1] + 1:
            req, first = cont[0], False
            st.continuations += 1
        else:
            req, first = self._next_req, True
            self._next_req += 1
            st.requests += 1
        if recomputed and req != self._last_recomputing:
            st.recomputing_requests += 1  # once per request, however its prefill is chunked
            self._last_recomputing = req
        self.prefills.append((n * bs, recomputed * bs))
        self._open(hashes[-1], req, seq)
        blocks = prefix + list(hashes)
        computed = len(prefix)
        return Access(
            req=req,
            keys=self._keys(blocks),
            start=computed // self.bpc,
            first=first,
            tokens_per_chunk=bs * self.bpc,
            computed_tokens=computed * bs,
        )

    def _open(self, tail: int, req: int, seq: int) -> None:
        self.tails[tail] = (req, seq)
        if len(self.tails) > self.max_open:
            self.tails.popitem(last=False)


_MISSING = object()


class Model(Protocol):
    """A simulator of one or more CPU tier sizes fed with request accesses."""

    @property
    def tracked_blocks(self) -> int: ...

    def process_batch(self, ts: float, accesses: Sequence[Access]) -> list[float]:
        """Hit tokens per size for this batch."""
        ...

    def finish(self) -> None: ...


class _Req:
    __slots__ = ("next_stored", "open")

    def __init__(self) -> None:
        self.next_stored = 0
        self.open = False


class VllmCpuTier:
    """vLLM 0.26's CPU offloading manager and scheduler, replayed for one capacity.

    `capacity` is in offload chunks (GPU blocks with the default blocks_per_chunk=1).
    """

    def __init__(
        self,
        capacity: int,
        *,
        policy: str = "lru",
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        seed: int | None = 0,
        completion_lag: float = DEFAULT_COMPLETION_LAG,
        max_requests: int = 1 << 14,
    ) -> None:
        if policy not in ("lru", "arc"):
            raise ValueError(f"unknown policy {policy!r} (lru, arc)")
        self.capacity = max(0, int(capacity))
        self.policy = policy
        self.status: dict[int, int] = {}  # key -> ref count: -1 store in flight, 0 idle
        self.n_evictable = 0
        self.lru: OrderedDict[int, None] = OrderedDict()  # idle keys, least recent first
        # ARC state (vLLM's ARCCachePolicy semantics)
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.target_t1 = 0.0
        self.threshold = store_threshold
        self.max_tracker = max_tracker_size
        self.counts: OrderedDict[int, int] | None = OrderedDict() if store_threshold >= 2 else None
        # vLLM completes stores and loads by iterating a Python set of bytes keys, in an
        # order fixed by PYTHONHASHSEED: modelled by iterating a set of salted int keys.
        self.salt = random.Random(seed).getrandbits(64) if seed is not None else None
        self.lag = completion_lag
        self.max_requests = max_requests
        self.reqs: OrderedDict[int, _Req] = OrderedDict()
        self._old_jobs: list[list[int]] = []  # stores from the previous batch
        self._new_jobs: list[list[int]] = []
        self._retry: list[Access] = []  # stores that failed in the previous step
        self._last_ts = -math.inf
        self.stores = 0
        self.evictions = 0
        self.allocation_failures = 0
        self.stores_skipped = 0
        self.loads = 0

    @property
    def tracked_blocks(self) -> int:
        return len(self.status) + len(self.b1) + len(self.b2)

    # --- policy -----------------------------------------------------------------------

    def _touch(self, keys: Sequence[int]) -> None:
        if self.policy == "lru":
            lru = self.lru
            for k in reversed(keys):
                if k in lru:
                    lru.move_to_end(k)
            return
        t1, t2, b1, b2, status = self.t1, self.t2, self.b1, self.b2, self.status
        for k in reversed(keys):
            if k in t1:
                if status[k] < 0:
                    # Prepared for store but not written: not a second use.
                    t1.move_to_end(k)
                else:
                    del t1[k]
                    t2[k] = None
            elif k in t2:
                t2.move_to_end(k)
            elif k in b1:
                delta = max(1.0, len(b2) / len(b1))
                self.target_t1 = min(self.target_t1 + delta, float(self.capacity))
                b1.move_to_end(k)
            elif k in b2:
                delta = max(1.0, len(b1) / len(b2))
                self.target_t1 = max(self.target_t1 - delta, 0.0)
                b2.move_to_end(k)

    def _evict(self, n: int, protected: set[int]) -> list[int] | None:
        if self.policy == "lru":
            picked: list[int] = []
            for k in self.lru:
                if k in protected:
                    continue
                picked.append(k)
                if len(picked) == n:
                    break
            if len(picked) < n:
                return None
            for k in picked:
                del self.lru[k]
            return picked
        return self._evict_arc(n, protected)

    def _evict_arc(self, n: int, protected: set[int]) -> list[int] | None:
        status = self.status
        it1 = iter(self.t1)
        it2 = iter(self.t2)
        virtual_t1 = len(self.t1)
        chosen: list[tuple[int, bool]] = []

        def next_idle(it: Iterable[int]) -> int | None:
            for k in it:
                if status.get(k) == 0 and k not in protected:
                    return k
            return None

        t1_done = False
        for _ in range(n):
            pick: int | None = None
            from_t1 = False
            if not t1_done and virtual_t1 >= int(self.target_t1):
                pick = next_idle(it1)
                if pick is None:
                    t1_done = True
                else:
                    from_t1 = True
                    virtual_t1 -= 1
            if pick is None:
                pick = next_idle(it2)
                if pick is None:
                    return None
            chosen.append((pick, from_t1))
        for k, from_t1 in chosen:
            if from_t1:
                del self.t1[k]
                self.b1[k] = None
            else:
                del self.t2[k]
                self.b2[k] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return [k for k, _ in chosen]

    def _insert(self, k: int) -> None:
        self.status[k] = -1
        if self.policy == "arc":
            self.t1[k] = None
            self.b1.pop(k, None)
            self.b2.pop(k, None)

    def _mark_evictable(self, k: int) -> None:
        self.n_evictable += 1
        if self.policy == "lru":
            self.lru[k] = None

    def _mark_pinned(self, k: int) -> None:
        self.n_evictable -= 1
        if self.policy == "lru":
            del self.lru[k]

    def _set_order(self, keys: list[int]) -> list[int]:
        salt = self.salt
        if salt is None:
            return keys
        return [k ^ salt for k in {k ^ salt for k in keys}]

    # --- manager ----------------------------------------------------------------------

    def _count_lookup(self, k: int) -> None:
        counts = self.counts
        if counts is None:
            return
        if k in counts:
            counts.move_to_end(k)
            counts[k] += 1
        else:
            if len(counts) >= self.max_tracker:
                counts.popitem(last=False)
            counts[k] = 1

    def _prefix_hits(self, keys: Sequence[int], start: int) -> int:
        status = self.status
        hits = 0
        pending = False
        for i in range(start, len(keys)):
            k = keys[i]
            self._count_lookup(k)
            s = status.get(k)
            if s is None:
                break
            if s < 0:
                pending = True
            hits += 1
        if pending:
            # HIT_PENDING defers the request until the store lands; it then loads.
            self._complete(self._old_jobs)
            self._complete(self._new_jobs)
            self._old_jobs, self._new_jobs = [], []
        return hits

    def _load(self, keys: Sequence[int]) -> None:
        status = self.status
        for k in keys:
            if status[k] == 0:
                self._mark_pinned(k)
            status[k] += 1
        self.loads += len(keys)
        # The request waits for its load; completion re-queues the keys in set order.
        for k in self._set_order(list(keys)):
            status[k] -= 1
            if status[k] == 0:
                self._mark_evictable(k)

    def _prepare_store(self, keys: list[int]) -> list[int] | None:
        if self.counts is not None:
            counts, threshold = self.counts, self.threshold
            kept = [k for k in keys if counts.get(k, 0) >= threshold]
            self.stores_skipped += len(keys) - len(kept)
            keys = kept
        status = self.status
        to_store = [k for k in keys if k not in status]
        if not to_store:
            return []
        need = len(to_store) - (self.capacity - len(status))
        if need > 0:
            if need > self.n_evictable:
                return None
            evicted = self._evict(need, set(keys))
            if evicted is None:
                return None
            for k in evicted:
                del status[k]
            self.n_evictable -= len(evicted)
            self.evictions += len(evicted)
        for k in to_store:
            self._insert(k)
        self.stores += len(to_store)
        return to_store

    def _complete(self, jobs: list[list[int]]) -> None:
        status = self.status
        for job in jobs:
            for k in self._set_order(job):
                if status.get(k) == -1:
                    status[k] = 0
                    self._mark_evictable(k)

    def _req(self, req: int, fresh: bool) -> _Req:
        st = self.reqs.get(req)
        if st is None or fresh:
            st = _Req()
            self.reqs[req] = st
            if len(self.reqs) > self.max_requests:
                self.reqs.popitem(last=False)
        else:
            self.reqs.move_to_end(req)
        return st

    # --- scheduler --------------------------------------------------------------------

    def _lookup(self, a: Access) -> int:
        keys = a.keys
        st = self._req(a.req, a.first)
        if a.first:
            hits = self._prefix_hits(keys, a.start) if a.start < len(keys) else 0
            self._touch(keys)  # every lookup touches all of the request's blocks
            tokens = a.tokens_per_chunk * (a.start + hits) - a.computed_tokens
            if hits == 0 or tokens < a.tokens_per_chunk:
                st.open = hits > 0 and a.start + hits >= len(keys)
                return 0
            self._load(keys[a.start : a.start + hits])
            st.next_stored = a.start + hits
            st.open = a.start + hits >= len(keys)
            return tokens
        if not st.open or a.start >= len(keys) or st.next_stored < a.start:
            st.open = False
            return 0
        hits = self._prefix_hits(keys, a.start)
        st.open = a.start + hits >= len(keys)
        if hits:
            self._load(keys[a.start : a.start + hits])
            st.next_stored = a.start + hits
        return hits * a.tokens_per_chunk

    def _store(self, a: Access, retry: list[Access] | None = None) -> None:
        st = self.reqs.get(a.req)
        if st is None:
            return
        keys = a.keys
        if st.next_stored >= len(keys):
            return
        stored = self._prepare_store(list(keys[st.next_stored :]))
        if stored is None:
            self.allocation_failures += 1
            # Not advanced: vLLM offers the same blocks again in the request's next step
            # (at the latest the step that reports it finished), once here.
            if retry is not None:
                retry.append(a)
            return
        st.next_stored = len(keys)
        if stored:
            self._touch(keys)
            self._new_jobs.append(stored)

    def process_batch(self, ts: float, accesses: Sequence[Access]) -> list[float]:
        if ts - self._last_ts > self.lag:
            # Idle engine steps ran since the last batch. The first one is the finishing
            # step of the last batch's requests: it offers their failed stores again while
            # the last batch's copies are still in flight (completions are reported after
            # the stores are built); vLLM keeps stepping while copies are pending, so all
            # of them are done before this batch is scheduled.
            retry, self._retry = self._retry, []
            for a in retry:
                self._store(a)
            self._complete(self._old_jobs)
            self._complete(self._new_jobs)
            self._old_jobs, self._new_jobs = [], []
        # One engine step: all lookups happen while scheduling, all stores after it, the
        # scheduled requests' first and then those that finished in the previous step.
        hit = 0
        for a in accesses:
            hit += self._lookup(a)
        retry, self._retry = self._retry, []
        for a in accesses:
            self._store(a, self._retry)
        for a in retry:
            self._store(a)
        # Copies issued one step earlier are reported done in this step's output.
        self._complete(self._old_jobs)
        self._old_jobs, self._new_jobs = self._new_jobs, []
        self._last_ts = ts
        return [float(hit)]

    def finish(self) -> None:
        self._complete(self._old_jobs)
        self._complete(self._new_jobs)
        self._old_jobs, self._new_jobs = [], []


def sampled(keys: Iterable[int], threshold: int) -> list[int]:
    """SHARDS spatial sample: block hashes are uniform (sha256-derived), so low bits do."""
    return [k for k in keys if (k & _SAMPLE_MASK) < threshold]


def sample_threshold(rate: float) -> int:
    if not 0.0 < rate <= 1.0:
        raise ValueError("sample rate must be in (0, 1]")
    return max(1, round(rate * (1 << _SAMPLE_BITS)))


class StackModel:
    """Request-aware LRU for many sizes in one pass.

    The LRU stack is kept as access timestamps; for each candidate size a marker holds
    the timestamp of the deepest block that still fits. A block is resident at a size
    when its last access is at or after that size's marker, so a lookup reads every
    size at once, and an access moves only the markers it passes (amortised O(1) each).
    Hits follow vLLM's contiguity: a block counts at a size only if every block before
    it in the lookup run was resident at that size too.
    """

    def __init__(
        self,
        capacities: Sequence[int],
        *,
        sample_rate: float = 1.0,
        max_requests: int = 1 << 14,
    ) -> None:
        self.k = len(capacities)
        self.rate = sample_rate
        self.threshold = sample_threshold(sample_rate) if sample_rate < 1.0 else 0
        scaled = [
            int(c) if sample_rate >= 1.0 else max(0, round(int(c) * sample_rate))
            for c in capacities
        ]
        # Markers in descending capacity; capacity-0 sizes never hold anything.
        order = sorted(range(self.k), key=lambda i: -scaled[i])
        self.order = [i for i in order if scaled[i] > 0]
        self.caps = [scaled[i] for i in self.order]
        self.neg_caps = [-c for c in self.caps]  # ascending, for bisect
        self.n = len(self.caps)
        self.marks: list[int] = [0] * self.n  # ascending: largest size first
        self.last: dict[int, int] = {}
        self.slots: list[int | None] = []
        self.live = 0
        self.reqs: OrderedDict[int, int] = OrderedDict()  # req -> sizes still open
        self.max_requests = max_requests

    @property
    def tracked_blocks(self) -> int:
        return self.live

    def _touch(self, keys: Sequence[int]) -> None:
        """Access keys last to first, so the request's first block ends most recent.

        The hot loop of the one-pass model, kept in one function with locals: per access
        one dict lookup, and for every size whose boundary the block crosses, a step of
        that size's marker over dead slots (each slot is passed once per marker).
        """
        n = self.n
        if n == 0:
            return
        neg_caps = self.neg_caps
        last, slots, marks = self.last, self.slots, self.marks
        get, append = last.get, slots.append
        live = self.live
        now = len(slots)
        for k in reversed(keys):
            t_old = get(k)
            append(k)
            last[k] = now
            if t_old is None:
                if live == 0:
                    live = 1
                    for i in range(n):
                        marks[i] = now
                    now += 1
                    continue
                # Sizes already full lose their deepest block to the newcomer.
                start = bisect_left(neg_caps, -live)
                live += 1
            else:
                slots[t_old] = None
                # Sizes where the block was at or below the boundary.
                start = bisect_left(marks, t_old)
            now += 1
            if start == 0:
                b = marks[0]
                gone = slots[b]
                if gone is not None:
                    # Falls out of the largest size: forget it.
                    slots[b] = None
                    del last[gone]
                    live -= 1
                b += 1
                while slots[b] is None:
                    b += 1
                marks[0] = b
                start = 1
            for i in range(start, n):
                b = marks[i] + 1
                while slots[b] is None:
                    b += 1
                marks[i] = b
            if now > 2 * live + 4096:
                self.live = live
                self._compact()
                last, slots, marks = self.last, self.slots, self.marks
                get, append = last.get, slots.append
                now = len(slots)
        self.live = live

    def _compact(self) -> None:
        if not self.n:
            self.slots.clear()
            self.last.clear()
            self.live = 0
            return
        start = self.marks[0]
        live = [k for k in self.slots[start:] if k is not None]
        pos = {k: i for i, k in enumerate(live)}
        new_marks = []
        for m in self.marks:
            key = self.slots[m]
            new_marks.append(pos[key] if key is not None else 0)
        self.slots = list(live)
        self.last = pos
        self.marks = new_marks

    def _level(self, k: int) -> int:
        t = self.last.get(k)
        return 0 if t is None else bisect_right(self.marks, t)

    def _run_levels(self, a: Access, run: Sequence[int]) -> list[int]:
        """Per hit block of the lookup run, how many of the largest sizes it hits at."""
        m = self.n if a.first else self.reqs.get(a.req, 0)
        out: list[int] = []
        if m == 0:
            return out
        last, marks = self.last, self.marks
        for k in run:
            t = last.get(k)
            if t is None:
                break
            lvl = bisect_right(marks, t)
            m = min(m, lvl)
            if m == 0:
                break
            out.append(m)
        return out

    def process_batch(self, ts: float, accesses: Sequence[Access]) -> list[float]:
        hist = [0.0] * (self.n + 1)
        thr = self.threshold
        touched: list[list[int]] = []
        for a in accesses:
            keys = a.keys
            run = keys[a.start :] if thr == 0 else sampled(keys[a.start :], thr)
            levels = self._run_levels(a, run)
            still_open = bool(run) and len(levels) == len(run)
            if levels and thr == 0 and a.first:
                loadable = a.tokens_per_chunk * (a.start + len(levels)) - a.computed_tokens
                if loadable < a.tokens_per_chunk:
                    # Less than a chunk past a GPU hit that ends mid-chunk: vLLM loads nothing.
                    levels, still_open = [], False
            for m in levels:
                hist[m] += a.tokens_per_chunk
            self.reqs[a.req] = levels[-1] if still_open else 0
            self.reqs.move_to_end(a.req)
            if len(self.reqs) > self.max_requests:
                self.reqs.popitem(last=False)
            touched.append(list(keys) if thr == 0 else sampled(keys, thr))
        for blocks in touched:
            self._touch(blocks)
        # hist[m]: tokens that hit at the m largest sizes; SHARDS samples scale back up.
        scale = 1.0 / self.rate
        out = [0.0] * self.k
        acc = 0.0
        for j in range(self.n - 1, -1, -1):
            acc += hist[j + 1]
            out[self.order[j]] = acc * scale
        return out

    def finish(self) -> None:
        return None


class StackReference:
    """The StackModel's semantics simulated one OrderedDict per size: the check."""

    def __init__(self, capacities: Sequence[int], *, sample_rate: float = 1.0) -> None:
        self.rate = sample_rate
        self.threshold = sample_threshold(sample_rate) if sample_rate < 1.0 else 0
        self.caps = [
            int(c) if sample_rate >= 1.0 else max(0, round(int(c) * sample_rate))
            for c in capacities
        ]
        self.caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in self.caps]
        self.open: dict[tuple[int, int], bool] = {}

    @property
    def tracked_blocks(self) -> int:
        return sum(len(c) for c in self.caches)

    def process_batch(self, ts: float, accesses: Sequence[Access]) -> list[float]:
        thr = self.threshold
        out = [0.0] * len(self.caps)
        for i, cache in enumerate(self.caches):
            for a in accesses:
                run = a.keys[a.start :] if thr == 0 else sampled(a.keys[a.start :], thr)
                is_open = True if a.first else self.open.get((i, a.req), False)
                hits = 0
                if is_open and self.caps[i] > 0:
                    for k in run:
                        if k not in cache:
                            break
                        hits += 1
                is_open = is_open and self.caps[i] > 0 and bool(run) and hits == len(run)
                if thr == 0 and a.first and hits:
                    tokens = a.tokens_per_chunk * (a.start + hits) - a.computed_tokens
                    if tokens < a.tokens_per_chunk:
                        hits, is_open = 0, False
                self.open[(i, a.req)] = is_open
                out[i] += hits * a.tokens_per_chunk / self.rate
            for a in accesses:
                keys = a.keys if thr == 0 else sampled(a.keys, thr)
                for k in reversed(keys):
                    if k in cache:
                        cache.move_to_end(k)
                    else:
                        cache[k] = None
                        if len(cache) > self.caps[i]:
                            cache.popitem(last=False)
        return out

    def finish(self) -> None:
        return None


class PlainLru:
    """Baseline: an OrderedDict LRU per size over the GPU-miss stream, block by block.

    What a generic cache simulator would do with the events: every computed block is a
    lookup (hit if cached) followed by an insert. No request structure, no contiguity.
    """

    def __init__(self, capacities: Sequence[int]) -> None:
        self.caps = [int(c) for c in capacities]
        self.caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in self.caps]

    @property
    def tracked_blocks(self) -> int:
        return sum(len(c) for c in self.caches)

    def process_batch(self, ts: float, accesses: Sequence[Access]) -> list[float]:
        out = [0.0] * len(self.caps)
        for i, cache in enumerate(self.caches):
            cap = self.caps[i]
            for a in accesses:
                for k in a.keys[a.start :]:
                    if k in cache:
                        cache.move_to_end(k)
                        out[i] += a.tokens_per_chunk
                    elif cap > 0:
                        cache[k] = None
                        if len(cache) > cap:
                            cache.popitem(last=False)
        return out

    def finish(self) -> None:
        return None


class TierSet:
    """Several independent VllmCpuTier sizes behind the Model interface."""

    def __init__(
        self,
        capacities: Sequence[int],
        *,
        policy: str = "lru",
        store_threshold: int = 0,
        seed: int | None = 0,
        completion_lag: float = DEFAULT_COMPLETION_LAG,
    ) -> None:
        self.tiers = [
            VllmCpuTier(
                c,
                policy=policy,
                store_threshold=store_threshold,
                seed=seed,
                completion_lag=completion_lag,
            )
            for c in capacities
        ]

    @property
    def tracked_blocks(self) -> int:
        return sum(t.tracked_blocks for t in self.tiers)

    def process_batch(self, ts: float, accesses: Sequence[Access]) -> list[float]:
        return [t.process_batch(ts, accesses)[0] for t in self.tiers]

    def finish(self) -> None:
        for t in self.tiers:
            t.finish()


MODELS = ("vllm", "stack", "plain")


def make_model(
    kind: str,
    capacities: Sequence[int],
    *,
    policy: str = "lru",
    store_threshold: int = 0,
    sample_rate: float = 1.0,
    seed: int | None = 0,
    completion_lag: float = DEFAULT_COMPLETION_LAG,
) -> Model:
    if kind == "vllm":
        return TierSet(
            capacities,
            policy=policy,
            store_threshold=store_threshold,
            seed=seed,
            completion_lag=completion_lag,
        )
    if policy != "lru" or store_threshold >= 2:
        raise ValueError(f"the {kind} model is plain LRU; use the vllm model for ARC or thresholds")
    if kind == "stack":
        return StackModel(capacities, sample_rate=sample_rate)
    if kind == "plain":
        return PlainLru(capacities)
    raise ValueError(f"unknown model {kind!r} ({', '.join(MODELS)})")


@dataclass(frozen=True, slots=True)
class SizeResult:
    cpu_buffer_blocks: int
    cpu_buffer_bytes: int | None
    hit_tokens: float


@dataclass(frozen=True, slots=True)
class Curve:
    stored_tokens: int
    recomputed_after_eviction_tokens: int
    sizes: tuple[SizeResult, ...]
    batches: int
    requests: int
    bad_batches: int = 0

    def hit_ratio(self, i: int, denominator: float | None = None) -> float:
        den = self.stored_tokens if denominator is None else denominator
        return self.sizes[i].hit_tokens / den if den > 0 else 0.0


def blocks_for_bytes(size_bytes: int, kv_bytes_per_block: int, blocks_per_chunk: int = 1) -> int:
    """CPU chunks vLLM 0.26 allocates for cpu_bytes_to_use (CPUOffloadingSpec, floor)."""
    if kv_bytes_per_block <= 0:
        raise ValueError("kv_bytes_per_block must be positive")
    return int(size_bytes) // (kv_bytes_per_block * blocks_per_chunk)


class Replay:
    """Feed messages of one or more engines through a TraceBuilder and models per engine."""

    def __init__(
        self,
        capacities: Sequence[int],
        factory: Callable[[Sequence[int]], Model],
        *,
        blocks_per_chunk: int = 1,
    ) -> None:
        self.capacities = list(capacities)
        self.factory = factory
        self.bpc = blocks_per_chunk
        self.builders: dict[int, TraceBuilder] = {}
        self.models: dict[int, Model] = {}
        self.hits = [0.0] * len(self.capacities)
        self.batches = 0

    def engine(self, rank: int) -> tuple[TraceBuilder, Model]:
        b = self.builders.get(rank)
        if b is None:
            b = self.builders[rank] = TraceBuilder(self.bpc)
            self.models[rank] = self.factory(self.capacities)
        return b, self.models[rank]

    def feed(self, msg: Message) -> list[float]:
        rank = msg.batch.dp_rank or 0
        builder, model = self.engine(rank)
        accesses = builder.process(msg.batch, msg.seq)
        self.batches += 1
        hits = model.process_batch(msg.batch.ts, accesses)
        for i, h in enumerate(hits):
            self.hits[i] += h
        return hits

    def curve(self, sizes_bytes: Sequence[int | None] | None = None) -> Curve:
        for m in self.models.values():
            m.finish()
        stored = sum(b.stats.stored_tokens for b in self.builders.values())
        recomputed = sum(b.stats.recomputed_tokens for b in self.builders.values())
        requests = sum(b.stats.requests for b in self.builders.values())
        sizes = tuple(
            SizeResult(c, None if sizes_bytes is None else sizes_bytes[i], self.hits[i])
            for i, c in enumerate(self.capacities)
        )
        return Curve(stored, recomputed, sizes, self.batches, requests)


def replay(
    messages: Iterable[Message],
    capacities: Sequence[int],
    *,
    model: str = "vllm",
    policy: str = "lru",
    store_threshold: int = 0,
    sample_rate: float = 1.0,
    seeds: Sequence[int | None] = (0,),
    blocks_per_chunk: int = 1,
    sizes_bytes: Sequence[int | None] | None = None,
    completion_lag: float = DEFAULT_COMPLETION_LAG,
    on_message: Callable[[Message], None] | None = None,
) -> Curve:
    """The hit-token curve of a recorded stream; set-order seeds are averaged (vllm model)."""
    msgs = messages if isinstance(messages, list) else list(messages)
    runs: Sequence[int | None] = seeds if model == "vllm" else (0,)
    curves: list[Curve] = []
    for n, seed in enumerate(runs):

        def factory(caps: Sequence[int], seed: int | None = seed) -> Model:
            return make_model(
                model,
                caps,
                policy=policy,
                store_threshold=store_threshold,
                sample_rate=sample_rate,
                seed=seed,
                completion_lag=completion_lag,
            )

        r = Replay(capacities, factory, blocks_per_chunk=blocks_per_chunk)
        for msg in msgs:
            r.feed(msg)
            if on_message is not None and n == 0:
                on_message(msg)
        curves.append(r.curve(sizes_bytes))
    first = curves[0]
    mean = tuple(
        SizeResult(
            s.cpu_buffer_blocks,
            s.cpu_buffer_bytes,
            sum(c.sizes[i].hit_tokens for c in curves) / len(curves),
        )
        for i, s in enumerate(first.sizes)
    )
    return Curve(
        first.stored_tokens,
        first.recomputed_after_eviction_tokens,
        mean,
        first.batches,
        first.requests,
    )


def ttft_saved_seconds_per_second(
    hit_tokens_per_second: float,
    seconds_per_computed_token: float | None,
    transfer_tokens_per_second: float | None,
    computed_tokens_per_second: float | None = None,
    loads_per_second: float = 0.0,
    seconds_per_load: float = 0.0,
    priced_tokens_per_second: float | None = None,
    requests_per_store: float = 1.0,
    utilisation: float = 0.0,
) -> float | None:
    """Summed TTFT saved per second by a CPU tier serving these hits: negative when it costs.

    Each hit saves computing a token and costs loading it; every other computed token is
    stored, at the same copy speed. Without offload `computed_tokens_per_second` were
    computed, hits included, so the tier moves each of them once over the link:
    hits x cost - computed / transfer. Without a computed rate only the loads are charged.
    Each load also keeps its request waiting `seconds_per_load` beyond the copy (vLLM
    schedules it at a step after the copy is seen done), however few tokens it brings.
    `priced_tokens_per_second` (default: the hits) are the tokens whose computing the hits
    save: fewer where prefills have a floor (view.floor_fit). A store delays every request
    whose prefill shares its step, a load only its own request: the stores are charged
    `requests_per_store` times (view.StepSharing.requests_per_step).

    `utilisation` (view.queue_utilisation: the engine's as a processor-sharing queue of the
    jobs that share steps, `requests_per_store` requests each) makes the hits' saving a
    queue's: TTFT prices a computed token at its work over (1 - utilisation), the average
    inflation, but removing work shortens every overlapping prefill, and the summed TTFT of
    such a queue, rho / (1 - rho) per request sharing a step, falls faster than linearly:
    by the linear saving over (1 - rho') where rho' is the utilisation left. 0: no queue
    (the linear saving).
    """
    if seconds_per_computed_token is None or transfer_tokens_per_second is None:
        return None
    if seconds_per_computed_token < 0 or transfer_tokens_per_second <= 0:
        return None
    moved = hit_tokens_per_second
    if computed_tokens_per_second is not None:
        moved = max(computed_tokens_per_second, hit_tokens_per_second)
    priced = hit_tokens_per_second
    if priced_tokens_per_second is not None:
        priced = priced_tokens_per_second
    stored = moved - hit_tokens_per_second
    return (
        queue_saving(priced * seconds_per_computed_token, utilisation, requests_per_store)
        - (hit_tokens_per_second + stored * requests_per_store) / transfer_tokens_per_second
        - loads_per_second * seconds_per_load
    )


def queue_saving(linear: float, utilisation: float, requests_per_job: float = 1.0) -> float:
    """Summed TTFT saved per second by removing work that a linear TTFT fit prices at
    `linear`, from an M/G/1 processor-sharing queue at `utilisation` whose jobs are
    `requests_per_job` requests that share their steps.

    The queue's summed TTFT per second is k rho / (1 - rho) (Little: requests waiting for
    their first token), a job of work x waits x / (1 - rho), so the fit's price of a computed
    token is k w / (1 - rho) for its work w, and a saving priced `linear` removes
    linear (1 - rho) / k of work per second. What is left, rho', gives
    k rho / (1 - rho) - k rho' / (1 - rho') = linear / (1 - rho'). A negative `linear`
    (nothing saved) or no queue stays linear."""
    if linear <= 0 or utilisation <= 0:
        return linear
    rho = min(utilisation, 1.0 - 1e-9)
    left = max(rho - linear * (1.0 - rho) / max(requests_per_job, 1.0), 0.0)
    return linear / (1.0 - left)
