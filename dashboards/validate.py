"""Strict validation of dashboard JSON against Grafana's JSON schemas (draft-07).

The schemas (dashboards/schemas/, copied from grafana-foundation-sdk's jsonschema/)
forbid unknown properties. The dashboard schema leaves panel options, custom field
config and targets open, so each is checked against its own schema too:
  - the dashboard             -> dashboard.jsonschema.json  #/definitions/Dashboard
  - panel.options             -> <panel type>.jsonschema.json #/definitions/Options
  - fieldConfig.defaults.custom -> <panel type>.jsonschema.json #/definitions/FieldConfig
  - each target               -> prometheus.jsonschema.json  #/definitions/Dataquery
  - every unit                -> units.jsonschema.json (or a custom si:/suffix:/prefix: unit)
and schemaVersion must be at least 36 (Grafana 12 migrates from 9 up, writes 42).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft7Validator
from jsonschema.exceptions import best_match

SCHEMAS = Path(__file__).parent / "schemas"
PANEL_TYPES = ("timeseries", "stat", "table", "barchart")
MIN_SCHEMA_VERSION = 36
_CUSTOM_UNIT = re.compile(r"^(si|suffix|prefix|count):.+$")


@cache
def schema(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((SCHEMAS / f"{name}.jsonschema.json").read_text())
    return data


def _validator(name: str, definition: str | None) -> Draft7Validator:
    doc = schema(name)
    if definition is not None:
        doc = {**doc, "$ref": f"#/definitions/{definition}"}
    Draft7Validator.check_schema(doc)
    return Draft7Validator(doc)


@cache
def grafana_units() -> frozenset[str]:
    return frozenset(d["const"] for d in schema("units")["definitions"].values() if "const" in d)


def unit_ok(unit: str) -> bool:
    return unit in grafana_units() or bool(_CUSTOM_UNIT.match(unit))


def _message(err: Any, where: str) -> str:
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
    return f"{where}{path}: {err.message}"


def _errors(validator: Draft7Validator, doc: Any, where: str) -> Iterator[str]:
    for top in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        # anyOf/oneOf: report the closest branch's error rather than "not valid under any"
        err = best_match(top.context) if top.context else top
        assert err is not None
        yield _message(err, where)


def _dashboard_errors(dashboard: dict[str, Any]) -> Iterator[str]:
    panels = dashboard.get("panels", [])
    for err in _validator("dashboard", None).iter_errors(dashboard):
        path = list(err.absolute_path)
        if err.validator in ("anyOf", "oneOf") and len(path) == 2 and path[0] == "panels":
            # A panel is a Panel or a RowPanel: report against the one its type says.
            panel = panels[path[1]]
            kind = "RowPanel" if panel.get("type") == "row" else "Panel"
            yield from _errors(_validator("dashboard", kind), panel, f"$.panels[{path[1]}]")
        else:
            yield _message(err, "$")


def panels_of(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # panels of collapsed rows


def problems(dashboard: dict[str, Any]) -> list[str]:
    """Every schema violation in a dashboard; empty when it is valid."""
    out = list(_dashboard_errors(dashboard))
    if dashboard.get("schemaVersion", 0) < MIN_SCHEMA_VERSION:
        out.append(f"$.schemaVersion: {dashboard.get('schemaVersion')} < {MIN_SCHEMA_VERSION}")
    target_v = _validator("prometheus", None)
    for i, panel in enumerate(dashboard.get("panels", [])):
        where = f"$.panels[{i}]"
        ptype = panel.get("type")
        if ptype == "row":
            continue
        if ptype not in PANEL_TYPES:
            out.append(f"{where}.type: {ptype!r} has no schema here")
            continue
        out += _errors(_validator(ptype, "Options"), panel.get("options", {}), where + ".options")
        custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom")
        if custom is not None:
            out += _errors(
                _validator(ptype, "FieldConfig"), custom, where + ".fieldConfig.defaults.custom"
            )
        for j, target in enumerate(panel.get("targets", [])):
            out += _errors(target_v, target, f"{where}.targets[{j}]")
        units = [panel.get("fieldConfig", {}).get("defaults", {}).get("unit")]
        for ov in panel.get("fieldConfig", {}).get("overrides", []):
            units += [p["value"] for p in ov.get("properties", []) if p.get("id") == "unit"]
        for unit in units:
            if unit is None or not unit_ok(unit):
                out.append(f"{where}: unit {unit!r} is not a Grafana unit")
    return out
