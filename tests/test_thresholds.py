"""exporter/thresholds.py: the shared thresholds and the defaults docs/advisor.md promises."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from exporter.thresholds import DEFAULT, Thresholds

DOC = Path(__file__).resolve().parent.parent / "docs" / "advisor.md"


def documented_defaults() -> dict[str, float]:
    """docs/advisor.md's "## Thresholds" table: name -> default."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Thresholds") :]
    section = section[: section.index("\n## ", 1)]
    rows = re.findall(r"^\| `([a-z_]+)` \| ([0-9.]+) \|", section, flags=re.MULTILINE)
    return {name: float(value) for name, value in rows}


def test_defaults_are_the_ones_docs_advisor_md_lists() -> None:
    documented = documented_defaults()
    assert len(documented) >= 10, "the table parser finds too few rows: it is broken"
    fields = {f.name: getattr(DEFAULT, f.name) for f in dataclasses.fields(Thresholds)}
    assert fields == documented


def test_default_is_thresholds_with_no_override_and_frozen() -> None:
    assert Thresholds() == DEFAULT
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.kv_usage_high = 0.5  # type: ignore[misc]
    changed = dataclasses.replace(DEFAULT, min_window_seconds=15.0)
    assert changed.min_window_seconds == 15.0 and DEFAULT.min_window_seconds == 120.0


def test_thresholds_are_ordered_as_their_meaning_requires() -> None:
    assert 0 < DEFAULT.kv_usage_high < DEFAULT.kv_usage_critical <= 1
    for name in (
        "recompute_share_material",
        "offload_hit_ratio_material",
        "reuse_ratio_low",
        "memory_usage_high",
        "pcie_utilization_high",
        "whatif_gain_material",
        "whatif_knee_share",
    ):
        assert 0 < getattr(DEFAULT, name) < 1, name  # shares of a whole
    assert DEFAULT.transfer_speedup_min > 1  # reloading must beat recomputing
