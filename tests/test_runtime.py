"""The runtime: which sources the configuration builds, how their snapshots become the
model's CycleInputs, and the whole exporter on recorded GPU and host data."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from exporter.config import Config
from exporter.options import TargetConfig
from exporter.runtime import Exporter, build_sources, memory_state, record_dir
from exporter.server import make_app
from exporter.sources.cgroup import CgroupMemory, CgroupSource
from exporter.sources.nvml.source import NvmlSource
from exporter.sources.procfs.parsers import PoolEstimate, url_port
from exporter.sources.procfs.source import ProcfsSource
from exporter.sources.vllm_http import VllmTarget
from testbed.replay import ReplayServer, files
from tests.exporter_harness import sample_value
from tests.nvml_doubles import FakeClock, RecordedGpu, RecordedNvml, load_fast
from tests.proc_tree import (
    API,
    CGROUP,
    GIB,
    KIB,
    MIB,
    OTHER_API,
    RUNS,
    VLLM_CGROUP,
    build_proc,
    recorded_statvfs,
)


class _SteppedNvml(NvmlSource):
    """The NVML source without its poller thread: the tests step the poller on a fake clock
    themselves, and a thread stepping it too (the app's startup starts every source) would
    race them and count the recorded PCIe bytes twice."""

    async def start(self) -> None:
        self.health.started = True


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
        _SteppedNvml(api, monotonic=clock),
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
    snap = procfs.snapshot()
    assert snap is not None
    pool = snap.pool
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


async def test_inputs_carry_every_snapshot_to_the_model(tmp_path: Path) -> None:
    """Launch flags (procfs), the host link and PCIe load (NVML), memory (cgroup + pool):
    what the model gets is what the sources read, each from its own snapshot."""
    b = RUNS / "b_offload"
    weights = 1.12 * GIB  # Qwen3-0.6B, as vLLM logs it
    with ReplayServer(files([b / "metrics_before.txt", b / "metrics_after.txt"])) as srv:
        proc = build_proc(tmp_path, port=srv.port)
        cfg = Config(
            targets=(TargetConfig(url=srv.url, model_weight_bytes=weights),),
            interval=1.0,
            window=300.0,
        )
        api = RecordedNvml([RecordedGpu(rows=load_fast("b_offload"))])
        clock = FakeClock()
        exporter = Exporter(cfg, _sources(cfg, proc, api, clock))
        nvml = exporter.nvml
        assert nvml is not None
        for _ in range(2):
            for _ in range(len(load_fast("b_offload")) // 2):
                nvml.poller.step()
                clock.advance(0.01)
            await exporter.run_cycle()
    (ts,) = exporter.watched
    assert ts.procfs is not None and ts.cgroup is not None and ts.kv_events is None
    procfs, cgroup, reading = ts.procfs.snapshot(), ts.cgroup.snapshot(), nvml.snapshot()
    assert procfs is not None and cgroup is not None and reading is not None
    inputs = exporter.cycle_inputs(123.0)
    (t,) = inputs.targets
    assert inputs.now == 123.0
    assert t.settings.launch == procfs.launch and procfs.launch is not None
    assert t.settings.link_bandwidth == reading.link_bandwidth
    # The weights over the recorded GPU's peak (its NVML name, the H200): a token's floor.
    assert reading.gpu_names == ("NVIDIA H200",)
    assert t.settings.computed_token_floor == weights / 989e12
    assert inputs.pcie_utilization == reading.pcie_utilization
    assert t.memory == memory_state(cgroup, procfs.pool)
    assert t.memory is not None and t.memory.pool_bytes == 896 * MIB
    assert t.kv_items is None  # no KV-event source for this target: no what-if
    assert t.window is ts.target.window


def test_memory_state_prefers_the_cgroup_and_names_the_pool() -> None:
    view = CgroupMemory(2, "/x", 32 * GIB, 10 * GIB, 4 * GIB, 2 * GIB, 26 * GIB)
    pool = PoolEstimate(896 * MIB, "dev_zero_groups", 28)
    state = memory_state(view, pool)
    assert state is not None
    assert (state.limit_bytes, state.usage_bytes, state.pool_bytes) == (
        32 * GIB,
        view.headroom_usage,
        896 * MIB,
    )
    assert memory_state(None, pool) is None
    assert memory_state(view, None) is not None and memory_state(view, None).pool_bytes is None  # type: ignore[union-attr]


def test_record_dir_is_the_folder_itself_for_one_target_and_a_subfolder_each_for_several() -> None:
    one = Config(targets=(TargetConfig(url="http://a:1"),), record="/r")
    assert record_dir(one, "a:1") == Path("/r")
    two = replace(
        one, targets=(TargetConfig(url="http://a:1", name="a/1"), TargetConfig(url="http://b:1"))
    )
    assert record_dir(two, "a/1") == Path("/r/a_1")
    assert record_dir(replace(one, record=""), "a:1") is None
