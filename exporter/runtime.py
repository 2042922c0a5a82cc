"""One collection cycle, wired: collect every source, build CycleInputs from their snapshots,
step the model (exporter/model/pipeline.py), render the families, swap the cached exposition.

The runtime holds each source by its type (a target's procfs, cgroup and KV-event sources
beside it, one NVML source): it never asks a source for anything by name.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from exporter import __version__
from exporter.catalogue import Family
from exporter.config import Config
from exporter.logs import log_event
from exporter.model.advisor.types import Advice, AdvisorInput, MemoryState
from exporter.model.derive.compute import computed_token_floor
from exporter.model.derive.engines import CostBefore, DeriveSettings, EngineDerived
from exporter.model.history import History, cycle_points
from exporter.model.inputs import CycleInputs, TargetInputs
from exporter.model.pipeline import CycleResult, Pipeline
from exporter.model.whatif.engine import WhatIfSettings
from exporter.options import TargetConfig
from exporter.recording import Writer, kv_events_path
from exporter.render.advice import advice_families
from exporter.render.backends import backend_families
from exporter.render.cgroup import cgroup_families
from exporter.render.derived import derived_families
from exporter.render.exposition import Exposition
from exporter.render.kv_events import kv_events_families
from exporter.render.nvml import nvml_families
from exporter.render.procfs import offload_pool_families, procfs_families
from exporter.render.self_metrics import self_families
from exporter.render.targets import target_families
from exporter.render.whatif import whatif_families
from exporter.sources import Clock, Source, execute
from exporter.sources.cgroup import CgroupMemory, CgroupSource
from exporter.sources.kv_events.source import KvEventsSettings, KvEventsSource
from exporter.sources.nvml.source import NvmlSource
from exporter.sources.procfs.parsers import PoolEstimate, url_port
from exporter.sources.procfs.source import ProcfsSource
from exporter.sources.vllm_http import VllmTarget
from exporter.state import StateError
from exporter.state import load as load_state
from exporter.state import save as save_state
from exporter.vllm_metrics import EngineKey

log = logging.getLogger("kvoe.runtime")

# The fits change every cycle while offload is off; the file needs only the latest one by the
# time vLLM restarts, and stop() writes it last.
STATE_SAVE_INTERVAL = 60.0


@dataclass(slots=True)
class TargetSources:
    """A vLLM target and the sources that watch the same server."""

    target: VllmTarget
    procfs: ProcfsSource | None = None
    cgroup: CgroupSource | None = None
    kv_events: KvEventsSource | None = None

    @property
    def label(self) -> str:
        return self.target.config.label


def whatif_settings(cfg: Config) -> WhatIfSettings:
    return WhatIfSettings(
        sizes_bytes=tuple(int(b) for b in cfg.whatif_sizes),
        policy=cfg.whatif_policy,
        store_threshold=cfg.whatif_store_threshold,
        sample_rate=cfg.whatif_sample_rate,
        model=cfg.whatif_model,
        history_seconds=cfg.window + 120.0,
    )


def record_dir(cfg: Config, label: str) -> Path | None:
    """Where --record DIR writes a target's recording: DIR itself for a single target."""
    if not cfg.record:
        return None
    base = Path(cfg.record)
    if len(cfg.targets) == 1:
        return base
    return base / "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)


def kv_events_settings(cfg: Config, target: TargetConfig) -> KvEventsSettings:
    """A target's endpoints: its own (YAML targets[]), else the flags for a single target."""
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
        replay_timeout=cfg.kv_events_replay_timeout,
        record_path=_record_path(cfg.record_events, target.label, single)
        or str(kv_events_path(directory) if (directory := record_dir(cfg, target.label)) else ""),
    )


def _record_path(path: str, label: str, single: bool) -> str:
    """--record-events FILE for one target; with several, FILE.<label>.ext each."""
    if not path or single:
        return path
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{safe}{p.suffix}"))


def build_sources(cfg: Config, clock: Clock = time.time) -> list[Source]:
    """Every source the configuration asks for, in the order they render."""
    targets = [
        VllmTarget(
            t,
            window_seconds=cfg.window,
            timeout=cfg.effective_scrape_timeout,
            max_body_bytes=cfg.max_body_bytes,
            clock=clock,
        )
        for t in cfg.targets
    ]
    sources: list[Source] = list(targets)
    if cfg.nvml:
        sources.append(NvmlSource(poll_interval=cfg.nvml_poll_interval or None, clock=clock))
    single = len(cfg.targets) == 1
    for t in cfg.targets:
        pid = t.pid or (cfg.vllm_pid if single else None)
        if cfg.procfs:
            sources.append(
                ProcfsSource(
                    t.label,
                    port=url_port(t.url),
                    pid=pid,
                    procfs=cfg.path_procfs,
                    shm=cfg.path_shm,
                    single_target=single,
                    clock=clock,
                )
            )
        if cfg.cgroup:
            sources.append(
                CgroupSource(
                    t.label,
                    pid=pid,
                    procfs_root=cfg.path_procfs,
                    cgroup_root=cfg.path_cgroup,
                    memory_limit=cfg.memory_limit or None,
                    clock=clock,
                )
            )
    if cfg.kv_events:
        sources.extend(
            KvEventsSource(t, kv_events_settings(cfg, t), clock=clock) for t in cfg.targets
        )
    return sources


def memory_state(view: CgroupMemory | None, pool: PoolEstimate | None) -> MemoryState | None:
    """The advisor's view of a target's memory: limit, non-reclaimable usage, the pool."""
    if view is None:
        return None
    return MemoryState(
        limit_bytes=view.limit,
        usage_bytes=view.headroom_usage,
        pool_bytes=pool.bytes if pool is not None else None,
    )


class Exporter:
    def __init__(
        self,
        cfg: Config,
        sources: Sequence[Source],
        clock: Clock = time.time,
        timer: Clock = time.perf_counter,
    ) -> None:
        self.cfg = cfg
        self.timer = timer
        self.sources = list(sources)
        self.clock = clock
        self.nvml = next((s for s in self.sources if isinstance(s, NvmlSource)), None)
        self.watched: list[TargetSources] = []
        by_label: dict[str, TargetSources] = {}
        for src in self.sources:
            if isinstance(src, VllmTarget):
                by_label[src.config.label] = ts = TargetSources(src)
                self.watched.append(ts)
        for src in self.sources:
            if isinstance(src, ProcfsSource) and src.target in by_label:
                by_label[src.target].procfs = src
            elif isinstance(src, CgroupSource) and src.target in by_label:
                by_label[src.target].cgroup = src
            elif isinstance(src, KvEventsSource) and src.label in by_label:
                by_label[src.label].kv_events = src
        self.targets = [ts.target for ts in self.watched]
        self.pipeline = Pipeline(
            cfg.thresholds,
            confirm=cfg.advice_confirm_cycles,
            confirm_seconds=cfg.advice_confirm_seconds,
            whatif=whatif_settings(cfg),
        )
        self.recorders = {
            ts.label: Writer(directory)
            for ts in self.watched
            if (directory := record_dir(cfg, ts.label)) is not None
        }
        self._meta: dict[str, dict[str, object]] = {}
        self.result = CycleResult(0.0, ())
        self.history = History(cfg.window)  # per-cycle values for the status page
        self.exposition = Exposition(self._self_families())
        self.cycles = 0
        self.last_cycle: float | None = None
        self.started = False
        self.state_file = Path(cfg.state_file) if cfg.state_file else None
        # What the state file holds, as Pipeline.remembered(); None: not known to hold anything.
        self._saved: dict[str, dict[EngineKey, CostBefore]] | None = None
        self._saved_at: float | None = None
        if self.state_file is not None:
            self._load_state(self.state_file)

    def _load_state(self, path: Path) -> None:
        if not path.exists():
            # The first cycle writes it: a volume that cannot take it shows at once.
            log_event(log, logging.INFO, "state_file_new", file=str(path))
            return
        try:
            remembered = load_state(path)
        except StateError as exc:
            # A bad file costs what it remembered, not the exporter: it is rewritten on the
            # next save.
            log_event(log, logging.ERROR, "state_load_failed", file=str(path), error=str(exc))
            return
        for label, fits in remembered.items():
            self.pipeline.remember_before(label, fits)
        self._saved = self.pipeline.remembered()
        log_event(
            log,
            logging.INFO,
            "state_loaded",
            file=str(path),
            engines=sum(len(f) for f in remembered.values()),
        )

    async def _save_state(self, now: float | None) -> None:
        """Rewrite the state file if what is remembered changed, at most every
        STATE_SAVE_INTERVAL seconds (now None: at once, on the way out)."""
        if self.state_file is None:
            return
        remembered = self.pipeline.remembered()
        if remembered == self._saved:
            return
        if (
            now is not None
            and self._saved_at is not None
            and now - self._saved_at < STATE_SAVE_INTERVAL
        ):
            return
        try:
            await asyncio.to_thread(save_state, self.state_file, remembered)
        except OSError as exc:
            # A read-only or full volume loses the memory across restarts, nothing else.
            log_event(
                log, logging.ERROR, "state_save_failed", file=str(self.state_file), error=str(exc)
            )
        else:
            self._saved = remembered
        self._saved_at = now

    async def start(self) -> None:
        for src in self.sources:
            try:
                await src.start()
            except Exception:  # a source that cannot start stays down; the rest serve
                log.exception("source %s failed to start", src.name)
        self.started = True

    async def stop(self) -> None:
        for src in self.sources:
            try:
                await src.stop()
            except Exception:
                log.exception("source %s failed to stop", src.name)
        for writer in self.recorders.values():
            writer.close()
        await self._save_state(None)

    def _record(self, now: float) -> None:
        """--record: this cycle's scrape of each target, and meta.json when it changes."""
        reading = self.nvml.snapshot() if self.nvml is not None else None
        derived = self.result.derived()
        for ts in self.watched:
            writer = self.recorders.get(ts.label)
            if writer is None:
                continue
            snap = ts.target.snapshot()
            procfs = ts.procfs.snapshot() if ts.procfs is not None else None
            per_token = next(
                (d.kv_bytes_per_token for d in derived.get(ts.label, ()) if d.kv_bytes_per_token),
                None,
            )
            meta: dict[str, object] = {
                "vllm_argv": list(procfs.argv) if procfs is not None and procfs.argv else None,
                "link_bandwidth_bytes_per_second": reading.link_bandwidth if reading else None,
                "kv_bytes_per_token": per_token,
                "machine": reading.machine if reading else None,
                "gpu_names": list(reading.gpu_names) if reading and reading.gpu_names else None,
                "model_weight_bytes": ts.target.config.model_weight_bytes
                or self.cfg.model_weight_bytes
                or None,
                "vllm_version": snap.version,
                "exporter_version": __version__,
            }
            meta = {k: v for k, v in meta.items() if v is not None}
            try:
                writer.write_scrape(now, snap.body, None if snap.health.up else snap.health.error)
                if meta != self._meta.get(ts.label):
                    writer.write_meta(meta)
                    self._meta[ts.label] = meta
            except OSError as exc:
                # A full disk stops the recording, never the exporter.
                log_event(log, logging.ERROR, "record_failed", target=ts.label, error=str(exc))
                writer.close()
                del self.recorders[ts.label]

    def link_bandwidth(self) -> float | None:
        """Slowest host link among the GPUs, bytes/s; None without a GPU collector."""
        reading = self.nvml.snapshot() if self.nvml is not None else None
        return reading.link_bandwidth if reading is not None else None

    def _follow_procfs(self) -> None:
        # The cgroup is vLLM's: found from the root process procfs found last cycle.
        for ts in self.watched:
            if ts.cgroup is not None and ts.procfs is not None:
                snap = ts.procfs.snapshot()
                if snap is None:
                    ts.cgroup.follow(None, None)
                else:
                    ts.cgroup.follow(snap.root_pid, snap.unreclaimable_bytes())

    def cycle_inputs(self, now: float) -> CycleInputs:
        """This cycle's CycleInputs, from the sources' snapshots."""
        reading = self.nvml.snapshot() if self.nvml is not None else None
        link = reading.link_bandwidth if reading is not None else None
        cfg = self.cfg
        rows = []
        for ts in self.watched:
            procfs = ts.procfs.snapshot() if ts.procfs is not None else None
            cgroup = ts.cgroup.snapshot() if ts.cgroup is not None else None
            kv = ts.kv_events.snapshot() if ts.kv_events is not None else None
            config = ts.target.config
            settings = DeriveSettings(
                stale_after=2 * cfg.interval + cfg.effective_scrape_timeout,
                kv_bytes_per_token=config.kv_bytes_per_token or cfg.kv_bytes_per_token or None,
                assumed_load_bandwidth=float(cfg.assumed_load_bandwidth) or None,
                link_bandwidth=link,
                launch=procfs.launch if procfs is not None else None,
                machine=reading.machine if reading is not None else None,
                computed_token_floor=computed_token_floor(
                    config.model_weight_bytes or cfg.model_weight_bytes or None,
                    reading.gpu_names if reading is not None else (),
                    cfg.gpu_peak_flops or None,
                ),
            )
            rows.append(
                TargetInputs(
                    label=ts.label,
                    window=ts.target.window,
                    settings=settings,
                    memory=memory_state(cgroup, procfs.pool if procfs is not None else None),
                    kv_items=kv.items if kv is not None else None,
                )
            )
        return CycleInputs(
            now, tuple(rows), reading.pcie_utilization if reading is not None else None
        )

    async def run_cycle(self) -> None:
        self._follow_procfs()
        timeout = self.cfg.effective_scrape_timeout
        await asyncio.gather(*(execute(src, timeout, self.timer) for src in self.sources))
        now = self.clock()
        self.result = self.pipeline.step(self.cycle_inputs(now))
        self.history.record(now, cycle_points(now, self.advice, self.inputs))
        self.exposition = Exposition(self.families())
        if self.recorders:
            await asyncio.to_thread(self._record, now)
        await self._save_state(now)
        self.cycles += 1
        self.last_cycle = now

    @property
    def derived(self) -> dict[str, list[EngineDerived]]:
        return self.result.derived()

    @property
    def advice(self) -> dict[str, list[tuple[EngineKey, Advice]]]:
        return self.result.advice()

    @property
    def inputs(self) -> dict[tuple[str, EngineKey], AdvisorInput]:
        """What the advisor saw for each engine in the last cycle."""
        return self.result.inputs()

    def _self_families(self) -> list[Family]:
        states = [s.health.state() for s in self.sources if not isinstance(s, VllmTarget)]
        return list(self_families(__version__, platform.python_version(), self.cfg.window, states))

    def families(self) -> list[Family]:
        return list(self._families())

    def _families(self) -> Iterator[Family]:
        # The order of first appearance is the exposition's order: keep it stable.
        result = self.result
        yield from self._self_families()
        for ts in self.watched:
            yield from target_families(ts.target.snapshot())
        if self.nvml is not None:
            yield from nvml_families(self.nvml.snapshot())
        for ts in self.watched:
            if ts.procfs is not None:
                yield from procfs_families(ts.label, ts.procfs.snapshot())
            if ts.cgroup is not None:
                yield from cgroup_families(ts.label, ts.cgroup.snapshot())
        by_label = {t.label: t for t in result.targets}
        derived_now = result.derived()
        for ts in self.watched:
            if ts.kv_events is not None:
                latest = ts.target.window.latest
                sim = by_label[ts.label].simulation if ts.label in by_label else None
                per_token = {d.key: d.kv_bytes_per_token for d in derived_now.get(ts.label, ())}
                yield from kv_events_families(
                    ts.label,
                    ts.kv_events.snapshot(),
                    latest.engines if latest is not None else (),
                    sim or {},
                    per_token,
                )
        derived = result.derived()
        covered = {t.label: t.covered_seconds for t in result.targets}
        yield from derived_families(derived.items(), covered)
        yield from advice_families(result.advice().items())
        yield from backend_families(derived.items())
        for ts in self.watched:
            t = by_label.get(ts.label)
            if ts.kv_events is not None and t is not None:
                yield from whatif_families(
                    ts.label, ((e.derived.key, e.whatif, e.policies) for e in t.engines)
                )
        pools = {
            ts.label: snap.pool
            for ts in self.watched
            if ts.procfs is not None and (snap := ts.procfs.snapshot()) is not None
        }
        yield from offload_pool_families(pools, derived)

    def covered_seconds(self) -> dict[str, float]:
        return {ts.label: ts.target.window.covered_seconds() for ts in self.watched}

    async def run_forever(self) -> None:
        interval = self.cfg.interval
        next_at = time.monotonic()
        while True:
            try:
                await self.run_cycle()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one cycle must not end the exporter
                log.exception("collection cycle failed")
            next_at += interval
            delay = next_at - time.monotonic()
            if delay < 0:
                skipped = int(-delay // interval) + 1
                log_event(log, logging.WARNING, "cycle_overrun", skipped_cycles=skipped)
                next_at += skipped * interval
                delay = next_at - time.monotonic()
            await asyncio.sleep(delay)
