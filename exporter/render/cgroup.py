"""The families of the `cgroup:<target>` collector: the vLLM container's memory."""

from __future__ import annotations

from exporter.catalogue import Family
from exporter.sources.cgroup import CgroupMemory

CONTAINER_FAMILIES = (
    "kvoffload_container_memory_limit_bytes",
    "kvoffload_container_memory_usage_bytes",
    "kvoffload_container_memory_anon_bytes",
    "kvoffload_container_memory_shmem_bytes",
    "kvoffload_container_memory_headroom_bytes",
)


def cgroup_families(target: str, view: CgroupMemory | None) -> list[Family]:
    """Limit, usage, anon, shmem and headroom of the target's container; a value that is
    not known (no limit, the root cgroup) is an empty family, never 0. Nothing without a
    view."""
    if view is None:
        return []
    out: list[Family] = []
    values = (view.limit, view.usage, view.anon, view.shmem, view.headroom)
    for name, value in zip(CONTAINER_FAMILIES, values, strict=True):
        fam = Family(name)
        if value is not None:
            fam.add([target], value)
        out.append(fam)
    return out
