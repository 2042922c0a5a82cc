"""Pure parsers of /proc text and the memory heuristics built on them.

Every function here is a function of text (or of parsed values): /proc/PID/status, smaps,
smaps_rollup, stat, cmdline and /proc/net/tcp{,6}, what counts as pinned host memory, the
offload pool among a target's mappings, and how a vLLM process is recognised. Reading is
in discovery.py and source.py; tests run these on recorded literal text.

Pinned host memory is invisible to VmLck/VmPin: PyTorch's pinned allocations
(cudaHostAlloc) are shared anonymous mappings that the kernel names `/dev/zero (deleted)`
and counts as RssShmem, and vLLM's newer offload region is a /dev/shm file registered
with cudaHostRegister. So "pinned" here is what those mappings hold, read per mapping
from /proc/PID/smaps.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

KIB = 1024
MIB = 1 << 20
ROLES = ("api_server", "engine_core", "worker", "other")
SHARED_ANON_PATH = "/dev/zero (deleted)"
OFFLOAD_SHM_PREFIX = "/dev/shm/vllm_offload_"
# Smallest group of identical shared anonymous mappings taken for an offload pool: CUDA's
# own shared mappings and vLLM's small pinned staging buffers stay well below it.
MIN_POOL_GROUP_BYTES = 64 * MIB


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


_STATUS_RE = re.compile(
    r"^(Name|State|Pid|PPid|VmLck|VmPin|VmRSS|RssAnon|RssFile|RssShmem):(.*)$", re.MULTILINE
)
# Line breaks of str.splitlines() other than "\n": with none of them, the regex's lines
# are splitlines()' lines.
_ODD_BREAKS_RE = re.compile("[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def parse_status(text: str) -> ProcStatus:
    """/proc/PID/status -> sizes in bytes (None for fields the kernel does not show)."""
    fields: dict[str, str]
    if _ODD_BREAKS_RE.search(text) is None:
        # The ten fields used, found in C: the other ~50 lines are never split.
        fields = {key: value.strip() for key, value in _STATUS_RE.findall(text)}
    else:
        fields = {}
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


# The header of a shared writable mapping (kernel layout: "start-end perms offset dev inode
# path"), the only kind is_pinned_mapping() takes, matched on a line found by its perms.
_SHARED_RW_HEADER_RE = re.compile(
    r"([0-9a-fA-F]+)-([0-9a-fA-F]+) (rw[-x]s) +([0-9a-fA-F]+) +(\S+) +(\d+)(?:[ \t]+(.*))?"
)
_SHARED_RW_PERMS = (" rw-s ", " rwxs ")
_HEADER_RE = re.compile(r"\n[0-9a-fA-F]+-[0-9a-fA-F]+ ")  # any mapping's: it ends a block
_FIELDS_RE = re.compile(r"\n(Rss|Locked):(.*)")


def _shared_rw_lines(text: str) -> list[int]:
    """Where the lines holding a shared writable perms field start (str.find, in C)."""
    starts: set[int] = set()
    for perms in _SHARED_RW_PERMS:
        at = text.find(perms)
        while at >= 0:
            starts.add(text.rfind("\n", 0, at) + 1)
            at = text.find(perms, at + 1)
    return sorted(starts)


def pinned_mappings_in(pieces: Iterable[str]) -> list[SmapsEntry]:
    """pinned_mappings() of the text the pieces join to, holding at most one piece and the
    mapping block it cuts: each piece is parsed up to its last mapping header, the rest
    carried into the next."""
    out: list[SmapsEntry] = []
    carry = ""
    for piece in pieces:
        text = carry + piece
        cut = _last_header(text)
        if cut <= 0:
            carry = text
            continue
        out += pinned_mappings(text[:cut])
        carry = text[cut:]
    if carry:
        out += pinned_mappings(carry)
    return out


def _last_header(text: str) -> int:
    """Where the last mapping header that a newline precedes starts; 0 if none does."""
    at = len(text)
    while (at := text.rfind("\n", 0, at)) >= 0:
        if _HEADER_RE.match(text, at):
            return at + 1
    return 0


def pinned_mappings(text: str) -> list[SmapsEntry]:
    """The mappings of /proc/PID/smaps that is_pinned_mapping() takes, as parse_smaps()
    reads them from the kernel's layout, without splitting the rest: the shared writable
    mappings' headers are found by their perms field (a few among vLLM's thousands of
    mappings), and only their blocks are read."""
    out: list[SmapsEntry] = []
    for start in _shared_rw_lines(text):
        stop = text.find("\n", start)
        stop = len(text) if stop < 0 else stop
        head = _SHARED_RW_HEADER_RE.fullmatch(text, start, stop)
        if head is None:
            continue
        lo, hi, perms, offset, dev, inode, path = head.groups()
        path = path.strip() if path else ""
        if path != SHARED_ANON_PATH and not path.startswith(OFFLOAD_SHM_PREFIX):
            continue
        nxt = _HEADER_RE.search(text, stop)
        end = nxt.start() if nxt is not None else len(text)
        rss = locked = 0
        for m in _FIELDS_RE.finditer(text, stop, end):
            value = int(m.group(2).split()[0]) * KIB
            if m.group(1) == "Rss":
                rss = value
            else:
                locked = value
        out.append(
            SmapsEntry(
                start=int(lo, 16),
                end=int(hi, 16),
                perms=perms,
                offset=int(offset, 16),
                dev=dev,
                inode=int(inode),
                path=path,
                rss=rss,
                locked=locked,
            )
        )
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


StatVfs = Callable[[str], os.statvfs_result]


def dev_shm_usage(statvfs: StatVfs, path: str) -> tuple[int, int]:
    """(size, used) bytes of the tmpfs at `path`, from the given statvfs."""
    st = statvfs(path)
    size = st.f_blocks * st.f_frsize
    return size, size - st.f_bfree * st.f_frsize
