"""exporter/render/exposition.py: the renderer's bytes equal a direct rendering with
prometheus_client's number formatting (what it was before its caches), for every catalogue
metric, both formats, any label values and values; and the contract (one HELP/TYPE block per
name, counter naming, info values, escaping) read back with prometheus_client's parsers."""

from __future__ import annotations

import gzip
import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
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


# --- the contract, checked with prometheus_client's parsers -------------------------------


def _fam(name: str, *samples: tuple[list[str], float]) -> Family:
    f = Family(name)
    for labels, value in samples:
        f.add(labels, value)
    return f


def test_families_of_one_name_share_one_help_and_type_block() -> None:
    a = _fam("kvoffload_target_up", (["a"], 1.0))
    b = _fam("kvoffload_target_up", (["b"], 0.0))
    empty = _fam("kvoffload_window_seconds")
    text = Exposition([a, empty, b]).text.decode()
    assert text == (
        f"# HELP kvoffload_target_up {a.definition.help}\n"
        "# TYPE kvoffload_target_up gauge\n"
        'kvoffload_target_up{target="a"} 1.0\n'
        'kvoffload_target_up{target="b"} 0.0\n'
    )
    assert len(a) == 1  # the inputs are not changed by the merge


def test_empty_exposition_renders_nothing_but_the_openmetrics_eof() -> None:
    exp = Exposition([_fam("kvoffload_target_up")])
    assert exp.text == b"\n"
    assert exp.openmetrics == b"# EOF\n"


def test_counters_are_named_with_total_in_text_and_without_in_openmetrics() -> None:
    exp = Exposition([_fam("kvoffload_target_resets_total", (["t"], 2.0))])
    text = exp.body(TEXT).decode()
    assert "# TYPE kvoffload_target_resets_total counter\n" in text
    assert 'kvoffload_target_resets_total{target="t"} 2.0\n' in text
    om = exp.body(OPENMETRICS).decode()
    assert "# TYPE kvoffload_target_resets counter\n" in om and om.endswith("# EOF\n")
    (parsed,) = openmetrics_families(om)
    assert parsed.name == "kvoffload_target_resets" and parsed.type == "counter"
    assert [(s.name, s.labels, s.value) for s in parsed.samples] == [
        ("kvoffload_target_resets_total", {"target": "t"}, 2.0)
    ]


def test_info_metrics_are_gauges_of_value_one() -> None:
    text = Exposition([_fam("kvoffload_build_info", (["1.0", "3.11"], 7.0))]).text.decode()
    assert "# TYPE kvoffload_build_info gauge\n" in text
    assert 'kvoffload_build_info{version="1.0",python_version="3.11"} 1.0\n' in text


def test_label_values_are_escaped_and_parse_back() -> None:
    nasty = 'a\\b"c\nd'
    f = _fam("kvoffload_target_info", (["t", 'http://x/?q="1"', nasty], 1.0))
    text = Exposition([f]).text.decode()
    assert 'vllm_version="a\\\\b\\"c\\nd"' in text
    (parsed,) = text_string_to_metric_families(text)
    (sample,) = parsed.samples
    assert sample.labels == {"target": "t", "url": 'http://x/?q="1"', "vllm_version": nasty}


def test_bodies_are_rendered_once_per_format() -> None:
    exp = Exposition([_fam("kvoffload_target_up", (["a"], 1.0))])
    assert exp.body(TEXT) is exp.body(TEXT) is exp.text
    assert exp.body(OPENMETRICS) is exp.openmetrics
    assert exp.body(TEXT, compressed=True) is exp.body(TEXT, compressed=True)
