"""Hand-built inputs for the what-if model tests."""

from __future__ import annotations

from dataclasses import dataclass

from exporter.kvevents_codec import Message, decode_batch
from exporter.model.derive.engines import EngineDerived
from exporter.vllm_metrics import EngineKey, EngineSample, TargetSample
from exporter.window import TargetWindow

EK = EngineKey("m", "0")


def derived(**kw: object) -> EngineDerived:
    """An engine without offload, 16-token blocks of 114688 bytes per token."""
    defaults: dict[str, object] = dict(
        key=EK,
        fresh=True,
        offload_enabled=False,
        offload_buffer_bytes=None,
        gpu_capacity_tokens=2336.0,
        block_size=16,
        kv_usage=0.95,
        gpu_prefix_hit_ratio=0.2,
        offload_hit_ratio=None,
        offload_lookup_hit_ratio=None,
        load_bandwidth=None,
        store_bandwidth=None,
        reuse_ratio=None,
        kv_bytes_per_token=114688.0,
        kv_bytes_per_token_method="offload_loads",
        prefill_fit=None,
        offload_fit=None,
        recompute_tokens_per_second=23_000.0,
        recompute_negligible=False,
        prefill_average_tokens_per_second=20_000.0,
        transfer_tokens_per_second=110_000.0,
        transfer_estimated=True,
        transfer_speedup=110_000 / 23_000,
        transfer_speedup_lower=0.8 * 110_000 / 23_000,
        window={},
        totals={},
    )
    defaults.update(kw)
    return EngineDerived(**defaults)  # type: ignore[arg-type]


def stored(ts: float, *hashes: int, parent: int | None = None, dp_rank: int | None = 0) -> Message:
    """One GPU BlockStored batch of 16-token blocks."""
    event = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "block_size": 16,
    }
    doc: dict[str, object] = {"ts": ts, "events": [event]}
    if dp_rank is not None:
        doc["data_parallel_rank"] = dp_rank
    return Message("kv", int(ts * 1000), decode_batch(doc), doc)


@dataclass(frozen=True, slots=True)
class Item:
    """The source's StreamItem, as the model sees it (StreamItemLike)."""

    rank: int
    message: Message | None


def window(*points: tuple[float, float]) -> TargetWindow:
    """A window of scrapes (ts, cumulative prompt tokens) of engine EK."""
    w = TargetWindow(3600.0)
    for ts, prompt in points:
        sample = EngineSample(counters={"prompt_tokens": prompt}, gauges={})
        w.add(TargetSample(ts=ts, engines={EK: sample}))
    return w
