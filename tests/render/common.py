"""Reading rendered families in render tests."""

from __future__ import annotations

from collections.abc import Iterable

from exporter.catalogue import Family


def by_name(families: Iterable[Family]) -> dict[str, Family]:
    out: dict[str, Family] = {}
    for fam in families:
        assert fam.definition.name not in out, f"{fam.definition.name} rendered twice"
        out[fam.definition.name] = fam
    return out


def series(fam: Family) -> dict[tuple[str, ...], float]:
    """Label values -> value; a label set rendered twice is an error."""
    out = dict(fam.samples)
    assert len(out) == len(fam.samples), f"{fam.definition.name}: duplicate label set"
    return out
