"""Finding a target's vLLM processes under a procfs root.

`ProcFS` reads files under a configurable root (--path.procfs), so tests run on a fixture
tree. `Discovery` finds the target's vLLM root process (a configured pid, the owner of the
listening socket of the target's port, or an API server command line with that port) and
its process tree, remembering both between collections: a vLLM restart is noticed by the
root's start time, and the tree is rescanned every TREE_REFRESH seconds or when asked.
"""

from __future__ import annotations

import codecs
import errno
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from exporter.logs import log_event
from exporter.sources import CollectError, ErrorKind
from exporter.sources.procfs.parsers import (
    Listener,
    Stat,
    cmdline_port,
    is_api_server,
    parse_cmdline,
    parse_net_tcp,
    parse_stat,
)
from exporter.vllm_cmdline import is_vllm_server, parse_environ

log = logging.getLogger("kvoe.procfs")

DISCOVERY_RETRY = 30.0
# ProcFS.pieces' read size. Below glibc's initial mmap threshold (128 KiB): a large file read
# whole (a GPU vLLM's smaps is megabytes) is a transient allocation that raises the
# threshold, and the heap kept the peak; the CI soak saw RSS grow in steps with every smaps
# refresh while Python's heap stayed flat (docs/reliability.md "Resident memory").
PIECE_BYTES = 64 * 1024
# The vLLM process tree is spawned at start-up; rescanning every process's parent each
# cycle was most of this collector's CPU. A member that vanishes forces a rescan.
TREE_REFRESH = 10.0
DEFAULT_VLLM_PORT = 8000


def _newlines(text: str) -> str:
    # Universal newlines, as open() reads them.
    if "\r" in text:
        return text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def vanished(exc: OSError) -> bool:
    """The process (or its file) is gone: absence, not a failure."""
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

    def path(self, pid: int | str, name: str) -> str:
        """str(root / str(pid) / name), joined as a string."""
        return f"{self._prefix}/{pid}/{name}"

    def text(self, pid: int | str, name: str) -> str:
        """A file as text (UTF-8, bad bytes replaced, newlines universal as open() reads
        them). Plain os.read: a text-mode file object cost more than reading /proc's
        small pseudo-files."""
        fd = os.open(self.path(pid, name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks: list[bytes] = []
            while chunk := os.read(fd, PIECE_BYTES):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return _newlines(b"".join(chunks).decode("utf-8", "replace"))

    def pieces(self, pid: int | str, name: str, size: int = PIECE_BYTES) -> Iterator[str]:
        """The text() of a file in pieces of at most `size` bytes read, so that a large file
        is never held whole; a character or a CRLF that two reads split is held back to
        the next piece."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        held = ""
        fd = os.open(self.path(pid, name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            while chunk := os.read(fd, size):
                text = held + decoder.decode(chunk)
                text, held = (text[:-1], "\r") if text.endswith("\r") else (text, "")
                if text:
                    yield _newlines(text)
            if tail := held + decoder.decode(b"", final=True):
                yield _newlines(tail)
        finally:
            os.close(fd)

    def cmdline(self, pid: int) -> tuple[str, ...]:
        return parse_cmdline((self.root / str(pid) / "cmdline").read_bytes())

    def argv(self, pid: int) -> tuple[str, ...]:
        """The command line; () where it cannot be read (gone, or not ours)."""
        try:
            return self.cmdline(pid)
        except OSError:
            return ()

    def stat(self, pid: int) -> Stat | None:
        """/proc/PID/stat; None if the process is gone or the file is garbage."""
        try:
            return parse_stat(self.text(pid, "stat"))
        except OSError as exc:
            if vanished(exc):
                return None
            raise
        except (ValueError, IndexError):
            return None

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


@dataclass(slots=True)
class Member:
    """A process of the tree as its last rescan saw it: its start time (-1: unknown) and
    command line, which (but for a setproctitle title, see `Discovery.argv`) do not change
    while it runs."""

    starttime: int
    argv: tuple[str, ...] | None = None  # read on first use
    argv_name: str | None = None  # the status Name the argv was read under


@dataclass(frozen=True, slots=True)
class Root:
    """The target's vLLM root process, identified by pid and start time."""

    pid: int
    starttime: int
    method: str  # how it was found: pid | port | cmdline


def server_command(fs: ProcFS, root_pid: int) -> tuple[tuple[str, ...], Mapping[str, str] | None]:
    """argv and environment of the process holding vLLM's serving flags: the root, or (a
    root found by --vllm-pid may be the EngineCore, titled by setproctitle) the nearest
    ancestor whose command line has flags. ((), None) if none within four levels."""
    pid = root_pid
    for _ in range(4):
        argv = fs.argv(pid)
        if is_vllm_server(argv):
            return argv, fs.environ(pid)
        st = fs.stat(pid)
        if st is None or st.ppid <= 1:
            break
        pid = st.ppid
    return (), None


class Discovery:
    """The vLLM root process of one target and its process tree, kept between cycles."""

    def __init__(
        self,
        fs: ProcFS,
        target: str,
        *,
        port: int | None,
        pid: int | None = None,
        single_target: bool = False,
    ) -> None:
        self.fs = fs
        self.target = target
        self.port = port
        self.pid = pid
        self.single_target = single_target
        self.root: Root | None = None  # the last root found (kept while a cycle is in flight)
        self._miss: tuple[float, CollectError] | None = None  # last failed discovery
        self._tree_cache: tuple[Root, float, list[int]] | None = None
        self._members: dict[int, Member] = {}  # of the cached tree
        self.generation = 0  # counts tree rescans: what is kept per tree keys on it

    def lost(self) -> None:
        """The root's processes are all gone: look for vLLM afresh next time."""
        self.root = None

    def forget_tree(self) -> None:
        """A member exited: rescan the tree next time."""
        self._tree_cache = None

    def _still(self, root: Root) -> bool:
        st = self.fs.stat(root.pid)
        return st is not None and st.starttime == root.starttime and st.state != "Z"

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
            st = self.fs.stat(pid)
            if st is not None and st.ppid not in owner_set:
                return pid
        return owners[0]

    def find(self) -> Root:
        """The root process: the configured pid, the last one found if it still runs, or a
        new scan (at most every DISCOVERY_RETRY seconds while nothing is found)."""
        if self.pid is not None:
            st = self.fs.stat(self.pid)
            if st is None:
                self.root = None
                raise CollectError(
                    ErrorKind.UNAVAILABLE,
                    f"configured vLLM pid {self.pid} does not exist in {self.fs.root} "
                    "(does the exporter share the vLLM PID namespace?)",
                    absent=True,
                )
            self.root = Root(self.pid, st.starttime, "pid")
            return self.root
        if self.root is not None and self._still(self.root):
            return self.root
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

    def _scan(self) -> Root:
        try:
            all_pids = self.fs.pids()
        except OSError as exc:
            raise CollectError(
                ErrorKind.UNAVAILABLE, f"cannot list {self.fs.root}: {exc}"
            ) from None
        servers: list[int] = []
        engines: list[int] = []
        for pid in all_pids:
            argv = self.fs.argv(pid)
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
                p for p in servers if (cmdline_port(self.fs.argv(p)) or DEFAULT_VLLM_PORT) == port
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
        st = self.fs.stat(found[0])
        if st is None:
            raise CollectError(
                ErrorKind.UNAVAILABLE, f"vLLM pid {found[0]} exited during discovery", absent=True
            )
        root = Root(found[0], st.starttime, found[1])
        if self.root is None or self.root.pid != root.pid:
            log_event(
                log,
                logging.INFO,
                "vllm_process_found",
                target=self.target,
                pid=root.pid,
                method=root.method,
            )
        self.root = root
        return root

    def members(self, root: Root) -> list[int]:
        """The root's process tree (root first), rescanned every TREE_REFRESH seconds."""
        now = time.monotonic()
        cached = self._tree_cache
        if cached is not None and cached[0] == root and now - cached[1] < TREE_REFRESH:
            return cached[2]
        tree, starts = self._tree(root.pid)
        self._tree_cache = (root, now, tree)
        self._members = {pid: Member(starts.get(pid, -1)) for pid in tree}
        self.generation += 1
        return tree

    def starttime(self, pid: int) -> int:
        """The member's start time as the last rescan read it; -1 if unknown."""
        member = self._members.get(pid)
        return member.starttime if member is not None else -1

    def argv(self, pid: int, name: str) -> tuple[str, ...]:
        """The member's command line, read once per tree rescan, and again when its
        status Name (`name`) changes: setproctitle retitles both after a fork."""
        member = self._members.get(pid)
        if member is None:
            return self.fs.argv(pid)
        if member.argv is None or member.argv_name != name:
            member.argv = self.fs.argv(pid)
            member.argv_name = name
        return member.argv

    def _tree(self, root: int) -> tuple[list[int], dict[int, int]]:
        """The root's tree (root first) and every listed process' start time."""
        children: dict[int, list[int]] = {}
        starts: dict[int, int] = {}
        for pid in self.fs.pids():
            st = self.fs.stat(pid)
            if st is not None:
                children.setdefault(st.ppid, []).append(pid)
                starts[pid] = st.starttime
        out: list[int] = []
        todo = [root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, ()))
        return out, starts
