"""exporter/sources/procfs/parsers.py: the pure parsers and heuristics, on the recorded
vLLM 0.26 H200 text and on literal strings."""

from __future__ import annotations

import os
from dataclasses import replace

from exporter.sources.procfs.parsers import (
    PoolEstimate,
    ShmFile,
    SmapsEntry,
    cmdline_port,
    dev_shm_usage,
    is_api_server,
    is_pinned_mapping,
    offload_pool,
    parse_cmdline,
    parse_net_tcp,
    parse_smaps,
    parse_smaps_rollup,
    parse_stat,
    parse_status,
    pinned_bytes,
    pinned_mappings,
    pinned_mappings_in,
    role_of,
    url_port,
)
from tests.proc_tree import (
    API,
    ENGINE,
    GIB,
    KIB,
    MIB,
    SMAPS,
    argv_from_cmd,
    engine_maps,
    recorded,
)

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
    maps = parse_smaps(text)
    assert pinned_bytes(maps) == (256 + 32 + 32) * 1024 * 1024


def test_dev_shm_usage_from_statvfs():
    seen: list[str] = []

    def statvfs(path: str) -> os.statvfs_result:
        seen.append(path)
        return os.statvfs_result((4096, 4096, 1000, 250, 250, 0, 0, 0, 0, 255))

    assert dev_shm_usage(statvfs, "/dev/shm") == (1000 * 4096, 750 * 4096)
    assert seen == ["/dev/shm"]


# --- the offload pool -----------------------------------------------------------------------


def test_pool_of_vllm_026_is_the_group_of_per_layer_tensors():
    pool = offload_pool(engine_maps("b_offload"))
    assert pool == PoolEstimate(896 * MIB, "shared_anon_group", 28)
    assert offload_pool(engine_maps("a_nooffload")) is None  # CUDA's own small mappings


def test_pool_counts_a_region_shared_by_two_processes_once():
    maps = engine_maps("b_offload")
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


def test_pinned_mappings_are_the_pinned_ones_parse_smaps_finds():
    # The source reads only these (one regex for the shared writable headers).
    for run in ("a_nooffload", "b_offload"):
        for who in ("engine", "api"):
            text = (SMAPS / f"vllm-0.26.0-h200-{run}" / f"{who}_smaps.txt").read_text()
            want = [m for m in parse_smaps(text) if is_pinned_mapping(m)]
            assert pinned_mappings(text) == want
    assert (
        len(
            pinned_mappings((SMAPS / "vllm-0.26.0-h200-b_offload" / "engine_smaps.txt").read_text())
        )
        >= 28
    )
    text = (
        "7f3a40000000-7f3a42000000 rw-s 00000000 00:01 5121   /dev/zero (deleted)  \n"
        "Rss:               32768 kB\nLocked:               4 kB\n"
        "7f3a42000000-7f3a43000000 r--s 00000000 00:01 5122 /dev/zero (deleted)\n"
        "Rss:                   4 kB\n"
        "7f3a50000000-7f3a51000000 rw-s 00001000 00:1a 77 /dev/shm/vllm_offload_0.mmap\n"
        "7f3a60000000-7f3a61000000 rw-s 00000000 00:1a 78 /dev/shm/other\n"
        "Rss:               16384 kB\n"
    )
    want = [m for m in parse_smaps(text) if is_pinned_mapping(m)]
    assert [(m.path, m.rss, m.locked) for m in want] == [
        ("/dev/zero (deleted)", 32 * MIB, 4 * KIB),
        ("/dev/shm/vllm_offload_0.mmap", 0, 0),  # its block ends at the next header
    ]
    assert pinned_mappings(text) == want


def test_pinned_mappings_in_pieces_are_those_of_the_whole_text():
    """The source parses smaps as it reads it: wherever the reads cut (inside a header, a
    field, a block), the mappings found are those of the whole file."""
    engine = (SMAPS / "vllm-0.26.0-h200-b_offload" / "engine_smaps.txt").read_text()
    want = pinned_mappings(engine)
    assert len(want) >= 28
    for size in (1, 7, 61, 1000, 4096, len(engine)):
        pieces = [engine[i : i + size] for i in range(0, len(engine), size)]
        assert pinned_mappings_in(pieces) == want, size
    assert pinned_mappings_in([]) == [] == pinned_mappings_in(["", ""])


def test_status_with_other_line_breaks_reads_as_splitlines_does():
    plain = "Name:\tpython3\nState:\tS (sleeping)\nPid:\t7\nPPid:\t1\nVmRSS:\t  12 kB\n"
    st = parse_status(plain)
    assert (st.name, st.state, st.pid, st.ppid, st.resident, st.anon) == (
        "python3",
        "S",
        7,
        1,
        12 * KIB,
        None,
    )
    # A "\r" or "\u2028" (a thread name may hold one) ends a line for splitlines(): the
    # fast path hands such text to the line loop.
    odd = "Name:\tpy\u2028VmRSS: 3 kB\nState:\tR\r\nRssAnon:\t2 kB\n"
    st = parse_status(odd)
    assert (st.name, st.resident, st.state, st.anon) == ("py", 3 * KIB, "R", 2 * KIB)
