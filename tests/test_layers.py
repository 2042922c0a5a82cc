"""The layers of docs/architecture.md, checked on the import graph of the exporter package.

Every import statement counts, at module level or inside a function, under TYPE_CHECKING or
not: a layer that needs another layer's types has the dependency all the same.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "exporter"

# What the pure model must never reach: I/O, threads, the clock, and the layers around it.
MODEL_FORBIDDEN = (
    "exporter.sources",
    "exporter.render",
    "exporter.server",
    "exporter.cli",
    "exporter.runtime",
    "exporter.config",
    "exporter.logs",
    "aiohttp",
    "zmq",
    "socket",
    "threading",
    "asyncio",
    "subprocess",
    "pynvml",
    "time",
    "os",
    "pathlib",
)
SOURCES_FORBIDDEN = ("exporter.model", "exporter.render", "exporter.runtime", "exporter.server")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, name: str | None = None) -> Iterator[str]:
    """Absolute names of everything a module imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name or module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            yield base
            for alias in node.names:
                # `from exporter.sources import procfs` imports a module, not a name.
                sub = PACKAGE.parent / f"{base}.{alias.name}".replace(".", "/")
                if sub.is_dir() or sub.with_suffix(".py").exists():
                    yield f"{base}.{alias.name}"


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(owner: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{mod} imports {imp}"
        for mod, path in modules().items()
        if _under(mod, (owner,))
        for imp in imports(path)
        if _under(imp, forbidden)
    ]


def test_layers_exist() -> None:
    names = modules()
    for layer in ("exporter.sources", "exporter.model", "exporter.render", "exporter.runtime"):
        assert layer in names, f"{layer} is missing"


def test_sources_import_neither_the_model_nor_the_renderer() -> None:
    assert _violations("exporter.sources", SOURCES_FORBIDDEN) == []


def test_the_model_is_pure() -> None:
    assert _violations("exporter.model", MODEL_FORBIDDEN) == []


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import threading\nfrom exporter.render.exposition import Exposition\n"
        "from ..sources import vllm_http\n"
    )
    assert list(imports(bad, "exporter.model.bad")) == [
        "threading",
        "exporter.render.exposition",
        "exporter.sources",
        "exporter.sources.vllm_http",
    ]


def _graph() -> dict[str, set[str]]:
    names = modules()
    graph: dict[str, set[str]] = {}
    for mod, path in names.items():
        deps = set()
        for name in imports(path):
            # An import of a.b.c also runs a and a.b: depend on the deepest module named.
            imp = name
            while imp and imp not in names:
                imp = imp.rpartition(".")[0]
            if imp and imp != mod and imp.startswith("exporter"):
                deps.add(imp)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep.startswith(node + ".") or (node.startswith(dep + ".") and dep == "exporter"):
                continue
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_cycle() -> None:
    graph = _graph()
    # A package's __init__ importing nothing of its children keeps parent -> child edges out.
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_cycle_finder_finds_a_planted_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_runtime_asks_no_source_for_anything_by_name() -> None:
    tree = ast.parse((PACKAGE / "runtime.py").read_text())
    calls = [
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in ("getattr", "hasattr")
    ]
    assert calls == []


def missing_test_files(package: Path, tests: Path) -> list[str]:
    """Modules of `package` (all of it, top level included; not __init__.py or __main__.py)
    without their tests/<path>/test_<module>.py."""
    return [
        str(p.relative_to(package))
        for p in sorted(package.rglob("*.py"))
        if p.name not in ("__init__.py", "__main__.py")
        and not (tests / p.relative_to(package).parent / f"test_{p.stem}.py").is_file()
    ]


def test_every_module_of_a_layer_has_its_test_file() -> None:
    tests = Path(__file__).resolve().parent
    assert missing_test_files(PACKAGE, tests) == []


def test_the_test_file_check_sees_a_missing_one(tmp_path: Path) -> None:
    pkg, tests = tmp_path / "pkg", tmp_path / "tests"
    for rel in ("__init__.py", "__main__.py", "top.py", "layer/__init__.py", "layer/deep.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("")
    (tests / "layer").mkdir(parents=True)
    (tests / "test_top.py").write_text("")
    assert missing_test_files(pkg, tests) == ["layer/deep.py"]
    (tests / "layer" / "test_deep.py").write_text("")
    assert missing_test_files(pkg, tests) == []
