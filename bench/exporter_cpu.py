"""CPU of the real exporter process at --interval 1 while /metrics is scraped (issue 14).

    python -m bench.exporter_cpu [--duration 60] [--rounds 1] [--rate 2] [--warmup 310]
        [--exporter-root NAME=DIR ...] [--baseline NAME] [--host-off NAME ...]

Starts the 8-engine corpus (bench/corpus.py) as a stand-in vLLM in its own process
(bench/serve_corpus.py: counters advance every scrape, 8 idle children so /proc holds a
process tree), then the real exporter as a subprocess, once per variant:
`python -m exporter --vllm-url CORPUS --interval 1 --listen 127.0.0.1:PORT --vllm-pid
CORPUS_PID --no-kv-events` with its default collectors (procfs reads the corpus server's
process tree, cgroup this machine's cgroup of that process, NVML is absent without a GPU).

All exporters start together and collect for --warmup seconds (default 310: the default
300 s window full, the steady state; a fresh exporter sums and fits over few intervals and
looks cheaper than it is). Then each in turn is measured while the others keep collecting,
unscraped: for --duration seconds a client scrapes its /metrics --rate times a second the
way Prometheus does (OpenMetrics, gzip, one kept-alive connection; the phase against the
cycle sweeps one scrape period over the run) and times each request. The exporter's CPU
is the run time of all its threads (/proc/PID/task/*/schedstat, nanoseconds; the user+sys
ticks of /proc/PID/stat if a thread exited meanwhile), read at the start and the end.

Each --exporter-root NAME=DIR runs the exporter package of that checkout (PYTHONPATH=DIR,
cwd DIR), e.g. `--exporter-root before=/work/before --exporter-root after=.`; every root is
also run with `--no-procfs --no-cgroup` ("host off"), unless --host-off names the roots
that get that run. The runs of one round are interleaved (before, after, before host off,
after host off) and rounds repeat the sequence, so machine noise falls on all alike;
ratios are against --baseline (default: the first root).
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import table
from testbed.procs import free_port, http_get, start, stop, wait_http

REPO = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
# What Prometheus 2.x/3.x sends (scrape_protocols default order, then gzip).
PROM_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Accept-Encoding": "gzip",
    "User-Agent": "Prometheus/3.0.0",
}


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    root: Path
    host: bool  # procfs and cgroup collectors on


@dataclass(slots=True)
class Run:
    variant: Variant
    round: int
    cpu_seconds: float
    wall_seconds: float
    cycles: float
    latencies: list[float]
    rss_mib: float
    load: float
    errors: int
    collectors: dict[str, float] = field(default_factory=dict)

    @property
    def cpu_share(self) -> float:
        return self.cpu_seconds / self.wall_seconds

    @property
    def per_cycle(self) -> float:
        return self.cpu_seconds / self.cycles if self.cycles else float("nan")


def cpu_ticks(pid: int) -> float:
    """user + sys of the whole process (exited threads included), seconds, in clock ticks."""
    text = Path(f"/proc/{pid}/stat").read_text()
    rest = text[text.rindex(")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / TICKS


def cpu_threads(pid: int) -> dict[int, float]:
    """Each live thread's CPU time to the nanosecond (schedstat), seconds."""
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return out


def cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU of the threads between two readings (a thread born in between counts from 0)."""
    return sum(t - before.get(tid, 0.0) for tid, t in after.items())


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cycles_done(port: int) -> float | None:
    """The exporter's completed cycles (its status JSON), None if it does not say."""
    import json

    try:
        status, body = http_get(f"http://127.0.0.1:{port}/api/v1/status", timeout=5)
        value = json.loads(body).get("cycles") if status == 200 else None
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, int | float) else None


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


_UP_RE = re.compile(r'^kvoffload_collector_up\{collector="([^"]+)"\} (\S+)$', re.M)


def scrape(port: int, duration: float, rate: float) -> tuple[list[float], int, bytes]:
    """Scrape /metrics `rate` times a second for `duration` s; latencies, failures, last body.

    Scrape k is due at k/rate + (k/n)/rate: the phase against the exporter's cycle sweeps
    one whole period over the run, so the percentiles see every phase once.
    """
    period = 1.0 / rate
    n = max(int(duration * rate), 1)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    lat: list[float] = []
    errors = 0
    last = b""
    t0 = time.monotonic()
    for k in range(n):
        due = t0 + k * period + (k / n) * period
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        start_t = time.perf_counter()
        try:
            conn.request("GET", "/metrics", headers=PROM_HEADERS)
            resp = conn.getresponse()
            body = resp.read()
            ok = resp.status == 200 and bool(body)
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            ok = False
        elapsed = time.perf_counter() - start_t
        if ok:
            lat.append(elapsed)
            last = body
        else:
            errors += 1
    conn.close()
    return lat, errors, last


def collectors_up(body: bytes) -> dict[str, float]:
    try:
        text = gzip.decompress(body).decode()
    except OSError:
        text = body.decode(errors="replace")
    return {name: float(value) for name, value in _UP_RE.findall(text)}


@dataclass(slots=True)
class Running:
    variant: Variant
    proc: subprocess.Popen[bytes]
    port: int
    log: Path


def launch(variant: Variant, corpus: tuple[str, int], interval: float, work: Path) -> Running:
    url, corpus_pid = corpus
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "exporter",
        "--vllm-url",
        url,
        "--interval",
        f"{interval:g}",
        "--listen",
        f"127.0.0.1:{port}",
        "--no-kv-events",
        "--log-level",
        "warning",
    ]
    if variant.host:
        cmd += ["--vllm-pid", str(corpus_pid)]
    else:
        cmd += ["--no-procfs", "--no-cgroup"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOE_")}
    env["PYTHONPATH"] = str(variant.root)
    log = work / f"{variant.name.replace(' ', '-')}.log"
    return Running(variant, start(cmd, log, env=env, cwd=variant.root), port, log)


def measure(run: Running, rnd: int, args: argparse.Namespace) -> Run:
    proc, port = run.proc, run.port
    if proc.poll() is not None:
        raise RuntimeError(f"exporter exited with {proc.returncode}:\n{run.log.read_text()}")
    scrape(port, 2 / args.rate, args.rate)  # the connection and both encodings warm
    load = os.getloadavg()[0]
    n0 = cycles_done(port)
    c0, t0, w0 = cpu_threads(proc.pid), cpu_ticks(proc.pid), time.monotonic()
    lat, errors, last = scrape(port, args.duration, args.rate)
    c1, t1, w1 = cpu_threads(proc.pid), cpu_ticks(proc.pid), time.monotonic()
    n1 = cycles_done(port)
    rss = rss_mib(proc.pid)
    if proc.poll() is not None:
        raise RuntimeError(f"exporter exited with {proc.returncode}:\n{run.log.read_text()}")
    cycles = (n1 - n0) if n0 is not None and n1 is not None else (w1 - w0) / args.interval
    cpu = cpu_between(c0, c1)
    if (t1 - t0) - cpu > 0.05 + 0.1 * (t1 - t0):
        # A thread exited in between (its schedstat went with it): take the coarser clock.
        cpu = t1 - t0
    return Run(run.variant, rnd, cpu, w1 - w0, cycles, lat, rss, load, errors, collectors_up(last))


def uptime() -> str:
    try:
        return subprocess.run(
            ["uptime"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        one, five, fifteen = os.getloadavg()
        return f"load average: {one:.2f}, {five:.2f}, {fifteen:.2f}"


def variants(args: argparse.Namespace) -> list[Variant]:
    roots: list[tuple[str, Path]] = []
    for spec in args.exporter_root or [f"current={REPO}"]:
        name, sep, path = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"--exporter-root wants NAME=DIR, got {spec!r}")
        root = Path(path).resolve()
        if not (root / "exporter" / "__main__.py").is_file():
            raise SystemExit(f"{root} holds no exporter package")
        roots.append((name, root))
    names = [n for n, _ in roots]
    host_off = names if args.host_off is None else args.host_off
    unknown = set(host_off) - set(names)
    if unknown:
        raise SystemExit(f"--host-off names unknown roots: {sorted(unknown)}")
    out = [Variant(n, r, True) for n, r in roots]
    out += [Variant(f"{n} host off", r, False) for n, r in roots if n in host_off]
    return out


def summary_rows(runs: list[Run], order: list[Variant], baseline: str) -> list[tuple[str, ...]]:
    by: dict[str, list[Run]] = {}
    for r in runs:
        by.setdefault(r.variant.name, []).append(r)
    base_runs = by.get(baseline, [])
    base = statistics.mean(r.cpu_share for r in base_runs) if base_runs else None
    rows: list[tuple[str, ...]] = []
    for v in order:
        rs = by[v.name]
        share = statistics.mean(r.cpu_share for r in rs)
        lat = [x for r in rs for x in r.latencies]
        rows.append(
            (
                v.name,
                f"{share:.2%}",
                f"{statistics.mean(r.per_cycle for r in rs) * 1e3:.2f} ms",
                f"{percentile(lat, 0.50) * 1e3:.2f} ms",
                f"{percentile(lat, 0.99) * 1e3:.2f} ms",
                f"{max(r.rss_mib for r in rs):.0f} MiB",
                ", ".join(f"{r.load:.1f}" for r in rs),
                f"{share / base:.2f}x" if base else "n/a",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds measured per run")
    parser.add_argument(
        "--warmup", type=float, default=310.0, help="seconds before measuring (fill the window)"
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rate", type=float, default=2.0, help="/metrics scrapes per second")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--children", type=int, default=8, help="idle children of the corpus")
    parser.add_argument("--static", action="store_true", help="the corpus never changes")
    parser.add_argument("--exporter-root", action="append", metavar="NAME=DIR")
    parser.add_argument("--baseline", default=None, help="variant the ratios are against")
    parser.add_argument("--host-off", nargs="*", default=None, metavar="NAME")
    args = parser.parse_args(argv)
    order = variants(args)
    baseline = args.baseline or order[0].name
    if baseline not in {v.name for v in order}:
        raise SystemExit(f"--baseline {baseline!r} is not one of {[v.name for v in order]}")
    work = Path(tempfile.mkdtemp(prefix="kvoe-cpu-"))
    print(f"start: {uptime()}")
    corpus_port = free_port()
    corpus_cmd = [
        sys.executable,
        "-m",
        "bench.serve_corpus",
        str(corpus_port),
        "--engines",
        str(args.engines),
        "--children",
        str(args.children),
    ]
    if not args.static:
        corpus_cmd.append("--advance")
    corpus = start(corpus_cmd, work / "corpus.log", cwd=REPO)
    runs: list[Run] = []
    running: list[Running] = []
    try:
        wait_http(f"http://127.0.0.1:{corpus_port}/version", 60, corpus, work / "corpus.log")
        url = f"http://127.0.0.1:{corpus_port}"
        size = len(http_get(url + "/metrics")[1])
        print(
            f"corpus: {args.engines} engines, {size:,} bytes, "
            f"{'static' if args.static else 'counters advancing'}, {args.children} children; "
            f"--interval {args.interval:g}, {args.rate:g} scrapes/s, {args.duration:g} s per run"
        )
        # Every exporter runs from the start, so each has a full window (--window 300 by
        # default: 300 intervals to sum and fit, the steady state) when it is measured;
        # the others keep collecting, unscraped, while one is measured.
        for v in order:
            running.append(launch(v, (url, corpus.pid), args.interval, work))
        for r in running:
            wait_http(f"http://127.0.0.1:{r.port}/readyz", 60, r.proc, r.log)
        print(f"warm-up: {args.warmup:g} s", flush=True)
        time.sleep(args.warmup)
        for rnd in range(1, args.rounds + 1):
            for r in running:
                run = measure(r, rnd, args)
                v = r.variant
                runs.append(run)
                up = ", ".join(f"{k}={v:g}" for k, v in sorted(run.collectors.items()))
                print(
                    f"round {rnd} {v.name:<20} CPU {run.cpu_share:6.2%} "
                    f"({run.cpu_seconds:.3f} s in {run.wall_seconds:.1f} s)  "
                    f"{run.per_cycle * 1e3:6.2f} ms/cycle ({run.cycles:.0f} cycles)  "
                    f"p50 {percentile(run.latencies, 0.5) * 1e3:5.2f} ms  "
                    f"p99 {percentile(run.latencies, 0.99) * 1e3:5.2f} ms  "
                    f"RSS {run.rss_mib:.0f} MiB  load {run.load:.2f}  "
                    f"failed scrapes {run.errors}  up: {up}",
                    flush=True,
                )
    finally:
        for r in running:
            stop(r.proc)
        stop(corpus)
    print(f"end: {uptime()}")
    print(
        table(
            summary_rows(runs, order, baseline),
            (
                "exporter",
                "CPU of one core",
                "CPU per cycle",
                "/metrics p50",
                "p99",
                "RSS",
                "load (1 min) per round",
                f"CPU vs {baseline}",
            ),
        )
    )
    print(
        "CPU per cycle: the process's user+sys over the run / cycles completed, "
        f"{args.rate:g} scrapes per second included"
    )
    return 1 if any(r.errors for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
