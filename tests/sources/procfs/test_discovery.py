"""exporter/sources/procfs/discovery.py: finding the vLLM root process and its tree, on a
/proc tree built around the recorded H200 run (tests/proc_tree.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from exporter.render.procfs import procfs_families
from exporter.sources import CollectError, ErrorKind, execute
from exporter.sources.procfs import discovery
from exporter.sources.procfs.discovery import Discovery, ProcFS, Root, server_command
from tests.nvml_doubles import series
from tests.proc_tree import (
    API,
    API_SOCKET,
    ENGINE,
    OTHER_API,
    OTHER_SOCKET,
    SHELL,
    TRACKER,
    ZMQ_SOCKET,
    argv_from_cmd,
    build_proc,
    recorded,
    source,
    stat_line,
)

# --- the reader -----------------------------------------------------------------------------


def test_procfs_reader_on_the_tree(tmp_path):
    fs = ProcFS(build_proc(tmp_path))
    assert fs.pids() == sorted([1, SHELL, API, ENGINE, TRACKER, OTHER_API])
    st = fs.stat(ENGINE)
    assert st is not None and (st.ppid, st.starttime) == (API, 1000 + ENGINE)
    assert fs.argv(ENGINE) == ("VLLM::EngineCore",)
    assert fs.stat(424242) is None and fs.argv(424242) == ()
    assert fs.environ(API) is None  # no environ file: not ours to read
    assert fs.socket_inodes(API) == {API_SOCKET}
    assert {(ln.port, ln.inode) for ln in fs.listeners()} == {
        (8000, API_SOCKET),
        (8001, OTHER_SOCKET),
        (0x15C5, ZMQ_SOCKET),
    }


def test_server_command_of_a_setproctitle_root_is_its_parents(tmp_path):
    fs = ProcFS(build_proc(tmp_path))
    argv, environ = server_command(fs, ENGINE)
    assert argv == tuple(argv_from_cmd("b_offload", 8000)) and environ is None
    assert server_command(fs, TRACKER) == server_command(fs, API)  # flags are the API's
    assert server_command(fs, 1) == ((), None)  # no serving flags up to init


# --- finding the root -----------------------------------------------------------------------


def test_discovery_finds_the_port_owner_and_its_tree(tmp_path):
    found = Discovery(ProcFS(build_proc(tmp_path)), "vllm-b", port=8000)
    root = found.find()
    assert root == Root(API, 1000 + API, "port") and found.root == root
    tree = found.members(root)
    assert tree[0] == API and set(tree) == {API, ENGINE, TRACKER}
    found.lost()
    assert found.root is None


def test_unlistable_procfs_is_a_failure_not_absence(tmp_path):
    found = Discovery(ProcFS(tmp_path / "missing"), "vllm-b", port=8000)
    with pytest.raises(CollectError) as exc:
        found.find()
    assert exc.value.kind == ErrorKind.UNAVAILABLE and not exc.value.absent


def test_collect_error_for_unlistable_procfs(tmp_path):
    src = source(tmp_path / "missing")
    with pytest.raises(CollectError) as exc:
        src.read()
    assert exc.value.kind == ErrorKind.UNAVAILABLE and not exc.value.absent


def test_a_miss_is_remembered_until_the_retry_period(tmp_path, monkeypatch):
    proc = build_proc(tmp_path, fds=False)
    found = Discovery(ProcFS(proc), "vllm-b", port=9999)
    with pytest.raises(CollectError) as first:
        found.find()
    assert first.value.absent
    late = proc / "4100"
    shutil.copytree(proc / str(OTHER_API), late, symlinks=True)
    (late / "stat").write_text(stat_line(4100, "python3", 1, 9200))
    (late / "cmdline").write_bytes(b"vllm\0serve\0/models/late\0--port\x009999\0")
    with pytest.raises(CollectError) as again:
        found.find()
    assert again.value is first.value  # not scanned again yet
    monkeypatch.setattr(discovery, "DISCOVERY_RETRY", 0.0)
    assert found.find() == Root(4100, 9200, "cmdline")


async def test_finds_vllm_by_command_line_when_sockets_are_hidden(tmp_path):
    proc = build_proc(tmp_path, fds=False)
    src = source(proc)
    assert await execute(src, 5.0)
    snap = src.snapshot()
    assert snap is not None and (snap.root_pid, snap.method) == (API, "cmdline")
    other = source(proc, port=8001)
    assert await execute(other, 5.0)
    other_snap = other.snapshot()
    assert other_snap is not None and other_snap.root_pid == OTHER_API


async def test_configured_pid_wins_and_a_missing_one_is_absent(tmp_path):
    proc = build_proc(tmp_path)
    src = source(proc, port=None, pid=ENGINE)
    assert await execute(src, 5.0)
    snap = src.snapshot()
    assert snap is not None and [p.pid for p in snap.processes] == [ENGINE]
    gone = source(proc, pid=99999)
    assert not await execute(gone, 5.0)
    assert gone.health.error_kind == ErrorKind.UNAVAILABLE
    assert "99999" in (gone.health.error or "") and gone.health.errors_total == {}
    assert gone.discovery.root is None and gone.snapshot() is None


async def test_no_vllm_visible_is_absence_with_a_hint(tmp_path):
    proc = build_proc(tmp_path, fds=False)
    src = source(proc, port=9999)
    assert not await execute(src, 5.0)
    assert "PID namespace" in (src.health.error or "")
    assert src.health.errors_total == {}
    assert src.snapshot() is None
    assert series(procfs_families(src.target, src.snapshot())) == {}


def _fork_like(proc: Path, like: int, pid: int, ppid: int) -> None:
    """A new child process in the fixture tree, a copy of an existing one."""
    shutil.copytree(proc / str(like), proc / str(pid), symlinks=True)
    (proc / str(pid) / "stat").write_text(stat_line(pid, "python3", ppid, 9100))


def _pids(src) -> set[int]:
    snap = src.snapshot()
    assert snap is not None
    return {p.pid for p in snap.processes}


async def test_the_process_tree_is_cached_until_refresh_or_a_member_exits(tmp_path, monkeypatch):
    proc = build_proc(tmp_path)
    src = source(proc)
    assert await execute(src, 5.0)
    assert _pids(src) == {API, ENGINE, TRACKER}
    # A child spawned after the scan is picked up at the next rescan, not every cycle.
    _fork_like(proc, TRACKER, 5000, API)
    assert await execute(src, 5.0)
    assert 5000 not in _pids(src)
    monkeypatch.setattr(discovery, "TREE_REFRESH", 0.0)
    assert await execute(src, 5.0)
    assert 5000 in _pids(src)
    # A member that exits forces a rescan on the next cycle, whatever the refresh period.
    monkeypatch.setattr(discovery, "TREE_REFRESH", 3600.0)
    assert await execute(src, 5.0)  # cached again from here
    shutil.rmtree(proc / "5000")
    _fork_like(proc, TRACKER, 5001, API)
    assert await execute(src, 5.0)
    assert _pids(src) == {API, ENGINE, TRACKER}
    assert await execute(src, 5.0)
    assert _pids(src) == {API, ENGINE, TRACKER, 5001}


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
    snap = src.snapshot()
    assert snap is not None and snap.root_pid == 4000


async def test_argv_is_kept_with_the_tree_and_read_again_when_a_process_retitles(tmp_path):
    proc = build_proc(tmp_path)
    src = source(proc)
    assert await execute(src, 5.0)
    snap = src.snapshot()
    assert snap is not None and {p.pid: p.role for p in snap.processes}[TRACKER] == "other"
    # A forked child retitles itself (setproctitle): new cmdline and new status Name.
    (proc / str(TRACKER) / "cmdline").write_bytes(b"VLLM::Worker_TP0" + b" " * 20 + b"\0")
    assert await execute(src, 5.0)
    snap = src.snapshot()
    assert snap is not None and {p.pid: p.role for p in snap.processes}[TRACKER] == "other"
    status = (proc / str(TRACKER) / "status").read_text()
    (proc / str(TRACKER) / "status").write_text(
        status.replace("Name:\tpython3", "Name:\tVLLM::Worker_TP")
    )
    assert await execute(src, 5.0)
    snap = src.snapshot()
    assert snap is not None and {p.pid: p.role for p in snap.processes}[TRACKER] == "worker"
    assert src.discovery.starttime(TRACKER) == 1000 + TRACKER


def test_pieces_read_a_file_as_text_reads_it(tmp_path):
    """A character or a CRLF that two reads split is decoded whole, bad bytes are replaced
    alike and line breaks are universal, as text() reads the file whole."""
    d = tmp_path / "7"
    d.mkdir()
    raw = "Name:\tpyth\u00f6n \u20ac\r\nState:\tS\rx\r".encode() + b"\xff tail\r"
    (d / "status").write_bytes(raw)
    fs = ProcFS(tmp_path)
    whole = fs.text(7, "status")
    assert whole == "Name:\tpyth\u00f6n \u20ac\nState:\tS\nx\n\ufffd tail\n"
    for size in range(1, len(raw) + 2):
        assert "".join(fs.pieces(7, "status", size)) == whole, size
