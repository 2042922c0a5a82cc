#!/usr/bin/env python3
"""Turn the GPU acceptance results ($OUT of each device call) into compact repo fixtures.

    .venv/bin/python bench/gpu/to_fixtures.py RESULTS... [--dest tests/fixtures/gpu]

RESULTS are folders holding what came back from the device (<config>.tar.xz, env.tar.xz,
summary.json, driver.log) or single tarballs. For each configuration it writes
DEST/<config>/ (see the README.md it writes there for the format), plus DEST/summary.json (all
calls merged), DEST/env/<n>/ (hardware, driver, versions per call) and DEST/INDEX.json (what was
kept and dropped, sizes, source sha256). Target: the whole DEST under 8 MiB.

What is kept: every KV event (gzip), every request's latency, the /metrics sequences of vLLM and
the exporter with all consecutive 1 s samples from 10 s before the first workload to 10 s after
the last (xz: consecutive samples differ in few numbers), the exact expositions before and after
each workload, the raw NVML counters at full rate (10 ms) inside the workloads +-1 s and one row
per second elsewhere, all /proc and system readings, advice/status/what-if outputs and the
commands. What is dropped: samples far from the workloads, the per-workload event slices and the
exporter's own copy of the events (checked identical to the recorder's first), the middle of
vLLM's log.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import lzma
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import gpukit as kit  # noqa: E402

TARGET_BYTES = 8 * kit.MIB
SMALL_TEXT = 64 * 1024  # text files above this are gzipped
EVENTS_XZ = False  # --events-xz: ~15 % smaller than gzip on random token ids

README = HERE / "fixtures-README.md"  # copied to DEST/README.md


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def collect(inputs: list[Path]) -> tuple[list[Path], list[Path]]:
    """(tarballs, summary.json files) from folders and files, in a stable order."""
    tars: list[Path] = []
    sums: list[Path] = []
    for p in inputs:
        if p.is_dir():
            tars += sorted(p.glob("*.tar.xz"))
            sums += sorted(p.glob("summary.json"))
        elif p.name.endswith(".tar.xz"):
            tars.append(p)
        elif p.name.endswith(".json"):
            sums.append(p)
    return tars, sums


def write_jsonl_xz(path: Path, rows: list[Any]) -> None:
    with lzma.open(path, "wt", encoding="utf-8", preset=9) as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def gzip_file(src: Path, dest: Path) -> None:
    with src.open("rb") as fi, gzip.open(dest, "wb", compresslevel=9) as fo:
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


def convert_config(root: Path, dest: Path, index: dict[str, Any]) -> None:
    """root: an extracted <config>/ folder of the driver."""
    name = root.name
    out = dest / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    entry: dict[str, Any] = {"kept": [], "dropped": []}
    index["configs"][name] = entry
    cmd_text = (root / "cmd.txt").read_text() if (root / "cmd.txt").exists() else ""
    work = work_dir_of(cmd_text)

    run: dict[str, Any] = {}
    if (root / "run.json").exists():
        run = json.loads((root / "run.json").read_text())
        (out / "run.json").write_text(scrub(json.dumps(run, indent=1), work) + "\n")
    else:
        entry["note"] = "no run.json: the server failed or the turn was cut short"
    windows = [tuple(w) for w in run.get("windows", {}).values()]

    for fname in ("cmd.txt", "exporter_cmd.txt", "latency.json", "kv_events.jsonl.stats.json"):
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
            with (
                events.open("rb") as fi,
                lzma.open(out / "kv_events.jsonl.xz", "wb", preset=9) as fo,
            ):
                shutil.copyfileobj(fi, fo)
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

    fast = root / "nvml_fast.csv"
    if fast.exists():
        rows = kit.read_nvml_csv(fast.read_text().splitlines())
        kept_rows = kit.thin_nvml(rows, windows) if windows else rows
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
        (out / "nvml_thr.csv").write_text("\n".join(keep) + "\n")

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


def merge_summaries(paths: list[Path]) -> dict[str, Any]:
    merged: dict[str, Any] = {"calls": [], "configs": {}}
    for i, p in enumerate(paths):
        doc = json.loads(p.read_text())
        configs = doc.pop("configs", {})
        for name, res in configs.items():
            keep = {k: v for k, v in res.items() if k not in ("server_log_tail",)}
            keep["call"] = i
            merged["configs"][name] = keep
        merged["calls"].append({"source": p.parent.name, **doc})
    return merged


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
    index: dict[str, Any] = {"sources": {}, "configs": {}, "target_bytes": TARGET_BYTES}
    env_n = 0
    with tempfile.TemporaryDirectory(prefix="kvoe-fix-") as tmp:
        for tar_path in tars:
            index["sources"][f"{tar_path.parent.name}/{tar_path.name}"] = sha256(tar_path)
            x = Path(tmp) / f"x{len(index['sources'])}"
            with tarfile.open(tar_path, "r:xz") as tar:
                tar.extractall(x, filter="data")
            for root in sorted(d for d in x.iterdir() if d.is_dir()):
                if root.name == "env":
                    convert_env(root, a.dest / "env" / str(env_n))
                    env_n += 1
                else:
                    convert_config(root, a.dest, index)
                    print(f"{root.name}: {index['configs'][root.name]['bytes']} bytes")
    if sums:
        (a.dest / "summary.json").write_text(
            json.dumps(merge_summaries(sums), indent=1, default=str) + "\n"
        )
    shutil.copy(README, a.dest / "README.md")
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
