"""vLLM process memory from /proc: pinned (shmem-backed) host memory and the offload pool.

Pinned host memory is invisible to VmLck/VmPin: PyTorch's pinned allocations
(cudaHostAlloc) are shared anonymous mappings that the kernel names `/dev/zero (deleted)`
and counts as RssShmem, and vLLM's newer offload region is a /dev/shm file registered
with cudaHostRegister. So "pinned" here is what those mappings hold, read per mapping
from /proc/PID/smaps. Parsers are pure functions of file text; `ProcFS` does the reading
under a configurable root (--path.procfs) so tests run on a fixture tree.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from exporter.catalogue import Family
from exporter.logs import log_event
from exporter.sources import Clock, CollectError, ErrorKind, Health
from exporter.vllm_cmdline import LaunchConfig, is_vllm_server, launch_config, parse_environ

if TYPE_CHECKING:
    from exporter.model.derive.engines import EngineDerived

log = logging.getLogger("kvoe.procfs")

KIB = 1024
MIB = 1 << 20
ROLES = ("api_server", "engine_core", "worker", "other")
SHARED_ANON_PATH = "/dev/zero (deleted)"
OFFLOAD_SHM_PREFIX = "/dev/shm/vllm_offload_"
# Smallest group of identical shared anonymous mappings taken for an offload pool: CUDA's
# own shared mappings and vLLM's small pinned staging buffers stay well below it.
MIN_POOL_GROUP_BYTES = 64 * MIB
DISCOVERY_RETRY = 30.0
SMAPS_REFRESH = 30.0
# The vLLM process tree is spawned at start-up; rescanning every process's parent each
# cycle was most of this collector's CPU. A member that vanishes forces a rescan.
TREE_REFRESH = 10.0
DEFAULT_VLLM_PORT = 8000


# --- pure parsers -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcStatus:
    pid: int
    name: str
    ppid: int | None
    state: str
    resident: int | None  # bytes, VmRSS
    anon: int | None  # RssAnon
    file: int | None  # RssFile
    shmem: int | None  # RssShmem
    locked: int | None  # VmLck
    pinned_vm: int | None  # VmPin


def _kb(fields: Mapping[str, str], key: str) -> int | None:
    raw = fields.get(key)
    if raw is None:
        return None
    number, _, unit = raw.strip().partition(" ")
    try:
        value = int(number)
    except ValueError:
        return None
    return value * KIB if unit.strip() == "kB" else value


def parse_status(text: str) -> ProcStatus:
    """/proc/PID/status -> sizes in bytes (None for fields the kernel does not show)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()
    pid = int(fields.get("Pid", "0") or 0)
    ppid_raw = fields.get("PPid")
    return ProcStatus(
        pid=pid,
        name=fields.get("Name", ""),
        ppid=int(ppid_raw) if ppid_raw and ppid_raw.isdigit() else None,
        state=fields.get("State", "?")[:1],
        resident=_kb(fields, "VmRSS"),
        anon=_kb(fields, "RssAnon"),
        file=_kb(fields, "RssFile"),
        shmem=_kb(fields, "RssShmem"),
        locked=_kb(fields, "VmLck"),
        pinned_vm=_kb(fields, "VmPin"),
    )


@dataclass(frozen=True, slots=True)
class SmapsEntry:
    """One mapping of /proc/PID/smaps."""

    start: int
    end: int
    perms: str
    offset: int
    dev: str
    inode: int
    path: str
    rss: int  # bytes
    locked: int  # bytes

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def shared(self) -> bool:
        return len(self.perms) > 3 and self.perms[3] == "s"

    @property
    def key(self) -> tuple[str, int]:
        """Identity of the backing object, the same in every process that maps it."""
        return (self.dev, self.inode)


def _is_header(line: str) -> bool:
    head = line.split(" ", 1)[0]
    lo, sep, hi = head.partition("-")
    if not sep or not lo or not hi:
        return False
    try:
        int(lo, 16)
        int(hi, 16)
    except ValueError:
        return False
    return True


def parse_smaps(text: str) -> list[SmapsEntry]:
    """/proc/PID/smaps -> mappings with their resident and locked bytes."""
    out: list[SmapsEntry] = []
    head: list[str] | None = None
    rss = locked = 0

    def flush() -> None:
        if head is None:
            return
        lo, _, hi = head[0].partition("-")
        out.append(
            SmapsEntry(
                start=int(lo, 16),
                end=int(hi, 16),
                perms=head[1],
                offset=int(head[2], 16),
                dev=head[3],
                inode=int(head[4]),
                path=head[5].strip() if len(head) > 5 else "",
                rss=rss,
                locked=locked,
            )
        )

    for line in text.splitlines():
        if _is_header(line):
            flush()
            parts = line.split(None, 5)
            head = parts if len(parts) >= 5 else None
            rss = locked = 0
            continue
        key, sep, value = line.partition(":")
        if not sep:
            continue
        if key == "Rss":
            rss = int(value.split()[0]) * KIB
        elif key == "Locked":
            locked = int(value.split()[0]) * KIB
    flush()
    return out


def parse_smaps_rollup(text: str) -> dict[str, int]:
    """/proc/PID/smaps_rollup -> {field: bytes}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        parts = value.split()
        if sep and len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key] = int(parts[0]) * KIB
    return out


def is_pinned_mapping(m: SmapsEntry) -> bool:
    """Shared writable mappings that pinned host memory lives in: PyTorch pinned tensors
    (cudaHostAlloc, shown as `/dev/zero (deleted)`) and vLLM's registered /dev/shm region."""
    if not (m.shared and m.perms.startswith("rw")):
        return False
    return m.path == SHARED_ANON_PATH or m.path.startswith(OFFLOAD_SHM_PREFIX)


def pinned_bytes(maps: Iterable[SmapsEntry]) -> int:
    """Resident bytes of the pinned mappings, each backing object counted once.

    vLLM 0.26's tiering spec maps its /dev/shm region twice in the same process; the kernel
    reports each mapping's Rss, but the pages exist once. Per file, the total is capped at
    the length of the file ranges the mappings cover.
    """
    total = 0
    by_file: dict[tuple[str, int], list[SmapsEntry]] = {}
    for m in maps:
        if not is_pinned_mapping(m):
            continue
        if m.inode == 0 or m.path == SHARED_ANON_PATH:
            total += m.rss  # every shared anonymous mapping is its own object
        else:
            by_file.setdefault(m.key, []).append(m)
    for entries in by_file.values():
        spans = sorted((e.offset, e.offset + (e.end - e.start)) for e in entries)
        covered, reach = 0, -1
        for lo, hi in spans:
            if hi <= reach:
                continue
            covered += hi - max(lo, reach)
            reach = hi
        total += min(sum(e.rss for e in entries), covered)
    return total


@dataclass(frozen=True, slots=True)
class Stat:
    pid: int
    comm: str
    state: str
    ppid: int
    starttime: int


def parse_stat(text: str) -> Stat:
    """/proc/PID/stat; comm may hold spaces and parentheses, so split at the last ')'."""
    lpar = text.index("(")
    rpar = text.rindex(")")
    rest = text[rpar + 2 :].split()
    return Stat(
        pid=int(text[:lpar]),
        comm=text[lpar + 1 : rpar],
        state=rest[0],
        ppid=int(rest[1]),
        starttime=int(rest[19]),
    )


def parse_cmdline(data: bytes) -> tuple[str, ...]:
    text = data.decode("utf-8", "replace")
    parts = text.split("\0")
    while parts and not parts[-1]:
        parts.pop()
    if len(parts) == 1:
        # setproctitle titles ("VLLM::EngineCore") come padded in one argument.
        parts = [parts[0].strip()]
    return tuple(parts)


@dataclass(frozen=True, slots=True)
class Listener:
    address: str
    port: int
    inode: int


def _hex_address(text: str) -> str:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # IPv6 in /proc/net/tcp6 is four host-order (little-endian) 32-bit words.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def parse_net_tcp(text: str) -> list[Listener]:
    """LISTEN sockets of /proc/net/tcp or tcp6."""
    out: list[Listener] = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10 or parts[3] != "0A":
            continue
        addr, _, port = parts[1].rpartition(":")
        try:
            out.append(Listener(_hex_address(addr), int(port, 16), int(parts[9])))
        except ValueError:
            continue
    return out


def is_api_server(argv: Sequence[str]) -> bool:
    joined = " ".join(argv)
    if "vllm.entrypoints.openai.api_server" in joined or "vllm/entrypoints/openai" in joined:
        return True
    names = [a.rsplit("/", 1)[-1] for a in argv[:3]]
    return "vllm" in names and "serve" in argv


def cmdline_port(argv: Sequence[str]) -> int | None:
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--port="):
            value = arg.partition("=")[2]
        else:
            continue
        return int(value) if value.isdigit() else None
    return None


def url_port(url: str) -> int | None:
    """The TCP port a target URL points at (the one the vLLM API server listens on)."""
    try:
        parts = urlsplit(url)
        return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None


def role_of(name: str, argv: Sequence[str], *, listener: bool = False) -> str:
    for text in (argv[0] if argv else "", name):
        if text.startswith("VLLM::EngineCor"):
            return "engine_core"
        if text.startswith("VLLM::Worker"):
            return "worker"
        if text.startswith("VLLM::APIServer"):
            return "api_server"
    if listener or is_api_server(argv):
        return "api_server"
    return "other"


# --- the offload pool -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShmFile:
    name: str
    size: int


@dataclass(frozen=True, slots=True)
class PoolEstimate:
    bytes: int
    method: str  # dev_shm_files | shared_anon_group
    regions: int


def offload_pool(
    maps: Iterable[SmapsEntry], shm_files: Sequence[ShmFile] = ()
) -> PoolEstimate | None:
    """The CPU offload pool among the mappings of a target's processes, each shared object
    counted once however many processes map it.

    vLLM releases with a /dev/shm region: the sizes of the `vllm_offload_*` files mapped.
    Earlier ones (0.26: one pinned tensor per layer, each rounded up to a power of two by
    PyTorch): the largest group of equally sized shared anonymous mappings.
    """
    by_name = {f.name: f.size for f in shm_files}
    files: dict[tuple[str, int], int] = {}
    anon: dict[tuple[str, int], int] = {}
    for m in maps:
        if not is_pinned_mapping(m):
            continue
        if m.path.startswith(OFFLOAD_SHM_PREFIX):
            name = m.path.removesuffix(" (deleted)").rsplit("/", 1)[-1]
            size = by_name.get(name, m.offset + m.size)
            files[m.key] = max(files.get(m.key, 0), size)
        else:
            anon[m.key] = max(anon.get(m.key, 0), m.size)
    if files:
        return PoolEstimate(sum(files.values()), "dev_shm_files", len(files))
    groups: dict[int, int] = {}
    for size in anon.values():
        groups[size] = groups.get(size, 0) + 1
    best = max(
        ((size * n, n) for size, n in groups.items() if n >= 2),
        default=None,
    )
    if best is None or best[0] < MIN_POOL_GROUP_BYTES:
        return None
    return PoolEstimate(best[0], "shared_anon_group", best[1])


def offload_pool_families(
    pools: Mapping[str, PoolEstimate | None],
    derived: Mapping[str, Sequence[EngineDerived]],
) -> list[Family]:
    """Pool bytes per target and pool / configured buffer per engine.

    A pool guessed from mapping sizes is only shown where vLLM reports offload configured,
    so an engine without offload never shows a "pool" of unrelated pinned buffers.
    """
    pool_fam = Family("kvoffload_offload_pool_bytes")
    ratio_fam = Family("kvoffload_offload_pool_to_buffer_ratio")
    for target, pool in pools.items():
        if pool is None:
            continue
        engines = derived.get(target, ())
        if pool.method != "dev_shm_files" and not any(d.offload_enabled for d in engines):
            continue
        pool_fam.add([target], pool.bytes)
        for d in engines:
            buffer = d.offload_buffer_bytes
            if d.offload_enabled and buffer is not None and buffer > 0:
                ratio_fam.add([target, d.key.model_name, d.key.engine], pool.bytes / buffer)
    return [pool_fam, ratio_fam]


# --- reading ------------------------------------------------------------------------------


def _vanished(exc: OSError) -> bool:
    return isinstance(exc, FileNotFoundError | ProcessLookupError) or exc.errno in (
        errno.ENOENT,
        errno.ESRCH,
    )


class ProcFS:
    """File access under a procfs root."""

    def __init__(self, root: str | Path = "/proc") -> None:
        self.root = Path(root)
        self._prefix = str(self.root)  # plain string joins: pathlib cost more than the read

    def pids(self) -> list[int]:
        return sorted(int(e.name) for e in os.scandir(self._prefix) if e.name.isdigit())

    def text(self, pid: int | str, name: str) -> str:
        with open(f"{self._prefix}/{pid}/{name}", encoding="utf-8", errors="replace") as fh:  # noqa: PTH123
            return fh.read()

    def cmdline(self, pid: int) -> tuple[str, ...]:
        return parse_cmdline((self.root / str(pid) / "cmdline").read_bytes())

    def environ(self, pid: int) -> dict[str, str] | None:
        """The process environment; None where it is not ours to read (ptrace access)."""
        try:
            return parse_environ((self.root / str(pid) / "environ").read_bytes())
        except OSError:
            return None

    def listeners(self, pid: int | None = None) -> list[Listener]:
        base = self.root / "net" if pid is None else self.root / str(pid) / "net"
        out: list[Listener] = []
        for name in ("tcp", "tcp6"):
            try:
                out += parse_net_tcp((base / name).read_text(encoding="ascii", errors="replace"))
            except OSError:
                continue  # no IPv6, or the process is gone
        return out

    def socket_inodes(self, pid: int) -> set[int]:
        out: set[int] = set()
        try:
            entries = list(os.scandir(self.root / str(pid) / "fd"))
        except OSError:
            return out  # gone, or not ours to read
        for e in entries:
            try:
                link = str(Path(e.path).readlink())
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(int(link[8:-1]))
        return out


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
    pool: PoolEstimate | None
    smaps_denied: tuple[int, ...]
    # The vLLM server's command line (its KV-transfer flags) and environment (None: unreadable).
    launch_argv: tuple[str, ...] = ()
    launch_environ: Mapping[str, str] | None = None

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


StatVfs = Callable[[str], os.statvfs_result]


def dev_shm_usage(statvfs: StatVfs, path: str) -> tuple[int, int]:
    st = statvfs(path)
    size = st.f_blocks * st.f_frsize
    return size, size - st.f_bfree * st.f_frsize


@dataclass(frozen=True, slots=True)
class _Root:
    pid: int
    starttime: int
    method: str


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
        self.port = port
        self.pid = pid
        self.fs = ProcFS(procfs)
        self.shm = Path(shm)
        self.single_target = single_target
        self.statvfs = statvfs
        self.snapshot: ProcfsSnapshot | None = None
        self._root: _Root | None = None
        self._miss: tuple[float, CollectError] | None = None  # last failed discovery
        self._smaps_cache: dict[int, tuple[tuple[int, int], float, list[SmapsEntry] | None]] = {}
        self._tree_cache: tuple[_Root, float, list[int]] | None = None
        self._denied_logged: set[int] = set()

    async def start(self) -> None:
        self.health.started = True

    async def stop(self) -> None:
        return None

    async def collect(self) -> None:
        try:
            snap = await asyncio.to_thread(self.read)
        except Exception:
            self.snapshot = None
            raise
        self.snapshot = snap

    # hooks -------------------------------------------------------------------------------

    def root_pid(self) -> int | None:
        """The last vLLM root process found (kept while a collection is in flight)."""
        return self._root.pid if self._root is not None else None

    def pool(self) -> PoolEstimate | None:
        return self.snapshot.pool if self.snapshot else None

    def launch_config(self, target: str) -> LaunchConfig | None:
        """The target's KV-transfer configuration from its command line (Exporter._hook)."""
        snap = self.snapshot
        if target != self.target or snap is None or not snap.launch_argv:
            return None
        return launch_config(snap.launch_argv, snap.launch_environ)

    # discovery ---------------------------------------------------------------------------

    def _stat(self, pid: int) -> Stat | None:
        try:
            return parse_stat(self.fs.text(pid, "stat"))
        except OSError as exc:
            if _vanished(exc):
                return None
            raise
        except (ValueError, IndexError):
            return None

    def _still(self, root: _Root) -> bool:
        st = self._stat(root.pid)
        return st is not None and st.starttime == root.starttime and st.state != "Z"

    def _argv(self, pid: int) -> tuple[str, ...]:
        try:
            return self.fs.cmdline(pid)
        except OSError:
            return ()

    def _by_port(self, port: int, candidates: Sequence[int]) -> int | None:
        inodes = {ln.inode for ln in self.fs.listeners() if ln.port == port}
        # A sidecar may share only the PID namespace: look in the candidates' own netns too.
        for pid in candidates:
            inodes |= {ln.inode for ln in self.fs.listeners(pid) if ln.port == port}
        inodes.discard(0)
        if not inodes:
            return None
        pids = list(candidates) + [p for p in self.fs.pids() if p not in set(candidates)]
        owners = [p for p in pids if self.fs.socket_inodes(p) & inodes]
        if not owners:
            return None
        owner_set = set(owners)
        # Several processes may hold the socket (forked workers): take the topmost.
        for pid in owners:
            st = self._stat(pid)
            if st is not None and st.ppid not in owner_set:
                return pid
        return owners[0]

    def _discover(self) -> _Root:
        if self.pid is not None:
            st = self._stat(self.pid)
            if st is None:
                self._root = None
                raise CollectError(
                    ErrorKind.UNAVAILABLE,
                    f"configured vLLM pid {self.pid} does not exist in {self.fs.root} "
                    "(does the exporter share the vLLM PID namespace?)",
                    absent=True,
                )
            self._root = _Root(self.pid, st.starttime, "pid")
            return self._root
        if self._root is not None and self._still(self._root):
            return self._root
        # Scanning every process's command line costs ~10 ms on a busy host; while nothing is
        # found, look again only every DISCOVERY_RETRY seconds.
        if self._miss is not None and time.monotonic() - self._miss[0] < DISCOVERY_RETRY:
            raise self._miss[1]
        try:
            root = self._scan()
        except CollectError as err:
            if err.absent:
                self._miss = (time.monotonic(), err)
            raise
        self._miss = None
        return root

    def _scan(self) -> _Root:
        try:
            all_pids = self.fs.pids()
        except OSError as exc:
            raise CollectError(
                ErrorKind.UNAVAILABLE, f"cannot list {self.fs.root}: {exc}"
            ) from None
        servers: list[int] = []
        engines: list[int] = []
        for pid in all_pids:
            argv = self._argv(pid)
            if not argv:
                continue
            if is_api_server(argv) or argv[0].startswith("VLLM::APIServer"):
                servers.append(pid)
            elif argv[0].startswith("VLLM::EngineCore"):
                engines.append(pid)
        found: tuple[int, str] | None = None
        if self.port is not None:
            owner = self._by_port(self.port, servers)
            if owner is not None:
                found = (owner, "port")
        if found is None:
            port = self.port or DEFAULT_VLLM_PORT
            matching = [
                p for p in servers if (cmdline_port(self._argv(p)) or DEFAULT_VLLM_PORT) == port
            ]
            pick = matching or (servers if len(servers) == 1 and self.single_target else [])
            pick = pick or (engines if len(engines) == 1 and self.single_target else [])
            if pick:
                found = (min(pick), "cmdline")
        if found is None:
            raise CollectError(
                ErrorKind.UNAVAILABLE,
                f"no vLLM process for port {self.port} is visible in {self.fs.root} "
                "(share the PID namespace with vLLM, or set --vllm-pid / targets[].pid)",
                absent=True,
            )
        st = self._stat(found[0])
        if st is None:
            raise CollectError(
                ErrorKind.UNAVAILABLE, f"vLLM pid {found[0]} exited during discovery", absent=True
            )
        root = _Root(found[0], st.starttime, found[1])
        if self._root is None or self._root.pid != root.pid:
            log_event(
                log,
                logging.INFO,
                "vllm_process_found",
                target=self.target,
                pid=root.pid,
                method=root.method,
            )
        self._root = root
        return root

    def _members(self, root: _Root) -> list[int]:
        """The root's process tree, rescanned every TREE_REFRESH seconds."""
        now = time.monotonic()
        cached = self._tree_cache
        if cached is not None and cached[0] == root and now - cached[1] < TREE_REFRESH:
            return cached[2]
        tree = self._tree(root.pid)
        self._tree_cache = (root, now, tree)
        return tree

    def _tree(self, root: int) -> list[int]:
        children: dict[int, list[int]] = {}
        for pid in self.fs.pids():
            st = self._stat(pid)
            if st is not None:
                children.setdefault(st.ppid, []).append(pid)
        out: list[int] = []
        todo = [root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, ()))
        return out

    # reading -----------------------------------------------------------------------------

    def _process(self, pid: int, root: _Root) -> tuple[ProcessMemory, bool] | None:
        """One process' memory, or None if it exited meanwhile; the flag says smaps was
        readable."""
        try:
            status = parse_status(self.fs.text(pid, "status"))
            argv = self._argv(pid)
        except OSError as exc:
            if _vanished(exc):
                return None
            raise CollectError(ErrorKind.UNAVAILABLE, f"pid {pid} status: {exc}") from None
        if status.state == "Z":
            return None
        maps: list[SmapsEntry] | None
        st = self._stat(pid)
        ident = (pid, st.starttime if st is not None else -1)
        cached = self._smaps_cache.get(pid)
        now = time.monotonic()
        if cached is not None and cached[0] == ident and now - cached[1] < SMAPS_REFRESH:
            # A large process's smaps is thousands of mappings (~10 ms to read and parse);
            # pinned pools are allocated at start-up, so a slower refresh loses nothing.
            maps = cached[2]
        else:
            try:
                maps = parse_smaps(self.fs.text(pid, "smaps"))
            except OSError as exc:
                if _vanished(exc) and not (self.fs.root / str(pid)).exists():
                    return None
                maps = None  # EACCES without ptrace rights: pinned stays unknown
            except (ValueError, IndexError):
                maps = None
            if maps is not None:
                maps = [m for m in maps if is_pinned_mapping(m)]
            self._smaps_cache[pid] = (ident, now, maps)
        role = role_of(status.name, argv, listener=pid == root.pid and root.method == "port")
        pinned_maps = tuple(m for m in maps or () if is_pinned_mapping(m))
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

    def _launch(self, root_pid: int) -> tuple[tuple[str, ...], Mapping[str, str] | None]:
        """argv and environment of the process holding vLLM's serving flags: the root, or
        (a root found by --vllm-pid may be the EngineCore, titled by setproctitle) the
        nearest ancestor whose command line has flags."""
        pid = root_pid
        for _ in range(4):
            argv = self._argv(pid)
            if is_vllm_server(argv):
                return argv, self.fs.environ(pid)
            st = self._stat(pid)
            if st is None or st.ppid <= 1:
                break
            pid = st.ppid
        return (), None

    def _dev_shm(self, root_pid: int) -> tuple[int, int] | None:
        # The vLLM process' own view first (its mount namespace), then ours.
        for path in (self.fs.root / str(root_pid) / "root" / "dev" / "shm", self.shm):
            try:
                return dev_shm_usage(self.statvfs, str(path))
            except OSError:
                continue
        return None

    def read(self) -> ProcfsSnapshot:
        root = self._discover()
        processes: list[ProcessMemory] = []
        denied: list[int] = []
        tree = self._members(root)
        for stale in set(self._smaps_cache) - set(tree):
            del self._smaps_cache[stale]
        for pid in tree:
            got = self._process(pid, root)
            if got is None:
                self._tree_cache = None  # a member exited: look for its successor next cycle
                continue
            processes.append(got[0])
            if not got[1]:
                denied.append(pid)
        if not processes:
            self._root = None
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
        launch = self._launch(root.pid)
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
            launch_argv=launch[0],
            launch_environ=launch[1],
        )

    # families ----------------------------------------------------------------------------

    def families(self) -> Iterable[Family]:
        snap = self.snapshot
        if snap is None:
            return []
        names = (
            "kvoffload_process_pinned_bytes",
            "kvoffload_process_resident_bytes",
            "kvoffload_process_resident_anon_bytes",
            "kvoffload_process_resident_shmem_bytes",
            "kvoffload_process_locked_bytes",
        )
        fam = {n: Family(n) for n in names}
        for p in snap.processes:
            labels = [self.target, str(p.pid), p.role]
            for name, value in zip(
                names, (p.pinned, p.resident, p.anon, p.shmem, p.locked), strict=True
            ):
                if value is not None:
                    fam[name].add(labels, value)
        out = list(fam.values())
        if snap.dev_shm is not None:
            size = Family("kvoffload_dev_shm_size_bytes")
            size.add([self.target], snap.dev_shm[0])
            used = Family("kvoffload_dev_shm_used_bytes")
            used.add([self.target], snap.dev_shm[1])
            out += [size, used]
        return out
