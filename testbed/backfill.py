"""A Prometheus whose history is recorded data: expositions -> OpenMetrics -> TSDB blocks.

Offload cannot run on a CPU vLLM, so dashboards are proven against recorded GPU runs:

    vllm = Series("vllm", "h200:8000", [(t0, text0), (t1, text1), ...])    # vLLM /metrics
    exporter = run_exporter([Recording("h200:8000", vllm.scrapes)])       # the real exporter
    prom = backfilled_prometheus(workdir, [vllm, exporter], promtool)    # serves both

- `run_exporter` runs the exporter's own code (Exporter, VllmTarget, derivations, the
  collector) in-process over recorded expositions: a ReplayServer serves each target's
  exposition for the current step and the exporter's clock is the recorded time, so
  every windowed value is what the exporter would have exported at that moment. A
  recording's KV events (exporter/recording.py's format) reach the exporter's KV-event
  source as its receiver would have queued them: each message at the first cycle at or
  after its timestamp, so the what-if simulation and the evidence it rebuilds are the
  current code's over the recorded stream.
- `interpolate` makes a series over time from two recorded expositions (before and
  after a workload): counters and histograms move linearly from one to the other,
  series that appear only afterwards (vLLM creates offload series lazily) start from 0.
  Interpolated data has the right totals and ratios but invented timing: rates per
  second depend on the chosen step and say nothing about the real run.
- `openmetrics` writes Series as OpenMetrics with timestamps (families contiguous,
  counters as `# TYPE x counter` with `x_total` samples, `_created` samples dropped,
  `job`/`instance` labels added as Prometheus would at scrape time).
- `backfilled_prometheus` runs `promtool tsdb create-blocks-from openmetrics` and starts
  a Prometheus (nothing to scrape) on the blocks.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from exporter.sources.kv_events.source import (
    KvEventsSettings,
    KvEventsSnapshot,
    KvEventsSource,
    StreamItem,
    StreamStats,
)
from testbed.prometheus import PROMTOOL, Prometheus
from testbed.replay import ReplayServer, Reply

if TYPE_CHECKING:
    from exporter.config import Config
    from exporter.kvevents_codec import Message
    from exporter.options import TargetConfig
    from exporter.sources import Clock

Scrape = tuple[float, str]  # (unix seconds, exposition text)


@dataclass(frozen=True)
class Series:
    """What Prometheus would have scraped from one target: job, instance, expositions."""

    job: str
    instance: str
    scrapes: Sequence[Scrape]


@dataclass(frozen=True)
class Recording:
    """One vLLM target's recorded /metrics over time, for run_exporter."""

    target: str  # the exporter's `target` label (and vLLM's `instance` when scraped directly)
    scrapes: Sequence[Scrape]
    kv_bytes_per_token: float | None = None
    vllm_version: str = "0.26.0"
    # The KV events the server published (exporter.recording.read_kv_events), in order.
    kv_events: Sequence[Message] = ()


# ----------------------------------------------------------------------------- interpolate


def _samples(text: str) -> tuple[list[str], dict[str, float]]:
    """Sample lines of a Prometheus text exposition: order of keys and key -> value."""
    order: list[str] = []
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        order.append(key)
        values[key] = float(value)
    return order, values


def _sample_name(key: str) -> str:
    return key.split("{", 1)[0]


def interpolate(before: str, after: str, steps: int) -> list[str]:
    """steps + 1 expositions from `before` (index 0) to `after` (index steps).

    Every sample moves linearly; a sample only in `after` is absent at index 0 and
    moves from 0 (counters, histogram parts) or holds its value (gauges); `_created`
    samples keep their `after` value. Comment lines are `after`'s.
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    _, old = _samples(before)
    gauges = {
        s.name
        for fam in text_string_to_metric_families(after)
        if fam.type in ("gauge", "unknown")
        for s in fam.samples
    }
    out = []
    for i in range(steps + 1):
        f = i / steps
        lines = []
        for line in after.splitlines():
            if not line or line.startswith("#"):
                lines.append(line)
                continue
            key, _, raw = line.rpartition(" ")
            new = float(raw)
            name = _sample_name(key)
            if key not in old:
                if i == 0:
                    continue
                start = new if name in gauges else 0.0
            else:
                start = old[key]
            value = new if name.endswith("_created") else start + (new - start) * f
            lines.append(f"{key} {value!r}")
        out.append("\n".join(lines) + "\n")
    return out


def evenly(texts: Sequence[str], end: float, step: float) -> list[Scrape]:
    """Timestamps `step` apart, the last one at `end`."""
    n = len(texts)
    return [(end - (n - 1 - i) * step, t) for i, t in enumerate(texts)]


# ----------------------------------------------------------------------------- exporter


class RecordedKvEvents(KvEventsSource):
    """A target's recorded KV events in place of its ZMQ stream: each collect hands over
    the messages published up to the exporter's clock, in recording order, as the receiver
    would have queued them (a sequence number going back on a DP rank is a publisher
    restart, as the live receiver reads it). Nothing is lost, dropped or replayed."""

    def __init__(self, target: TargetConfig, messages: Sequence[Message], clock: Clock) -> None:
        super().__init__(target, KvEventsSettings(), clock=clock)
        self._messages = list(messages)
        self._next = 0
        self._last_seq: dict[int, int] = {}
        self._stats: dict[int, StreamStats] = {}
        self._recorded: KvEventsSnapshot | None = None

    def snapshot(self) -> KvEventsSnapshot | None:
        return self._recorded

    async def start(self) -> None:
        self.health.started = True

    async def stop(self) -> None:
        return None

    async def collect(self) -> None:
        now = self._clock()
        items: list[StreamItem] = []
        while self._next < len(self._messages) and self._messages[self._next].batch.ts <= now:
            msg = self._messages[self._next]
            self._next += 1
            rank = msg.batch.dp_rank if msg.batch.dp_rank is not None else 0
            seen = self._stats.get(rank, StreamStats(0, 0, 0, 0, 0))
            restarted = rank in self._last_seq and msg.seq < self._last_seq[rank]
            if restarted:
                items.append(StreamItem(rank, None))
            self._last_seq[rank] = msg.seq
            self._stats[rank] = replace(
                seen, batches=seen.batches + 1, restarts=seen.restarts + int(restarted)
            )
            items.append(StreamItem(rank, msg))
        decoded = self._recorded.decoded if self._recorded is not None else 0
        self._recorded = KvEventsSnapshot(
            streams=dict(sorted(self._stats.items())),
            dropped=0,
            queue_depth=0,
            bad_frames=0,
            bad_payloads=0,
            decoded=decoded + sum(1 for i in items if i.message is not None),
            items=tuple(items),
        )


def run_exporter(
    recordings: Sequence[Recording],
    *,
    interval: float,
    window: float = 300.0,
    job: str = "kv-offload-exporter",
    instance: str = "kv-offload-exporter:9747",
    configure: Callable[[Config], Config] | None = None,
    times: Sequence[float] = (),
) -> Series:
    """The exporter's exposition at every recorded timestamp (or at `times`), computed by
    its own code; each target serves its latest scrape at or before that time.

    Collectors that read this machine (NVML, /proc, cgroup) are switched off: their data
    would be this machine's, not the recording's. `configure(cfg) -> cfg` may switch them
    back on pointed at recorded trees (path_procfs, path_cgroup, ...). A recording with
    KV events gets them through RecordedKvEvents instead of a ZMQ stream.
    """
    return asyncio.run(_run_exporter(recordings, interval, window, job, instance, configure, times))


async def _run_exporter(
    recordings: Sequence[Recording],
    interval: float,
    window: float,
    job: str,
    instance: str,
    configure: Callable[[Config], Config] | None,
    at: Sequence[float],
) -> Series:
    from exporter.config import Config
    from exporter.options import TargetConfig
    from exporter.runtime import Exporter, build_sources

    times = sorted(at) if at else sorted({ts for r in recordings for ts, _ in r.scrapes})
    now = [times[0]]

    def clock() -> float:
        return now[0]

    servers = [ReplayServer(version=r.vllm_version).start() for r in recordings]
    try:
        for server, rec in zip(servers, recordings, strict=True):
            server.set(_current(rec.scrapes, now))
        cfg = Config(
            targets=tuple(
                TargetConfig(url=s.url, name=r.target, kv_bytes_per_token=r.kv_bytes_per_token)
                for s, r in zip(servers, recordings, strict=True)
            ),
            interval=interval,
            window=window,
        )
        cfg = replace(cfg, nvml=False, procfs=False, cgroup=False)
        if configure is not None:
            cfg = configure(cfg)
        events = {r.target: r.kv_events for r in recordings if r.kv_events}
        sources = [
            RecordedKvEvents(s.target, events[s.label], clock)
            if isinstance(s, KvEventsSource) and s.label in events
            else s
            for s in build_sources(cfg, clock)
        ]
        exp = Exporter(cfg, sources, clock)
        await exp.start()
        scrapes: list[Scrape] = []
        try:
            for ts in times:
                now[0] = ts
                await exp.run_cycle()
                scrapes.append((ts, exp.exposition.text.decode()))
        finally:
            await exp.stop()
    finally:
        for s in servers:
            s.stop()
    return Series(job, instance, scrapes)


def _current(scrapes: Sequence[Scrape], now: list[float]) -> Callable[[int], Reply]:
    ordered = sorted(scrapes, key=lambda s: s[0])

    def reply(_: int) -> Reply:
        body = ""
        for ts, text in ordered:
            if ts <= now[0]:
                body = text
        if not body:
            return Reply(status=503, body=b"not started yet")
        return Reply(body=body.encode())

    return reply


# ----------------------------------------------------------------------------- OpenMetrics

_OM_TYPES = {"counter", "gauge", "histogram", "summary", "unknown", "info", "stateset"}


def _om_value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _om_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def openmetrics(series: Sequence[Series]) -> str:
    """One OpenMetrics document with every sample of every series, timestamps in seconds."""
    types: dict[str, str] = {}
    points: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[float, float]]]] = {}
    for s in series:
        extra = {"job": s.job, "instance": s.instance}
        for ts, text in s.scrapes:
            for fam in text_string_to_metric_families(text):
                if fam.name.endswith("_created"):
                    continue  # prometheus_client's *_created gauges of counters
                ftype = fam.type if fam.type in _OM_TYPES else "unknown"
                if types.setdefault(fam.name, ftype) != ftype:
                    raise ValueError(f"{fam.name}: type {ftype} here, {types[fam.name]} before")
                fam_points = points.setdefault(fam.name, {})
                for sample in fam.samples:
                    if sample.name.endswith("_created"):
                        continue
                    labels = {**sample.labels, **extra}
                    key = (sample.name, tuple(sorted(labels.items())))
                    fam_points.setdefault(key, []).append((ts, float(sample.value)))
    lines = []
    for name in sorted(points):
        lines.append(f"# TYPE {name} {types[name]}")
        for (sample_name, label_pairs), values in sorted(points[name].items()):
            label_text = ",".join(f'{k}="{_om_label(v)}"' for k, v in label_pairs)
            for ts, value in sorted(values):
                lines.append(f"{sample_name}{{{label_text}}} {_om_value(value)} {ts:.3f}")
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- Prometheus


def create_blocks(om_text: str, data_dir: Path, promtool: str = PROMTOOL) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    src = data_dir.parent / "backfill.om"
    src.write_text(om_text)
    proc = subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(src), str(data_dir)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"promtool create-blocks-from failed:\n{proc.stdout}\n{proc.stderr}")


def backfilled_prometheus(
    workdir: Path,
    series: Sequence[Series],
    promtool: str = PROMTOOL,
    lookback: float | None = None,
) -> Prometheus:
    """A started Prometheus serving exactly `series` (it scrapes nothing).

    Backfilled blocks carry no staleness markers, so a series that stopped (an advice that
    changed its action) would stay visible for the default 5 min lookback; `lookback`
    (seconds, a few scrape intervals) ends it as a scraping Prometheus would."""
    prom = Prometheus(workdir, config={"global": {"scrape_interval": "15s"}})
    create_blocks(openmetrics(series), workdir / "data", promtool)
    extra = ["--storage.tsdb.retention.time=30d"]
    if lookback is not None:
        extra.append(f"--query.lookback-delta={lookback:g}s")
    return prom.start(extra)


def shift(series: Series, seconds: float) -> Series:
    return replace(series, scrapes=[(ts + seconds, text) for ts, text in series.scrapes])


def recent_end(margin: float = 60.0) -> float:
    """A whole-second end time just in the past, so backfilled data sits in retention."""
    return float(int(time.time() - margin))
