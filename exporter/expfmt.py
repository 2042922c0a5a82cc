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
from functools import lru_cache

Labels = tuple[tuple[str, str], ...]

_NAME_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:")
_BLANKS = " \t\x0b\x0c\r"
_NAME_END_RE = re.compile(r"[\t\x0b\x0c\r ]")
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


_PAIR = r'[a-zA-Z_][a-zA-Z0-9_]*\s*=\s*"(?:[^"\\]|\\.)*"'
# The whole label block in one C-level match, then the pairs with one findall: a Python
# loop per label costs more than everything else on vLLM's 35-label cache_config_info.
_BLOCK_RE = re.compile(r"\{\s*(?:" + _PAIR + r"\s*(?:,\s*" + _PAIR + r"\s*)*,?\s*)?\}")
_PAIRS_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


# Label blocks repeat verbatim on every scrape (the same series, the same labels): parsing
# each distinct block once is most of the parser's speed. Bounded; cleared when full.
_LABEL_CACHE: dict[str, Labels] = {}
_LABEL_CACHE_MAX = 1 << 16


def _parse_labels(line: str, pos: int, lineno: int) -> tuple[Labels, int]:
    """Parse `{k="v",...}` starting at line[pos] == '{'; return labels and the index after '}'."""
    close = line.rfind("}")
    if close > pos:
        cached = _LABEL_CACHE.get(line[pos : close + 1])
        if cached is not None:
            return cached, close + 1
    m = _BLOCK_RE.match(line, pos)
    if m is None:
        raise ExpositionError(f"line {lineno}: malformed labels: {line[:120]!r}")
    pairs = _PAIRS_RE.findall(line, pos, m.end())
    labels = [(k, _unescape(v)) for k, v in pairs]
    if len({k for k, _ in labels}) != len(labels):
        raise ExpositionError(f"line {lineno}: repeated label name: {line[:120]!r}")
    result = tuple(sorted(labels))
    if len(_LABEL_CACHE) >= _LABEL_CACHE_MAX:
        _LABEL_CACHE.clear()
    _LABEL_CACHE[line[pos : m.end()]] = result
    return result, m.end()


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


def parse(text: str, wanted: Collection[str]) -> list[Sample]:  # noqa: PLR0912  the per-line hot loop of every scrape: inline, a call per line costs (bench/parse_bench.py)
    """Return the samples whose name is in `wanted`, in body order.

    Raises ExpositionError on a malformed body, or on a wanted series that appears
    twice: Prometheus itself would reject it, and picking one would be a guess.
    """
    if not any(c in text for c in "\t\x0b\x0c\r"):
        finder = _line_finder(frozenset(wanted))
        if finder is not None:
            found = _parse_found(text, finder)
            if found is not None:
                return found
    # One scan of the body decides whether any line needs the careful name cut; vLLM and
    # prometheus_client write single spaces, so the per-line fast path is the normal one.
    odd_blanks = any(c in text for c in "\t\x0b\x0c\r") or " {" in text
    out: list[Sample] = []
    seen: set[tuple[str, Labels]] = set()
    name_start = _NAME_START
    for lineno, raw in enumerate(text.split("\n"), start=1):
        if not raw:
            continue
        line = raw
        first = line[0]
        if first == "#":
            continue
        if first not in name_start:
            if line.isspace():
                continue
            if first in _BLANKS:
                # Leading blanks are allowed (as prometheus_client and Go's expfmt do).
                line = line.lstrip(_BLANKS)
                if line[0] == "#":
                    continue
            if line[0] not in name_start:
                raise ExpositionError(f"line {lineno}: not a sample line: {line[:120]!r}")
        # Cheap name cut first: most lines are histogram buckets nobody asked for.
        end = line.find("{")
        if end < 0:
            end = line.find(" ")
            if end < 0:
                end = len(line)
        if odd_blanks:
            # Tabs, other blanks, or a blank before the labels somewhere in the body: cut the
            # name at the first blank of any kind (prometheus_client accepts these).
            m = _NAME_END_RE.search(line, 0, end)
            if m is not None:
                end = m.start()
        name = line[:end]
        if name in wanted:
            _add_sample(out, seen, line, name, end, lineno)
    return out


def _add_sample(
    out: list[Sample], seen: set[tuple[str, Labels]], line: str, name: str, end: int, lineno: int
) -> None:
    """Parse a wanted sample line whose name is line[:end] and append it to `out`."""
    pos = end
    if pos < len(line) and line[pos] != "{":
        rest = line[pos:].lstrip(_BLANKS)
        if rest.startswith("{"):
            pos = len(line) - len(rest)  # blanks between the name and its labels
    labels: Labels = ()
    if pos < len(line) and line[pos] == "{":
        labels, pos = _parse_labels(line, pos, lineno)
    value = _parse_value(line[pos:], lineno, line)
    key = (name, labels)
    if key in seen:
        raise ExpositionError(f"line {lineno}: duplicate series {name}{dict(labels)}")
    seen.add(key)
    out.append(Sample(name, labels, value))


# --- the found-lines path ------------------------------------------------------------------
# Most of a vLLM body is histogram buckets nobody asked for, and a Python loop over every
# line costs more than parsing the few wanted ones. Where no line starts with a blank and
# the body holds no tab or other odd blank, one regex finds exactly the lines the loop
# above takes (a wanted name at the start of a line, then '{', ' ' or the line's end) and
# another the first line it rejects (first character neither '#' nor a name character):
# same samples, same errors, same line numbers. Anything else goes to the loop.

_LINE_START = re.compile(r"\n[^#a-zA-Z_:\n]")
_UNFINDABLE = frozenset("{ \n\t\x0b\x0c\r")

_Tree = dict[str, "_Tree"]


def _alternation(names: Collection[str]) -> str:
    """A regex matching exactly the given names, as a prefix tree (fast in the re engine)."""
    tree: _Tree = {}
    for name in names:
        node = tree
        for ch in name:
            node = node.setdefault(ch, {})
        node[""] = {}  # a name ends here

    def emit(node: _Tree) -> str:
        branches = [re.escape(ch) + emit(sub) for ch, sub in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        # A name ending where longer ones go on: the rest is optional (greedy, and the
        # engine backtracks to the shorter name when the longer does not fit the line).
        return "(?:" + body + ")?" if "" in node else body

    return emit(tree)


@lru_cache(maxsize=8)
def _line_finder(wanted: frozenset[str]) -> re.Pattern[str] | None:
    """'\n' + a wanted name at a line's start; None where a name could not be found so."""
    if not wanted or any(not w or not _UNFINDABLE.isdisjoint(w) for w in wanted):
        return None
    return re.compile(r"\n(" + _alternation(wanted) + r")(?=[{ \n]|\Z)")


def _parse_found(text: str, finder: re.Pattern[str]) -> list[Sample] | None:
    """The wanted samples, or None where the body needs the per-line loop."""
    body = "\n" + text  # every line, the first too, starts after a newline
    size = len(body)
    bad = size  # where the first line the loop rejects starts (its newline)
    for m in _LINE_START.finditer(body):
        eol = body.find("\n", m.start() + 1)
        line = body[m.start() + 1 : eol if eol >= 0 else size]
        if line.isspace():
            continue  # skipped by the loop too
        if line[0] in _BLANKS:
            return None  # leading blanks before the first bad line: the loop's name cut
        bad = m.start()
        break
    out: list[Sample] = []
    seen: set[tuple[str, Labels]] = set()
    for m in finder.finditer(body, 0, bad):
        at = m.start()
        eol = body.find("\n", at + 1)
        line = body[at + 1 : eol if eol >= 0 else size]
        name = m.group(1)
        end = len(name)
        if end < len(line) and line[end] == " " and "{" in line:
            # The loop cuts the name at the brace (so it is not this one), unless some
            # line has a blank before a brace: then it cuts at blanks, the loop's business.
            if " {" in text:
                return None
            continue
        try:
            _add_sample(out, seen, line, name, end, 0)
        except ExpositionError:
            # The same error again with its line number (counted only now: it costs).
            _add_sample(out, seen, line, name, end, body.count("\n", 0, at + 1))
            raise
    if bad < size:
        eol = body.find("\n", bad + 1)
        line = body[bad + 1 : eol if eol >= 0 else size]
        lineno = body.count("\n", 0, bad + 1)
        raise ExpositionError(f"line {lineno}: not a sample line: {line[:120]!r}")
    return out


def is_finite_nonnegative(value: float) -> bool:
    return math.isfinite(value) and value >= 0.0
