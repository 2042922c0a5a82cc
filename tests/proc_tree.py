"""A whole /proc tree around the recorded vLLM 0.26 H200 runs, for the procfs and cgroup tests
(and the golden exposition).

The status files, smaps_rollup and cmd.txt are the recorded ones; the per-mapping smaps
come from tests/fixtures/proc/make_smaps.py (checked against the recordings in
tests/sources/procfs/test_parsers.py); stat, cmdline layout, fds, net/tcp and the extra
processes around vLLM are made up to build the tree in a temporary directory.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from exporter.sources.procfs.parsers import SmapsEntry, parse_smaps
from exporter.sources.procfs.source import ProcfsSource

FIXTURES = Path(__file__).parent / "fixtures"
RUNS = FIXTURES / "vllm-0.26.0-h200"
SMAPS = FIXTURES / "proc"
CGROUP = FIXTURES / "cgroup"
KIB = 1024
MIB = 1 << 20
GIB = 1 << 30
SHELL, API, ENGINE, TRACKER, OTHER_API = 2330, 2567, 2631, 2640, 3100
API_SOCKET, OTHER_SOCKET, ZMQ_SOCKET = 918273, 918300, 918400
VLLM_CGROUP = (
    "/kubepods.slice/kubepods-podf1e2d3c4_0000_4000_8000_000000000001.slice/"
    "cri-containerd-vllm0001.scope"
)
EXPORTER_CGROUP = VLLM_CGROUP.replace("vllm0001", "exporter0002")


def recorded(run: str, name: str) -> str:
    return (RUNS / run / name).read_text()


def argv_from_cmd(run: str, port: int) -> list[str]:
    """cmd.txt as an argv: the JSON argument stays one argument, <dir> becomes real paths."""
    text = recorded(run, "cmd.txt").strip()
    parts = re.findall(r"\{[^}]*\}|\S+", text)
    parts[0] = "/opt/venv/bin/python3"
    parts = [p.replace("<dir>", "/models/qwen3-0.6b-dummy") for p in parts]
    i = parts.index("--port")
    parts[i + 1] = str(port)
    return parts


def stat_line(pid: int, comm: str, ppid: int, starttime: int, state: str = "S") -> str:
    fields = [state, str(ppid), str(ppid), str(ppid), "0", "-1", "4194560"]
    fields += ["0"] * 4 + ["120", "35", "0", "0", "20", "0", "54", "0", str(starttime)]
    fields += ["0"] * 30
    return f"{pid} ({comm}) " + " ".join(fields) + "\n"


def small_status(pid: int, ppid: int, name: str, rss_kb: int) -> str:
    return (
        f"Name:\t{name}\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t{pid}\nPid:\t{pid}\n"
        f"PPid:\t{ppid}\nVmLck:\t       0 kB\nVmPin:\t       0 kB\nVmRSS:\t {rss_kb} kB\n"
        f"RssAnon:\t {rss_kb - 1000} kB\nRssFile:\t    1000 kB\nRssShmem:\t       0 kB\n"
    )


def build_proc(
    base: Path,
    run: str = "b_offload",
    port: int = 8000,
    *,
    fds: bool = True,
    cgroup: str = VLLM_CGROUP,
) -> Path:
    proc = base / "proc"

    def process(
        pid: int,
        *,
        status: str,
        comm: str,
        ppid: int,
        argv: list[str],
        smaps: str | None = None,
        sockets: tuple[int, ...] = (),
    ) -> Path:
        d = proc / str(pid)
        d.mkdir(parents=True)
        (d / "status").write_text(status)
        (d / "stat").write_text(stat_line(pid, comm, ppid, 1000 + pid))
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (d / "cgroup").write_text(f"0::{cgroup}\n")
        if smaps is not None:
            (d / "smaps").write_text(smaps)
        if fds:
            (d / "fd").mkdir()
            (d / "fd" / "0").symlink_to("/dev/null")
            for n, inode in enumerate(sockets, start=20):
                (d / "fd" / str(n)).symlink_to(f"socket:[{inode}]")
        return d

    process(1, status=small_status(1, 0, "tini", 900), comm="tini", ppid=0, argv=["/tini"])
    process(
        SHELL,
        status=small_status(SHELL, 1, "bash", 4000),
        comm="bash",
        ppid=1,
        argv=["bash", "run.sh"],
    )
    api = process(
        API,
        status=recorded(run, "api_status.txt"),
        comm="python3",
        ppid=SHELL,
        argv=argv_from_cmd(run, port),
        smaps=(SMAPS / f"vllm-0.26.0-h200-{run}" / "api_smaps.txt").read_text(),
        sockets=(API_SOCKET,),
    )
    engine = process(
        ENGINE,
        status=recorded(run, "engine_status.txt"),
        comm="VLLM::EngineCor",
        ppid=API,
        # setproctitle pads the title in the old argv area.
        argv=["VLLM::EngineCore" + " " * 40],
        smaps=(SMAPS / f"vllm-0.26.0-h200-{run}" / "engine_smaps.txt").read_text(),
        sockets=(ZMQ_SOCKET,),
    )
    shutil.copy(RUNS / run / "engine_smaps_rollup.txt", engine / "smaps_rollup")
    assert api.exists()
    tracker_argv = [
        "/opt/venv/bin/python3",
        "-c",
        "from multiprocessing.resource_tracker import main;main(23)",
    ]
    process(
        TRACKER,
        status=small_status(TRACKER, API, "python3", 12000),
        comm="python3",
        ppid=API,
        argv=tracker_argv,
        smaps="",
    )
    other_argv = ["/opt/venv/bin/vllm", "serve", "/models/other", "--port", "8001"]
    process(
        OTHER_API,
        status=small_status(OTHER_API, 1, "python3", 500000),
        comm="python3",
        ppid=1,
        argv=other_argv,
        smaps="",
        sockets=(OTHER_SOCKET,),
    )
    (proc / "self").mkdir()
    (proc / "self" / "cgroup").write_text(f"0::{EXPORTER_CGROUP}\n")
    head = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid"
        "  timeout inode\n"
    )
    tail = (
        "00000000:00000000 00:00000000 00000000     0        0 {inode} 1 0000000000000000"
        " 100 0 0 10 0\n"
    )
    (proc / "net").mkdir()
    (proc / "net" / "tcp").write_text(
        head
        + f"   0: 0100007F:{port:04X} 00000000:0000 0A "
        + tail.format(inode=API_SOCKET)
        + f"   1: 00000000:{8001:04X} 00000000:0000 0A "
        + tail.format(inode=OTHER_SOCKET)
        + f"   2: 0100007F:{port:04X} 0100007F:D2F0 01 "
        + tail.format(inode=777)
    )
    (proc / "net" / "tcp6").write_text(
        head
        + "   0: 00000000000000000000000000000000:15C5 00000000000000000000000000000000:0000 0A "
        + tail.format(inode=ZMQ_SOCKET)
    )
    return proc


def recorded_statvfs(run: str = "b_offload"):
    """statvfs of /dev/shm as dev_shm.txt recorded it (df -B1)."""
    line = next(x for x in recorded(run, "dev_shm.txt").splitlines() if x.startswith("tmpfs"))
    _, size, used, *_ = line.split()
    blocks, free = int(size) // 4096, (int(size) - int(used)) // 4096
    seen: list[str] = []

    def statvfs(path: str) -> os.statvfs_result:
        seen.append(path)
        return os.statvfs_result((4096, 4096, blocks, free, free, 0, 0, 0, 0, 255))

    statvfs.seen = seen  # type: ignore[attr-defined]
    return statvfs


def source(proc: Path, port: int | None = 8000, **kw) -> ProcfsSource:
    kw.setdefault("statvfs", recorded_statvfs())
    kw.setdefault("shm", proc.parent / "shm")
    return ProcfsSource("vllm-b", port=port, procfs=proc, **kw)


def engine_maps(run: str) -> list[SmapsEntry]:
    """The EngineCore's per-mapping smaps of a recorded run."""
    return parse_smaps((SMAPS / f"vllm-0.26.0-h200-{run}" / "engine_smaps.txt").read_text())
