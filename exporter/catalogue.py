"""The metric set as data: catalogue.csv is the single list of every exported metric.

Code, docs/metrics.md, dashboards and rules take names from here, so a typo is an
error at import or test time instead of a silently empty panel.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources

_NAME_RE = re.compile(r"^kvoffload_[a-z0-9_]+$")
_LABEL_RE = re.compile(r"^[a-z][a-z0-9_]*$")
TYPES = frozenset({"gauge", "counter", "info"})
UNITS = frozenset({"", "seconds", "bytes", "bytes_per_second", "ratio"})
SOURCES = frozenset(
    {"self", "vllm", "derive", "nvml", "procfs", "cgroup", "kv_events", "whatif", "advisor"}
)


class CatalogueError(ValueError):
    """The catalogue file is malformed; the message names every bad line."""


@dataclass(frozen=True, slots=True)
class MetricDef:
    name: str
    type: str
    unit: str
    labels: tuple[str, ...]
    source: str
    help: str


def parse_catalogue(text: str) -> dict[str, MetricDef]:
    """Parse and validate catalogue CSV text; raise CatalogueError listing every problem."""
    rows = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    reader = csv.DictReader(rows)
    problems: list[str] = []
    out: dict[str, MetricDef] = {}
    for lineno, row in enumerate(reader, start=2):
        d = MetricDef(
            name=(row.get("name") or "").strip(),
            type=(row.get("type") or "").strip(),
            unit=(row.get("unit") or "").strip(),
            labels=tuple((row.get("labels") or "").split()),
            source=(row.get("source") or "").strip(),
            help=(row.get("help") or "").strip(),
        )
        where = f"row {lineno} ({d.name or '?'})"
        if None in row or len(row) != 6:
            problems.append(f"{where}: expected 6 columns")
            continue
        problems += [f"{where}: {problem}" for problem in _row_problems(d)]
        if d.name in out:
            problems.append(f"{where}: duplicate name")
        out[d.name] = d
    if problems:
        raise CatalogueError("catalogue.csv: " + "; ".join(problems))
    return out


def _row_problems(d: MetricDef) -> Iterator[str]:
    """What is wrong with one row on its own (the naming rules), in a fixed order."""
    if not _NAME_RE.match(d.name):
        yield f"name must match {_NAME_RE.pattern}"
    if d.type not in TYPES:
        yield f"unknown type {d.type!r}"
    if d.unit not in UNITS:
        yield f"unknown unit {d.unit!r}"
    if d.source not in SOURCES:
        yield f"unknown source {d.source!r}"
    if not d.help:
        yield "empty help"
    if d.type == "counter" and not d.name.endswith("_total"):
        yield "counters end in _total"
    if d.type != "counter" and d.name.endswith("_total"):
        yield "only counters end in _total"
    if d.type == "info" and not d.name.endswith("_info"):
        yield "info metrics end in _info"
    if d.unit and not d.name.removesuffix("_total").endswith("_" + d.unit):
        yield f"unit {d.unit} must be the name's suffix"
    for label in d.labels:
        if not _LABEL_RE.match(label):
            yield f"bad label name {label!r}"
    if len(set(d.labels)) != len(d.labels):
        yield "duplicate label"


def _load() -> dict[str, MetricDef]:
    text = resources.files("exporter").joinpath("catalogue.csv").read_text(encoding="utf-8")
    return parse_catalogue(text)


CATALOGUE: Mapping[str, MetricDef] = _load()


def metric(name: str) -> MetricDef:
    """Look a metric up; a name missing from the catalogue is a programming error."""
    try:
        return CATALOGUE[name]
    except KeyError:
        raise KeyError(f"{name} is not in exporter/catalogue.csv") from None


class Family:
    """Collects the samples of one catalogue metric for rendering.

    Label values are given positionally in catalogue order, so a caller cannot
    silently emit a series with a missing or extra label.
    """

    __slots__ = ("_def", "_samples")

    def __init__(self, name: str) -> None:
        self._def = metric(name)
        self._samples: list[tuple[tuple[str, ...], float]] = []

    @property
    def definition(self) -> MetricDef:
        return self._def

    def add(self, labels: Sequence[str], value: float) -> None:
        if len(labels) != len(self._def.labels):
            raise ValueError(
                f"{self._def.name}: expected labels {self._def.labels}, got {tuple(labels)}"
            )
        self._samples.append((tuple(labels), float(value)))

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def samples(self) -> list[tuple[tuple[str, ...], float]]:
        return self._samples

    def copy(self) -> Family:
        out = Family(self._def.name)
        out._samples = list(self._samples)
        return out

    def extend(self, other: Family) -> None:
        if other._def.name != self._def.name:
            raise ValueError(f"cannot merge {other._def.name} into {self._def.name}")
        self._samples.extend(other._samples)
