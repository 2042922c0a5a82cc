"""exporter/sources/registry.py: every optional source, registered once."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from exporter.config import CORE_OPTIONS, OPTIONS
from exporter.options import Registration
from exporter.sources.registry import REGISTRATIONS

SOURCES = Path(__file__).resolve().parents[2] / "exporter" / "sources"


def _defines_registration(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(
        isinstance(node, ast.Assign | ast.AnnAssign)
        and any(
            isinstance(t, ast.Name) and t.id == "REGISTRATION"
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
        for node in tree.body
    )


def _registering_modules() -> list[str]:
    """Modules under exporter/sources/ that define a REGISTRATION (a package: its __init__)."""
    out = []
    for path in sorted(SOURCES.rglob("*.py")):
        if path.parent == SOURCES and path.name == "__init__.py":
            continue  # the Source protocol itself
        if _defines_registration(path):
            rel = path.relative_to(SOURCES.parent.parent).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out.append(".".join(parts))
    return out


def test_registry_lists_every_registration_the_sources_define_once() -> None:
    modules = _registering_modules()
    assert len(modules) >= 4, "the REGISTRATION finder finds too few: it is broken"
    defined = [importlib.import_module(m).REGISTRATION for m in modules]
    assert sorted(r.name for r in defined) == sorted(r.name for r in REGISTRATIONS)
    assert all(any(r is d for d in defined) for r in REGISTRATIONS)


def test_every_source_package_registers_under_its_own_name() -> None:
    packages = sorted(p.parent.name for p in SOURCES.glob("*/__init__.py"))
    assert packages, "no source package found"
    for name in packages:
        reg = importlib.import_module(f"exporter.sources.{name}").REGISTRATION
        assert isinstance(reg, Registration) and reg.name == name
        assert reg in REGISTRATIONS


def test_registration_names_and_flags_are_unique() -> None:
    names = [r.name for r in REGISTRATIONS]
    assert len(set(names)) == len(names)
    flags = [o.flag for o in CORE_OPTIONS]
    flags += [o.flag for r in REGISTRATIONS for o in (r.switch, *r.options)]
    assert len(set(flags)) == len(flags), "two options share a flag"
    keys = {o.key for o in OPTIONS}
    assert len(keys) == len(OPTIONS), "two options share a key (flag, env and YAML collide)"


def test_every_registration_brings_its_switch_and_options_into_config() -> None:
    for reg in REGISTRATIONS:
        assert reg.switch in OPTIONS, reg.name
        assert reg.switch.kind == "bool" and reg.switch.help == reg.help
        for opt in reg.options:
            assert opt in OPTIONS, (reg.name, opt.flag)
            kinds = ("str", "float", "int", "bool", "bytes", "list", "bytes_list")
            assert opt.help and opt.kind in kinds
