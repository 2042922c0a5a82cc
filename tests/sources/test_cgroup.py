"""exporter/sources/cgroup.py: container memory from the vLLM process' cgroup, on v2 and v1
fixture trees (see tests/fixtures/cgroup/README.md: only the H200 root-cgroup stat is
recorded) and the /proc tree of tests/proc_tree.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from exporter.sources import CollectError, ErrorKind, execute
from exporter.sources.cgroup import (
    CgroupSource,
    Located,
    ProcCgroup,
    locate,
    parse_limit,
    parse_memory_stat,
    parse_proc_cgroup,
    read_v1,
    read_v2,
)
from tests.proc_tree import API, CGROUP, GIB, MIB, VLLM_CGROUP, build_proc, source

POD = VLLM_CGROUP.rsplit("/", 1)[0]


def stat_of(path: Path) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}


def level(rel: str) -> Path:
    return CGROUP / "v2" / rel.lstrip("/")


# --- parsers ------------------------------------------------------------------------------


def test_proc_cgroup_v2_v1_and_hybrid():
    assert parse_proc_cgroup(f"0::{VLLM_CGROUP}\n") == ProcCgroup(VLLM_CGROUP, None)
    v1 = (
        "12:pids:/docker/0123456789ab\n11:memory:/docker/0123456789ab\n"
        "10:cpu,cpuacct:/docker/0123456789ab\n1:name=systemd:/docker/0123456789ab\n"
    )
    assert parse_proc_cgroup(v1) == ProcCgroup(None, "/docker/0123456789ab")
    hybrid = v1 + "0::/docker/0123456789ab\n"
    assert parse_proc_cgroup(hybrid) == ProcCgroup("/docker/0123456789ab", "/docker/0123456789ab")
    assert parse_proc_cgroup("") == ProcCgroup(None, None)


def test_limits_max_and_v1_huge_value_mean_no_limit():
    assert parse_limit("max\n") is None
    assert parse_limit("9223372036854771712\n") is None
    assert parse_limit("34359738368\n") == 32 * GIB
    with pytest.raises(ValueError):
        parse_limit("lots")


def test_memory_stat_parser_on_recorded_root_stat():
    stat = parse_memory_stat((CGROUP / "v2-root" / "memory.stat").read_text())
    assert stat == {
        "anon": 272211968,
        "file": 2075361280,
        "kernel": 15044608,
        "shmem": 7544832,
        "unevictable": 8417280,
    }


# --- reading trees ----------------------------------------------------------------------------


def test_v2_container_limit_usage_and_headroom_at_the_tightest_level():
    mem = read_v2(CGROUP / "v2", VLLM_CGROUP)
    own = stat_of(level(VLLM_CGROUP) / "memory.stat")
    assert mem.version == 2
    assert mem.limit == 32 * GIB  # not the pod's 32.25 GiB or the node's 120 GiB
    assert mem.usage == int((level(VLLM_CGROUP) / "memory.current").read_text())
    assert (mem.anon, mem.shmem) == (own["anon"], own["shmem"])
    rooms = []
    for rel in (VLLM_CGROUP, POD, "/kubepods.slice"):
        st = stat_of(level(rel) / "memory.stat")
        rooms.append(int((level(rel) / "memory.max").read_text()) - st["anon"] - st["shmem"])
    assert mem.headroom == min(rooms) == rooms[0]
    assert mem.unreclaimable == own["anon"] + own["shmem"]


def test_v2_pod_limit_is_tighter_when_the_container_has_none(tmp_path):
    tree = tmp_path / "v2"
    shutil.copytree(CGROUP / "v2", tree)
    (tree / VLLM_CGROUP.lstrip("/") / "memory.max").write_text("max\n")
    mem = read_v2(tree, VLLM_CGROUP)
    assert mem.limit == 32 * GIB + 256 * MIB
    pod = stat_of(tree / POD.lstrip("/") / "memory.stat")
    assert mem.headroom == 32 * GIB + 256 * MIB - pod["anon"] - pod["shmem"]


def test_v2_without_any_limit_has_no_limit_or_headroom():
    mem = read_v2(CGROUP / "v2", "/system.slice/vllm.service")
    assert mem.limit is None and mem.headroom is None
    assert mem.usage is not None and mem.shmem is not None


def test_v2_root_cgroup_of_the_h200_vm():
    mem = read_v2(CGROUP / "v2-root", "/")
    assert (mem.limit, mem.usage, mem.headroom) == (None, None, None)
    assert (mem.anon, mem.shmem) == (272211968, 7544832)


def test_memory_limit_override_replaces_the_cgroup_limit():
    mem = read_v2(CGROUP / "v2", "/system.slice/vllm.service", override=16 * GIB)
    assert mem.limit == 16 * GIB
    assert mem.headroom == 16 * GIB - mem.anon - mem.shmem


def test_v1_limited_and_unlimited():
    base = CGROUP / "v1" / "memory"
    lim = read_v1(base, "/docker/0123456789ab")
    st = stat_of(base / "docker" / "0123456789ab" / "memory.stat")
    assert lim.version == 1 and lim.limit == 24 * GIB
    assert (lim.anon, lim.shmem) == (st["total_rss"], st["total_shmem"])
    assert lim.headroom == 24 * GIB - st["total_rss"] - st["total_shmem"]
    free = read_v1(base, "/docker/ba9876543210")
    assert free.limit is None and free.headroom is None and free.usage is not None


def test_unreadable_file_is_a_failure_with_the_path(tmp_path):
    tree = tmp_path / "v2"
    shutil.copytree(CGROUP / "v2", tree)
    current = tree / VLLM_CGROUP.lstrip("/") / "memory.current"
    current.unlink()
    current.mkdir()  # reading fails (EISDIR), as it would without permission
    with pytest.raises(CollectError) as exc:
        read_v2(tree, VLLM_CGROUP)
    assert exc.value.kind == ErrorKind.UNAVAILABLE and not exc.value.absent
    assert "memory.current" in exc.value.message


def test_garbage_limit_is_a_parse_error(tmp_path):
    tree = tmp_path / "v2"
    shutil.copytree(CGROUP / "v2", tree)
    (tree / VLLM_CGROUP.lstrip("/") / "memory.max").write_text("unlimited\n")
    with pytest.raises(CollectError) as exc:
        read_v2(tree, VLLM_CGROUP)
    assert exc.value.kind == ErrorKind.PARSE


def test_no_memory_controller_is_absence(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CollectError) as exc:
        read_v2(tmp_path, "/empty")
    assert exc.value.absent


# --- finding the cgroup ------------------------------------------------------------------------


def test_locate_v2_path_and_namespace_escape():
    root = CGROUP / "v2"
    assert locate(root, ProcCgroup(VLLM_CGROUP, None), None) == Located(2, root, VLLM_CGROUP)
    far = locate(root, ProcCgroup("/../cri-containerd-vllm0001.scope", None), ProcCgroup("/", None))
    assert isinstance(far, str) and "namespace" in far
    missing = locate(root, ProcCgroup("/kubepods.slice/elsewhere", None), None)
    assert isinstance(missing, str) and "not under" in missing


def test_locate_v1_same_container_without_cgroup_namespace(tmp_path):
    # Docker on v1 mounts the container's own cgroup at the root of memory/.
    mount = tmp_path / "memory"
    shutil.copytree(CGROUP / "v1" / "memory" / "docker" / "0123456789ab", mount)
    mine = ProcCgroup(None, "/docker/0123456789ab")
    assert locate(tmp_path, mine, mine) == Located(1, mount, "/")
    other = ProcCgroup(None, "/docker/ba9876543210")
    assert isinstance(locate(tmp_path, other, mine), str)
    assert read_v1(mount, "/").limit == 24 * GIB


# --- the source -------------------------------------------------------------------------------


async def test_source_reads_the_vllm_cgroup_of_the_pid_procfs_found(tmp_path):
    proc = build_proc(tmp_path)
    procfs = source(proc)
    cg = CgroupSource("vllm-b", procfs_root=proc, cgroup_root=CGROUP / "v2")
    assert not await execute(cg, 5.0)  # no vLLM process known yet: absent, not an error
    assert cg.health.errors_total == {} and "not known yet" in (cg.health.error or "")
    assert cg.snapshot() is None
    assert await execute(procfs, 5.0)
    snap = procfs.snapshot()
    assert snap is not None
    cg.follow(snap.root_pid, snap.unreclaimable_bytes())
    assert await execute(cg, 5.0)
    view = cg.snapshot()
    own = stat_of(level(VLLM_CGROUP) / "memory.stat")
    assert view is not None and view.version == 2 and view.limit == 32 * GIB
    assert (view.anon, view.shmem) == (own["anon"], own["shmem"])
    assert view.headroom == 32 * GIB - own["anon"] - own["shmem"]
    # What the advisor's MemoryState takes as usage.
    assert view.headroom_usage == own["anon"] + own["shmem"]


async def test_followed_pid_wins_over_the_configured_one(tmp_path):
    proc = build_proc(tmp_path)
    cg = CgroupSource("t", pid=424242, procfs_root=proc, cgroup_root=CGROUP / "v2")
    cg.follow(API, None)
    assert await execute(cg, 5.0)
    view = cg.snapshot()
    assert view is not None and view.limit == 32 * GIB
    cg.follow(None, None)  # procfs lost vLLM: back to the configured pid
    assert not await execute(cg, 5.0)
    assert "424242" in (cg.health.error or "") and cg.snapshot() is None


async def test_sidecar_outside_the_cgroup_namespace_uses_memory_limit(tmp_path):
    proc = build_proc(tmp_path, cgroup="/../cri-containerd-vllm0001.scope")
    procfs = source(proc)
    assert await execute(procfs, 5.0)
    snap = procfs.snapshot()
    assert snap is not None
    used = snap.unreclaimable_bytes()
    blind = CgroupSource("vllm-b", procfs_root=proc, cgroup_root=CGROUP / "v2")
    blind.follow(snap.root_pid, used)
    assert not await execute(blind, 5.0)
    assert "--memory-limit" in (blind.health.error or "") and blind.health.errors_total == {}
    assert "namespace" in (blind.health.error or "")
    assert blind.snapshot() is None
    told = CgroupSource(
        "vllm-b", procfs_root=proc, cgroup_root=CGROUP / "v2", memory_limit=32 * GIB
    )
    told.follow(snap.root_pid, used)
    assert await execute(told, 5.0)
    by_pid = {p.pid: p for p in snap.processes}
    assert used == sum(p.anon + p.shmem for p in by_pid.values())  # nothing shared twice
    view = told.snapshot()
    assert view is not None and view.version == 0
    assert (view.limit, view.usage, view.anon, view.shmem) == (32 * GIB, None, None, None)
    assert view.headroom == 32 * GIB - used
    assert view.unreclaimable is None and view.headroom_usage == used


async def test_memory_limit_before_vllm_is_known_has_no_headroom(tmp_path):
    proc = build_proc(tmp_path)
    cg = CgroupSource("t", procfs_root=proc, cgroup_root=CGROUP / "v2", memory_limit=GIB)
    assert await execute(cg, 5.0)
    view = cg.snapshot()
    assert view is not None and view.limit == GIB and view.headroom is None
    assert "not known yet" in view.path and view.headroom_usage is None


async def test_configured_pid_without_procfs(tmp_path):
    proc = build_proc(tmp_path)
    cg = CgroupSource("t", pid=API, procfs_root=proc, cgroup_root=CGROUP / "v2")
    assert await execute(cg, 5.0)
    view = cg.snapshot()
    assert view is not None and view.limit == 32 * GIB


async def test_vanished_pid_without_limit_is_absent(tmp_path):
    proc = build_proc(tmp_path)
    cg = CgroupSource("t", pid=424242, procfs_root=proc, cgroup_root=CGROUP / "v2")
    assert not await execute(cg, 5.0)
    assert "424242" in (cg.health.error or "") and cg.health.errors_total == {}


def test_memory_stat_parser_with_only_the_keys_used():
    text = "anon 10\nfile 5\nshmem 3\nanon_thp 0\nshmem_thp x\n"
    assert parse_memory_stat(text, frozenset({"anon", "shmem"})) == {"anon": 10, "shmem": 3}
    assert parse_memory_stat(text) == {"anon": 10, "file": 5, "shmem": 3, "anon_thp": 0}
    # "\r" ends a line for splitlines(): those texts take the line loop, same answer.
    odd = "anon 10\r\nshmem 3\rfile 1\n"
    assert parse_memory_stat(odd, frozenset({"anon", "shmem"})) == {"anon": 10, "shmem": 3}


async def test_the_located_cgroup_is_kept_while_the_pid_and_its_cgroup_stay(tmp_path):
    proc = build_proc(tmp_path)
    tree = tmp_path / "v2"
    shutil.copytree(CGROUP / "v2", tree)
    cg = CgroupSource("t", pid=API, procfs_root=proc, cgroup_root=tree)
    assert await execute(cg, 5.0)
    first = cg.snapshot()
    assert first is not None and first.limit == 32 * GIB
    # /proc/self/cgroup is not read again while the pid and its cgroup stay the same.
    (proc / "self" / "cgroup").unlink()
    assert await execute(cg, 5.0)
    assert cg.snapshot() == first
    # vLLM moved to another cgroup (no limit there): located again at once.
    (proc / str(API) / "cgroup").write_text("0::/system.slice/vllm.service\n")
    assert await execute(cg, 5.0)
    moved = cg.snapshot()
    assert moved is not None and moved.limit is None and moved.path.endswith("vllm.service")
    # Its files vanish (a read fails): located again, and absent like before.
    shutil.rmtree(tree / "system.slice" / "vllm.service")
    assert not await execute(cg, 5.0)
    assert cg.snapshot() is None and "system.slice/vllm.service" in (cg.health.error or "")
