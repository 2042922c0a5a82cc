"""exporter/model/advisor/types.py: the advisor's vocabulary and its value types.

What is generated from the vocabulary (dashboards, catalogue help, docs, alert rules) is
checked in tests/test_generated.py.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from exporter.model.advisor.hysteresis import HELD_THROUGH
from exporter.model.advisor.types import (
    ACTION_INFO,
    REASON_INFO,
    URGENT,
    Action,
    Advice,
    AdvisorInput,
    Reason,
    Tone,
    WhatIfState,
)
from tests.model.advisor.common import base

DOC = Path(__file__).resolve().parents[3] / "docs" / "advisor.md"


def test_every_action_and_reason_has_its_entry_in_enum_order() -> None:
    assert list(ACTION_INFO) == list(Action)
    assert list(REASON_INFO) == list(Reason)
    for info in ACTION_INFO.values():
        assert info.title and info.meaning and "|" not in info.meaning
    for rinfo in REASON_INFO.values():
        assert rinfo.meaning and "|" not in rinfo.meaning


def test_info_tables_are_read_only() -> None:
    with pytest.raises(TypeError):
        ACTION_INFO[Action.KEEP] = ACTION_INFO[Action.NO_ACTION]  # type: ignore[index]
    with pytest.raises(TypeError):
        del REASON_INFO[Reason.PAYING_OFF]  # type: ignore[attr-defined]


@pytest.mark.parametrize("enum", [Action, Reason, Tone])
def test_enum_values_are_their_names_in_snake_case(enum: type) -> None:
    """The values are label values (kvoffload_advice{action}, {reason}): bounded snake_case."""
    for member in enum:
        assert member.value == member.name.lower()
        assert re.fullmatch(r"[a-z][a-z_]*", member.value)
        assert str(member) == member.value  # StrEnum: renders as the label value


def test_every_tone_colours_some_action() -> None:
    assert {info.tone for info in ACTION_INFO.values()} == set(Tone)


def test_urgent_actions_are_the_ones_the_docs_exempt_from_hysteresis() -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Hysteresis") :]
    section = section[: section.index("\n## ", 1)]
    named = {a for a in Action if f"`{a.value}`" in section}
    assert named == set(URGENT) == {Action.REDUCE_BUFFER_OOM_RISK, Action.INSUFFICIENT_DATA}
    # and the doubt a standing decision holds through
    assert {r for r in Reason if f"`{r.value}`" in section} == HELD_THROUGH


def test_advice_defaults_and_is_frozen() -> None:
    a = Advice(Action.KEEP, Reason.PAYING_OFF, "it pays")
    assert a.recommended_buffer_bytes is None and a.candidate is None
    assert dict(a.numbers) == {}
    assert Advice(Action.KEEP, Reason.PAYING_OFF, "x").numbers is not a.numbers  # own dict
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.action = Action.NO_ACTION  # type: ignore[misc]


def test_advisor_input_defaults_to_no_whatif_memory_pcie_or_policies() -> None:
    inp = AdvisorInput(base(), 60.0)
    assert (inp.whatif, inp.memory, inp.pcie_utilization) == (None, None, None)
    assert inp.policy_alternatives == ()
    state = WhatIfState((), 0.0)
    assert state.configured_hit_ratio is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.points = ()  # type: ignore[misc]


def test_every_action_has_a_distinct_headline_for_the_status_page() -> None:
    from exporter.model.advisor.types import ACTION_INFO

    heads = [info.headline for info in ACTION_INFO.values()]
    assert all(heads) and len(set(heads)) == len(heads)
