"""exporter/sources/procfs/source.py: ProcfsSource reading a /proc tree built around the
recorded vLLM 0.26 H200 runs (tests/proc_tree.py) into a ProcfsSnapshot."""

from __future__ import annotations

import errno
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from exporter.config import Config
from exporter.render.procfs import procfs_families
from exporter.runtime import Exporter, build_sources
from exporter.server import make_app
from exporter.sources import execute
from exporter.sources.cgroup import CgroupSource
from exporter.sources.nvml.source import NvmlSource
from exporter.sources.procfs.parsers import PoolEstimate, url_port
from exporter.sources.procfs.source import ProcessMemory, ProcfsSnapshot, ProcfsSource
from exporter.sources.vllm_http import TargetConfig, VllmTarget
from testbed.replay import ReplayServer, files
from tests.exporter_harness import sample_value
from tests.nvml_doubles import FakeClock, RecordedGpu, RecordedNvml, load_fast, series
from tests.proc_tree import (
    API,
    CGROUP,
    ENGINE,
    GIB,
    KIB,
    MIB,
    OTHER_API,
    RUNS,
    TRACKER,
    VLLM_CGROUP,
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
        # The runtime hands it the root pid procfs found (CgroupSource.follow()).
        CgroupSource(label, procfs_root=proc, cgroup_root=CGROUP / "v2"),
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
    # What the runtime hands the derivations and the advisor: the GPU link, the memory view.
    assert exporter.link_bandwidth() == pytest.approx(63.015e9, rel=1e-4)
    procfs, cg = exporter.sources[2], exporter.sources[3]
    assert isinstance(procfs, ProcfsSource) and isinstance(cg, CgroupSource)
    view = cg.snapshot()
    assert view is not None and view.limit == 32 * GIB
    assert view.headroom_usage == int(stat["anon"]) + int(stat["shmem"])
    pool = _snap(procfs).pool
    assert pool is not None and pool.bytes == 896 * MIB
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
