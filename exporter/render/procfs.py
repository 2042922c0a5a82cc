"""The families of the `procfs:<target>` collector, and the offload pool per target.

`procfs_families` renders one target's ProcfsSnapshot (per-process memory, /dev/shm);
`offload_pool_families` joins each target's pool estimate with its derived engines
(the pool / configured buffer ratio).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from exporter.catalogue import Family
from exporter.model.derive.engines import EngineDerived
from exporter.sources.procfs.parsers import PoolEstimate
from exporter.sources.procfs.source import ProcfsSnapshot

PROCESS_FAMILIES = (
    "kvoffload_process_pinned_bytes",
    "kvoffload_process_resident_bytes",
    "kvoffload_process_resident_anon_bytes",
    "kvoffload_process_resident_shmem_bytes",
    "kvoffload_process_locked_bytes",
)


def procfs_families(target: str, snap: ProcfsSnapshot | None) -> list[Family]:
    """Per-process memory of the target's vLLM processes and its /dev/shm; nothing
    without a snapshot. A value the kernel did not show (or smaps that could not be read,
    for pinned) is no series, never 0."""
    if snap is None:
        return []
    fam = {n: Family(n) for n in PROCESS_FAMILIES}
    for p in snap.processes:
        labels = [target, str(p.pid), p.role]
        for name, value in zip(
            PROCESS_FAMILIES, (p.pinned, p.resident, p.anon, p.shmem, p.locked), strict=True
        ):
            if value is not None:
                fam[name].add(labels, value)
    out = list(fam.values())
    if snap.dev_shm is not None:
        size = Family("kvoffload_dev_shm_size_bytes")
        size.add([target], snap.dev_shm[0])
        used = Family("kvoffload_dev_shm_used_bytes")
        used.add([target], snap.dev_shm[1])
        out += [size, used]
    return out


def offload_pool_families(
    pools: Mapping[str, PoolEstimate | None],
    derived: Mapping[str, Sequence[EngineDerived]],
) -> list[Family]:
    """Pool bytes per target and pool / configured buffer per engine.

    A pool guessed from mapping sizes is only shown where vLLM reports offload configured,
    so an engine without offload never shows a "pool" of unrelated pinned buffers.
    """
    pool_fam = Family("kvoffload_offload_pool_bytes")
    ratio_fam = Family("kvoffload_offload_pool_to_buffer_ratio")
    for target, pool in pools.items():
        if pool is None:
            continue
        engines = derived.get(target, ())
        if pool.method != "dev_shm_files" and not any(d.offload_enabled for d in engines):
            continue
        pool_fam.add([target], pool.bytes)
        for d in engines:
            buffer = d.offload_buffer_bytes
            if d.offload_enabled and buffer is not None and buffer > 0:
                ratio_fam.add([target, d.key.model_name, d.key.engine], pool.bytes / buffer)
    return [pool_fam, ratio_fam]
