"""`kv-offload-exporter replay DIR`: the whole pipeline over a recording, on its own clock.

Each recorded scrape is one collection cycle at the scrape's time: the body goes through the
same parsing, normalisation and window as a live scrape (VllmTarget with the recording as
its fetch), the KV events published up to that time step the what-if simulation, and the
model's Pipeline derives and advises with its hysteresis, exactly as the live exporter's
runtime does. Nothing waits: a day of recording replays as fast as the CPU allows.

What the live exporter learns from /proc and NVML comes from meta.json (vLLM's command
line, the GPU's host link, KV bytes per token); exporter flags such as --threshold,
--whatif-sizes or --assumed-load-bandwidth apply as they would live. A directory whose
subdirectories are recordings (what --record writes, one per target) replays each of them.
An --interval coarser than the recording's cadence replays one scrape per interval: what an
exporter collecting that often would have seen, and advised (at_interval).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import statistics
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exporter.config import Config, ConfigError, add_arguments, load_config
from exporter.kvevents_codec import Message
from exporter.model.advisor.types import Action, Advice
from exporter.model.derive.compute import computed_token_floor
from exporter.model.derive.engines import CostBefore, DeriveSettings
from exporter.model.inputs import CycleInputs, TargetInputs
from exporter.model.pipeline import CycleResult, EngineResult, Pipeline
from exporter.options import TargetConfig
from exporter.recording import (
    METRICS,
    Meta,
    RecordingError,
    Scrape,
    has_kv_events,
    read_kv_events,
    read_meta,
    read_scrapes,
)
from exporter.render.advice_json import advice_json
from exporter.runtime import whatif_settings
from exporter.sources import CollectError, ErrorKind, execute
from exporter.sources.kv_events.source import StreamItem
from exporter.sources.vllm_http import VllmTarget
from exporter.vllm_cmdline import launch_config
from exporter.vllm_metrics import EngineKey


@dataclass(frozen=True, slots=True)
class Step:
    """One engine's advice at one cycle of the replay."""

    t: float  # seconds since the recording's first scrape
    target: str
    model_name: str
    engine: str
    action: str
    reason: str
    recommended_buffer_bytes: float | None
    pending_action: str | None

    def json(self) -> dict[str, Any]:
        return {
            "t": round(self.t, 3),
            "target": self.target,
            "model_name": self.model_name,
            "engine": self.engine,
            "action": self.action,
            "reason": self.reason,
            "recommended_buffer_bytes": self.recommended_buffer_bytes,
            "pending_action": self.pending_action,
        }


@dataclass(frozen=True, slots=True)
class Replayed:
    target: str
    scrapes: int
    seconds: float  # from the first scrape to the last
    timeline: tuple[Step, ...]  # the first step of each engine, then every change
    final: CycleResult
    first_decision: dict[tuple[str, str], float]  # (model, engine) -> t of the first settled
    # Each engine's TTFT fit with offload off at the end (what a live exporter would carry
    # into the restart that enables offload; `--prior`).
    before: dict[EngineKey, CostBefore]


def _step(t: float, target: str, e: EngineResult) -> Step:
    a = e.advice
    return Step(
        t,
        target,
        e.derived.key.model_name,
        e.derived.key.engine,
        str(a.action),
        str(a.reason),
        _finite(a.recommended_buffer_bytes),
        str(a.candidate) if a.candidate else None,
    )


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def _settled(a: Advice) -> bool:
    return a.action != Action.INSUFFICIENT_DATA and a.candidate is None


def _kv_items(messages: Iterator[Message]) -> Iterator[tuple[float, StreamItem]]:
    """(time, item) in recording order; a sequence number going back on a rank is a
    publisher restart, as the live receiver reads it."""
    last: dict[int, int] = {}
    for msg in messages:
        rank = msg.batch.dp_rank if msg.batch.dp_rank is not None else 0
        if rank in last and msg.seq < last[rank]:
            yield msg.batch.ts, StreamItem(rank, None)
        last[rank] = msg.seq
        yield msg.batch.ts, StreamItem(rank, msg)


def scrape_interval(scrapes: Sequence[Scrape]) -> float:
    """The recording's scrape interval: the median gap (1 s when there is one scrape)."""
    gaps = [b.t - a.t for a, b in itertools.pairwise(scrapes) if b.t > a.t]
    return statistics.median(gaps) if gaps else 1.0


def at_interval(scrapes: Sequence[Scrape], interval: float) -> list[Scrape]:
    """The scrapes an exporter collecting every `interval` seconds would have taken: the
    first, then each one at least `interval` after the last taken. A recording's scrapes
    jitter around its cadence, so a scrape half a recorded gap early still counts as on time;
    an interval at or below the recording's own cadence keeps every scrape."""
    cadence = scrape_interval(scrapes)
    if interval <= cadence or not scrapes:
        return list(scrapes)
    out = [scrapes[0]]
    for s in scrapes[1:]:
        if s.t - out[-1].t >= interval - cadence / 2:
            out.append(s)
    return out


def replay_one(
    directory: Path,
    cfg: Config,
    label: str | None = None,
    before: Mapping[EngineKey, CostBefore] | None = None,
) -> Replayed:
    """Replay one recording; the target is named after its directory unless `label`.
    `before`: the engines' TTFT fits with offload off from an earlier recording (Replayed.
    before), remembered from the start as a live exporter remembers them."""
    scrapes = at_interval(read_scrapes(directory), cfg.interval)
    meta = read_meta(directory)
    events = _kv_items(read_kv_events(directory)) if has_kv_events(directory) else None
    name = label or directory.resolve().name
    return asyncio.run(_replay(scrapes, meta, events, cfg, name, before or {}))


async def _replay(
    scrapes: Sequence[Scrape],
    meta: Meta,
    events: Iterator[tuple[float, StreamItem]] | None,
    cfg: Config,
    label: str,
    before: Mapping[EngineKey, CostBefore],
) -> Replayed:
    interval = scrape_interval(scrapes)
    now = scrapes[0].t
    current: Scrape = scrapes[0]

    async def fetch(url: str, limit: int) -> bytes:
        if url.endswith("/version"):
            version = meta.other.get("vllm_version")
            if not isinstance(version, str):
                raise CollectError(ErrorKind.UNAVAILABLE, "no vllm_version in meta.json")
            return json.dumps({"version": version}).encode()
        if current.body is None:
            raise CollectError(ErrorKind.CONNECT, f"recorded failure: {current.error}")
        body = current.body.encode()
        if len(body) > limit:
            raise CollectError(ErrorKind.TOO_LARGE, f"body of {len(body)} bytes")
        return body

    target = VllmTarget(
        TargetConfig(url="http://recording", name=label, max_engines=cfg.max_engines_per_target),
        window_seconds=cfg.window,
        timeout=cfg.effective_scrape_timeout,
        max_body_bytes=cfg.max_body_bytes,
        clock=lambda: now,
        fetch=fetch,
    )
    await target.start()
    pipeline = Pipeline(
        cfg.thresholds,
        confirm=cfg.advice_confirm_cycles,
        confirm_seconds=cfg.advice_confirm_seconds,
        whatif=whatif_settings(cfg),
    )
    pipeline.remember_before(label, before)
    settings = DeriveSettings(
        stale_after=2 * interval + cfg.effective_scrape_timeout,
        kv_bytes_per_token=meta.kv_bytes_per_token or cfg.kv_bytes_per_token or None,
        assumed_load_bandwidth=float(cfg.assumed_load_bandwidth) or None,
        link_bandwidth=meta.link_bandwidth,
        launch=launch_config(meta.vllm_argv) if meta.vllm_argv else None,
        machine=meta.machine,
        computed_token_floor=computed_token_floor(
            cfg.model_weight_bytes or meta.model_weight_bytes,
            meta.gpu_names,
            cfg.gpu_peak_flops or None,
        ),
    )
    pending = next(events, None) if events is not None else None
    timeline: list[Step] = []
    last: dict[tuple[str, str], Step] = {}
    first: dict[tuple[str, str], float] = {}
    result = CycleResult(now, ())
    t0 = scrapes[0].t
    for scrape in scrapes:
        now, current = scrape.t, scrape
        items: list[StreamItem] = []
        while events is not None and pending is not None and pending[0] <= now:
            items.append(pending[1])
            pending = next(events, None)
        await execute(target, cfg.effective_scrape_timeout)
        inputs = TargetInputs(label, target.window, settings, None, items if events else None)
        result = pipeline.step(CycleInputs(now, (inputs,)))
        for t in result.targets:
            for e in t.engines:
                step = _step(now - t0, label, e)
                key = (step.model_name, step.engine)
                seen = last.get(key)
                if seen is None or (
                    step.action,
                    step.reason,
                    step.pending_action,
                    step.recommended_buffer_bytes,
                ) != (seen.action, seen.reason, seen.pending_action, seen.recommended_buffer_bytes):
                    timeline.append(step)
                last[key] = step
                if key not in first and _settled(e.advice):
                    first[key] = step.t
    await target.stop()
    return Replayed(
        label,
        len(scrapes),
        scrapes[-1].t - t0,
        tuple(timeline),
        result,
        first,
        pipeline.before(label),
    )


def recordings(directory: Path) -> list[Path]:
    """DIR itself when it is a recording, else its subdirectories that are."""
    if any((directory / n).is_file() for n in (METRICS, METRICS + ".xz")):
        return [directory]
    found = sorted(
        d
        for d in directory.iterdir()
        if d.is_dir() and any((d / n).is_file() for n in (METRICS, METRICS + ".xz"))
    )
    if not found:
        raise RecordingError(f"{directory}: not a recording ({METRICS}) nor a folder of them")
    return found


def final_json(r: Replayed, cfg: Config) -> list[dict[str, Any]]:
    out = []
    for t in r.final.targets:
        for e in t.engines:
            doc = advice_json(r.target, e.derived.key, e.advice, cfg.thresholds)
            doc.pop("thresholds")
            doc["whatif"] = [
                {
                    "cpu_buffer_bytes": p.cpu_buffer_bytes,
                    "offload_hit_ratio": p.hit_ratio,
                    "ttft_saved_seconds_per_second": _finite(p.ttft_saved_seconds_per_second),
                }
                for p in (e.whatif.points if e.whatif is not None else ())
            ]
            key = (e.derived.key.model_name, e.derived.key.engine)
            doc["first_settled_decision_t"] = r.first_decision.get(key)
            out.append(doc)
    return out


def document(results: Sequence[Replayed], cfg: Config) -> dict[str, Any]:
    return {
        "timeline": [s.json() for r in results for s in r.timeline],
        "final": [doc for r in results for doc in final_json(r, cfg)],
        "recordings": [
            {
                "target": r.target,
                "scrapes": r.scrapes,
                "seconds": round(r.seconds, 3),
            }
            for r in results
        ],
    }


def _print_text(results: Sequence[Replayed], cfg: Config) -> None:
    gib = float(1 << 30)
    for r in results:
        print(f"{r.target}: {r.scrapes} scrapes over {r.seconds:.0f} s")
        for s in r.timeline:
            rec = (
                f"  size {s.recommended_buffer_bytes / gib:.2f} GiB"
                if s.recommended_buffer_bytes is not None
                else ""
            )
            pend = f"  (pending {s.pending_action})" if s.pending_action else ""
            print(f"  t={s.t:8.1f}s  {s.model_name}/{s.engine}  {s.action} ({s.reason}){rec}{pend}")
        for doc in final_json(r, cfg):
            print(f"  final {doc['model_name']}/{doc['engine']}: {doc['action']} ({doc['reason']})")
            print(f"    {doc['explanation']}")
            if doc["whatif"]:
                print("    CPU buffer     hit ratio   TTFT saved s/s")
                for p in doc["whatif"]:
                    saved = p["ttft_saved_seconds_per_second"]
                    print(
                        f"    {p['cpu_buffer_bytes'] / gib:8.2f} GiB  {p['offload_hit_ratio']:9.3f}"
                        f"   {'n/a' if saved is None else f'{saved:.4f}':>14}"
                    )
        print()


def run(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kv-offload-exporter replay",
        description="Replay a recording (--record DIR) through the exporter's pipeline on its "
        "own clock and print the advice timeline. Exporter flags (--threshold, "
        "--whatif-sizes, --assumed-load-bandwidth, ...) apply as they would live; an "
        "--interval coarser than the recording's takes one scrape per interval.",
    )
    parser.add_argument("directory", type=Path, help="a recording, or a folder of recordings")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--prior",
        type=Path,
        metavar="DIR",
        help="a recording of the same engine without offload, replayed first: the cost of a "
        "computed token it measured is remembered, as a running exporter remembers it across "
        "the vLLM restart that enables offload",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args, {}, require_targets=False)
        before = replay_one(args.prior, cfg).before if args.prior else None
        results = [replay_one(d, cfg, before=before) for d in recordings(args.directory)]
    except ConfigError as exc:
        print(f"kv-offload-exporter replay: {exc}", file=sys.stderr)
        return 2
    except (RecordingError, OSError) as exc:
        print(f"kv-offload-exporter replay: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(document(results, cfg), sys.stdout, indent=1)
        print()
    else:
        _print_text(results, cfg)
    return 0
