"""Hand-built inputs for the what-if model tests."""

from __future__ import annotations

from dataclasses import dataclass

from exporter.kvevents_codec import Message, decode_batch
from exporter.model.derive.engines import EngineDerived
from exporter.vllm_metrics import EngineKey, EngineSample, TargetSample
from exporter.window import TargetWindow
from tests.model.advisor.common import base

EK = EngineKey("m", "0")


def derived(**kw: object) -> EngineDerived:
    """An engine without offload, 16-token blocks of 114688 bytes per token, key EK, an
    empty window: the advisor tests' engine (tests/model/advisor/common.py) with these."""
    return base(**{"key": EK, "window": {}, **kw})


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
