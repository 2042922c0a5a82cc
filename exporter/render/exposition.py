"""Rendering metric families to the text (0.0.4) and OpenMetrics formats.

Rendered lazily, once per collection cycle and format, on the first scrape that asks for it:
Prometheus asks for OpenMetrics, curl for text, and nobody should pay for both every cycle.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable

from prometheus_client.utils import floatToGoString

from exporter.catalogue import Family

TEXT = "text"
OPENMETRICS = "openmetrics"


def _escape_label(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        value = value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return value


def _escape_help(text: str, openmetrics: bool) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if openmetrics else text


# Each series' text up to its value ('name{k="v",...} '): the same label sets come back
# every cycle, so joining and escaping them once is most of the rendering saved. Bounded;
# cleared when full (a target whose pids or engines churn cannot grow it without limit).
_HEADS: dict[tuple[str, tuple[str, ...]], str] = {}
_HEADS_MAX = 1 << 16


def _head(name: str, names: tuple[str, ...], values: tuple[str, ...]) -> str:
    key = (name, values)
    head = _HEADS.get(key)
    if head is None:
        labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in zip(names, values, strict=True))
        head = f"{name}{{{labels}}} "
        if len(_HEADS) >= _HEADS_MAX:
            _HEADS.clear()
        _HEADS[key] = head
    return head


def _number(value: float) -> str:
    """prometheus_client's floatToGoString, without its cost for the common case."""
    text = repr(float(value))
    # repr is the answer unless the value is not finite ('inf', '-inf', 'nan') or positive
    # with more than six digits before the point (Go's exponent form): leave those to it.
    if text.find(".") > 6 or text[-1] in "fn":
        return floatToGoString(value)  # type: ignore[no-untyped-call,no-any-return]
    return text


def _render(families: Iterable[Family], openmetrics: bool) -> bytes:
    out: list[str] = []
    append = out.append
    for fam in families:
        d = fam.definition
        mtype = "counter" if d.type == "counter" else "gauge"
        # OpenMetrics names the counter family without _total; the text format with it.
        meta = d.name.removesuffix("_total") if openmetrics and mtype == "counter" else d.name
        append(f"# HELP {meta} {_escape_help(d.help, openmetrics)}")
        append(f"# TYPE {meta} {mtype}")
        name, names = d.name, d.labels
        info = d.type == "info"
        for values, value in fam.samples:
            number = "1.0" if info else _number(value)
            if names:
                append(_head(name, names, values) + number)
            else:
                append(f"{name} {number}")
    if openmetrics:
        append("# EOF")
    return ("\n".join(out) + "\n").encode("utf-8")


class Exposition:
    """One cycle's families, rendered per format and encoding on first use."""

    def __init__(self, families: Iterable[Family]) -> None:
        # Several sources emit the same family (one per target): one HELP/TYPE block each,
        # or Prometheus rejects the scrape ("second HELP line").
        merged: dict[str, Family] = {}
        for fam in families:
            if not len(fam):
                continue
            name = fam.definition.name
            if name in merged:
                merged[name].extend(fam)
            else:
                merged[name] = fam.copy()
        self._families = list(merged.values())
        self._cache: dict[tuple[str, bool], bytes] = {}

    def body(self, fmt: str = TEXT, compressed: bool = False) -> bytes:
        key = (fmt, compressed)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        if compressed:
            # Level 1: a fifth of level 5's CPU for ~10 % more bytes on the wire.
            data = gzip.compress(self.body(fmt, False), compresslevel=1)
        else:
            data = _render(self._families, fmt == OPENMETRICS)
        self._cache[key] = data
        return data

    @property
    def text(self) -> bytes:
        return self.body(TEXT)

    @property
    def openmetrics(self) -> bytes:
        return self.body(OPENMETRICS)
