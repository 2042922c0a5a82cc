"""exporter/render/exposition.py: the renderer's bytes equal a direct rendering with
prometheus_client's number formatting (what it was before its caches), for every catalogue
metric, both formats, any label values and values."""

from __future__ import annotations

import gzip
import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.utils import floatToGoString

from exporter.catalogue import CATALOGUE, Family
from exporter.render import exposition
from exporter.render.exposition import OPENMETRICS, TEXT, Exposition


def _direct(families: list[Family], openmetrics: bool) -> bytes:
    """The renderer as it was: every label block joined and every number formatted anew."""
    out: list[str] = []
    for fam in families:
        d = fam.definition
        mtype = "counter" if d.type == "counter" else "gauge"
        meta = d.name.removesuffix("_total") if openmetrics and mtype == "counter" else d.name
        out.append(f"# HELP {meta} {exposition._escape_help(d.help, openmetrics)}")
        out.append(f"# TYPE {meta} {mtype}")
        for values, value in fam.samples:
            number = floatToGoString(1.0 if d.type == "info" else value)
            if d.labels:
                labels = ",".join(
                    f'{k}="{exposition._escape_label(v)}"'
                    for k, v in zip(d.labels, values, strict=True)
                )
                out.append(f"{d.name}{{{labels}}} {number}")
            else:
                out.append(f"{d.name} {number}")
    if openmetrics:
        out.append("# EOF")
    return ("\n".join(out) + "\n").encode("utf-8")


VALUES = st.one_of(
    st.floats(),
    st.sampled_from([0.0, -0.0, 1.0, 1e16, 1.5e16, 1234567.0, -1234567.0, 999999.0, 5e-324]),
    st.integers(0, 2**63).map(float),
)
LABEL_VALUES = st.text(st.sampled_from('ab\\"\n{}=, é0'), max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_rendering_equals_the_direct_rendering(data: st.DataObject) -> None:
    families = []
    for name, d in CATALOGUE.items():
        fam = Family(name)
        for _ in range(data.draw(st.integers(0, 3))):
            labels = [data.draw(LABEL_VALUES) for _ in d.labels]
            fam.add(labels, data.draw(VALUES))
        if len(fam):
            families.append(fam)
    exp = Exposition(families)
    for fmt, om in ((TEXT, False), (OPENMETRICS, True)):
        assert exp.body(fmt) == _direct(families, om)
        assert gzip.decompress(exp.body(fmt, compressed=True)) == exp.body(fmt)


def test_numbers_are_prometheus_clients() -> None:
    values = [0.0, -0.0, 1.0, -1.0, 0.1, 1e16, 1.5e16, 1e22, 1234567.0, -1234567.0, 9999999.0]
    values += [999999.0, 123456.7, 1e-7, 5e-324, 2.0**53, 1e300, -1e300, math.inf, -math.inf]
    values += [math.nan, 1.7961380500053575e09, 42.5e6]
    for v in values:
        assert exposition._number(v) == floatToGoString(v), v


def test_label_cache_is_bounded_and_answers_the_same(monkeypatch) -> None:
    monkeypatch.setattr(exposition, "_HEADS_MAX", 2)
    exposition._HEADS.clear()
    fam = Family("kvoffload_target_up")
    for i in range(5):
        fam.add([f't"{i}'], 1)
    first = Exposition([fam]).body(TEXT)
    assert len(exposition._HEADS) <= 2
    assert Exposition([fam]).body(TEXT) == first == _direct([fam], False)
