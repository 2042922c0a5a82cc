"""The collection loop: run every source on the interval, derive, render, swap the cache."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from exporter.advisor import Advice, Advisor, AdvisorInput, MemoryState, PolicyPoint, WhatIfState
from exporter.backends import backend_families, with_peer_recompute
from exporter.catalogue import Family
from exporter.collector import (
    advice_families,
    derived_families,
    render,
    self_families,
)
from exporter.config import Config
from exporter.derive import DeriveSettings, EngineDerived, derive_target
from exporter.exposition import Exposition
from exporter.logs import log_event
from exporter.model.history import History, cycle_points
from exporter.sources import Clock, Source, execute
from exporter.sources.cgroup import CgroupSource
from exporter.sources.kv_events import kv_event_sources
from exporter.sources.nvml import NvmlSource
from exporter.sources.procfs import ProcfsSource, offload_pool_families, url_port
from exporter.sources.vllm_http import VllmTarget
from exporter.vllm_cmdline import LaunchConfig
from exporter.vllm_metrics import EngineKey

log = logging.getLogger("kvoe.runtime")


def build_sources(cfg: Config, clock: Clock = time.time) -> list[Source]:
    sources: list[Source] = [
        VllmTarget(
            t,
            window_seconds=cfg.window,
            timeout=cfg.effective_scrape_timeout,
            max_body_bytes=cfg.max_body_bytes,
            clock=clock,
        )
        for t in cfg.targets
    ]
    if cfg.nvml:
        sources.append(NvmlSource(poll_interval=cfg.nvml_poll_interval or None, clock=clock))
    single = len(cfg.targets) == 1
    for t in cfg.targets:
        pid = t.pid or (cfg.vllm_pid if single else None)
        procfs = None
        if cfg.procfs:
            procfs = ProcfsSource(
                t.label,
                port=url_port(t.url),
                pid=pid,
                procfs=cfg.path_procfs,
                shm=cfg.path_shm,
                single_target=single,
                clock=clock,
            )
            sources.append(procfs)
        if cfg.cgroup:
            sources.append(
                CgroupSource(
                    t.label,
                    procfs=procfs,
                    pid=pid,
                    procfs_root=cfg.path_procfs,
                    cgroup_root=cfg.path_cgroup,
                    memory_limit=cfg.memory_limit or None,
                    clock=clock,
                )
            )
    sources.extend(kv_event_sources(cfg, sources, clock))
    return sources


class Exporter:
    def __init__(self, cfg: Config, sources: Sequence[Source], clock: Clock = time.time) -> None:
        self.cfg = cfg
        self.sources = list(sources)
        self.targets = [s for s in self.sources if isinstance(s, VllmTarget)]
        self.clock = clock
        self.derived: dict[str, list[EngineDerived]] = {}
        self.advisor = Advisor(cfg.thresholds, confirm=cfg.advice_confirm_cycles)
        self.advice: dict[str, list[tuple[EngineKey, Advice]]] = {}
        self.inputs: dict[tuple[str, EngineKey], AdvisorInput] = {}  # each advice's input
        self.history = History(cfg.window)  # per-cycle values for the status page
        self.exposition: Exposition = render(self_families(cfg.window, self.sources))
        self.cycles = 0
        self.last_cycle: float | None = None
        self.started = False

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

    def settings_for(self, target: VllmTarget) -> DeriveSettings:
        return DeriveSettings(
            stale_after=2 * self.cfg.interval + self.cfg.effective_scrape_timeout,
            kv_bytes_per_token=target.config.kv_bytes_per_token
            or self.cfg.kv_bytes_per_token
            or None,
            assumed_load_bandwidth=float(self.cfg.assumed_load_bandwidth) or None,
            link_bandwidth=self.link_bandwidth(),
            launch=self._launch(target.config.label),
        )

    def _launch(self, label: str) -> LaunchConfig | None:
        launch = self._hook("launch_config", label)
        return launch if isinstance(launch, LaunchConfig) else None

    def link_bandwidth(self) -> float | None:
        """Slowest host link among the GPUs, bytes/s; None without a GPU collector."""
        values = [
            bw
            for src in self.sources
            if (fn := getattr(src, "link_bandwidth", None)) is not None and (bw := fn()) is not None
        ]
        return min(values) if values else None

    async def run_cycle(self) -> None:
        timeout = self.cfg.effective_scrape_timeout
        await asyncio.gather(*(execute(src, timeout) for src in self.sources))
        now = self.clock()
        derived = {
            t.config.label: derive_target(t.window, now, self.settings_for(t)) for t in self.targets
        }
        # A decode engine (NIXL) takes the recompute rate of a prefill engine of its model.
        self.derived = with_peer_recompute(derived)
        self.advise()
        self.exposition = render(self.families())
        self.cycles += 1
        self.last_cycle = now
        self.history.record(now, cycle_points(now, self.advice, self.inputs))

    def _hook(self, name: str, *args: object) -> object | None:
        """First non-None answer of a source hook (duck-typed: not every source has it)."""
        for src in self.sources:
            fn = getattr(src, name, None)
            if fn is not None and (value := fn(*args)) is not None:
                return value  # type: ignore[no-any-return]
        return None

    def advise(self) -> None:
        pcie = self._hook("pcie_utilization")
        present: set[tuple[str, EngineKey]] = set()
        out: dict[str, list[tuple[EngineKey, Advice]]] = {}
        inputs: dict[tuple[str, EngineKey], AdvisorInput] = {}
        for t in self.targets:
            label = t.config.label
            memory = self._hook("memory_state", label)
            for d in self.derived.get(label, []):
                whatif = self._hook("whatif_state", label, d.key, d)
                policies = self._hook("policy_state", label, d.key, d)
                mem = memory if isinstance(memory, MemoryState) else None
                if mem is not None and mem.pool_bytes and d.offload_buffer_bytes:
                    # The measured pool/flag ratio (1.75 on vLLM 0.26) sizes recommendations.
                    mem = replace(mem, pool_to_buffer_ratio=mem.pool_bytes / d.offload_buffer_bytes)
                inp = AdvisorInput(
                    derived=d,
                    covered_seconds=t.window.covered_seconds(),
                    whatif=whatif if isinstance(whatif, WhatIfState) else None,
                    memory=mem,
                    pcie_utilization=pcie if isinstance(pcie, float) else None,
                    policy_alternatives=tuple(
                        p
                        for p in (policies if isinstance(policies, tuple) else ())
                        if isinstance(p, PolicyPoint)
                    ),
                )
                advice = self.advisor.update(label, inp)
                inputs[(label, d.key)] = inp
                out.setdefault(label, []).append((d.key, advice))
                for src in self.sources:
                    # The policy what-if of an engine without offload runs at this size.
                    note = getattr(src, "note_recommended", None)
                    if note is not None:
                        note(label, d.key, advice.recommended_buffer_bytes)
                present.add((label, d.key))
        self.advisor.forget_missing(present)
        self.advice = out
        self.inputs = inputs

    def families(self) -> list[Family]:
        out = list(self_families(self.cfg.window, self.sources))
        for src in self.sources:
            out.extend(src.families())
        out.extend(derived_families(self.derived.items(), self.covered_seconds()))
        out.extend(advice_families(self.advice.items()))
        out.extend(backend_families(self.derived.items()))
        for src in self.sources:
            # Families that need the derived window (what-if hit ratios over prompt tokens).
            hook = getattr(src, "derived_families", None)
            if hook is not None:
                out.extend(hook(self.derived))
        pools = {s.target: s.pool() for s in self.sources if isinstance(s, ProcfsSource)}
        out.extend(offload_pool_families(pools, self.derived))
        return out

    def covered_seconds(self) -> dict[str, float]:
        return {t.config.label: t.window.covered_seconds() for t in self.targets}

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
