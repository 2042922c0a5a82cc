"""exporter/render/advice.py: kvoffload_advice{action}, the recommended size and the info."""

from __future__ import annotations

from exporter.model.advisor.types import Action, Advice, Reason
from exporter.render.advice import advice_families
from exporter.vllm_metrics import EngineKey
from tests.render.common import by_name, series

E0 = EngineKey("qwen3", "0")
E1 = EngineKey("qwen3", "1")
GIB = 1 << 30


def test_advice_families_one_hot_action_recommended_size_and_info() -> None:
    enable = Advice(Action.ENABLE_OFFLOAD, Reason.RECOMPUTE_AFTER_EVICTION, "x", 0.5 * GIB)
    keep = Advice(Action.KEEP, Reason.PAYING_OFF, "y", candidate=Action.DISABLE_OFFLOAD)
    fams = advice_families([("a", [(E0, enable), (E1, keep)]), ("b", [])])
    assert [f.definition.name for f in fams] == [
        "kvoffload_advice",
        "kvoffload_advice_recommended_buffer_bytes",
        "kvoffload_advice_info",
    ]
    f = by_name(fams)
    state = series(f["kvoffload_advice"])
    assert len(state) == 2 * len(Action)  # every action per engine: 1 on the current one
    assert {k[3] for k, v in state.items() if k[:3] == ("a", "qwen3", "0") and v == 1.0} == {
        "enable_offload"
    }
    assert {k[3] for k, v in state.items() if k[:3] == ("a", "qwen3", "1") and v == 1.0} == {
        "keep"  # the standing action, not the pending candidate
    }
    assert sum(state.values()) == 2.0
    # No recommendation: no sample (never 0, which would read "use no buffer").
    assert series(f["kvoffload_advice_recommended_buffer_bytes"]) == {
        ("a", "qwen3", "0"): 0.5 * GIB
    }
    assert series(f["kvoffload_advice_info"]) == {
        ("a", "qwen3", "0", "enable_offload", "recompute_after_eviction"): 1.0,
        ("a", "qwen3", "1", "keep", "paying_off"): 1.0,
    }


def test_advice_families_without_engines_are_empty() -> None:
    assert [len(f) for f in advice_families([])] == [0, 0, 0]
