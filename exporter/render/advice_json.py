"""The /advice document: one JSON object per engine."""

from __future__ import annotations

import math
from typing import Any

from exporter.model.advisor.types import Advice
from exporter.thresholds import Thresholds
from exporter.vllm_metrics import EngineKey


def advice_json(target: str, key: EngineKey, a: Advice, th: Thresholds) -> dict[str, Any]:
    def clean(v: float | None) -> float | None:
        return None if v is None or not math.isfinite(v) else v

    return {
        "target": target,
        "model_name": key.model_name,
        "engine": key.engine,
        "action": str(a.action),
        "reason": a.reason,
        "explanation": a.explanation,
        "recommended_buffer_bytes": clean(a.recommended_buffer_bytes),
        "pending_action": str(a.candidate) if a.candidate else None,
        "numbers": {k: clean(v) for k, v in a.numbers.items()},
        "thresholds": {f: getattr(th, f) for f in th.__dataclass_fields__},
    }
