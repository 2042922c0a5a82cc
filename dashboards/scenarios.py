"""The Prometheus data sets every panel is proven against (and previews are drawn from).

live     a real vLLM CPU server (offload cannot run on CPU) with the seed workload, the
         exporter as a process beside it, and a real Prometheus scraping both the exporter
         (job kv-offload-exporter) and vLLM itself (job vllm), 1 s apart.
offload  the H200 offload run (tests/fixtures/vllm-0.26.0-h200/b_offload): vLLM's /metrics
         before and after the workload, interpolated to a 10-minute series at 15 s steps,
         run through the real exporter code (testbed.backfill.run_exporter) and backfilled
         with promtool next to the raw vLLM expositions. Totals and ratios are the run's;
         per-second rates are not (the run took ~3 s; the time axis is stretched).
gpu      recorded H200 runs with everything on (tests/fixtures/gpu/small-b-graphs-long:
         vLLM 0.26, 0.5 GiB native offload, CUDA graphs, KV events; large-b: the 32B shape
         with 1.14 GiB): vLLM's /metrics and the exporter's, backfilled at their recorded
         times (moved to now, the 1 s spacing kept), so rates and per-second values are the
         runs' own. The exporter series are the current exporter's, run over each
         recording (vLLM's /metrics and the KV events at their recorded times, the run's
         exporter settings; no host link bandwidth or memory limit) at the recorded
         exporter's scrape times. The recorded exporter output (an older version) adds
         only the families the current one cannot compute without the H200 host (NVML,
         /proc, cgroup collectors). large-b's exporter starts from what it remembered of
         the same engine without offload (large-a's TTFT fit, the golden's --state-file),
         as after the restart that enables offload: what enabling delivered has data.
backends the KV transfer backends (docs/backends.md): recorded vLLM 0.26 H200 runs (the fs
         tiering spec; the 32B shape without offload as a prefill engine; two real
         disaggregated prefill/decode pairs of the 32B shape with NixlConnector on one H200,
         KV read over TCP emulation and over cuda_ipc, tests/fixtures/nixl/) and vLLM 0.32
         tiering, simple offload and NIXL (failures, RDMA) expositions plus LMCache's,
         synthesized from the upstream definitions (tests/fixtures/backends/), up to 41
         scrapes 15 s apart through one real exporter, backfilled next to the raw series.
"""

from __future__ import annotations

import argparse
import json
import lzma
import shlex
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dashboards.spec import Scenario
from exporter.config import Config, add_arguments, load_config
from exporter.recording import read_kv_events, read_meta, read_scrapes
from testbed import backfill
from testbed.exporter_proc import ExporterProcess
from testbed.procs import http_get
from testbed.prometheus import Prometheus
from testbed.vllm_cpu import VllmServer, kv_bytes_per_token, seed_workload

REPO = Path(__file__).resolve().parent.parent
H200_OFFLOAD = REPO / "tests" / "fixtures" / "vllm-0.26.0-h200" / "b_offload"
GPU_RUNS = REPO / "tests" / "fixtures" / "gpu"
H200_TARGET = "h200-offload:8000"
OFFLOAD_STEP = 15.0
OFFLOAD_STEPS = 40
# An offload-less engine gets an estimated reload speed from this (PCIe Gen4 x16 at the
# 56% efficiency measured for vLLM's block copies on an H200): the live speedup panel.
LIVE_ASSUMED_LOAD_BANDWIDTH = 14_000_000_000
LIVE_WHATIF_MIB = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Data:
    """A Prometheus holding one scenario, and the time range a dashboard looks at."""

    scenario: Scenario
    prometheus: Prometheus
    start: float
    end: float
    scrape_interval: float
    note: str

    def api(self, path: str, **params: str) -> Any:
        return self.prometheus.api(path, **params)


def offload_series(end: float) -> list[backfill.Series]:
    before = (H200_OFFLOAD / "metrics_before.txt").read_text()
    after = (H200_OFFLOAD / "metrics_after.txt").read_text()
    texts = backfill.interpolate(before, after, OFFLOAD_STEPS)
    scrapes = backfill.evenly(texts, end, OFFLOAD_STEP)
    vllm = backfill.Series("vllm", H200_TARGET, scrapes)
    exporter = backfill.run_exporter(
        [backfill.Recording(H200_TARGET, scrapes)], interval=OFFLOAD_STEP, window=300.0
    )
    return [vllm, exporter]


@contextmanager
def offload(workdir: Path) -> Iterator[Data]:
    end = backfill.recent_end()
    prom = backfill.backfilled_prometheus(workdir, offload_series(end))
    try:
        yield Data(
            Scenario.OFFLOAD,
            prom,
            start=end - OFFLOAD_STEP * OFFLOAD_STEPS - 60,  # "last 11 minutes"
            end=end,
            scrape_interval=OFFLOAD_STEP,
            note="H200 offload run (vLLM 0.26), replayed through the exporter",
        )
    finally:
        prom.stop()


BACKENDS_DIR = REPO / "tests" / "fixtures" / "backends"
# target -> (synthesized fixture name, or recorded GPU configuration), KV bytes per token
BACKEND_TARGETS: dict[str, tuple[str, float | None]] = {
    "tiering-032:8000": ("vllm-0.32-tiering", None),
    "simple-032:8000": ("vllm-0.32-simple", None),
    # Synthesized: the only NIXL data with failed transfers and an RDMA link.
    "nixl-rdma-032:8000": ("vllm-0.32-nixl-rdma", None),
    "lmcache:8000": ("lmcache-v1-tp2", None),
    "h200-tier:8000": ("small-tier", 114_688.0),
    "h200-prefill-32b:8000": ("large-a", 262_144.0),
}


# Real disaggregated runs on one H200 (vLLM 0.26, the 32B shape): target -> recording of one
# engine. pull-default READs the KV over TCP emulation (the slow link, speedup < 1), pull-ipc
# over cuda_ipc (the fast one); the decode engine counts the transfers.
NIXL_RUNS = REPO / "tests" / "fixtures" / "nixl" / "h200-2026-12-03"
NIXL_TARGETS: dict[str, Path] = {
    "h200-nixl-tcp-prefill:8000": NIXL_RUNS / "large-pull-default" / "prefill",
    "h200-nixl-tcp-decode:8000": NIXL_RUNS / "large-pull-default" / "decode",
    "h200-nixl-ipc-prefill:8000": NIXL_RUNS / "large-pull-ipc-r64" / "prefill",
    "h200-nixl-ipc-decode:8000": NIXL_RUNS / "large-pull-ipc-r64" / "decode",
}


def _evenly_chosen(bodies: list[str], n: int) -> list[str]:
    """n of the bodies, evenly spaced, first and last included."""
    n = min(n, len(bodies))
    return [bodies[round(i * (len(bodies) - 1) / (n - 1))] for i in range(n)]


def _recorded_bodies(config: str, n: int) -> list[str]:
    """n of a recorded run's 1 s /metrics bodies, evenly spaced, first and last included."""
    return _evenly_chosen([body for _, body in _recorded(config, "vllm")], n)


def _recorded(config: str, source: str) -> list[backfill.Scrape]:
    """(unix seconds, body) of every successful 1 s GET of a recorded run's endpoint."""
    path = GPU_RUNS / config / f"{source}_metrics.jsonl.xz"
    with lzma.open(path, "rt", encoding="utf-8") as fh:
        return [(float(r["t"]), r["body"]) for r in map(json.loads, fh) if r.get("status") == 200]


def backends_series(end: float) -> list[backfill.Series]:
    series: list[backfill.Series] = []
    recordings: list[backfill.Recording] = []
    for target, (name, bpt) in BACKEND_TARGETS.items():
        synth = BACKENDS_DIR / f"{name}.before.prom"
        if synth.exists():
            texts = backfill.interpolate(
                synth.read_text(), (BACKENDS_DIR / f"{name}.after.prom").read_text(), OFFLOAD_STEPS
            )
        else:
            texts = _recorded_bodies(name, OFFLOAD_STEPS + 1)
        scrapes = backfill.evenly(texts, end, OFFLOAD_STEP)
        series.append(backfill.Series("vllm", target, scrapes))
        recordings.append(backfill.Recording(target, scrapes, kv_bytes_per_token=bpt))
    for target, recording in NIXL_TARGETS.items():
        # 1 s scrapes laid 15 s apart like the rest: the transfer bandwidth and the speedup
        # are ratios of counters and keep their values; per-second rates do not.
        bodies = [s.body for s in read_scrapes(recording) if s.body]
        scrapes = backfill.evenly(_evenly_chosen(bodies, OFFLOAD_STEPS + 1), end, OFFLOAD_STEP)
        series.append(backfill.Series("vllm", target, scrapes))
        bpt = read_meta(recording).kv_bytes_per_token
        recordings.append(backfill.Recording(target, scrapes, kv_bytes_per_token=bpt))
    series.append(backfill.run_exporter(recordings, interval=OFFLOAD_STEP, window=600.0))
    return series


@contextmanager
def backends(workdir: Path) -> Iterator[Data]:
    end = backfill.recent_end()
    prom = backfill.backfilled_prometheus(workdir, backends_series(end))
    try:
        yield Data(
            Scenario.BACKENDS,
            prom,
            start=end - OFFLOAD_STEP * OFFLOAD_STEPS - 60,
            end=end,
            scrape_interval=OFFLOAD_STEP,
            note="KV transfer backends: recorded vLLM 0.26 runs and synthesized 0.32/LMCache",
        )
    finally:
        prom.stop()


GPU_RUN = "small-b-graphs-long"
GPU_EXPORTER_INSTANCE = "h200-exporter:9747"
# The 32B run beside it: the advisor recommends a larger buffer there (grow_buffer), so the
# reuse-gap panel shows the recommendation next to the configured buffer.
GPU_RUN_LARGE = "large-b"
GPU_EXPORTER_INSTANCE_LARGE = "h200-exporter-large:9747"
GPU_RUNS_SHOWN = ((GPU_RUN, GPU_EXPORTER_INSTANCE), (GPU_RUN_LARGE, GPU_EXPORTER_INSTANCE_LARGE))
# What the exporter remembered of an engine before offload was enabled (--state-file),
# by shown run: large-b's is large-a's TTFT fit (the same 32B engine and traffic without
# offload), the golden exposition's state (tests/fixtures/e2e/make_state.py), so the
# panels of what enabling delivered and of the TTFT the tier adds to a request have data.
GPU_RUN_STATE = {GPU_RUN_LARGE: REPO / "tests" / "fixtures" / "e2e" / "state.json"}


def recorded_settings(config: str) -> Config:
    """The exporter configuration of a recorded run, read from its command line
    (exporter_cmd.txt) and its --config file by the exporter's own option parser."""
    argv = shlex.split((GPU_RUNS / config / "exporter_cmd.txt").read_text().splitlines()[0])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv[argv.index("exporter") + 1 :])
    args.config = str(GPU_RUNS / config / "exporter-full.yaml")
    return load_config(args, {})


def _families(text: str) -> dict[str, list[str]]:
    """An exposition's lines by family, for the families that have samples."""
    out: dict[str, list[str]] = {}
    name = ""
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            name = line.split(" ", 3)[2]
        if line:
            out.setdefault(name, []).append(line)
    return {n: lines for n, lines in out.items() if any(not x.startswith("#") for x in lines)}


def merged(current: str, recorded: str) -> str:
    """The current exporter's exposition, plus the recorded one's families it lacks."""
    mine = _families(current)
    theirs = _families(recorded)
    lines = [x for lines in mine.values() for x in lines]
    lines += [x for n, lines in theirs.items() if n not in mine for x in lines]
    return "\n".join(lines) + "\n"


def _state_for(config: str, target: str, folder: Path) -> str:
    """A --state-file holding what the exporter remembered of the run's engine before
    offload (GPU_RUN_STATE), keyed to the run's target; "" (no state) for the other runs."""
    source = GPU_RUN_STATE.get(config)
    if source is None:
        return ""
    doc = json.loads(source.read_text())
    (remembered,) = doc["targets"].values()
    path = folder / "state.json"
    path.write_text(json.dumps({**doc, "targets": {target: remembered}}))
    return str(path)


def current_exporter(config: str) -> list[backfill.Scrape]:
    """What the current exporter exports over a recorded run: vLLM's /metrics and the KV
    events at their recorded times, with the run's exporter settings (host collectors
    off), at each scrape time of the recorded exporter; merged with the recorded exporter's
    families that need the host collectors (NVML, /proc, cgroup). A run in GPU_RUN_STATE
    starts from what the exporter remembered of its engine without offload."""
    recorded = _recorded(config, "exporter")
    rec = recorded_settings(config)
    (target,) = rec.targets

    def settings(cfg: Config) -> Config:
        # The model's settings as on the H200; run_exporter's targets and collectors.
        return replace(
            cfg,
            interval=rec.interval,
            window=rec.window,
            thresholds=rec.thresholds,
            advice_confirm_cycles=rec.advice_confirm_cycles,
            advice_confirm_seconds=rec.advice_confirm_seconds,
            assumed_load_bandwidth=rec.assumed_load_bandwidth,
            whatif_sizes=rec.whatif_sizes,
            whatif_policy=rec.whatif_policy,
            whatif_store_threshold=rec.whatif_store_threshold,
            whatif_model=rec.whatif_model,
            whatif_sample_rate=rec.whatif_sample_rate,
        )

    run = backfill.Recording(
        target.label,
        _recorded(config, "vllm"),
        kv_bytes_per_token=target.kv_bytes_per_token,
        kv_events=list(read_kv_events(GPU_RUNS / config)),
    )
    with tempfile.TemporaryDirectory(prefix="kvoe-scenario-") as tmp:
        state = _state_for(config, target.label, Path(tmp))
        current = backfill.run_exporter(
            [run],
            interval=rec.interval,
            configure=lambda cfg: replace(settings(cfg), state_file=state),
            times=[t for t, _ in recorded],
        )
    return [
        (t, merged(now, then))
        for (t, then), (_, now) in zip(recorded, current.scrapes, strict=True)
    ]


def gpu_series(end: float) -> list[backfill.Series]:
    """Each shown run's exporter and vLLM scrapes, moved so its exporter's last one is at
    `end`: the exporter's first, then vLLM's, run after run."""
    out = []
    for config, instance in GPU_RUNS_SHOWN:
        exporter = current_exporter(config)
        vllm = _recorded(config, "vllm")
        # Prometheus stores milliseconds; whole-millisecond shifts keep the spacing exact.
        offset = round(end - exporter[-1][0], 3)
        (target,) = recorded_settings(config).targets
        job = "kv-offload-exporter"
        out += [
            backfill.shift(backfill.Series(job, instance, exporter), offset),
            backfill.shift(backfill.Series("vllm", target.label, vllm), offset),
        ]
    return out


@contextmanager
def gpu(workdir: Path) -> Iterator[Data]:
    end = backfill.recent_end()
    series = gpu_series(end)
    # 1 s scrapes: a series gone for 3 s is stale, as a scraping Prometheus would mark it
    # (an advice_info series whose action changed must not linger for 5 minutes).
    prom = backfill.backfilled_prometheus(workdir, series, lookback=3.0)
    first = min(ts for s in series for ts, _ in s.scrapes)
    try:
        yield Data(
            Scenario.GPU,
            prom,
            start=float(int(first) - 5),
            end=end,
            scrape_interval=1.0,
            note=f"H200 runs {GPU_RUN} and {GPU_RUN_LARGE} (vLLM 0.26), current exporter",
        )
    finally:
        prom.stop()


def _cycles(exporter: ExporterProcess) -> int:
    _, body = http_get(exporter.url + "/api/v1/status")
    return int(json.loads(body)["cycles"])


def _wait_cycles(exporter: ExporterProcess, n: int) -> None:
    start = _cycles(exporter)
    deadline = time.monotonic() + 60
    while _cycles(exporter) < start + n:
        if time.monotonic() > deadline:
            raise TimeoutError("exporter stopped cycling")
        time.sleep(0.2)


def live_exporter_args(vllm: VllmServer) -> list[str]:
    args = [
        "--vllm-url",
        vllm.url,
        "--interval",
        "1",
        "--window",
        "60",
        "--kv-bytes-per-token",
        str(kv_bytes_per_token()),
        "--assumed-load-bandwidth",
        str(LIVE_ASSUMED_LOAD_BANDWIDTH),
    ]
    if vllm.proc is not None:
        args += ["--vllm-pid", str(vllm.proc.pid)]
    if vllm.kv_events_endpoint:  # vLLM connects to it, so the exporter binds it
        args += ["--kv-events-bind", vllm.kv_events_endpoint]
    # The tiny model's prompts are 1.6 MB of KV: simulate MiB-sized CPU tiers.
    args += ["--whatif-sizes", ",".join(f"{m}MiB" for m in LIVE_WHATIF_MIB)]
    return args


@contextmanager
def live(workdir: Path, vllm: VllmServer, batches: int = 5) -> Iterator[Data]:
    """Exporter + Prometheus beside a running vLLM CPU server, after the seed workload."""
    exporter = ExporterProcess(workdir, live_exporter_args(vllm)).start()
    prom = None
    try:
        prom = Prometheus(
            workdir / "prometheus",
            config={
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "kv-offload-exporter",
                        "static_configs": [{"targets": [exporter.address]}],
                    },
                    {
                        "job_name": "vllm",
                        "static_configs": [{"targets": [vllm.url.removeprefix("http://")]}],
                    },
                ],
            },
        ).start()
        start = time.time()
        prom.wait_for("kvoffload_target_up == 1")
        prom.wait_for('up{job="vllm"} == 1')
        seed_workload(vllm.url, batches=batches, seed=606, pause=0.2)
        _wait_cycles(exporter, 3)
        # The speedup needs the marginal prefill cost, a fit over the window's intervals: on
        # a busy 2-core machine the CPU prefills can leave it undetermined, and the exporter
        # then (rightly) states no speedup. More traffic narrows it, as it would for an
        # operator: up to five more batches of fresh prompts (two were not always enough
        # while the whole suite loaded both cores, 2026-12-01).
        for extra in range(5):
            if b"\nkvoffload_transfer_speedup_ratio{" in http_get(exporter.url + "/metrics")[1]:
                break
            seed_workload(vllm.url, batches=1, seed=607 + extra, pause=0.2)
            _wait_cycles(exporter, 3)
        time.sleep(2.5)  # two more Prometheus scrapes of the final state
        yield Data(
            Scenario.LIVE,
            prom,
            start=float(int(start) - 5),
            end=float(int(time.time())),
            scrape_interval=1.0,
            note="vLLM CPU 0.32 (offload off), seed workload, scraped live",
        )
    finally:
        if prom is not None:
            prom.stop()
        exporter.stop()
