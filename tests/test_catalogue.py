from __future__ import annotations

import re
from pathlib import Path

import pytest

from exporter.catalogue import CATALOGUE, CatalogueError, Family, parse_catalogue

REPO = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\bkvoffload_[a-z0-9_]*[a-z0-9]\b")


def _code_names() -> set[str]:
    names: set[str] = set()
    for path in (REPO / "exporter").rglob("*.py"):
        names |= set(NAME.findall(path.read_text()))
    return names


def test_every_metric_in_code_is_in_the_catalogue_and_every_row_is_emitted():
    used = _code_names()
    assert used - set(CATALOGUE) == set(), "used in code but missing from catalogue.csv"
    assert set(CATALOGUE) - used == set(), "in catalogue.csv but never emitted"


def test_docs_list_every_metric():
    doc = (REPO / "docs" / "metrics.md").read_text()
    assert set(NAME.findall(doc)) >= set(CATALOGUE)


def test_catalogue_rejects_bad_rows():
    bad = (
        "name,type,unit,labels,source,help\n"
        "kvoffload_x_seconds,counter,seconds,,self,h\n"
        "kvoffload_y_total,gauge,,,self,h\n"
        "kvoffload_z,gauge,bytes,,self,h\n"
        "Bad-Name,gauge,,,self,h\n"
        "kvoffload_w,gauge,,Bad-Label,nowhere,\n"
    )
    with pytest.raises(CatalogueError) as exc:
        parse_catalogue(bad)
    msg = str(exc.value)
    for needle in (
        "counters end in _total",
        "only counters end in _total",
        "unit bytes",
        "name must match",
        "bad label",
        "unknown source",
        "empty help",
    ):
        assert needle in msg


def test_family_enforces_label_arity():
    fam = Family("kvoffload_target_up")
    with pytest.raises(ValueError):
        fam.add(["a", "b"], 1)
    with pytest.raises(KeyError):
        Family("kvoffload_not_a_metric")
