"""exporter/render/cgroup.py: the container-memory families of one CgroupMemory view."""

from __future__ import annotations

from exporter.render.cgroup import CONTAINER_FAMILIES, cgroup_families
from exporter.sources.cgroup import CgroupMemory, read_v2
from tests.nvml_doubles import series
from tests.proc_tree import CGROUP, GIB, VLLM_CGROUP

T = {"target": "vllm-b"}


def test_every_value_of_a_limited_container_in_catalogue_order():
    view = read_v2(CGROUP / "v2", VLLM_CGROUP)
    fams = cgroup_families("vllm-b", view)
    assert [f.definition.name for f in fams] == list(CONTAINER_FAMILIES)
    assert series(fams) == {
        "kvoffload_container_memory_limit_bytes": [(T, 32 * GIB)],
        "kvoffload_container_memory_usage_bytes": [(T, view.usage)],
        "kvoffload_container_memory_anon_bytes": [(T, view.anon)],
        "kvoffload_container_memory_shmem_bytes": [(T, view.shmem)],
        "kvoffload_container_memory_headroom_bytes": [(T, view.headroom)],
    }


def test_unknown_values_are_empty_families_never_zero():
    root = read_v2(CGROUP / "v2-root", "/")  # the H200 VM: no limit, no memory.current
    fams = cgroup_families("vllm-b", root)
    assert len(fams) == len(CONTAINER_FAMILIES)
    assert series(fams) == {
        "kvoffload_container_memory_anon_bytes": [(T, 272211968)],
        "kvoffload_container_memory_shmem_bytes": [(T, 7544832)],
    }
    # Only --memory-limit and the processes' own memory (a sidecar without vLLM's cgroup).
    told = CgroupMemory(0, "--memory-limit (x)", 32 * GIB, None, None, None, 30 * GIB)
    assert series(cgroup_families("vllm-b", told)) == {
        "kvoffload_container_memory_limit_bytes": [(T, 32 * GIB)],
        "kvoffload_container_memory_headroom_bytes": [(T, 30 * GIB)],
    }


def test_no_view_renders_nothing():
    assert cgroup_families("vllm-b", None) == []
