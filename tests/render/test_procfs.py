"""exporter/render/procfs.py: per-process memory and /dev/shm of a ProcfsSnapshot, and the
offload pool per target joined with the derived engines (recorded H200 runs)."""

from __future__ import annotations

from exporter.model.derive.engines import DeriveSettings, derive_target
from exporter.render.procfs import PROCESS_FAMILIES, offload_pool_families, procfs_families
from exporter.sources.procfs.parsers import PoolEstimate, offload_pool
from exporter.sources.procfs.source import ProcessMemory, ProcfsSnapshot
from tests.helpers import sample_from, window_of
from tests.nvml_doubles import series
from tests.proc_tree import GIB, MIB, RUNS, engine_maps


def _derived(run: str):
    b = RUNS / run
    win = window_of(
        sample_from(b / "metrics_before.txt", 0.0), sample_from(b / "metrics_after.txt", 5.0)
    )
    return derive_target(win, 5.0, DeriveSettings(stale_after=30.0))


def _process(pid: int, role: str, *, pinned: int | None = 3, locked: int | None = 0):
    return ProcessMemory(pid, role, "python3", 10, 6, 4, locked, pinned, ())


def test_process_and_dev_shm_families_in_order():
    snap = ProcfsSnapshot(
        root_pid=7,
        method="port",
        processes=(_process(7, "api_server"), _process(8, "engine_core", pinned=None)),
        dev_shm=(1000, 250),
        pool=None,
        smaps_denied=(8,),
    )
    fams = procfs_families("t", snap)
    names = [f.definition.name for f in fams]
    dev_shm = ["kvoffload_dev_shm_size_bytes", "kvoffload_dev_shm_used_bytes"]
    assert names == [*PROCESS_FAMILIES, *dev_shm]
    api = {"target": "t", "pid": "7", "role": "api_server"}
    engine = {"target": "t", "pid": "8", "role": "engine_core"}
    assert series(fams) == {
        # smaps of pid 8 could not be read: no pinned series for it, never 0.
        "kvoffload_process_pinned_bytes": [(api, 3)],
        "kvoffload_process_resident_bytes": [(api, 10), (engine, 10)],
        "kvoffload_process_resident_anon_bytes": [(api, 6), (engine, 6)],
        "kvoffload_process_resident_shmem_bytes": [(api, 4), (engine, 4)],
        "kvoffload_process_locked_bytes": [(api, 0), (engine, 0)],
        "kvoffload_dev_shm_size_bytes": [({"target": "t"}, 1000)],
        "kvoffload_dev_shm_used_bytes": [({"target": "t"}, 250)],
    }


def test_without_dev_shm_or_a_snapshot():
    snap = ProcfsSnapshot(7, "pid", (_process(7, "other", locked=None),), None, None, ())
    fams = procfs_families("t", snap)
    assert [f.definition.name for f in fams] == list(PROCESS_FAMILIES)
    assert "kvoffload_process_locked_bytes" not in series(fams)
    assert procfs_families("t", None) == []


def test_pool_to_buffer_ratio_on_the_h200_run_is_1_75():
    engines = _derived("b_offload")
    pool = offload_pool(engine_maps("b_offload"))
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
    assert series(offload_pool_families({"a": None}, {"a": engines})) == {}
