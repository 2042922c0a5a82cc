#!/usr/bin/env python3
"""Turn the GPU acceptance results ($OUT of each device call) into compact repo fixtures.

    .venv/bin/python bench/gpu/to_fixtures.py RESULTS... [--dest tests/fixtures/gpu] [--events-xz]

RESULTS are folders holding what came back from one device call (<config>.tar.xz, env.tar.xz,
summary.json, driver.log, gpu_probe.json), in call order, or single tarballs; a folder's name is
its call label. Written to DEST (format: fixtures-README.md, copied to DEST/README.md with a
generated section on the recording appended):

- DEST/<config>/ per server configuration: every KV event, every request's latency, the 1 s
  /metrics sequences of vLLM and the exporter and the exporter's /advice (consecutive samples
  from 10 s before the first workload to 10 s after the last), the exact expositions before and
  after each workload, the raw NVML counters at full rate over the workloads, /proc and system
  readings, advice/status/what-if outputs, the commands. A configuration recorded again in a
  later call gets the mode (`-graphs` without --enforce-eager) or the call as a suffix.
- DEST/<shape>-<mode>-<workload>/ per workload of each group of runs with one model, one mode
  and the same prompts: the what-if comparison's layout (bench/whatif_vs_observed.py,
  docs/whatif.md): run.json (the base run's "count" selects the workload's event batches),
  nooffload/kv-events.jsonl.xz (every event of the server, the caches carry over between
  workloads), <run>/metrics_{before,after}.txt.gz bracketing the workload, <run>/cmd.txt.
- DEST/summary.json (the driver summaries of all calls), DEST/env/<n>/ (hardware, driver,
  versions and the driver log of call n), DEST/gpu_probe.json, DEST/INDEX.json (what was kept
  and dropped, sizes, source sha256).

Dropped: the exporter's own copy of the events (checked identical to the recorder's first),
the driver's per-workload event slices (a slice loses the cache state the earlier workload
left: the comparison replays the whole stream and counts one workload), NVML rows between
workloads beyond one a second, the middle of vLLM's log, the call-wide NVML logs in env.
Target: the whole DEST under 8 MiB.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import lzma
import re
import shlex
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import gpukit as kit  # noqa: E402

TARGET_BYTES = 8 * kit.MIB
SMALL_TEXT = 16 * 1024  # /proc and /sys readings above this are gzipped
EVENTS_XZ = False  # --events-xz: xz finds the repeated token ids gzip's window misses
SETTLE_S = 4.0  # the driver's idle seconds after each workload (acceptance.py --settle)
SLICE_LEAD_S = 1.0  # a workload's events start this long before its first request

README = HERE / "fixtures-README.md"  # copied to DEST/README.md


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def collect(inputs: list[Path]) -> tuple[list[tuple[str, Path]], list[tuple[str, Path]]]:
    """((call, tarball), (call, summary.json)) from folders and files, in a stable order."""
    tars: list[tuple[str, Path]] = []
    sums: list[tuple[str, Path]] = []
    for p in inputs:
        if p.is_dir():
            tars += [(p.name, t) for t in sorted(p.glob("*.tar.xz"))]
            sums += [(p.name, s) for s in sorted(p.glob("summary.json"))]
        elif p.name.endswith(".tar.xz"):
            tars.append((p.parent.name, p))
        elif p.name.endswith(".json"):
            sums.append((p.parent.name, p))
    return tars, sums


def write_jsonl_xz(path: Path, rows: list[Any]) -> None:
    with lzma.open(path, "wt", encoding="utf-8", preset=9) as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def gzip_file(src: Path, dest: Path) -> None:
    with src.open("rb") as fi, gzip.open(dest, "wb", compresslevel=9) as fo:
        shutil.copyfileobj(fi, fo)


def gzip_text(text: str, dest: Path) -> None:
    with gzip.open(dest, "wt", compresslevel=9, encoding="utf-8") as fo:
        fo.write(text)


def xz_file(src: Path, dest: Path) -> None:
    with src.open("rb") as fi, lzma.open(dest, "wb", preset=9) as fo:
        shutil.copyfileobj(fi, fo)


def scrub(text: str, work: str | None) -> str:
    if work:
        text = text.replace(work, "<work>")
    return text


def work_dir_of(cmd_text: str) -> str | None:
    m = re.search(r"--model (\S+)/models/\w+", cmd_text)
    return m.group(1) if m else None


def log_excerpt(text: str, head: int = 150, tail: int = 100, cap: int = 100_000) -> str:
    lines = text.splitlines()
    if len(lines) <= head + tail:
        return text[-cap:]
    notable = [
        ln
        for ln in lines[head:-tail]
        if any(k in ln for k in ("WARNING", "ERROR", "Traceback", "Error", "KV Transfer"))
    ]
    out = [
        *lines[:head],
        f"... ({len(lines) - head - tail} lines; notable ones follow) ...",
        *notable,
    ]
    out += ["... (tail) ...", *lines[-tail:]]
    return "\n".join(out)[-cap:] + "\n"


# --- what a server command says about the run ----------------------------------------------


@dataclass
class RunInfo:
    """One converted configuration, for grouping into what-if experiments."""

    name: str  # the driver's configuration name
    dirname: str  # its folder under DEST
    call: str
    root: Path  # the extracted driver folder
    run: dict[str, Any]
    cmd: str
    shape: str
    mode: str  # eager | graphs
    offload_flag: str | None  # --kv-offloading-size as typed
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config

    @property
    def offload_bytes(self) -> int:
        return int(float(self.offload_flag) * (1 << 30)) if self.offload_flag else 0


def server_argv(cmd_text: str) -> list[str]:
    first = next((ln for ln in cmd_text.splitlines() if ln.strip()), "")
    try:
        return shlex.split(first)
    except ValueError:
        return first.split()


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def run_info(root: Path, dirname: str, call: str, run: dict[str, Any], cmd: str) -> RunInfo:
    argv = server_argv(cmd)
    flag = flag_value(argv, "--kv-offloading-size")
    extra: dict[str, Any] = {}
    raw = flag_value(argv, "--kv-transfer-config")
    if raw:
        try:
            extra = dict(json.loads(raw).get("kv_connector_extra_config") or {})
        except (ValueError, AttributeError):
            extra = {"unparsed": raw}
    shape = str(run.get("shape") or root.name.split("-", 1)[0])
    mode = "eager" if "--enforce-eager" in argv else "graphs"
    return RunInfo(root.name, dirname, call, root, run, cmd, shape, mode, flag, extra)


def run_dir_name(info: RunInfo) -> str:
    if not info.offload_flag:
        return "nooffload"
    name = f"offload-{info.offload_flag}GiB"
    ex = info.extra
    if ex.get("eviction_policy"):
        name += f"-{ex['eviction_policy']}"
    if ex.get("store_threshold"):
        name += f"-thr{ex['store_threshold']}"
    if ex.get("spec_name") or ex.get("secondary_tiers"):
        tiers = "-".join(str(t.get("type", "x")) for t in ex.get("secondary_tiers") or [])
        name += "-tier" + (f"-{tiers}" if tiers else "")
    return name


# --- one configuration -----------------------------------------------------------------------


def convert_config(root: Path, dest: Path, index: dict[str, Any], dirname: str) -> None:
    """root: an extracted <config>/ folder of the driver; written to dest/dirname."""
    out = dest / dirname
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    entry: dict[str, Any] = {"source_config": root.name, "kept": [], "dropped": []}
    index["configs"][dirname] = entry
    cmd_text = (root / "cmd.txt").read_text() if (root / "cmd.txt").exists() else ""
    work = work_dir_of(cmd_text)

    run: dict[str, Any] = {}
    if (root / "run.json").exists():
        run = json.loads((root / "run.json").read_text())
        (out / "run.json").write_text(scrub(json.dumps(run, indent=1), work) + "\n")
    else:
        entry["note"] = "no run.json: the server failed or the turn was cut short"
    windows = [tuple(w) for w in run.get("windows", {}).values()]

    for fname in (
        "cmd.txt",
        "exporter_cmd.txt",
        "latency.json",
        "kv_events.jsonl.stats.json",
        "exporter-full.yaml",
    ):
        p = root / fname
        if p.exists():
            (out / fname).write_text(scrub(p.read_text(), work))
    for p in sorted(root.glob("advice_*.json")) + sorted(root.glob("status_*.json")):
        shutil.copy(p, out / p.name)
    for p in sorted(root.glob("whatif_*.txt")):
        (out / p.name).write_text(scrub(p.read_text(), work))
    for p in sorted(root.glob("metrics_*_W*.txt")):
        gzip_file(p, out / (p.stem + ".prom.gz"))
    for p in sorted(root.glob("exporter_metrics_W*.txt")):
        gzip_file(p, out / (p.stem + ".prom.gz"))

    events = root / "kv_events.jsonl"
    if events.exists():
        if EVENTS_XZ:
            xz_file(events, out / "kv_events.jsonl.xz")
        else:
            gzip_file(events, out / "kv_events.jsonl.gz")
        theirs = root / "exporter_kv_events.jsonl"
        if theirs.exists():
            ours = [(r.get("seq"), r.get("payload")) for r in kit.iter_jsonl(events)]
            other = [(r.get("seq"), r.get("payload")) for r in kit.iter_jsonl(theirs)]
            entry["exporter_events_identical"] = ours == other
            entry["dropped"].append(
                f"exporter_kv_events.jsonl ({len(other)} messages, identical={ours == other})"
            )
    for p in root.glob("kv_events_W*.jsonl"):
        entry["dropped"].append(f"{p.name} (a time slice of kv_events.jsonl)")

    scrape = root / "scrape"
    for jl in sorted(scrape.glob("*.jsonl")) if scrape.exists() else []:
        samples = list(kit.iter_jsonl(jl))
        kept = kit.thin_samples(samples, windows, margin_s=10.0) if windows else samples
        write_jsonl_xz(out / (jl.name + ".xz"), kept)
        entry["kept"].append(f"{jl.name}: {len(kept)} of {len(samples)} samples")

    # Full rate from 1 s before the first workload to the end of the last one's settle time,
    # which is what the driver accumulated PCIe bytes over; one row a second elsewhere.
    span = [(min(a for a, _ in windows) - 1.0, max(b for _, b in windows) + SETTLE_S + 1.0)]
    fast = root / "nvml_fast.csv"
    if fast.exists():
        rows = kit.read_nvml_csv(fast.read_text().splitlines())
        kept_rows = kit.thin_nvml(rows, span, margin_s=0.0) if windows else rows
        with gzip.open(out / "nvml_fast.csv.gz", "wt", compresslevel=9) as fh:
            fh.write(kit.nvml_csv(kept_rows))
        entry["kept"].append(f"nvml_fast.csv: {len(kept_rows)} of {len(rows)} rows")
    thr = root / "nvml_thr.csv"
    if thr.exists():
        lines = thr.read_text().splitlines()
        keep = lines[:1] + [
            ln
            for ln in lines[1:]
            if any(a - 5 <= _t(ln) <= b + 5 for a, b in windows) or not windows
        ]
        gzip_text("\n".join(keep) + "\n", out / "nvml_thr.csv.gz")

    for sub in ("proc", "sys"):
        src = root / sub
        if not src.exists():
            continue
        (out / sub).mkdir()
        for p in sorted(src.iterdir()):
            if p.stat().st_size > SMALL_TEXT:
                gzip_file(p, out / sub / (p.name + ".gz"))
            else:
                shutil.copy(p, out / sub / p.name)
    if (root / "server.log").exists():
        text = (root / "server.log").read_text(errors="replace")
        (out / "server_log_excerpt.txt").write_text(scrub(log_excerpt(text), work))
    if (root / "exporter.log").exists():
        lines = (root / "exporter.log").read_text(errors="replace").splitlines()
        (out / "exporter_log_tail.txt").write_text(scrub("\n".join(lines[-200:]), work) + "\n")
    entry["files"] = {
        str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()
    }
    entry["bytes"] = sum(entry["files"].values())


def _t(line: str) -> float:
    try:
        return float(line.split(",", 1)[0])
    except ValueError:
        return -1.0


def convert_env(root: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in (
        "environment.json",
        "nvidia_smi_q.txt",
        "nvidia_smi.txt",
        "exporter_help.txt",
        "exporter_whatif_help.txt",
        "nvml_fast.csv.status.json",
        "free.txt",
    ):
        p = root / name
        if p.exists():
            shutil.copy(p, dest / name)


def merge_summaries(paths: list[tuple[str, Path]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"calls": [], "configs": {}}
    for i, (call, p) in enumerate(paths):
        doc = json.loads(p.read_text())
        configs = doc.pop("configs", {})
        for name, res in configs.items():
            keep = {k: v for k, v in res.items() if k not in ("server_log_tail",)}
            keep["call"] = i
            keep["call_label"] = call
            key = name if name not in merged["configs"] else f"{name}@{call}"
            merged["configs"][key] = keep
        merged["calls"].append({"source": call, **doc})
    return merged


def dir_name_for(name: str, call: str, mode: str, taken: dict[str, tuple[str, str]]) -> str:
    """The configuration's folder: its name, suffixed when an earlier call recorded it."""
    if name not in taken:
        return name
    _, first_mode = taken[name]
    candidate = f"{name}-{mode}" if mode != first_mode else f"{name}-call{call}"
    while candidate in taken:
        candidate += "x"
    return candidate


# --- what-if experiments ------------------------------------------------------------------------


def read_events(path: Path) -> list[str]:
    opener: Any = lzma.open if path.suffix == ".xz" else gzip.open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [ln for ln in (raw.strip() for raw in fh) if ln]


def count_windows(windows: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """Event timestamps each workload owns: from SLICE_LEAD_S before its first request to the
    same point before the next workload's (the last one's runs to the end of the stream)."""
    starts = sorted((w[0] - SLICE_LEAD_S, name) for name, w in windows.items())
    out: dict[str, tuple[float, float]] = {}
    for i, (t0, name) in enumerate(starts):
        out[name] = (t0, starts[i + 1][0] if i + 1 < len(starts) else 1e18)
    return out


def count_messages(lines: list[str], window: tuple[float, float]) -> int:
    return sum(1 for ln in lines if window[0] <= float(json.loads(ln)["payload"][0]) < window[1])


def build_experiments(dest: Path, runs: list[RunInfo], index: dict[str, Any]) -> list[str]:
    """One experiment per (shape, mode, workload) with a run without offload and offload runs."""
    groups: dict[tuple[str, str], list[RunInfo]] = {}
    for r in runs:
        groups.setdefault((r.shape, r.mode), []).append(r)
    made: list[str] = []
    for (shape, mode), members in sorted(groups.items()):
        bases = [r for r in members if not r.offload_flag]
        offloads = [r for r in members if r.offload_flag]
        if not bases or not offloads:
            index["experiments_skipped"].append(f"{shape}-{mode}: needs a base and offload runs")
            continue
        base = bases[-1]
        if len(bases) > 1:
            index["experiments_skipped"].append(
                f"{shape}-{mode}: {len(bases)} runs without offload; {base.dirname} used"
            )
        events_path = next(
            (
                q
                for q in (dest / base.dirname / f"kv_events.jsonl.{x}" for x in ("xz", "gz"))
                if q.exists()
            ),
            None,
        )
        if events_path is None:
            index["experiments_skipped"].append(f"{shape}-{mode}: no events in {base.dirname}")
            continue
        windows = base.run.get("windows") or {}
        lines = read_events(events_path)
        counts = count_windows(windows)
        version = index.get("vllm_version")
        cc = dict(base.run.get("cache_config_info") or [])
        block_size = None
        for labels in cc:
            m = re.search(r'block_size="(\d+)"', labels)
            if m:
                block_size = int(m.group(1))
        for wl in windows:
            name = f"{shape}-{mode}-{wl}"
            exp = dest / name
            if exp.exists():
                shutil.rmtree(exp)
            exp.mkdir(parents=True)
            entries: list[dict[str, Any]] = []
            used: set[str] = set()
            for r in [base, *sorted(offloads, key=lambda x: (x.offload_bytes, x.dirname))]:
                before = r.root / f"metrics_before_{wl}.txt"
                after = r.root / f"metrics_after_{wl}.txt"
                if not (before.exists() and after.exists()):
                    index["experiments_skipped"].append(f"{name}: {r.dirname} lacks {wl}")
                    continue
                rd = run_dir_name(r)
                while rd in used:
                    rd += "x"
                used.add(rd)
                (exp / rd).mkdir()
                gzip_file(before, exp / rd / "metrics_before.txt.gz")
                gzip_file(after, exp / rd / "metrics_after.txt.gz")
                (exp / rd / "cmd.txt").write_text(scrub(r.cmd, work_dir_of(r.cmd)))
                entry: dict[str, Any] = {
                    "dir": rd,
                    "config": r.name,
                    "data": f"../{r.dirname}",
                    "call": r.call,
                }
                if r is base:
                    # The whole stream: the caches carry over from the earlier workloads, so
                    # the comparison replays everything and counts the workload's batches.
                    with lzma.open(exp / rd / "kv-events.jsonl.xz", "wt", preset=9) as fh:
                        fh.write("".join(ln + "\n" for ln in lines))
                    entry["count"] = list(counts[wl])
                    entry["workload_window"] = windows[wl]
                    entry["count_messages"] = count_messages(lines, counts[wl])
                else:
                    entry["offload_bytes"] = r.offload_bytes
                    entry["kv_offloading_size"] = r.offload_flag
                    ex = r.extra
                    if ex.get("eviction_policy"):
                        entry["eviction_policy"] = ex["eviction_policy"]
                    if ex.get("store_threshold"):
                        entry["store_threshold"] = int(ex["store_threshold"])
                    other = set(ex) - {"eviction_policy", "store_threshold"}
                    if other:
                        entry["whatif"] = False
                        entry["why"] = (
                            f"kv_connector_extra_config {sorted(other)} is not modelled "
                            "(the simulator is vLLM 0.26's CPU tier alone)"
                        )
                        entry["kv_connector_extra_config"] = ex
                entries.append(entry)
            spec = {
                "vllm_version": version,
                "block_size": block_size,
                "kv_bytes_per_block": base.run.get("kv_bytes_per_block"),
                "kv_bytes_per_token": base.run.get("kv_bytes_per_token"),
                "eviction_policy": "lru",
                "shape": shape,
                "mode": mode,
                "workload": wl,
                "runs": entries,
            }
            (exp / "run.json").write_text(json.dumps(spec, indent=1) + "\n")
            made.append(name)
    return made


# --- README ------------------------------------------------------------------------------------


def recording_section(dest: Path, calls: list[dict[str, Any]], envs: dict[str, str]) -> str:
    """What was recorded where: generated from the environment and driver logs."""
    lines = ["", "## This recording (generated)", ""]
    probe = dest / "gpu_probe.json"
    if probe.exists():
        doc = json.loads(probe.read_text())
        gpu = doc.get("gpu") or {}
        lines.append(
            f"- GPU probe (`gpu_probe.json`): {gpu.get('name', '?')}, driver "
            f"{gpu.get('driver', '?')}, PCIe Gen{gpu.get('link_generation_max', '?')} "
            f"x{gpu.get('link_width_max', '?')}, torch {doc.get('torch', '?')}, method "
            f"{doc.get('method', '?')}, status {doc.get('status', '?')}"
        )
    env_of = {call: n for n, call in envs.items()}
    for c in calls:
        env = c.get("environment") or {}
        pk = env.get("packages") or {}
        if not env:
            continue
        lines.append(
            f"- call `{c['label']}`: {env.get('Product Name', '?')}, driver "
            f"{env.get('Driver Version', '?')}, CUDA {env.get('CUDA Version', '?')}, vLLM "
            f"{pk.get('vllm', '?')}, torch {pk.get('torch', '?')} (CUDA {pk.get('torch.cuda', '?')}"
            f"), Python {env.get('python', '?')}, {env.get('nproc', '?')} CPUs; configurations "
            f"{', '.join(c.get('configs', [])) or '-'}"
            + (f"; `env/{env_of[c['label']]}/`" if c["label"] in env_of else "")
        )
        if c.get("argv"):
            lines.append(f"  - `{c['argv']}`")
    exps = sorted(p.parent.name for p in dest.glob("*/run.json") if _is_experiment(p))
    if exps:
        lines += ["", "What-if experiments: " + ", ".join(f"`{e}`" for e in exps) + "."]
    return "\n".join(lines) + "\n"


def _is_experiment(p: Path) -> bool:
    try:
        return "runs" in json.loads(p.read_text())
    except ValueError:
        return False


def driver_argv(log_text: str) -> str | None:
    m = re.search(r"driver: (\[.*?\]) budget", log_text)
    if not m:
        return None
    try:
        argv = json.loads(m.group(1).replace("'", '"'))
    except ValueError:
        return None
    return "python3 " + " ".join(shlex.quote(a) for a in argv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--dest", type=Path, default=REPO / "tests" / "fixtures" / "gpu")
    ap.add_argument("--events-xz", action="store_true", help="kv_events.jsonl.xz, not .gz")
    a = ap.parse_args(argv)
    global EVENTS_XZ  # noqa: PLW0603
    EVENTS_XZ = a.events_xz
    tars, sums = collect(a.results)
    if not tars:
        print("no *.tar.xz found in", [str(p) for p in a.results], file=sys.stderr)
        return 2
    a.dest.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {
        "sources": {},
        "configs": {},
        "experiments": [],
        "experiments_skipped": [],
        "env": {},
        "target_bytes": TARGET_BYTES,
    }
    calls: dict[str, dict[str, Any]] = {}
    for p in a.results:
        if p.is_dir():
            c = calls.setdefault(p.name, {"label": p.name, "configs": []})
            log = p / "driver.log"
            if log.exists():
                c["argv"] = driver_argv(log.read_text(errors="replace"))
            if (p / "gpu_probe.json").exists():
                shutil.copy(p / "gpu_probe.json", a.dest / "gpu_probe.json")
                index["gpu_probe"] = p.name
    env_n = 0
    taken: dict[str, tuple[str, str]] = {}
    infos: list[RunInfo] = []
    with tempfile.TemporaryDirectory(prefix="kvoe-fix-") as tmp:
        for call, tar_path in tars:
            index["sources"][f"{call}/{tar_path.name}"] = sha256(tar_path)
            x = Path(tmp) / f"x{len(index['sources'])}"
            with tarfile.open(tar_path, "r:xz") as tar:
                tar.extractall(x, filter="data")
            for root in sorted(d for d in x.iterdir() if d.is_dir()):
                if root.name == "env":
                    env_dest = a.dest / "env" / str(env_n)
                    convert_env(root, env_dest)
                    log = tar_path.parent / "driver.log"
                    if log.exists():
                        shutil.copy(log, env_dest / "driver.log")
                    index["env"][str(env_n)] = call
                    envj = root / "environment.json"
                    if envj.exists():
                        calls.setdefault(call, {"label": call, "configs": []})["environment"] = (
                            json.loads(envj.read_text())
                        )
                    env_n += 1
                    continue
                cmd = (root / "cmd.txt").read_text() if (root / "cmd.txt").exists() else ""
                run = (
                    json.loads((root / "run.json").read_text())
                    if (root / "run.json").exists()
                    else {}
                )
                mode = "eager" if "--enforce-eager" in server_argv(cmd) else "graphs"
                dirname = dir_name_for(root.name, call, mode, taken)
                taken[dirname] = (call, mode)
                taken.setdefault(root.name, (call, mode))
                convert_config(root, a.dest, index, dirname)
                calls.setdefault(call, {"label": call, "configs": []})["configs"].append(dirname)
                print(f"{dirname}: {index['configs'][dirname]['bytes']} bytes")
                if run.get("windows"):
                    infos.append(run_info(root, dirname, call, run, cmd))
        for c in calls.values():
            if "environment" in c:
                index["vllm_version"] = (c["environment"].get("packages") or {}).get("vllm")
        index["experiments"] = build_experiments(a.dest, infos, index)
    if sums:
        (a.dest / "summary.json").write_text(
            json.dumps(merge_summaries(sums), indent=1, default=str) + "\n"
        )
    (a.dest / "README.md").write_text(
        README.read_text() + recording_section(a.dest, list(calls.values()), index["env"])
    )
    total = sum(p.stat().st_size for p in a.dest.rglob("*") if p.is_file())
    index["total_bytes"] = total
    (a.dest / "INDEX.json").write_text(json.dumps(index, indent=1) + "\n")
    print(f"total {total} bytes in {a.dest} (target < {TARGET_BYTES})")
    if total > TARGET_BYTES:
        print("WARNING: over the target; see INDEX.json for the largest files", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
