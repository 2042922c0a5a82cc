"""exporter/render/advice_json.py: one engine's /advice object."""

from __future__ import annotations

import json
import math

from exporter.model.advisor.types import Action, Advice, Reason
from exporter.render.advice_json import advice_json
from exporter.thresholds import DEFAULT, Thresholds
from exporter.vllm_metrics import EngineKey

KEY = EngineKey("qwen3", "2")


def test_advice_json_has_the_specified_fields() -> None:
    a = Advice(
        Action.GROW_BUFFER,
        Reason.BUFFER_TOO_SMALL,
        "A larger buffer would serve more.",
        2.0 * 2**30,
        {"offload_hit_ratio": 0.01, "kv_usage": None},
        Action.SHRINK_BUFFER,
    )
    doc = advice_json("t", KEY, a, DEFAULT)
    assert doc == {
        "target": "t",
        "model_name": "qwen3",
        "engine": "2",
        "action": "grow_buffer",
        "reason": "buffer_too_small",
        "explanation": "A larger buffer would serve more.",
        "recommended_buffer_bytes": 2.0 * 2**30,
        "pending_action": "shrink_buffer",
        "numbers": {"offload_hit_ratio": 0.01, "kv_usage": None},
        "thresholds": doc["thresholds"],
    }
    assert doc["thresholds"]["kv_usage_high"] == DEFAULT.kv_usage_high
    assert set(doc["thresholds"]) == set(Thresholds.__dataclass_fields__)


def test_advice_json_is_strict_json_without_non_finite_numbers() -> None:
    a = Advice(
        Action.NO_ACTION,
        Reason.NO_KV_PRESSURE,
        "calm",
        math.inf,
        {"speedup": math.nan, "rate": -math.inf, "ok": 1.5},
    )
    doc = advice_json("t", KEY, a, DEFAULT)
    assert doc["recommended_buffer_bytes"] is None
    assert doc["numbers"] == {"speedup": None, "rate": None, "ok": 1.5}
    assert doc["pending_action"] is None  # nothing pending
    json.dumps(doc, allow_nan=False)  # raises on NaN or infinity


def test_advice_json_carries_the_thresholds_in_force() -> None:
    custom = Thresholds(min_window_seconds=15.0)
    a = Advice(Action.INSUFFICIENT_DATA, Reason.WINDOW_TOO_SHORT, "wait")
    assert advice_json("t", KEY, a, custom)["thresholds"]["min_window_seconds"] == 15.0
