"""Soak: the exporter process against a real vLLM CPU server under a steady workload.

    python -m bench.soak                       # 1 hour, starts its own vLLM (KV events on)
    python -m bench.soak --duration 120 --warmup 40     # the CI variant (tests/faults)
    python -m bench.soak --attach http://127.0.0.1:8000 # an already running vLLM
    python -m bench.soak --duration 180 --warmup 60 --window 30 --vllm-replay
                                               # the CI variant's server (replay endpoint on)

Every --sample-interval seconds it records the exporter's resident memory and open file
descriptors (from /proc/PID), its threads, its asyncio task count (from /api/v1/status)
and the KV-event batches left queued after the last cycle's drain (the backlog,
`kvoffload_kv_event_queue_depth` from /metrics, which must answer 200). After --warmup (at
least one --window, so the sliding window is full) the first and last thirds of the
samples are compared: each quantity must stay within --tolerance (5%) of its level,
with one unit of slack for small counts (fds, tasks, threads). Exit status 1 if not.
Everything runs on 127.0.0.1 and stops by itself after --duration, or on ^C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from exporter import expfmt
from exporter.catalogue import metric
from testbed.exporter_proc import ExporterProcess
from testbed.procs import free_port, http_get
from testbed.vllm_cpu import VllmServer, complete

COUNT_FLOOR = {"fds": 1.0, "tasks": 1.0, "threads": 1.0, "queue_depth": 1.0}
QUEUE_DEPTH = metric("kvoffload_kv_event_queue_depth").name
# The exporter runs with the arena cap its image sets (Dockerfile, tests/test_deploy.py): the
# soak measures what is shipped.
MALLOC_ARENA_MAX = 2


@dataclass
class Sample:
    t: float  # seconds since the start
    rss_bytes: float
    fds: float
    threads: float
    tasks: float
    queue_depth: float
    cycles: int
    metrics_status: int


@dataclass
class Verdict:
    quantity: str
    first: float  # mean of the first third after warm-up
    last: float  # mean of the last third
    drift: float  # (last - first) / first
    slope_per_hour: float  # least-squares slope over all samples after warm-up
    allowed: float  # the absolute change allowed
    flat: bool


@dataclass
class SoakResult:
    duration: float
    warmup: float
    samples: list[Sample]
    verdicts: list[Verdict]
    requests: int
    request_errors: int
    metrics_failures: int
    cycles: int
    exporter_args: list[str] = field(default_factory=list)
    malloc_arena_max: int = 0  # the exporter's MALLOC_ARENA_MAX (0: glibc's default)

    @property
    def flat(self) -> bool:
        return all(v.flat for v in self.verdicts) and self.metrics_failures == 0


def _proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        out[key] = rest.strip()
    return out


def sample(pid: int, base_url: str, t: float) -> Sample:
    st = _proc_status(pid)
    rss = float(st["VmRSS"].split()[0]) * 1024
    fds = float(sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir()))
    threads = float(st["Threads"])
    try:
        code, body = http_get(base_url + "/api/v1/status", timeout=10)
        doc = json.loads(body) if code == 200 else {}
    except (OSError, ValueError):  # no answer in 10 s counts as a failure, below
        doc = {}
    tasks = float((doc.get("runtime") or {}).get("asyncio_tasks") or 0)
    try:
        metrics_status, metrics = http_get(base_url + "/metrics", timeout=10)
    except OSError:
        metrics_status, metrics = 0, b""
    depth = backlog(metrics.decode("utf-8", "replace")) if metrics_status == 200 else 0.0
    if not doc:
        metrics_status = metrics_status if metrics_status != 200 else -1
    return Sample(t, rss, fds, threads, tasks, depth, int(doc.get("cycles", -1)), metrics_status)


def backlog(exposition: str) -> float:
    """KV-event batches left queued after the last cycle's drain, over all targets
    (`kvoffload_kv_event_queue_depth`). The queue's size at any other instant is what
    arrived since the last drain: traffic, not a backlog (a sample between drains once read
    2 batches and failed the CI soak)."""
    return float(sum(x.value for x in expfmt.parse(exposition, (QUEUE_DEPTH,))))


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def judge(samples: Sequence[Sample], warmup: float, tolerance: float) -> list[Verdict]:
    """First third vs last third of the samples after warm-up, per quantity. A leak is
    growth: a quantity that ends lower than it began (memory returned, a queue drained
    faster) is flat."""
    after = [s for s in samples if s.t >= warmup]
    if len(after) < 3:
        raise ValueError(f"only {len(after)} samples after warm-up; run longer")
    third = max(1, len(after) // 3)
    out = []
    for q in ("rss_bytes", "fds", "threads", "tasks", "queue_depth"):
        ys = [float(getattr(s, q)) for s in after]
        first = statistics.fmean(ys[:third])
        last = statistics.fmean(ys[-third:])
        key = q.removesuffix("_bytes")
        allowed = max(tolerance * abs(first), COUNT_FLOOR.get(key, 0.0))
        slope = _slope([s.t for s in after], ys) * 3600
        out.append(
            Verdict(
                quantity=q,
                first=first,
                last=last,
                drift=(last - first) / first if first else 0.0,
                slope_per_hour=slope,
                allowed=allowed,
                flat=last - first <= allowed,
            )
        )
    return out


class Workload(threading.Thread):
    """Steady, bounded load: prompts drawn from a small pool so prefixes repeat."""

    def __init__(self, url: str, until: float, pause: float = 0.2, seed: int = 11) -> None:
        super().__init__(name="workload", daemon=True)
        rng = random.Random(seed)
        self.url = url
        self.until = until
        self.pause = pause
        self.pool = [
            [rng.randrange(3, 2048) for _ in range(rng.choice((300, 500, 700)))] for _ in range(12)
        ]
        self.rng = rng
        self.requests = 0
        self.errors = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set() and time.monotonic() < self.until:
            prompt = self.rng.choice(self.pool)
            try:
                complete(self.url, prompt, max_tokens=4, timeout=60)
                self.requests += 1
            except (OSError, urllib.error.URLError, ValueError):
                self.errors += 1
            self._halt.wait(self.pause)

    def stop(self) -> None:
        self._halt.set()
        self.join(90)


def kv_event_args(endpoint: str | None) -> list[str]:
    """The exporter's KV-event flags, where this version has them (vLLM connects, we bind)."""
    if endpoint is None:
        return []
    helptext = subprocess.run(
        [sys.executable, "-m", "exporter", "--help"], capture_output=True, text=True, check=False
    ).stdout
    for flag in ("--kv-events-bind", "--kv-events-endpoint"):
        if flag in helptext:
            return [flag, endpoint]
    return []


def run(
    *,
    duration: float,
    warmup: float,
    sample_interval: float = 10.0,
    tolerance: float = 0.05,
    attach: str | None = None,
    kv_events_endpoint: str | None = None,
    workdir: Path | None = None,
    interval: float = 1.0,
    window: float = 60.0,
    extra_args: Sequence[str] = (),
    log: bool = True,
    malloc_arena_max: int = MALLOC_ARENA_MAX,
    vllm_replay: bool = False,
) -> SoakResult:
    workdir = workdir or Path(tempfile.mkdtemp(prefix="kvoe-soak-"))
    server = None
    if attach is None:
        kv_events_endpoint = kv_events_endpoint or f"tcp://127.0.0.1:{free_port()}"
        # The replay buffer (10,000 batches) grows vLLM's heap and so its smaps, which the
        # exporter reads every 30 s: the tests' session server has it on.
        replay = f"tcp://127.0.0.1:{free_port()}" if vllm_replay else None
        server = VllmServer(
            workdir / "vllm", kv_events_endpoint=kv_events_endpoint, replay_endpoint=replay
        ).start()
        url = server.url
    else:
        url = attach
    args = ["--vllm-url", url, "--interval", str(interval), "--window", str(window)]
    args += [*kv_event_args(kv_events_endpoint), *extra_args]
    env = {**os.environ, "MALLOC_ARENA_MAX": str(malloc_arena_max)} if malloc_arena_max else None
    exporter = ExporterProcess(workdir, args, env=env)
    samples: list[Sample] = []
    t0 = time.monotonic()
    workload = Workload(url, until=t0 + duration)
    try:
        exporter.start()
        assert exporter.proc is not None
        workload.start()
        n = 0
        while True:
            target = n * sample_interval
            now = time.monotonic() - t0
            if target > duration:
                break
            if target > now:
                time.sleep(target - now)
            s = sample(exporter.proc.pid, exporter.url, time.monotonic() - t0)
            samples.append(s)
            if log:
                print(
                    f"t={s.t:7.1f}s rss={s.rss_bytes / 2**20:7.2f}MiB fds={s.fds:3.0f} "
                    f"threads={s.threads:3.0f} tasks={s.tasks:3.0f} queue={s.queue_depth:5.0f} "
                    f"cycles={s.cycles} metrics={s.metrics_status} "
                    f"requests={workload.requests} errors={workload.errors}",
                    flush=True,
                )
            n += 1
    finally:
        try:
            workload.stop()
        finally:
            exporter.stop()
            if server is not None:
                server.stop()
    return SoakResult(
        duration=duration,
        warmup=warmup,
        samples=samples,
        verdicts=judge(samples, warmup, tolerance),
        requests=workload.requests,
        request_errors=workload.errors,
        metrics_failures=sum(1 for s in samples if s.metrics_status != 200),
        cycles=samples[-1].cycles if samples else 0,
        exporter_args=args,
        malloc_arena_max=malloc_arena_max,
    )


def report(result: SoakResult) -> str:
    lines = [
        f"soak {result.duration:.0f}s, warm-up {result.warmup:.0f}s, "
        f"{len(result.samples)} samples, "
        f"{result.cycles} exporter cycles, {result.requests} requests "
        f"({result.request_errors} errors), /metrics failures {result.metrics_failures}, "
        f"MALLOC_ARENA_MAX {result.malloc_arena_max or 'unset'}",
        f"{'quantity':12s} {'first':>14s} {'last':>14s} {'drift':>8s} {'slope/h':>12s} "
        f"{'allowed':>12s}  flat",
    ]
    for v in result.verdicts:
        lines.append(
            f"{v.quantity:12s} {v.first:14.1f} {v.last:14.1f} {v.drift:8.2%} "
            f"{v.slope_per_hour:12.1f} {v.allowed:12.1f}  {'yes' if v.flat else 'NO'}"
        )
    lines.append("FLAT" if result.flat else "NOT FLAT")
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=3600.0, help="seconds (default 3600)")
    p.add_argument("--warmup", type=float, default=300.0, help="seconds left out (default 300)")
    p.add_argument("--sample-interval", type=float, default=10.0)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--attach", help="URL of a running vLLM instead of starting one")
    p.add_argument("--kv-events-endpoint", help="with --attach: where that vLLM publishes to")
    p.add_argument(
        "--vllm-replay",
        action="store_true",
        help="start vLLM with its KV-event replay endpoint on, as the tests' server is",
    )
    p.add_argument("--interval", type=float, default=1.0, help="exporter --interval")
    p.add_argument("--window", type=float, default=60.0, help="exporter --window")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", type=Path, help="write samples and verdicts here")
    p.add_argument("--exporter-arg", action="append", default=[], help="extra exporter flag")
    p.add_argument(
        "--malloc-arena-max",
        type=int,
        default=MALLOC_ARENA_MAX,
        help=f"the exporter's MALLOC_ARENA_MAX (default {MALLOC_ARENA_MAX}, as the image sets "
        "it; 0: glibc's default, one arena per thread)",
    )
    a = p.parse_args(argv)
    if a.warmup < a.window:
        p.error("--warmup must be at least --window (the window fills during warm-up)")
    if a.vllm_replay and a.attach:
        p.error("--vllm-replay starts vLLM; an --attach'ed one is configured already")
    # A SIGTERM unwinds like ^C, so the vLLM server and the exporter started here stop too.
    signal.signal(signal.SIGTERM, _interrupt)
    result = run(
        duration=a.duration,
        warmup=a.warmup,
        sample_interval=a.sample_interval,
        tolerance=a.tolerance,
        attach=a.attach,
        kv_events_endpoint=a.kv_events_endpoint,
        workdir=a.workdir,
        interval=a.interval,
        window=a.window,
        extra_args=a.exporter_arg,
        malloc_arena_max=a.malloc_arena_max,
        vllm_replay=a.vllm_replay,
    )
    print(report(result))
    if a.json:
        a.json.write_text(json.dumps(asdict(result), indent=1))
    return 0 if result.flat else 1


if __name__ == "__main__":
    sys.exit(main())
