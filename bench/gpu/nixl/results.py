#!/usr/bin/env python3
"""The NIXL device runs, after the fact: pack them as test fixtures, and tabulate them.

    results.py pack CALL_DIR DEST [--as VARIANT=NAME ...]
        CALL_DIR is what one `run_pd.py run` call brought back (`<variant>.tar.xz`,
        summary.json, driver-*.log). Each variant becomes DEST/<shape>-<variant>/ (or the
        NAME given) with what the tests read: prefill/ and decode/ (metrics.jsonl.xz,
        meta.json), exporter.jsonl.xz, requests.jsonl.xz, summary.json, and ucx.txt (the
        UCX protocol tables and errors of both servers' logs, each line once). The server
        logs and KV events stay out: they are most of the bytes, and no test reads them.
    results.py table DIR
        One row per run under DIR: transfers, bytes and transfer seconds on the engine that
        issued them, the bandwidth (delta bytes / delta transfer time from vLLM's own
        counters), UCX's READ/WRITE transports, and per prompt length the median decode
        TTFT with the KV transferred against the median TTFT of the same engine computing a
        fresh prompt of that length (the baseline measured in the same run).

Runs here (no GPU); the tables in docs/backends.md are this script's output.
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
import shutil
import statistics
import sys
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ROLES = ("prefill", "decode")
# One line of UCX's protocol table or an error/warning of UCX itself, timestamp and pid
# stripped: "[1796286303.52] [vm:6966 :0]   | 0..inf | zero-copy | cuda_ipc/cuda |".
_UCX_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\) )?\[[0-9.]+\] \[[^\]]*\]\s+")
_UCX_KEEP = re.compile(r"^\||UCX\s+(?:ERROR|WARN)")


def ucx_lines(log: str) -> list[str]:
    """The UCX protocol-table rows and UCX errors of a server log, each distinct line once."""
    seen: dict[str, None] = {}
    for raw in log.splitlines():
        if not _UCX_PREFIX.match(raw):
            continue
        line = _UCX_PREFIX.sub("", raw).rstrip()
        if _UCX_KEEP.search(line) and not set(line) <= {"|", "+", "-", " "}:
            seen.setdefault(line, None)
    return list(seen)


def _members(tar: tarfile.TarFile) -> dict[str, tarfile.TarInfo]:
    """Members by path below the variant's own folder (`pull-ipc/decode/meta.json` ->
    `decode/meta.json`)."""
    out = {}
    for m in tar.getmembers():
        if m.isfile():
            parts = Path(m.name).parts
            out[str(Path(*parts[1:])) if len(parts) > 1 else parts[0]] = m
    return out


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    fh = tar.extractfile(member)
    if fh is None:
        raise ValueError(f"{member.name}: not a file")
    return fh.read()


def pack_variant(archive: Path, dest: Path) -> list[Path]:
    """One `<variant>.tar.xz` into dest; returns the files written."""
    written = []
    with tarfile.open(archive, "r:xz") as tar:
        members = _members(tar)
        dest.mkdir(parents=True, exist_ok=True)
        keep = [f"{r}/{n}" for r in ROLES for n in ("metrics.jsonl.xz", "meta.json")]
        keep += ["exporter.jsonl.xz", "summary.json"]
        for name in keep:
            if name in members:
                path = dest / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(_read(tar, members[name]))
                written.append(path)
        if "requests.jsonl" in members:
            path = dest / "requests.jsonl.xz"
            path.write_bytes(lzma.compress(_read(tar, members["requests.jsonl"]), preset=9))
            written.append(path)
        ucx = []
        for role in (*ROLES, "exporter"):
            if f"{role}.log" in members:
                text = _read(tar, members[f"{role}.log"]).decode("utf-8", "replace")
                lines = ucx_lines(text)
                if lines:
                    ucx += [f"== {role}.log", *lines, ""]
        if ucx:
            path = dest / "ucx.txt"
            path.write_text("\n".join(ucx))
            written.append(path)
    return written


def pack(call: Path, dest: Path, names: Mapping[str, str]) -> list[Path]:
    written = []
    for archive in sorted(call.glob("*.tar.xz")):
        variant = archive.name.removesuffix(".tar.xz")
        if variant == "probe":
            with tarfile.open(archive, "r:xz") as tar:
                members = _members(tar)
                if "probe.json" in members:
                    dest.mkdir(parents=True, exist_ok=True)
                    path = dest / "probe.json"
                    path.write_bytes(_read(tar, members["probe.json"]))
                    written.append(path)
            continue
        with tarfile.open(archive, "r:xz") as tar:
            members = _members(tar)
            summary = json.loads(_read(tar, members["summary.json"]))
        name = names.get(variant, f"{summary.get('shape', 'small')}-{variant}")
        target = dest / name
        if target.exists():
            shutil.rmtree(target)
        written += pack_variant(archive, target)
    return written


# ---------------------------------------------------------------------------------- table


def _scrapes(path: Path) -> Iterator[tuple[float, str]]:
    with lzma.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            doc = json.loads(line)
            if doc.get("body"):
                yield float(doc["t"]), doc["body"]


def counter(body: str, name: str) -> float:
    """The sum over every sample of `name` (one engine per server here)."""
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rpartition(" ")[2])
    return total


NIXL = {
    "transfers": "vllm:nixl_xfer_time_seconds_count",
    "bytes": "vllm:nixl_bytes_transferred_sum",
    "xfer_s": "vllm:nixl_xfer_time_seconds_sum",
    "failed": "vllm:nixl_num_failed_transfers_total",
}


def nixl_deltas(recording: Path) -> dict[str, float]:
    """Last minus first scrape of the NIXL counters of one server's recording."""
    scrapes = list(_scrapes(recording / "metrics.jsonl.xz"))
    first, last = scrapes[0][1], scrapes[-1][1]
    return {k: counter(last, n) - counter(first, n) for k, n in NIXL.items()}


def requests(run: Path) -> list[dict[str, Any]]:
    path = run / "requests.jsonl.xz"
    with lzma.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def by_length(rows: Sequence[Mapping[str, Any]]) -> dict[int, tuple[float, float, int]]:
    """prompt length -> (median decode TTFT with the KV transferred, median recompute TTFT
    of the baseline, requests)."""
    out = {}
    for length in sorted({int(r["length"]) for r in rows}):
        ok = [
            r
            for r in rows
            if int(r["length"]) == length
            and r.get("decode_ttft_s") is not None
            and r.get("baseline_ttft_s") is not None
        ]
        if ok:
            out[length] = (
                statistics.median(float(r["decode_ttft_s"]) for r in ok),
                statistics.median(float(r["baseline_ttft_s"]) for r in ok),
                len(ok),
            )
    return out


# The tables of the operations that move the KV: NIXL posts them as ucp_get/put "(multi)";
# the pull connector READs into GPU (or, with host buffers, host) memory, the push connector
# WRITEs from GPU memory. UCX's other tables are wire-up, active messages, notifications.
_KV_TABLE = re.compile(
    r"^\| remote memory (read) by ucp_get\*\(multi\) into"
    r"|^\| remote memory (write) by ucp_put\*\(multi\) from cuda"
)
_TITLE = re.compile(r"^\| (?:remote memory|active message|[0-9a-f]{8}-)|^==")


def transports(run: Path) -> tuple[str, str]:
    """UCX's READ and WRITE transports for the KV, from the packed ucx.txt: the rows of the
    tables `_KV_TABLE` names, as "transport (description)"."""
    path = run / "ucx.txt"
    if not path.exists():
        return "?", "?"
    found: dict[str, dict[str, None]] = {"read": {}, "write": {}}
    current = None
    for line in path.read_text().splitlines():
        m = _KV_TABLE.match(line)
        if m:
            current = m.group(1) or m.group(2)
            continue
        if _TITLE.match(line):
            current = None
            continue
        row = [c.strip() for c in line.strip("|").split("|")]
        if current and len(row) == 3 and re.match(r"^\d", row[0]):
            found[current].setdefault(f"{row[2]} ({row[1]})", None)
    return tuple(", ".join(found[op]) or "-" for op in ("read", "write"))  # type: ignore[return-value]


def exported(run: Path, role: str, family: str) -> float | None:
    """The recorded exporter's last value of `family` for one engine (its target label is
    the server's address, `127.0.0.1:<port>`)."""
    ports = json.loads((run / "summary.json").read_text())["ports"]
    prefix = f'{family}{{target="127.0.0.1:{ports[role + "_http"]}",'
    value = None
    for _, body in _scrapes(run / "exporter.jsonl.xz"):
        for line in body.splitlines():
            if line.startswith(prefix):
                value = float(line.rpartition(" ")[2])
    return value


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(root: Path) -> str:
    head = (
        "| run | engine | transfers | GB | transfer s | GB/s | failed | UCX READ (KV) | "
        "UCX WRITE (KV) | exporter: recompute tok/s, speedup | "
        "TTFT ms, P/D / recompute (recompute over P/D), per prompt length |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for run in sorted(p for p in root.iterdir() if (p / "summary.json").exists()):
        if not (run / "decode" / "metrics.jsonl.xz").exists():
            continue
        deltas = {role: nixl_deltas(run / role) for role in ROLES}
        role = max(ROLES, key=lambda r: deltas[r]["transfers"])
        d = deltas[role]
        bw = d["bytes"] / d["xfer_s"] if d["xfer_s"] > 0 else float("nan")
        read, write = transports(run)
        ttft = "; ".join(
            f"{length}: {pd * 1e3:.0f}/{rc * 1e3:.0f} (x{rc / pd:.2f}, n={n})"
            for length, (pd, rc, n) in by_length(requests(run)).items()
        )
        recompute = exported(run, role, "kvoffload_recompute_tokens_per_second")
        speed = exported(run, role, "kvoffload_nixl_transfer_speedup_ratio")
        rows.append(
            f"| {run.name} | {role} | {d['transfers']:.0f} | {d['bytes'] / 1e9:.2f} | "
            f"{d['xfer_s']:.3f} | {bw / 1e9:.2f} | {d['failed']:.0f} | {read} | {write} | "
            f"{_fmt(recompute, ',.0f')}, {_fmt(speed, '.2f')} | {ttft} |"
        )
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("call", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--as", dest="names", action="append", default=[], metavar="VARIANT=NAME")
    t = sub.add_parser("table")
    t.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "pack":
        names = dict(n.split("=", 1) for n in args.names)
        for path in pack(args.call, args.dest, names):
            print(f"{path.stat().st_size:>9} {path}")
        return 0
    sys.stdout.write(table(args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
