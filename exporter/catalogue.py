"""The metric set as data: catalogue.csv is the single list of every exported metric.

Code, docs/metrics.md, dashboards and rules take names from here, so a typo is an
error at import or test time instead of a silently empty panel.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Mapping, Sequence
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
        name = (row.get("name") or "").strip()
        mtype = (row.get("type") or "").strip()
        unit = (row.get("unit") or "").strip()
        labels = tuple((row.get("labels") or "").split())
        source = (row.get("source") or "").strip()
        help_text = (row.get("help") or "").strip()
        where = f"row {lineno} ({name or '?'})"
        if None in row or len(row) != 6:
            problems.append(f"{where}: expected 6 columns")
            continue
        if not _NAME_RE.match(name):
            problems.append(f"{where}: name must match {_NAME_RE.pattern}")
        if mtype not in TYPES:
            problems.append(f"{where}: unknown type {mtype!r}")
        if unit not in UNITS:
            problems.append(f"{where}: unknown unit {unit!r}")
        if source not in SOURCES:
            problems.append(f"{where}: unknown source {source!r}")
        if not help_text:
            problems.append(f"{where}: empty help")
        bare = name.removesuffix("_total")
        if mtype == "counter" and not name.endswith("_total"):
            problems.append(f"{where}: counters end in _total")
        if mtype != "counter" and name.endswith("_total"):
            problems.append(f"{where}: only counters end in _total")
        if mtype == "info" and not name.endswith("_info"):
            problems.append(f"{where}: info metrics end in _info")
        if unit and not bare.endswith("_" + unit):
            problems.append(f"{where}: unit {unit} must be the name's suffix")
        for label in labels:
            if not _LABEL_RE.match(label):
                problems.append(f"{where}: bad label name {label!r}")
        if len(set(labels)) != len(labels):
            problems.append(f"{where}: duplicate label")
        if name in out:
            problems.append(f"{where}: duplicate name")
        out[name] = MetricDef(name, mtype, unit, labels, source, help_text)
    if problems:
        raise CatalogueError("catalogue.csv: " + "; ".join(problems))
    return out


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
