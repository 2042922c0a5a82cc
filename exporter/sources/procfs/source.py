"""The `procfs:<target>` collector: the target's vLLM processes and their memory.

Each collection finds the vLLM process tree (discovery.py), reads every member's status and
(every SMAPS_REFRESH seconds) its pinned-candidate mappings, sizes the offload pool and
/dev/shm. The members' command lines and start times are read with the tree (every
TREE_REFRESH seconds, or when a member exits), and the launch configuration from the
server's command line once per root process and tree rescan: only `status` is read per
process each cycle. The result is a frozen `ProcfsSnapshot` (`snapshot()`); parsing is in
parsers.py, rendering in exporter/render/procfs.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from exporter.logs import log_event
from exporter.sources import Clock, CollectError, ErrorKind, Health
from exporter.sources.procfs.discovery import (
    Discovery,
    ProcFS,
    Root,
    server_command,
    vanished,
)
from exporter.sources.procfs.parsers import (
    PoolEstimate,
    ShmFile,
    SmapsEntry,
    StatVfs,
    dev_shm_usage,
    offload_pool,
    parse_status,
    pinned_mappings_in,
    role_of,
)
from exporter.vllm_cmdline import LaunchConfig, launch_config

log = logging.getLogger("kvoe.procfs")

SMAPS_REFRESH = 30.0


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    pid: int
    role: str
    name: str
    resident: int | None
    anon: int | None
    shmem: int | None
    locked: int | None
    pinned: int | None  # None: smaps not readable
    maps: tuple[SmapsEntry, ...]  # only the shared pinned-candidate mappings


@dataclass(frozen=True, slots=True)
class ProcfsSnapshot:
    root_pid: int
    method: str  # how the root was found: pid | port | cmdline
    processes: tuple[ProcessMemory, ...]
    dev_shm: tuple[int, int] | None  # (size, used) bytes
    pool: PoolEstimate | None  # the offload pool estimate
    smaps_denied: tuple[int, ...]
    # The vLLM server's KV-transfer configuration from its command line and environment;
    # None where no process of the tree (or its ancestors) carries serving flags.
    launch: LaunchConfig | None = None
    argv: tuple[str, ...] = ()  # the vLLM server's command line (--record writes it)

    def unreclaimable_bytes(self) -> int | None:
        """Anon + shmem of the processes, each shared object once: what cannot be
        reclaimed without swap, the basis of memory headroom without a cgroup."""
        total = 0
        seen: set[tuple[str, int]] = set()
        for p in self.processes:
            if p.anon is None or p.shmem is None:
                return None
            again = sum(m.rss for m in p.maps if m.key in seen)
            seen.update(m.key for m in p.maps)
            total += p.anon + max(p.shmem - again, 0)
        return total


class ProcfsSource:
    """The `procfs:<target>` collector: the target's vLLM processes and their memory."""

    def __init__(
        self,
        target: str,
        *,
        port: int | None,
        pid: int | None = None,
        procfs: str | Path = "/proc",
        shm: str | Path = "/dev/shm",
        single_target: bool = False,
        statvfs: StatVfs = os.statvfs,
        clock: Clock = time.time,
    ) -> None:
        self.target = target
        self.name = f"procfs:{target}"
        self.health = Health(self.name, clock)
        self.fs = ProcFS(procfs)
        self.discovery = Discovery(self.fs, target, port=port, pid=pid, single_target=single_target)
        self.shm = Path(shm)
        self.single_target = single_target
        self.statvfs = statvfs
        self._snapshot: ProcfsSnapshot | None = None
        self._smaps_cache: dict[int, tuple[tuple[int, int], float, list[SmapsEntry] | None]] = {}
        self._denied_logged: set[int] = set()
        self._launch_cache: tuple[tuple[Root, int], tuple[str, ...], LaunchConfig | None] | None = (
            None
        )

    @property
    def port(self) -> int | None:
        return self.discovery.port

    @property
    def pid(self) -> int | None:
        """The configured root pid (--vllm-pid / targets[].pid), if any."""
        return self.discovery.pid

    async def start(self) -> None:
        self.health.started = True

    async def stop(self) -> None:
        return None

    async def collect(self) -> None:
        try:
            snap = await asyncio.to_thread(self.read)
        except Exception:
            self._snapshot = None
            raise
        self._snapshot = snap

    def snapshot(self) -> ProcfsSnapshot | None:
        """The last successful collection; None before one and after a failed one.
        Never blocks, never raises."""
        return self._snapshot

    # reading -----------------------------------------------------------------------------

    def _process(self, pid: int, root: Root) -> tuple[ProcessMemory, bool] | None:
        """One process' memory, or None if it exited meanwhile; the flag says smaps was
        readable."""
        try:
            status = parse_status(self.fs.text(pid, "status"))
        except OSError as exc:
            if vanished(exc):
                return None
            raise CollectError(ErrorKind.UNAVAILABLE, f"pid {pid} status: {exc}") from None
        if status.state == "Z":
            return None
        # Only status is read every cycle: the command line and start time are the tree
        # rescan's (discovery.py), which the exit of any member forces.
        argv = self.discovery.argv(pid, status.name)
        maps: list[SmapsEntry] | None
        ident = (pid, self.discovery.starttime(pid))
        cached = self._smaps_cache.get(pid)
        now = time.monotonic()
        if cached is not None and cached[0] == ident and now - cached[1] < SMAPS_REFRESH:
            # A large process's smaps is thousands of mappings (~10 ms to read and parse);
            # pinned pools are allocated at start-up, so a slower refresh loses nothing.
            maps = cached[2]
        else:
            try:
                maps = pinned_mappings_in(self.fs.pieces(pid, "smaps"))
            except OSError as exc:
                if vanished(exc) and not (self.fs.root / str(pid)).exists():
                    return None
                maps = None  # EACCES without ptrace rights: pinned stays unknown
            except (ValueError, IndexError):
                maps = None
            self._smaps_cache[pid] = (ident, now, maps)
        role = role_of(status.name, argv, listener=pid == root.pid and root.method == "port")
        pinned_maps = tuple(maps or ())  # pinned_mappings() keeps only those
        mem = ProcessMemory(
            pid=pid,
            role=role,
            name=status.name,
            resident=status.resident,
            anon=status.anon,
            shmem=status.shmem,
            locked=status.locked,
            pinned=sum(m.rss for m in pinned_maps) if maps is not None else None,
            maps=pinned_maps,
        )
        return mem, maps is not None

    def _shm_files(self) -> list[ShmFile]:
        out: list[ShmFile] = []
        try:
            entries = list(os.scandir(self.shm))
        except OSError:
            return out
        for e in entries:
            if e.name.startswith("vllm_offload_"):
                try:
                    out.append(ShmFile(e.name, e.stat().st_size))
                except OSError:
                    continue
        return out

    def _dev_shm(self, root_pid: int) -> tuple[int, int] | None:
        # The vLLM process' own view first (its mount namespace), then ours.
        for path in (self.fs.path(root_pid, "root/dev/shm"), str(self.shm)):
            try:
                return dev_shm_usage(self.statvfs, path)
            except OSError:
                continue
        return None

    def _launch(self, root: Root) -> tuple[tuple[str, ...], LaunchConfig | None]:
        """The server's command line and launch configuration, read once per root process
        and tree rescan (a restart is a new root; the flags of a running one do not change)."""
        key = (root, self.discovery.generation)
        if self._launch_cache is None or self._launch_cache[0] != key:
            argv, environ = server_command(self.fs, root.pid)
            launch = launch_config(argv, environ) if argv else None
            self._launch_cache = (key, argv, launch)
        return self._launch_cache[1], self._launch_cache[2]

    def read(self) -> ProcfsSnapshot:
        root = self.discovery.find()
        processes: list[ProcessMemory] = []
        denied: list[int] = []
        tree = self.discovery.members(root)
        for stale in set(self._smaps_cache) - set(tree):
            del self._smaps_cache[stale]
        for pid in tree:
            got = self._process(pid, root)
            if got is None:
                self.discovery.forget_tree()  # a member exited: look for its successor
                continue
            processes.append(got[0])
            if not got[1]:
                denied.append(pid)
        if not processes:
            self.discovery.lost()
            raise CollectError(ErrorKind.UNAVAILABLE, f"vLLM pid {root.pid} exited", absent=True)
        new_denied = set(denied) - self._denied_logged
        if new_denied:
            log_event(
                log,
                logging.WARNING,
                "smaps_unreadable",
                target=self.target,
                pids=sorted(new_denied),
                hint="pinned bytes need ptrace-read access (same user, or CAP_SYS_PTRACE)",
            )
            self._denied_logged |= new_denied
        shm_files = self._shm_files()
        argv, launch = self._launch(root)
        all_maps = [m for p in processes for m in p.maps]
        pool = offload_pool(all_maps, shm_files)
        if pool is None and len(denied) == len(processes) and self.single_target and shm_files:
            # No mapping is readable; with one target every offload file is its own.
            pool = PoolEstimate(sum(f.size for f in shm_files), "dev_shm_files", len(shm_files))
        return ProcfsSnapshot(
            root_pid=root.pid,
            method=root.method,
            processes=tuple(processes),
            dev_shm=self._dev_shm(root.pid),
            pool=pool,
            smaps_denied=tuple(denied),
            launch=launch,
            argv=argv,
        )
