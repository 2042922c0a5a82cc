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


def _render(families: Iterable[Family], openmetrics: bool) -> bytes:
    out: list[str] = []
    for fam in families:
        d = fam.definition
        mtype = "counter" if d.type == "counter" else "gauge"
        # OpenMetrics names the counter family without _total; the text format with it.
        meta = d.name.removesuffix("_total") if openmetrics and mtype == "counter" else d.name
        out.append(f"# HELP {meta} {_escape_help(d.help, openmetrics)}")
        out.append(f"# TYPE {meta} {mtype}")
        names = d.labels
        for values, value in fam.samples:
            number = floatToGoString(1.0 if d.type == "info" else value)  # type: ignore[no-untyped-call]
            if names:
                labels = ",".join(
                    f'{k}="{_escape_label(v)}"' for k, v in zip(names, values, strict=True)
                )
                out.append(f"{d.name}{{{labels}}} {number}")
            else:
                out.append(f"{d.name} {number}")
    if openmetrics:
        out.append("# EOF")
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
            data = gzip.compress(self.body(fmt, False), compresslevel=5)
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
