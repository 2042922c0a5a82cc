"""exporter/model/inputs.py: one typed, frozen value per cycle."""

from __future__ import annotations

import dataclasses

import pytest

from exporter.model.derive.engines import DeriveSettings
from exporter.model.inputs import CycleInputs, TargetInputs
from exporter.window import TargetWindow


def test_target_inputs_default_to_no_memory_and_no_kv_event_consumer() -> None:
    win = TargetWindow(60.0)
    t = TargetInputs("a", win, DeriveSettings(stale_after=10.0))
    assert t.window is win  # the source's window itself, not a copy
    assert t.memory is None
    assert t.kv_items is None  # None: no consumer (no what-if); () would be "nothing new"


def test_cycle_inputs_default_to_unknown_pcie_load() -> None:
    c = CycleInputs(5.0, ())
    assert (c.now, c.targets, c.pcie_utilization) == (5.0, (), None)


@pytest.mark.parametrize(
    "value",
    [
        CycleInputs(1.0, ()),
        TargetInputs("a", TargetWindow(60.0), DeriveSettings(stale_after=10.0)),
    ],
)
def test_inputs_are_frozen_with_slots(value: object) -> None:
    field = dataclasses.fields(value)[0].name  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, field, None)
    assert not hasattr(value, "__dict__")
