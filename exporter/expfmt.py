"""A targeted parser for the Prometheus text exposition format.

vLLM's /metrics is mostly histogram buckets the exporter never reads. Only the
sample lines of wanted names are parsed in full; every other line gets a one
character sanity check, which is enough to reject an HTML error page or a
truncated binary body without paying for a full parse of what is thrown away.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]

_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,)?')
_NAME_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:")
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESCAPE_RE = re.compile(r"\\[\\\"n]")


class ExpositionError(ValueError):
    """The body is not valid exposition text; the message names the first bad line."""


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Labels
    value: float

    def label(self, key: str) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return None


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group(0)], value)


def _parse_labels(line: str, pos: int, lineno: int) -> tuple[Labels, int]:
    """Parse `{k="v",...}` starting at line[pos] == '{'; return labels and the index after '}'."""
    pos += 1
    labels: list[tuple[str, str]] = []
    end = len(line)
    while True:
        while pos < end and line[pos] == " ":
            pos += 1
        if pos < end and line[pos] == "}":
            pos += 1
            break
        m = _LABEL_RE.match(line, pos)
        if m is None:
            raise ExpositionError(f"line {lineno}: malformed labels: {line[:120]!r}")
        labels.append((m.group(1), _unescape(m.group(2))))
        pos = m.end()
        if m.group(3) is None:
            while pos < end and line[pos] == " ":
                pos += 1
            if pos >= end or line[pos] != "}":
                raise ExpositionError(f"line {lineno}: unterminated labels: {line[:120]!r}")
            pos += 1
            break
    keys = [k for k, _ in labels]
    if len(set(keys)) != len(keys):
        raise ExpositionError(f"line {lineno}: repeated label name: {line[:120]!r}")
    return tuple(sorted(labels)), pos


def _parse_value(text: str, lineno: int, line: str) -> float:
    parts = text.split()
    if not parts or len(parts) > 2:
        raise ExpositionError(f"line {lineno}: expected a value: {line[:120]!r}")
    try:
        value = float(parts[0])
        if len(parts) == 2:
            float(parts[1])  # timestamp: validated, not used
    except ValueError:
        raise ExpositionError(f"line {lineno}: bad number: {line[:120]!r}") from None
    return value


def parse(text: str, wanted: Collection[str]) -> list[Sample]:
    """Return the samples whose name is in `wanted`, in body order.

    Raises ExpositionError on a malformed body, or on a wanted series that appears
    twice: Prometheus itself would reject it, and picking one would be a guess.
    """
    out: list[Sample] = []
    seen: set[tuple[str, Labels]] = set()
    name_match = _NAME_RE.match
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line or line[0] == "#":
            continue
        first = line[0]
        if first not in _NAME_START:
            if line.isspace():
                continue
            raise ExpositionError(f"line {lineno}: not a sample line: {line[:120]!r}")
        m = name_match(line)
        assert m is not None  # first character is a valid name start
        name = m.group(0)
        if name not in wanted:
            continue
        pos = m.end()
        labels: Labels = ()
        if pos < len(line) and line[pos] == "{":
            labels, pos = _parse_labels(line, pos, lineno)
        elif pos < len(line) and line[pos] not in " \t":
            raise ExpositionError(f"line {lineno}: bad metric name: {line[:120]!r}")
        value = _parse_value(line[pos:], lineno, line)
        key = (name, labels)
        if key in seen:
            raise ExpositionError(f"line {lineno}: duplicate series {name}{dict(labels)}")
        seen.add(key)
        out.append(Sample(name, labels, value))
    return out


def is_finite_nonnegative(value: float) -> bool:
    return math.isfinite(value) and value >= 0.0
