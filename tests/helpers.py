"""Small builders shared by unit tests."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from bench.whatif_vs_observed import open_text, read_text
from exporter import expfmt
from exporter.kvevents_codec import Message, decode_payload, read_records
from exporter.lmcache import lmcache_samples
from exporter.model.derive.balance import KEYS as BALANCE_KEYS
from exporter.model.derive.engines import DeriveSettings, EngineDerived, derive_engine
from exporter.sources.kv_events.source import StreamItem
from exporter.vllm_cmdline import LaunchConfig
from exporter.vllm_metrics import WANTED, EngineKey, TargetSample, normalise
from exporter.window import TargetWindow


def sample_from(path: Path | str, ts: float) -> TargetSample:
    text = Path(path).read_text() if isinstance(path, Path) else path
    return normalise(expfmt.parse(text, WANTED), ts)


def window_of(*samples: TargetSample, window: float = 300.0) -> TargetWindow:
    win = TargetWindow(window)
    for s in samples:
        win.add(s)
    return win


def rename(text: str, mapping: dict[str, str]) -> str:
    for old, new in mapping.items():
        text = text.replace(old, new)
    return text


# --- the backend fixtures (tests/fixtures/gpu, tests/fixtures/backends; docs/backends.md) ---
#
# Real data: the H200 runs with vLLM 0.26.0 (tests/fixtures/gpu/: small-tier = 0.25 GiB CPU
# primary + fs secondary tier, small-arc = ARC at 0.25 GiB, small-thr2 = store_threshold 2 at
# 0.5 GiB, small-a = the same prompts without offload), their recorded command lines, 1 s
# /metrics sequences and KV events.
#
# Synthesized data (tests/fixtures/backends/, every file marked "# SYNTHESIZED"): vLLM 0.32's
# per-tier tiering counters, SimpleCPUOffloadConnector and NIXL series rendered by vLLM
# 0.32.0's own metric classes (synthesize.py), LMCache's series rendered from its
# observability.py definitions (synthesize_lmcache.py). Expected values are computed from
# the expositions with prometheus_client's parser, or are the scenario's scripted inputs.

REPO = Path(__file__).resolve().parent.parent
GPU = REPO / "tests" / "fixtures" / "gpu"
SYNTH = REPO / "tests" / "fixtures" / "backends"
GIB = 1 << 30
MODEL = "qwen3-dummy"
E0 = EngineKey(MODEL, "0")
E1 = EngineKey(MODEL, "1")
KV_BYTES_PER_TOKEN = 114_688  # the small shape: 28 layers x 8 KV heads x 128 x 2 x 2 bytes
CHUNK = 16 * KV_BYTES_PER_TOKEN
LARGE = EngineKey("qwen3-32b-dummy", "0")  # the large shape (NIXL scenarios)
KV_BYTES_PER_TOKEN_32B = 262_144


def raw(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels` (prometheus_client,
    independent of the exporter)."""
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def recorded_cmd(config: str) -> tuple[list[str], dict[str, str]]:
    """argv and environment of a recorded cmd.txt (first line, then KEY=VALUE lines)."""
    lines = (GPU / config / "cmd.txt").read_text().splitlines()
    env = dict(ln.split("=", 1) for ln in lines[1:] if "=" in ln and not ln.startswith("#"))
    return shlex.split(lines[0]), env


def gpu_metrics(config: str, when: str, wl: str) -> str:
    return read_text(GPU / config / f"metrics_{when}_{wl}.prom")


def gpu_scrapes(config: str) -> list[dict[str, Any]]:
    """The successful 1 s scrapes of a GPU run ({"t", "body", "status"})."""
    with open_text(GPU / config / "vllm_metrics.jsonl") as fh:
        return [s for s in map(json.loads, fh) if s.get("status") == 200]


def gpu_events(config: str) -> list[Message]:
    with open_text(GPU / config / "kv_events.jsonl") as fh:
        return list(read_records(fh))


def synth(name: str, step: str) -> str:
    text = (SYNTH / f"{name}.{step}.prom").read_text()
    assert text.startswith("# SYNTHESIZED"), name
    return text


def window_derived(
    before: str,
    after: str,
    ek: EngineKey,
    *,
    launch: LaunchConfig | None = None,
    kv_bytes_per_token: float | None = None,
) -> EngineDerived:
    """Engine `ek` derived from two expositions 10 s apart (LMCache's series mapped)."""
    win = TargetWindow(300.0)
    for ts, text in ((0.0, before), (10.0, after)):
        win.add(normalise(lmcache_samples(expfmt.parse(text, WANTED)), ts))
    d = derive_engine(
        win,
        ek,
        10.0,
        DeriveSettings(stale_after=30.0, launch=launch, kv_bytes_per_token=kv_bytes_per_token),
    )
    assert d is not None
    return d


_ENC = msgspec.msgpack.Encoder()


def items_until(msgs: list[Message], fed: int, t: float) -> tuple[list[StreamItem], int]:
    """The recorded KV event batches published by time t, from position `fed` on, re-encoded
    and decoded as the KV-event source decodes them; and the new position."""
    items: list[StreamItem] = []
    while fed < len(msgs) and msgs[fed].batch.ts <= t:
        m = msgs[fed]
        batch, _ = decode_payload(_ENC.encode([m.batch.ts, m.raw[1], m.batch.dp_rank or 0]))
        items.append(StreamItem(0, Message(m.topic, m.seq, batch, None)))
        fed += 1
    return items, fed


def balance_sums(loaded: float, computed: float, store: float, ttft: float) -> dict[str, float]:
    """The window sums offload_balance reads: tokens loaded and computed, store copy seconds,
    summed TTFT (exporter/model/derive/balance.py KEYS, in that order)."""
    return dict(zip(BALANCE_KEYS, (loaded, computed, store, ttft), strict=True))
