"""vLLM process memory from /proc, on the recorded vLLM 0.26 H200 runs.

The status files, smaps_rollup and cmd.txt are the recorded ones; the per-mapping smaps
come from tests/fixtures/proc/make_smaps.py (checked against the recordings below); stat,
cmdline layout, fds, net/tcp and the extra processes around vLLM are made up to build a
whole /proc tree in a temporary directory.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from exporter.config import Config
from exporter.model.derive.engines import DeriveSettings, derive_target
from exporter.options import TargetConfig
from exporter.runtime import Exporter, build_sources
from exporter.server import make_app
from exporter.sources import CollectError, ErrorKind, execute
from exporter.sources.cgroup import CgroupSource
from exporter.sources.nvml.source import NvmlSource
from exporter.sources.procfs import source as procfs
from exporter.sources.procfs.source import (
    PoolEstimate,
    ProcessMemory,
    ProcfsSnapshot,
    ProcfsSource,
    ShmFile,
    SmapsEntry,
    cmdline_port,
    is_api_server,
    offload_pool,
    offload_pool_families,
    parse_cmdline,
    parse_net_tcp,
    parse_smaps,
    parse_smaps_rollup,
    parse_stat,
    parse_status,
    pinned_bytes,
    role_of,
    url_port,
)
from exporter.sources.vllm_http import VllmTarget
from testbed.replay import ReplayServer, files
from tests.exporter_harness import sample_value
from tests.helpers import sample_from, window_of
from tests.nvml_doubles import FakeClock, RecordedGpu, RecordedNvml, load_fast, series

FIXTURES = Path(__file__).parent / "fixtures"
RUNS = FIXTURES / "vllm-0.26.0-h200"
SMAPS = FIXTURES / "proc"
CGROUP = FIXTURES / "cgroup"
KIB = 1024
MIB = 1 << 20
GIB = 1 << 30
SHELL, API, ENGINE, TRACKER, OTHER_API = 2330, 2567, 2631, 2640, 3100
API_SOCKET, OTHER_SOCKET, ZMQ_SOCKET = 918273, 918300, 918400
VLLM_CGROUP = (
    "/kubepods.slice/kubepods-podf1e2d3c4_0000_4000_8000_000000000001.slice/"
    "cri-containerd-vllm0001.scope"
)
EXPORTER_CGROUP = VLLM_CGROUP.replace("vllm0001", "exporter0002")


def recorded(run: str, name: str) -> str:
    return (RUNS / run / name).read_text()


def argv_from_cmd(run: str, port: int) -> list[str]:
    """cmd.txt as an argv: the JSON argument stays one argument, <dir> becomes real paths."""
    text = recorded(run, "cmd.txt").strip()
    parts = re.findall(r"\{[^}]*\}|\S+", text)
    parts[0] = "/opt/venv/bin/python3"
    parts = [p.replace("<dir>", "/models/qwen3-0.6b-dummy") for p in parts]
    i = parts.index("--port")
    parts[i + 1] = str(port)
    return parts


def stat_line(pid: int, comm: str, ppid: int, starttime: int, state: str = "S") -> str:
    fields = [state, str(ppid), str(ppid), str(ppid), "0", "-1", "4194560"]
    fields += ["0"] * 4 + ["120", "35", "0", "0", "20", "0", "54", "0", str(starttime)]
    fields += ["0"] * 30
    return f"{pid} ({comm}) " + " ".join(fields) + "\n"


def small_status(pid: int, ppid: int, name: str, rss_kb: int) -> str:
    return (
        f"Name:\t{name}\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t{pid}\nPid:\t{pid}\n"
        f"PPid:\t{ppid}\nVmLck:\t       0 kB\nVmPin:\t       0 kB\nVmRSS:\t {rss_kb} kB\n"
        f"RssAnon:\t {rss_kb - 1000} kB\nRssFile:\t    1000 kB\nRssShmem:\t       0 kB\n"
    )


def build_proc(
    base: Path,
    run: str = "b_offload",
    port: int = 8000,
    *,
    fds: bool = True,
    cgroup: str = VLLM_CGROUP,
) -> Path:
    proc = base / "proc"

    def process(
        pid: int,
        *,
        status: str,
        comm: str,
        ppid: int,
        argv: list[str],
        smaps: str | None = None,
        sockets: tuple[int, ...] = (),
    ) -> Path:
        d = proc / str(pid)
        d.mkdir(parents=True)
        (d / "status").write_text(status)
        (d / "stat").write_text(stat_line(pid, comm, ppid, 1000 + pid))
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (d / "cgroup").write_text(f"0::{cgroup}\n")
        if smaps is not None:
            (d / "smaps").write_text(smaps)
        if fds:
            (d / "fd").mkdir()
            (d / "fd" / "0").symlink_to("/dev/null")
            for n, inode in enumerate(sockets, start=20):
                (d / "fd" / str(n)).symlink_to(f"socket:[{inode}]")
        return d

    process(1, status=small_status(1, 0, "tini", 900), comm="tini", ppid=0, argv=["/tini"])
    process(
        SHELL,
        status=small_status(SHELL, 1, "bash", 4000),
        comm="bash",
        ppid=1,
        argv=["bash", "run.sh"],
    )
    api = process(
        API,
        status=recorded(run, "api_status.txt"),
        comm="python3",
        ppid=SHELL,
        argv=argv_from_cmd(run, port),
        smaps=(SMAPS / f"vllm-0.26.0-h200-{run}" / "api_smaps.txt").read_text(),
        sockets=(API_SOCKET,),
    )
    engine = process(
        ENGINE,
        status=recorded(run, "engine_status.txt"),
        comm="VLLM::EngineCor",
        ppid=API,
        # setproctitle pads the title in the old argv area.
        argv=["VLLM::EngineCore" + " " * 40],
        smaps=(SMAPS / f"vllm-0.26.0-h200-{run}" / "engine_smaps.txt").read_text(),
        sockets=(ZMQ_SOCKET,),
    )
    shutil.copy(RUNS / run / "engine_smaps_rollup.txt", engine / "smaps_rollup")
    assert api.exists()
    tracker_argv = [
        "/opt/venv/bin/python3",
        "-c",
        "from multiprocessing.resource_tracker import main;main(23)",
    ]
    process(
        TRACKER,
        status=small_status(TRACKER, API, "python3", 12000),
        comm="python3",
        ppid=API,
        argv=tracker_argv,
        smaps="",
    )
    other_argv = ["/opt/venv/bin/vllm", "serve", "/models/other", "--port", "8001"]
    process(
        OTHER_API,
        status=small_status(OTHER_API, 1, "python3", 500000),
        comm="python3",
        ppid=1,
        argv=other_argv,
        smaps="",
        sockets=(OTHER_SOCKET,),
    )
    (proc / "self").mkdir()
    (proc / "self" / "cgroup").write_text(f"0::{EXPORTER_CGROUP}\n")
    head = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid"
        "  timeout inode\n"
    )
    tail = (
        "00000000:00000000 00:00000000 00000000     0        0 {inode} 1 0000000000000000"
        " 100 0 0 10 0\n"
    )
    (proc / "net").mkdir()
    (proc / "net" / "tcp").write_text(
        head
        + f"   0: 0100007F:{port:04X} 00000000:0000 0A "
        + tail.format(inode=API_SOCKET)
        + f"   1: 00000000:{8001:04X} 00000000:0000 0A "
        + tail.format(inode=OTHER_SOCKET)
        + f"   2: 0100007F:{port:04X} 0100007F:D2F0 01 "
        + tail.format(inode=777)
    )
    (proc / "net" / "tcp6").write_text(
        head
        + "   0: 00000000000000000000000000000000:15C5 00000000000000000000000000000000:0000 0A "
        + tail.format(inode=ZMQ_SOCKET)
    )
    return proc


def recorded_statvfs(run: str = "b_offload"):
    """statvfs of /dev/shm as dev_shm.txt recorded it (df -B1)."""
    line = next(x for x in recorded(run, "dev_shm.txt").splitlines() if x.startswith("tmpfs"))
    _, size, used, *_ = line.split()
    blocks, free = int(size) // 4096, (int(size) - int(used)) // 4096
    seen: list[str] = []

    def statvfs(path: str) -> os.statvfs_result:
        seen.append(path)
        return os.statvfs_result((4096, 4096, blocks, free, free, 0, 0, 0, 0, 255))

    statvfs.seen = seen  # type: ignore[attr-defined]
    return statvfs


def source(proc: Path, port: int | None = 8000, **kw) -> ProcfsSource:
    kw.setdefault("statvfs", recorded_statvfs())
    kw.setdefault("shm", proc.parent / "shm")
    return ProcfsSource("vllm-b", port=port, procfs=proc, **kw)


# --- parsers on recorded text -------------------------------------------------------------


def test_status_of_recorded_engines_shows_pinned_as_shmem_not_locked():
    b = parse_status(recorded("b_offload", "engine_status.txt"))
    a = parse_status(recorded("a_nooffload", "engine_status.txt"))
    assert (b.pid, b.ppid, b.name, b.state) == (ENGINE, API, "VLLM::EngineCor", "S")
    assert b.shmem == 950_532 * KIB and a.shmem == 33_028 * KIB
    assert b.shmem - a.shmem == 896 * MIB  # the offload pool
    assert b.locked == 0 and b.pinned_vm == 0
    assert b.resident == b.anon + b.file + b.shmem


def test_synthetic_smaps_add_up_to_the_recorded_rollup_and_status():
    for run in ("a_nooffload", "b_offload"):
        maps = parse_smaps((SMAPS / f"vllm-0.26.0-h200-{run}" / "engine_smaps.txt").read_text())
        roll = parse_smaps_rollup(recorded(run, "engine_smaps_rollup.txt"))
        status = parse_status(recorded(run, "engine_status.txt"))
        assert sum(m.rss for m in maps) == roll["Rss"] == status.resident
        assert sum(m.rss for m in maps if m.shared) == status.shmem == roll["Pss_Shmem"]
        assert sum(m.locked for m in maps) == roll["Locked"] == 0
        api = parse_smaps((SMAPS / f"vllm-0.26.0-h200-{run}" / "api_smaps.txt").read_text())
        assert sum(m.rss for m in api) == parse_status(recorded(run, "api_status.txt")).resident


def test_pinned_bytes_of_the_offload_engine():
    maps = parse_smaps((SMAPS / "vllm-0.26.0-h200-b_offload" / "engine_smaps.txt").read_text())
    assert pinned_bytes(maps) == 950_532 * KIB
    pool = [m for m in maps if m.path == "/dev/zero (deleted)" and m.size == 32 * MIB]
    assert len(pool) == 28 and all(m.perms == "rw-s" for m in pool)
    assert not any(m.path.startswith("/opt") and m.rss and m.shared for m in maps)


def test_smaps_parser_on_literal_text():
    text = (
        "7f3a40000000-7f3a42000000 rw-s 00000000 00:01 5121"
        "                       /dev/zero (deleted)\n"
        "Size:              32768 kB\nRss:               32768 kB\nLocked:                0 kB\n"
        "VmFlags: rd wr sh mr mw me ms dc dd sd\n"
        "7ffd1000-7ffd2000 rw-p 00000000 00:00 0 \n"
        "Rss:                   4 kB\n"
        "7f3a50000000-7f3a51000000 rw-s 00001000 00:1a 77 /dev/shm/vllm_offload_0.mmap\n"
        "Rss:               16384 kB\n"
    )
    a, b, c = parse_smaps(text)
    assert (a.size, a.rss, a.shared, a.key, a.path) == (
        32 * MIB,
        32 * MIB,
        True,
        ("00:01", 5121),
        "/dev/zero (deleted)",
    )
    assert (b.path, b.shared, b.rss) == ("", False, 4 * KIB)
    assert (c.offset, c.path) == (0x1000, "/dev/shm/vllm_offload_0.mmap")
    assert pinned_bytes([a, b, c]) == 48 * MIB


def test_stat_cmdline_and_tcp_parsers():
    st = parse_stat("77 (my (weird) name) S 1 77 77 0 -1 0 " + " ".join(["0"] * 12) + " 4242 0\n")
    assert (st.pid, st.comm, st.state, st.ppid, st.starttime) == (
        77,
        "my (weird) name",
        "S",
        1,
        4242,
    )
    assert parse_cmdline(b"python3\0-m\0vllm.entrypoints.openai.api_server\0") == (
        "python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
    )
    assert parse_cmdline(b"VLLM::EngineCore" + b" " * 30 + b"\0\0\0") == ("VLLM::EngineCore",)
    text = (
        "  sl  local_address rem_address   st ...\n"
        "   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 12345 1\n"
        "   1: 0100007F:1F40 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000 0 0 999 1\n"
    )
    (ln,) = parse_net_tcp(text)
    assert (ln.address, ln.port, ln.inode) == ("127.0.0.1", 8000, 12345)
    six = (
        "hdr\n   0: 00000000000000000000000001000000:1F40 00000000000000000000000000000000:0000"
        " 0A 00000000:00000000 00:00000000 00000000 0 0 55 1\n"
    )
    (ln6,) = parse_net_tcp(six)
    assert (ln6.address, ln6.port, ln6.inode) == ("::1", 8000, 55)


def test_roles_and_vllm_command_lines():
    argv = argv_from_cmd("b_offload", 8000)
    assert is_api_server(argv) and cmdline_port(argv) == 8000
    assert (
        is_api_server(["/usr/bin/vllm", "serve", "m"])
        and cmdline_port(["vllm", "serve", "--port=9"]) == 9
    )
    assert not is_api_server(["python3", "train.py"])
    assert role_of("python3", argv) == "api_server"
    assert role_of("VLLM::EngineCor", ("VLLM::EngineCore",)) == "engine_core"
    assert role_of("VLLM::Worker_TP", ("VLLM::Worker_TP1",)) == "worker"
    assert role_of("python3", ("python3", "-c", "resource_tracker")) == "other"
    assert role_of("uvicorn", ("uvicorn",), listener=True) == "api_server"
    assert url_port("http://vllm:8000") == 8000 and url_port("https://x") == 443


# --- the offload pool -----------------------------------------------------------------------


def _engine_maps(run: str) -> list[SmapsEntry]:
    return parse_smaps((SMAPS / f"vllm-0.26.0-h200-{run}" / "engine_smaps.txt").read_text())


def test_pool_of_vllm_026_is_the_group_of_per_layer_tensors():
    pool = offload_pool(_engine_maps("b_offload"))
    assert pool == PoolEstimate(896 * MIB, "shared_anon_group", 28)
    assert offload_pool(_engine_maps("a_nooffload")) is None  # CUDA's own small mappings


def test_pool_counts_a_region_shared_by_two_processes_once():
    maps = _engine_maps("b_offload")
    # The same pool objects mapped in a second (forked) process: same dev:inode.
    child = [replace(m, start=m.start + (1 << 40), end=m.end + (1 << 40)) for m in maps]
    assert offload_pool(maps + child) == PoolEstimate(896 * MIB, "shared_anon_group", 28)


def test_pool_from_dev_shm_files_uses_file_sizes():
    region = SmapsEntry(
        0x7F0000000000,
        0x7F0040000000,
        "rw-s",
        0,
        "00:1a",
        991,
        "/dev/shm/vllm_offload_4f2a.mmap",
        1 * GIB,
        0,
    )
    same_in_worker = replace(region, start=0x7E0000000000, end=0x7E0040000000)
    pinned_tensor = SmapsEntry(
        0x7D0000000000, 0x7D0002000000, "rw-s", 0, "00:01", 5, "/dev/zero (deleted)", 32 * MIB, 0
    )
    pool = offload_pool(
        [region, same_in_worker, pinned_tensor], [ShmFile("vllm_offload_4f2a.mmap", 3 * GIB)]
    )
    assert pool == PoolEstimate(3 * GIB, "dev_shm_files", 1)


def _derived(run: str):
    b = RUNS / run
    win = window_of(
        sample_from(b / "metrics_before.txt", 0.0), sample_from(b / "metrics_after.txt", 5.0)
    )
    return derive_target(win, 5.0, DeriveSettings(stale_after=30.0))


def test_pool_to_buffer_ratio_on_the_h200_run_is_1_75():
    engines = _derived("b_offload")
    pool = offload_pool(_engine_maps("b_offload"))
    fams = series(offload_pool_families({"b": pool}, {"b": engines}))
    assert fams["kvoffload_offload_pool_to_buffer_ratio"] == [
        ({"target": "b", "model_name": "qwen3-dummy", "engine": "0"}, 1.75)
    ]
    assert fams["kvoffload_offload_pool_bytes"] == [({"target": "b"}, 896 * MIB)]


def test_guessed_pool_is_not_shown_without_offload_configured():
    engines = _derived("a_nooffload")
    assert not any(d.offload_enabled for d in engines)
    guessed = PoolEstimate(896 * MIB, "shared_anon_group", 28)
    assert series(offload_pool_families({"a": guessed}, {"a": engines})) == {}
    exact = PoolEstimate(GIB, "dev_shm_files", 1)
    fams = series(offload_pool_families({"a": exact}, {"a": engines}))
    assert fams == {"kvoffload_offload_pool_bytes": [({"target": "a"}, GIB)]}


# --- reading a /proc tree -------------------------------------------------------------------


async def test_finds_vllm_by_its_port_and_reads_its_processes(tmp_path):
    proc = build_proc(tmp_path)
    src = source(proc)
    assert await execute(src, 5.0)
    snap = src.snapshot
    assert snap is not None and (snap.root_pid, snap.method) == (API, "port")
    by_pid = {p.pid: p for p in snap.processes}
    assert set(by_pid) == {API, ENGINE, TRACKER}  # the other vLLM and the shell are not ours
    assert by_pid[API].role == "api_server" and by_pid[ENGINE].role == "engine_core"
    assert by_pid[TRACKER].role == "other"
    assert by_pid[ENGINE].pinned == 950_532 * KIB
    assert by_pid[API].pinned == 0
    assert by_pid[ENGINE].locked == 0
    assert snap.pool == PoolEstimate(896 * MIB, "shared_anon_group", 28)
    assert snap.dev_shm == (137438953472, 0)
    fams = series(src.families())
    pinned = {lab["pid"]: v for lab, v in fams["kvoffload_process_pinned_bytes"]}
    assert pinned == {str(API): 0, str(ENGINE): 950_532 * KIB, str(TRACKER): 0}
    shm = fams["kvoffload_process_resident_shmem_bytes"]
    assert {lab["role"] for lab, _ in shm} == {"api_server", "engine_core", "other"}
    assert src.root_pid() == API


async def test_without_offload_the_engine_pins_only_cuda_buffers(tmp_path):
    proc = build_proc(tmp_path, "a_nooffload")
    src = source(proc, statvfs=recorded_statvfs("a_nooffload"))
    assert await execute(src, 5.0)
    engine = next(p for p in src.snapshot.processes if p.role == "engine_core")
    assert engine.pinned == 33_028 * KIB and src.snapshot.pool is None


async def test_finds_vllm_by_command_line_when_sockets_are_hidden(tmp_path):
    proc = build_proc(tmp_path, fds=False)
    src = source(proc)
    assert await execute(src, 5.0)
    assert (src.snapshot.root_pid, src.snapshot.method) == (API, "cmdline")
    other = source(proc, port=8001)
    assert await execute(other, 5.0)
    assert other.snapshot.root_pid == OTHER_API


async def test_configured_pid_wins_and_a_missing_one_is_absent(tmp_path):
    proc = build_proc(tmp_path)
    src = source(proc, port=None, pid=ENGINE)
    assert await execute(src, 5.0)
    assert [p.pid for p in src.snapshot.processes] == [ENGINE]
    gone = source(proc, pid=99999)
    assert not await execute(gone, 5.0)
    assert gone.health.error_kind == ErrorKind.UNAVAILABLE
    assert "99999" in (gone.health.error or "") and gone.health.errors_total == {}
    assert gone.root_pid() is None


async def test_no_vllm_visible_is_absence_with_a_hint(tmp_path):
    proc = build_proc(tmp_path, fds=False)
    src = source(proc, port=9999)
    assert not await execute(src, 5.0)
    assert "PID namespace" in (src.health.error or "")
    assert src.health.errors_total == {}
    assert series(src.families()) == {}


async def test_a_process_vanishing_between_listing_and_reading_is_skipped(tmp_path):
    proc = build_proc(tmp_path)
    # The tracker exited after its stat was listed: its other files are gone.
    for name in ("status", "smaps", "cmdline"):
        (proc / str(TRACKER) / name).unlink()
    src = source(proc)
    assert await execute(src, 5.0)
    assert {p.pid for p in src.snapshot.processes} == {API, ENGINE}


def _fork_like(proc: Path, like: int, pid: int, ppid: int) -> None:
    """A new child process in the fixture tree, a copy of an existing one."""
    shutil.copytree(proc / str(like), proc / str(pid), symlinks=True)
    (proc / str(pid) / "stat").write_text(stat_line(pid, "python3", ppid, 9100))


async def test_the_process_tree_is_cached_until_refresh_or_a_member_exits(tmp_path, monkeypatch):
    proc = build_proc(tmp_path)
    src = source(proc)
    assert await execute(src, 5.0)
    assert {p.pid for p in src.snapshot.processes} == {API, ENGINE, TRACKER}
    # A child spawned after the scan is picked up at the next rescan, not every cycle.
    _fork_like(proc, TRACKER, 5000, API)
    assert await execute(src, 5.0)
    assert 5000 not in {p.pid for p in src.snapshot.processes}
    monkeypatch.setattr(procfs, "TREE_REFRESH", 0.0)
    assert await execute(src, 5.0)
    assert 5000 in {p.pid for p in src.snapshot.processes}
    # A member that exits forces a rescan on the next cycle, whatever the refresh period.
    monkeypatch.setattr(procfs, "TREE_REFRESH", 3600.0)
    assert await execute(src, 5.0)  # cached again from here
    shutil.rmtree(proc / "5000")
    _fork_like(proc, TRACKER, 5001, API)
    assert await execute(src, 5.0)
    assert {p.pid for p in src.snapshot.processes} == {API, ENGINE, TRACKER}
    assert await execute(src, 5.0)
    assert {p.pid for p in src.snapshot.processes} == {API, ENGINE, TRACKER, 5001}


async def test_unreadable_smaps_leaves_pinned_absent_not_zero(tmp_path):
    proc = build_proc(tmp_path)
    smaps = proc / str(ENGINE) / "smaps"
    smaps.unlink()
    smaps.mkdir()  # reading it fails with EISDIR, as EACCES would without ptrace rights
    with pytest.raises(IsADirectoryError) as exc:
        smaps.read_text()
    assert exc.value.errno == errno.EISDIR
    src = source(proc)
    assert await execute(src, 5.0)
    engine = next(p for p in src.snapshot.processes if p.pid == ENGINE)
    assert engine.pinned is None and engine.shmem == 950_532 * KIB
    assert src.snapshot.smaps_denied == (ENGINE,)
    fams = series(src.families())
    assert str(ENGINE) not in {lab["pid"] for lab, _ in fams["kvoffload_process_pinned_bytes"]}
    assert src.snapshot.pool is None


async def test_vllm_restart_is_rediscovered(tmp_path):
    proc = build_proc(tmp_path)
    src = source(proc)
    assert await execute(src, 5.0)
    # vLLM restarted: the old pid is gone, a new API server holds the socket.
    shutil.rmtree(proc / str(API))
    new = proc / "4000"
    new.mkdir()
    (new / "status").write_text(recorded("b_offload", "api_status.txt").replace(str(API), "4000"))
    (new / "stat").write_text(stat_line(4000, "python3", SHELL, 9000))
    (new / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv_from_cmd("b_offload", 8000)))
    (new / "fd").mkdir()
    (new / "fd" / "20").symlink_to(f"socket:[{API_SOCKET}]")
    assert await execute(src, 5.0)
    assert src.snapshot.root_pid == 4000


# --- the whole exporter --------------------------------------------------------------------


def _sources(cfg: Config, proc: Path, api: RecordedNvml, clock: FakeClock):
    (target,) = cfg.targets
    label = target.label
    procfs = ProcfsSource(
        label,
        port=url_port(target.url),
        procfs=proc,
        shm=proc.parent / "shm",
        single_target=True,
        statvfs=recorded_statvfs(),
    )
    return [
        VllmTarget(
            target, window_seconds=cfg.window, timeout=5.0, max_body_bytes=cfg.max_body_bytes
        ),
        NvmlSource(api, monotonic=clock),
        procfs,
        CgroupSource(label, procfs=procfs, procfs_root=proc, cgroup_root=CGROUP / "v2"),
    ]


async def test_exporter_with_gpu_and_host_sources_end_to_end(tmp_path, promtool):
    b = RUNS / "b_offload"
    with ReplayServer(files([b / "metrics_before.txt", b / "metrics_after.txt"])) as srv:
        proc = build_proc(tmp_path, port=srv.port)
        cfg = Config(targets=(TargetConfig(url=srv.url),), interval=1.0, window=300.0)
        api = RecordedNvml([RecordedGpu(rows=load_fast("b_offload"))])
        clock = FakeClock()
        exporter = Exporter(cfg, _sources(cfg, proc, api, clock))
        nvml = next(s for s in exporter.sources if isinstance(s, NvmlSource))
        from aiohttp.test_utils import TestClient, TestServer

        async with TestClient(TestServer(make_app(exporter, run_loop=False))) as client:
            for _ in range(2):
                for _ in range(len(load_fast("b_offload")) // 2):
                    nvml.poller.step()
                    clock.advance(0.01)
                await exporter.run_cycle()
            body = await (await client.get("/metrics")).read()
    text = body.decode()
    target = srv.url.removeprefix("http://")
    t = {"target": target}
    assert sample_value(text, "kvoffload_collector_up", collector="nvml") == 1
    assert sample_value(text, "kvoffload_collector_up", collector=f"procfs:{target}") == 1
    assert sample_value(text, "kvoffload_collector_up", collector=f"cgroup:{target}") == 1
    pinned = sample_value(text, "kvoffload_process_pinned_bytes", role="engine_core", **t)
    assert pinned == 950_532 * KIB
    assert sample_value(text, "kvoffload_process_locked_bytes", role="engine_core", **t) == 0
    assert sample_value(text, "kvoffload_offload_pool_bytes", **t) == 896 * MIB
    assert sample_value(text, "kvoffload_offload_pool_to_buffer_ratio", **t) == 1.75
    assert sample_value(text, "kvoffload_offload_buffer_bytes", **t) == 0.5 * GIB
    assert sample_value(text, "kvoffload_container_memory_limit_bytes", **t) == 32 * GIB
    stat = dict(
        line.split()
        for line in (CGROUP / "v2" / VLLM_CGROUP.lstrip("/") / "memory.stat")
        .read_text()
        .splitlines()
    )
    headroom = 32 * GIB - int(stat["anon"]) - int(stat["shmem"])
    assert sample_value(text, "kvoffload_container_memory_headroom_bytes", **t) == headroom
    assert sample_value(text, "kvoffload_dev_shm_size_bytes", **t) == 137438953472
    tx = sample_value(text, "kvoffload_gpu_pcie_tx_bytes_total", gpu="0")
    assert tx is not None and 0 < tx < 3.19e9
    assert sample_value(
        text, "kvoffload_gpu_pcie_link_bandwidth_bytes_per_second", gpu="0"
    ) == pytest.approx(63.015e9, rel=1e-4)
    # The GPU link reaches the derivations and the advisor through the source hooks.
    assert exporter.link_bandwidth() == pytest.approx(63.015e9, rel=1e-4)
    mem = exporter.sources[3].memory_state(target)
    assert mem.limit_bytes == 32 * GIB and mem.pool_bytes == 896 * MIB
    proc_run = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, check=False
    )
    assert proc_run.returncode == 0, proc_run.stdout.decode() + proc_run.stderr.decode()


def test_build_sources_wires_one_host_source_pair_per_target(tmp_path):
    cfg = Config(
        targets=(
            TargetConfig(url="http://127.0.0.1:8000", name="a"),
            TargetConfig(url="http://127.0.0.1:8001", name="b", pid=OTHER_API),
        ),
        path_procfs=str(tmp_path),
        path_cgroup=str(CGROUP / "v2"),
    )
    mine = ("vllm", "nvml", "procfs", "cgroup")  # other kinds of sources are not this test's

    def names(c: Config) -> list[str]:
        return [s.name for s in build_sources(c) if s.name.split(":")[0] in mine]

    assert names(cfg) == [
        "vllm:a",
        "vllm:b",
        "nvml",
        "procfs:a",
        "cgroup:a",
        "procfs:b",
        "cgroup:b",
    ]
    assert names(replace(cfg, nvml=False, cgroup=False)) == [
        "vllm:a",
        "vllm:b",
        "procfs:a",
        "procfs:b",
    ]
    srcs = build_sources(replace(cfg, nvml=False, cgroup=False))
    assert [s.pid for s in srcs if isinstance(s, ProcfsSource)] == [None, OTHER_API]
    single = Config(targets=(TargetConfig(url="http://127.0.0.1:8000"),), vllm_pid=API, nvml=False)
    (procfs,) = [s for s in build_sources(single) if isinstance(s, ProcfsSource)]
    assert procfs.pid == API and procfs.port == 8000


def test_collect_error_for_unlistable_procfs(tmp_path):
    src = source(tmp_path / "missing")
    with pytest.raises(CollectError) as exc:
        src.read()
    assert exc.value.kind == ErrorKind.UNAVAILABLE and not exc.value.absent


def test_unreclaimable_counts_a_region_shared_by_two_processes_once():
    maps = tuple(m for m in _engine_maps("b_offload") if m.shared)
    shared_rss = sum(m.rss for m in maps)
    parent = ProcessMemory(
        ENGINE, "engine_core", "VLLM::EngineCor", 0, 100, shared_rss, 0, shared_rss, maps
    )
    # A forked worker mapping the same pool objects, plus 5 MiB of shmem of its own.
    child = ProcessMemory(
        4001, "worker", "VLLM::Worker_TP", 0, 7, shared_rss + 5 * MIB, 0, shared_rss, maps
    )
    snap = ProcfsSnapshot(ENGINE, "pid", (parent, child), None, None, ())
    assert snap.unreclaimable_bytes() == 100 + shared_rss + 7 + 5 * MIB


def test_pinned_bytes_counts_a_file_mapped_twice_once():
    # vLLM 0.26's tiering spec maps its /dev/shm region twice in one process (seen on the
    # H200, small-tier): the kernel reports Rss per mapping, the pages exist once.
    region = "/dev/shm/vllm_offload_engine0.mmap"
    text = "".join(
        f"{lo}-{hi} rw-s 00000000 00:1a 4242 {region}\nSize: 262144 kB\nRss: 262144 kB\n"
        "Locked: 0 kB\n"
        for lo, hi in (("7f0000000000", "7f0010000000"), ("7f2000000000", "7f2010000000"))
    ) + (
        "7f3000000000-7f3002000000 rw-s 00000000 00:01 99 /dev/zero (deleted)\n"
        "Size: 32768 kB\nRss: 32768 kB\nLocked: 0 kB\n"
        "7f4000000000-7f4002000000 rw-s 00000000 00:01 100 /dev/zero (deleted)\n"
        "Size: 32768 kB\nRss: 32768 kB\nLocked: 0 kB\n"
    )
    maps = procfs.parse_smaps(text)
    assert procfs.pinned_bytes(maps) == (256 + 32 + 32) * 1024 * 1024
