"""The advisor's vocabulary (Action, Reason) against everything generated from it.

exporter/model/advisor/types.py holds the one definition: the enums and their ACTION_INFO /
REASON_INFO tables. The checks below read the generated artefacts (dashboards/json,
exporter/catalogue.csv, docs/advisor.md, alerts/rules.yml) as committed, so a table entry
that goes missing, or a generator that stops using the tables, fails here; `./run check-gen`
catches an artefact that was not regenerated.
"""

from __future__ import annotations

import ast
import csv
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.model.advisor.types import ACTION_INFO, NUMBER_INFO, REASON_INFO, Action, Reason
from exporter.render.status_page import fmt_number
from scripts.gen import _KIND_UNIT, ADVISOR_BEGIN, ADVISOR_END, NUMBERS_DOC, NUMBERS_SOURCE

REPO = Path(__file__).resolve().parent.parent
ACTIONS = [a.value for a in Action]
REASONS = [r.value for r in Reason]


def rules_pairs() -> set[tuple[str, str]]:
    """Every (Action, Reason) pair rules.py returns: calls whose first two arguments are
    `Action.X, Reason.Y` (advice(...) and Advice(...) alike)."""
    tree = ast.parse((REPO / "exporter/model/advisor/rules.py").read_text(encoding="utf-8"))
    pairs = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            continue
        a, r = node.args[0], node.args[1]
        if (
            isinstance(a, ast.Attribute)
            and isinstance(a.value, ast.Name)
            and a.value.id == "Action"
            and isinstance(r, ast.Attribute)
            and isinstance(r.value, ast.Name)
            and r.value.id == "Reason"
        ):
            pairs.add((Action[a.attr].value, Reason[r.attr].value))
    return pairs


# --- the tables themselves (their entries: tests/model/advisor/test_types.py) -------------


def test_each_reasons_action_is_the_one_rules_returns_with_it() -> None:
    pairs = rules_pairs()
    assert len(pairs) >= len(Reason), "the rules.py parser finds too few pairs: it is broken"
    assert {r for _, r in pairs} == set(REASONS), "a reason rules.py never returns, or vice versa"
    for action, reason in pairs:
        assert REASON_INFO[Reason(reason)].action == action, (reason, action)
    # and every action is reachable
    assert {a for a, _ in pairs} == set(ACTIONS)


def rules_numbers() -> set[str]:
    """Every key rules.py puts in an advice's numbers: the keys of the dict literal it binds
    to `numbers` and every `numbers["key"] = ...`."""
    tree = ast.parse((REPO / "exporter/model/advisor/rules.py").read_text(encoding="utf-8"))
    keys: set[str] = set()
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        value = getattr(node, "value", None)
        for t in targets:
            if isinstance(t, ast.Name) and t.id == "numbers" and isinstance(value, ast.Dict):
                keys |= {k.value for k in value.keys if isinstance(k, ast.Constant)}
            if (
                isinstance(t, ast.Subscript)
                and isinstance(t.value, ast.Name)
                and t.value.id == "numbers"
                and isinstance(t.slice, ast.Constant)
            ):
                keys.add(t.slice.value)
    return keys


def test_every_number_rules_gives_is_described_once() -> None:
    keys = rules_numbers()
    assert len(keys) >= 20, "the rules.py parser finds too few numbers: it is broken"
    assert keys == set(NUMBER_INFO), "a number without a label and meaning, or vice versa"


def test_the_docs_list_every_number_and_the_card_labels_each() -> None:
    text = (REPO / NUMBERS_DOC).read_text(encoding="utf-8")
    section = text.split(f"from {NUMBERS_SOURCE}; do not edit -->")[1].split("<!-- END")[0]
    assert re.findall(r"^\| `(\w+)` \|", section, re.M) == list(NUMBER_INFO)
    for key, info in NUMBER_INFO.items():
        label, text = fmt_number(key, 0.5)
        assert label == info.label and text, key
    # A kind the card or the doc does not know would print as a bare number, or stop `gen`.
    kinds = {info.kind for info in NUMBER_INFO.values()}
    assert kinds <= set(_KIND_UNIT)
    bare = fmt_number("no_such_key", 0.5)[1]
    for key, info in NUMBER_INFO.items():
        if info.kind != "n":
            assert fmt_number(key, 0.5)[1] != bare, (key, info.kind)


# --- dashboards --------------------------------------------------------------------------


def _panels(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in doc.get("panels", []):
        yield p
        yield from _panels(p)


def _action_mappings() -> list[dict[str, Any]]:
    """The value-mapping options of every committed panel that shows the advice's action."""
    found = []
    for path in sorted((REPO / "dashboards/json").glob("*.json")):
        for panel in _panels(json.loads(path.read_text(encoding="utf-8"))):
            exprs = " ".join(t.get("expr", "") for t in panel.get("targets", []))
            if not re.search(r"\bkvoffload_advice(_info)?\b", exprs):
                continue
            for m in panel.get("fieldConfig", {}).get("defaults", {}).get("mappings", []):
                if m.get("type") == "value":
                    found.append(m["options"])
    return found


def test_every_action_is_mapped_in_the_dashboards() -> None:
    mappings = _action_mappings()
    assert mappings, "no advice panel with value mappings in dashboards/json"
    for options in mappings:
        assert sorted(options) == sorted(ACTIONS)
        for action in Action:
            assert options[action.value]["text"] == ACTION_INFO[action].title


# --- catalogue ---------------------------------------------------------------------------


def test_catalogue_help_lists_every_action_in_order() -> None:
    text = (REPO / "exporter/catalogue.csv").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("kvoffload_advice,")]
    assert len(rows) == 1
    (row,) = csv.reader(rows)
    m = re.search(r"\(([a-z_, ]+)\)", row[-1])
    assert m, row[-1]
    assert m.group(1).split(", ") == ACTIONS


# --- docs/advisor.md ---------------------------------------------------------------------


def _doc_tables() -> tuple[dict[str, list[str]], dict[str, str]]:
    """(action -> its reason codes, reason -> its action) from the generated section."""
    text = (REPO / "docs/advisor.md").read_text(encoding="utf-8")
    assert text.count(ADVISOR_BEGIN) == 1 and text.count(ADVISOR_END) == 1
    section = text.split(ADVISOR_BEGIN)[1].split(ADVISOR_END)[0]
    actions: dict[str, list[str]] = {}
    reasons: dict[str, str] = {}
    table = 0
    for line in section.splitlines():
        if line.startswith("| action |"):
            table = 1
        elif line.startswith("| reason code |"):
            table = 2
        elif line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            if table == 1:
                actions[cells[0].strip("`")] = re.findall(r"`([a-z_]+)`", cells[1])
            elif table == 2:
                reasons[cells[0].strip("`")] = cells[1].strip("`")
    return actions, reasons


def test_docs_list_every_action_with_its_reasons() -> None:
    actions, _ = _doc_tables()
    assert list(actions) == ACTIONS
    pairs = rules_pairs()
    for action, reasons in actions.items():
        assert reasons, action
        assert {(action, r) for r in reasons} <= pairs, action


def test_docs_list_every_reason_with_its_action() -> None:
    _, reasons = _doc_tables()
    assert list(reasons) == REASONS
    assert set(reasons.items()) <= {(r, a) for a, r in rules_pairs()}


# --- alerts ------------------------------------------------------------------------------


def test_alert_rules_name_only_real_actions() -> None:
    text = (REPO / "alerts/rules.yml").read_text(encoding="utf-8")
    doc = yaml.safe_load(text)
    exprs = [r["expr"] for g in doc["groups"] for r in g["rules"] if "alert" in r]
    named = {a for e in exprs for a in re.findall(r'kvoffload_advice\{action="([^"]*)"\}', e)}
    assert named, "no alert on kvoffload_advice found: the extractor is broken"
    assert named <= set(ACTIONS)


# --- no spelled-out copies ---------------------------------------------------------------


def _literal_copies(source: str) -> list[str]:
    """String constants in Python source that spell an action: equal to one, or containing
    a multi-word one (`grow_buffer`) as an identifier; one-word values (`keep`) are ordinary
    English in descriptions, so only an exact match counts for them."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
            continue
        for action in ACTIONS:
            word = rf"(?<![a-z0-9_]){action}(?![a-z0-9_])"
            if node.value == action or ("_" in action and re.search(word, node.value)):
                hits.append(f"{node.lineno}: {action}")
    return hits


SOURCES = sorted([*(REPO / "dashboards").rglob("*.py"), *(REPO / "alerts").rglob("*.py")])


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(REPO)) for p in SOURCES])
def test_no_action_is_spelled_out_in_dashboard_or_alert_sources(path: Path) -> None:
    assert _literal_copies(path.read_text(encoding="utf-8")) == []


def test_the_literal_finder_finds_a_copy() -> None:
    source = 'X = ("keep", \'kvoffload_advice{action="grow_buffer"}\', "keep it", "no_actions")\n'
    assert _literal_copies(source) == ["1: keep", "1: grow_buffer"]
