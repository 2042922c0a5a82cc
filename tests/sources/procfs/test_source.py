"""exporter/sources/procfs/source.py: ProcfsSource reading a /proc tree built around the
recorded vLLM 0.26 H200 runs (tests/proc_tree.py) into a ProcfsSnapshot."""

from __future__ import annotations

import errno
import tracemalloc
from dataclasses import replace

import pytest

from exporter.render.procfs import procfs_families
from exporter.sources import execute
from exporter.sources.procfs.parsers import PoolEstimate
from exporter.sources.procfs.source import ProcessMemory, ProcfsSnapshot, ProcfsSource
from tests.nvml_doubles import series
from tests.proc_tree import (
    API,
    ENGINE,
    KIB,
    MIB,
    TRACKER,
    build_proc,
    engine_maps,
    recorded_statvfs,
    source,
)


def _snap(src: ProcfsSource) -> ProcfsSnapshot:
    snap = src.snapshot()
    assert snap is not None
    return snap


async def test_finds_vllm_by_its_port_and_reads_its_processes(tmp_path):
    proc = build_proc(tmp_path)
    src = source(proc)
    assert src.snapshot() is None  # nothing before the first collection
    assert await execute(src, 5.0)
    snap = src.snapshot()
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
    fams = series(procfs_families(src.target, snap))
    pinned = {lab["pid"]: v for lab, v in fams["kvoffload_process_pinned_bytes"]}
    assert pinned == {str(API): 0, str(ENGINE): 950_532 * KIB, str(TRACKER): 0}
    shm = fams["kvoffload_process_resident_shmem_bytes"]
    assert {lab["role"] for lab, _ in shm} == {"api_server", "engine_core", "other"}
    assert src.discovery.root is not None and src.discovery.root.pid == API


async def test_snapshot_carries_the_launch_config_of_the_vllm_server(tmp_path):
    proc = build_proc(tmp_path)  # the H200 offload run's tree: --kv-offloading-size 0.5
    src = source(proc)
    assert await execute(src, 5.0)
    lc = _snap(src).launch
    assert lc is not None and lc.connector == "OffloadingConnector"
    assert lc.offloading_size_gib == 0.5 and not lc.environ_read
    (proc / str(API) / "environ").write_bytes(b"VLLM_USE_SIMPLE_KV_OFFLOAD=1\0UCX_TLS=rc\0")
    # Read once per root process and tree rescan, not every cycle (a running server's
    # flags do not change): the same until the tree is rescanned.
    assert await execute(src, 5.0)
    assert _snap(src).launch == lc
    src.discovery.forget_tree()
    assert await execute(src, 5.0)
    lc = _snap(src).launch
    assert lc is not None and (lc.connector, lc.ucx_tls) == ("SimpleCPUOffloadConnector", "rc")
    # Rooted at the EngineCore (a setproctitle title): the flags are its parent's.
    engine = source(proc, port=None, pid=ENGINE)
    assert await execute(engine, 5.0)
    assert _snap(engine).launch == lc
    # A root without serving flags anywhere above it has no launch configuration.
    bare = source(proc, port=None, pid=1)
    assert await execute(bare, 5.0)
    assert _snap(bare).launch is None


async def test_without_offload_the_engine_pins_only_cuda_buffers(tmp_path):
    proc = build_proc(tmp_path, "a_nooffload")
    src = source(proc, statvfs=recorded_statvfs("a_nooffload"))
    assert await execute(src, 5.0)
    snap = _snap(src)
    engine = next(p for p in snap.processes if p.role == "engine_core")
    assert engine.pinned == 33_028 * KIB and snap.pool is None


async def test_a_process_vanishing_between_listing_and_reading_is_skipped(tmp_path):
    proc = build_proc(tmp_path)
    # The tracker exited after its stat was listed: its other files are gone.
    for name in ("status", "smaps", "cmdline"):
        (proc / str(TRACKER) / name).unlink()
    src = source(proc)
    assert await execute(src, 5.0)
    assert {p.pid for p in _snap(src).processes} == {API, ENGINE}


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
    snap = _snap(src)
    engine = next(p for p in snap.processes if p.pid == ENGINE)
    assert engine.pinned is None and engine.shmem == 950_532 * KIB
    assert snap.smaps_denied == (ENGINE,)
    fams = series(procfs_families(src.target, snap))
    assert str(ENGINE) not in {lab["pid"] for lab, _ in fams["kvoffload_process_pinned_bytes"]}
    assert snap.pool is None


async def test_a_failed_collection_clears_the_snapshot(tmp_path):
    proc = build_proc(tmp_path)
    src = source(proc, port=None, pid=ENGINE)
    assert await execute(src, 5.0)
    assert src.snapshot() is not None
    (proc / str(ENGINE) / "stat").unlink()  # the configured pid is gone
    assert not await execute(src, 5.0)
    assert src.snapshot() is None


def test_unreclaimable_counts_a_region_shared_by_two_processes_once():
    maps = tuple(m for m in engine_maps("b_offload") if m.shared)
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
    unknown = replace(child, anon=None)
    assert replace(snap, processes=(parent, unknown)).unreclaimable_bytes() is None


# --- the whole exporter --------------------------------------------------------------------


async def test_a_large_smaps_is_read_in_pieces_not_held_whole(tmp_path):
    """A GPU vLLM's smaps is megabytes (thousands of mappings). Read whole, every refresh
    was a transient allocation of several times its size that the allocator kept: the CI
    soak's resident memory grew in steps at each refresh while Python's heap stayed flat.
    The pinned mappings found are the same; the peak held is a piece's, not the file's."""
    proc = build_proc(tmp_path)
    smaps = proc / str(ENGINE) / "smaps"
    recorded = smaps.read_text()
    block = (
        "7a0000000000-7a0000021000 rw-p 00000000 00:00 0 \n"
        + "".join(f"{k}:{' ' * 12}132 kB\n" for k in ("Size", "Rss", "Pss", "Anonymous"))
        + "Locked:                0 kB\nVmFlags: rd wr mr mw me ac sd\n"
    )
    filler = block * (4 * MIB // len(block))
    smaps.write_text(filler + recorded + filler)
    src = source(proc)
    tracemalloc.start()
    try:
        assert await execute(src, 30.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    by_pid = {p.pid: p for p in _snap(src).processes}
    assert by_pid[ENGINE].pinned == 950_532 * KIB  # as from the recorded file alone
    assert peak < 1 * MIB, peak  # the file is 8 MiB; read whole, the peak was 3 times that
