"""Families of the advice: the current action per engine, its reason, the recommended size."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from exporter.catalogue import Family
from exporter.model.advisor.types import Action, Advice
from exporter.vllm_metrics import EngineKey


def advice_families(
    per_target: Iterable[tuple[str, Sequence[tuple[EngineKey, Advice]]]],
) -> list[Family]:
    state = Family("kvoffload_advice")
    recommended = Family("kvoffload_advice_recommended_buffer_bytes")
    info = Family("kvoffload_advice_info")
    for target, items in per_target:
        for key, advice in items:
            labels = [target, key.model_name, key.engine]
            for action in Action:
                state.add([*labels, str(action)], 1.0 if action == advice.action else 0.0)
            if advice.recommended_buffer_bytes is not None:
                recommended.add(labels, advice.recommended_buffer_bytes)
            info.add([*labels, str(advice.action), advice.reason], 1.0)
    return [state, recommended, info]
