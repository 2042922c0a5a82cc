"""Container memory of the vLLM process: limit, usage and headroom from its cgroup (v2 or v1).

The cgroup that matters is vLLM's, not the exporter's: it is found from
/proc/PID/cgroup of the target's root process and read under --path.cgroup. The source
takes that pid (and the processes' own anon + shmem) through `follow()`, which the runtime
calls each cycle from the procfs snapshot; without it, the configured pid is used. Pinned
offload pools are shmem, which cannot be reclaimed without swap, so headroom is the
limit minus anon + shmem (page cache is left out: the kernel reclaims it before an OOM
kill). Where vLLM's cgroup is not visible (a Kubernetes sidecar sees its own cgroup
namespace only), --memory-limit supplies the limit and the processes' own anon + shmem
from /proc stand in for the cgroup's. Rendering: exporter/render/cgroup.py.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from exporter.logs import log_event
from exporter.options import Option, Registration
from exporter.sources import Clock, CollectError, ErrorKind, Health

log = logging.getLogger("kvoe.cgroup")

REGISTRATION = Registration(
    "cgroup",
    True,
    "read the vLLM container's memory limit and usage",
    (
        Option("path.cgroup", "str", "/sys/fs/cgroup", "cgroup filesystem mount point", "PATH"),
        Option(
            "memory-limit",
            "bytes",
            0,
            "vLLM container memory limit when its cgroup is not visible here (0: from the cgroup)",
            "SIZE",
        ),
    ),
)

# cgroup v1 says "no limit" with LONG_MAX rounded down to a page (9223372036854771712);
# anything this large is no limit on any real machine.
V1_UNLIMITED = 1 << 60


# --- pure parsers -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcCgroup:
    v2: str | None  # the unified hierarchy path ("0::/path")
    v1_memory: str | None  # the v1 memory controller path ("N:memory:/path")


def parse_proc_cgroup(text: str) -> ProcCgroup:
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return ProcCgroup(v2, v1)


def parse_limit(text: str) -> int | None:
    """memory.max / memory.limit_in_bytes -> bytes, None for no limit."""
    value = text.strip()
    if value == "max":
        return None
    number = int(value)
    return None if number >= V1_UNLIMITED else number


# Line breaks of str.splitlines() other than "\n": with none of them, a MULTILINE regex's
# lines are splitlines()' lines.
_ODD_BREAKS_RE = re.compile("[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


@lru_cache(maxsize=8)
def _stat_keys_re(keys: frozenset[str]) -> re.Pattern[str]:
    return re.compile("^(" + "|".join(re.escape(k) for k in sorted(keys)) + ") (.*)$", re.MULTILINE)


def parse_memory_stat(text: str, keys: frozenset[str] | None = None) -> dict[str, int]:
    """memory.stat -> {key: value}; with `keys`, only those (found by one regex: the
    other 30-50 lines are never split)."""
    if keys is None or _ODD_BREAKS_RE.search(text) is not None:
        lines: list[tuple[str, str]] = [line.partition(" ")[::2] for line in text.splitlines()]
    else:
        lines = _stat_keys_re(keys).findall(text)
    out: dict[str, int] = {}
    for key, value in lines:
        if (keys is None or key in keys) and value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


V2_STAT_KEYS = frozenset(("anon", "shmem"))
V1_STAT_KEYS = frozenset(("hierarchical_memory_limit", "total_rss", "rss", "total_shmem", "shmem"))


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    version: int  # 2, 1, or 0 when only --memory-limit and /proc are known
    path: str  # what was read, for the log and status page
    limit: int | None  # effective: the smallest limit of the cgroup and its ancestors
    usage: int | None  # memory.current / memory.usage_in_bytes
    anon: int | None
    shmem: int | None
    headroom: int | None  # limit - (anon + shmem), at the tightest level

    @property
    def unreclaimable(self) -> int | None:
        if self.anon is None or self.shmem is None:
            return None
        return self.anon + self.shmem

    @property
    def headroom_usage(self) -> int | None:
        """The usage the limit is weighed against (the advisor's MemoryState.usage_bytes):
        anon + shmem, or where the cgroup's are unknown (only --memory-limit and /proc),
        limit - headroom, i.e. the processes' own anon + shmem."""
        used = self.unreclaimable
        if used is None and self.limit is not None and self.headroom is not None:
            used = self.limit - self.headroom
        return used


def headroom(limit: int | None, anon: int | None, shmem: int | None) -> int | None:
    if limit is None or anon is None or shmem is None:
        return None
    return limit - anon - shmem


# --- reading ------------------------------------------------------------------------------


def _read_optional(path: str | Path) -> str | None:
    """A missing file is None (no controller, root cgroup); any other failure is an error."""
    try:
        with open(path, "rb", buffering=0) as fh:  # noqa: PTH123 - a plain read, str paths
            return fh.read().decode("ascii", "replace").replace("\r\n", "\n").replace("\r", "\n")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CollectError(
            ErrorKind.UNAVAILABLE, f"cannot read {path}: {exc.strerror or exc}"
        ) from None


def _parse(path: str | Path, text: str) -> int | None:
    try:
        return parse_limit(text)
    except ValueError:
        raise CollectError(ErrorKind.PARSE, f"{path}: unexpected content {text[:40]!r}") from None


def _parts(rel: str) -> list[str]:
    # As Path.joinpath takes them: empty and "." components drop out.
    return [p for p in rel.split("/") if p and p != "."]


def _join(base: str, parts: list[str]) -> str:
    """str(Path(base).joinpath(*parts)) for a base that is already a str(Path)."""
    if not parts:
        return base
    return (base if base.endswith("/") else base + "/") + "/".join(parts)


def read_v2(root: Path, rel: str, override: int | None = None) -> CgroupMemory:
    return _read_v2(str(root), _parts(rel), override, None)[0]


def _read_v2(
    root: str, parts: list[str], override: int | None, levels: tuple[int, ...] | None
) -> tuple[CgroupMemory, tuple[int, ...]]:
    """The view, and the depths whose memory.max held a limit. `levels`: read only those
    depths' memory.max (None: every level from the cgroup up to the root)."""
    own = _join(root, parts)
    current = _read_optional(own + "/memory.current")
    stat_text = _read_optional(own + "/memory.stat")
    if current is None and stat_text is None:
        raise CollectError(
            ErrorKind.UNAVAILABLE,
            f"no memory controller files in {own} (memory controller not enabled?)",
            absent=True,
        )
    stat = parse_memory_stat(stat_text or "", V2_STAT_KEYS)
    anon, shmem = stat.get("anon"), stat.get("shmem")
    limits: list[tuple[int, int | None]] = []
    limited: list[int] = []
    for depth in range(len(parts), -1, -1) if levels is None else levels:
        level = _join(root, parts[:depth])
        raw = _read_optional(level + "/memory.max")
        if raw is None:
            continue
        limit = _parse(level + "/memory.max", raw)
        if limit is None:
            continue
        limited.append(depth)
        level_stat = (
            stat
            if depth == len(parts)
            else parse_memory_stat(_read_optional(level + "/memory.stat") or "", V2_STAT_KEYS)
        )
        limits.append((limit, headroom(limit, level_stat.get("anon"), level_stat.get("shmem"))))
    usage = _parse(own + "/memory.current", current) if current is not None else None
    if override is not None:
        view = CgroupMemory(2, own, override, usage, anon, shmem, headroom(override, anon, shmem))
        return view, tuple(limited)
    rooms = [h for _, h in limits if h is not None]
    view = CgroupMemory(
        version=2,
        path=own,
        limit=min((lim for lim, _ in limits), default=None),
        usage=usage,
        anon=anon,
        shmem=shmem,
        headroom=min(rooms, default=None),
    )
    return view, tuple(limited)


def read_v1(base: Path, rel: str, override: int | None = None) -> CgroupMemory:
    return _read_v1(str(base), _parts(rel), override)


def _read_v1(base: str, parts: list[str], override: int | None) -> CgroupMemory:
    own = _join(base, parts)
    usage_text = _read_optional(own + "/memory.usage_in_bytes")
    limit_text = _read_optional(own + "/memory.limit_in_bytes")
    stat_text = _read_optional(own + "/memory.stat")
    if usage_text is None and stat_text is None:
        raise CollectError(
            ErrorKind.UNAVAILABLE, f"no memory controller files in {own}", absent=True
        )
    stat = parse_memory_stat(stat_text or "", V1_STAT_KEYS)
    limits = [
        v
        for v in (
            _parse(own + "/memory.limit_in_bytes", limit_text) if limit_text else None,
            # The effective limit, ancestors included.
            stat.get("hierarchical_memory_limit"),
        )
        if v is not None and v < V1_UNLIMITED
    ]
    limit = override if override is not None else min(limits, default=None)
    # total_* include descendants, like v2's numbers do.
    anon = stat.get("total_rss", stat.get("rss"))
    shmem = stat.get("total_shmem", stat.get("shmem"))
    usage = _parse(own + "/memory.usage_in_bytes", usage_text) if usage_text else None
    return CgroupMemory(1, own, limit, usage, anon, shmem, headroom(limit, anon, shmem))


@dataclass(frozen=True, slots=True)
class Located:
    version: int
    base: Path  # the hierarchy's mount (v1: the memory controller's)
    rel: str


def locate(root: Path, target: ProcCgroup, own: ProcCgroup | None) -> Located | str:
    """Where the target's memory cgroup is under `root`, or why it cannot be reached."""
    if target.v1_memory is not None:
        # v1 or hybrid: memory is accounted in the v1 hierarchy.
        base = root / "memory" if (root / "memory").is_dir() else root
        version, rel, mine = 1, target.v1_memory, own.v1_memory if own else None
    elif target.v2 is not None:
        base, version, rel, mine = root, 2, target.v2, own.v2 if own else None
    else:
        return "no memory cgroup in /proc/PID/cgroup"
    if rel.startswith("/.."):
        return (
            f"cgroup {rel} is outside this container's cgroup namespace "
            "(a sidecar sees only its own cgroup)"
        )
    if base.joinpath(*[p for p in rel.split("/") if p]).is_dir():
        return Located(version, base, rel)
    # Without a cgroup namespace the mount shows only our own cgroup at its root: the
    # target's path is unreachable unless it is ours too (same container).
    if mine is not None and mine == rel:
        return Located(version, base, "/")
    return f"cgroup {rel} is not under {base}"


# --- the source -----------------------------------------------------------------------------

# How long a located cgroup is read without locating it again (while the pid and its
# /proc/PID/cgroup stay the same and the reads succeed): the exporter's own cgroup and the
# ancestors' limits are taken from the locating.
LOCATE_REFRESH = 30.0


@dataclass(slots=True)
class _Known:
    """A located cgroup: for which pid and /proc/PID/cgroup text, since when, where."""

    pid: int
    text: str
    since: float
    where: Located
    base: str
    parts: list[str]
    levels: tuple[int, ...] | None = None  # v2: the depths whose memory.max held a limit


class CgroupSource:
    """The `cgroup:<target>` collector."""

    def __init__(
        self,
        target: str,
        *,
        pid: int | None = None,
        procfs_root: str | Path = "/proc",
        cgroup_root: str | Path = "/sys/fs/cgroup",
        memory_limit: int | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.target = target
        self.name = f"cgroup:{target}"
        self.health = Health(self.name, clock)
        self.pid = pid
        self.procfs_root = Path(procfs_root)
        self.cgroup_root = Path(cgroup_root)
        self.memory_limit = memory_limit or None
        self._followed_pid: int | None = None
        self._unreclaimable: int | None = None
        self._view: CgroupMemory | None = None
        self._last_path: str | None = None
        self._known: _Known | None = None  # where the last located cgroup is

    async def start(self) -> None:
        self.health.started = True

    async def stop(self) -> None:
        return None

    def follow(self, pid: int | None, unreclaimable_bytes: int | None) -> None:
        """What procfs found for this target, for the next collection: vLLM's root pid
        (preferred over the configured one; None: not known) and its processes' anon +
        shmem (ProcfsSnapshot.unreclaimable_bytes(); used only with --memory-limit where
        the cgroup is not visible)."""
        self._followed_pid = pid
        self._unreclaimable = unreclaimable_bytes

    def snapshot(self) -> CgroupMemory | None:
        """The last successful collection; None before one and after a failed one.
        Never blocks, never raises."""
        return self._view

    def _followed(self) -> tuple[int | None, int | None]:
        return self._followed_pid, self._unreclaimable

    async def collect(self) -> None:
        try:
            # The known cgroup's few small pseudo-files are read inline (cheaper than a
            # thread hop); locating it (directories, /proc) goes through a thread.
            view = self._read_known()
            if view is None:
                view = await asyncio.to_thread(self.read)
        except CollectError:
            self._view = None
            raise
        if view.path != self._last_path:
            log_event(log, logging.INFO, "cgroup_found", target=self.target, path=view.path)
            self._last_path = view.path
        self._view = view

    def _without_cgroup(self, reason: str, used: int | None) -> CgroupMemory:
        """--memory-limit with the processes' own memory, or absent with the reason."""
        if self.memory_limit is None:
            raise CollectError(
                ErrorKind.UNAVAILABLE,
                f"{reason}; mount the host cgroup filesystem (--path.cgroup) "
                "or give --memory-limit",
                absent=True,
            )
        room = self.memory_limit - used if used is not None else None
        return CgroupMemory(
            0, f"--memory-limit ({reason})", self.memory_limit, None, None, None, room
        )

    def _proc_cgroup(self, pid: int) -> str:
        with open(f"{self.procfs_root}/{pid}/cgroup", encoding="utf-8") as fh:  # noqa: PTH123
            return fh.read()

    def _read_located(self, known: _Known) -> CgroupMemory:
        if known.where.version == 2:
            view, levels = _read_v2(known.base, known.parts, self.memory_limit, known.levels)
            known.levels = levels
            return view
        return _read_v1(known.base, known.parts, self.memory_limit)

    def _read_known(self) -> CgroupMemory | None:
        """The cgroup located before, if it still is vLLM's: the same pid, the same
        /proc/PID/cgroup, located less than LOCATE_REFRESH s ago and readable. None: locate
        it afresh (`read`)."""
        known = self._known
        followed, _ = self._followed()
        pid = followed if followed is not None else self.pid
        if known is None or pid != known.pid or time.monotonic() - known.since > LOCATE_REFRESH:
            return None
        try:
            if self._proc_cgroup(pid) != known.text:
                return None
            return self._read_located(known)
        except (OSError, CollectError):
            self._known = None  # read again, from the start, by read()
            return None

    def read(self) -> CgroupMemory:
        view = self._read_known()
        return view if view is not None else self._locate_and_read()

    def _locate_and_read(self) -> CgroupMemory:
        self._known = None
        followed, used = self._followed()
        pid = followed if followed is not None else self.pid
        if pid is None:
            return self._without_cgroup("the vLLM process is not known yet", used)
        try:
            text = self._proc_cgroup(pid)
        except OSError as exc:
            return self._without_cgroup(
                f"cannot read /proc/{pid}/cgroup: {exc.strerror or exc}", used
            )
        target = parse_proc_cgroup(text)
        try:
            own: ProcCgroup | None = parse_proc_cgroup(
                (self.procfs_root / "self" / "cgroup").read_text(encoding="utf-8")
            )
        except OSError:
            own = None
        where = locate(self.cgroup_root, target, own)
        if isinstance(where, str):
            return self._without_cgroup(f"pid {pid}: {where}", used)
        known = _Known(pid, text, time.monotonic(), where, str(where.base), _parts(where.rel))
        view = self._read_located(known)
        self._known = known  # only once it could be read
        return view
