from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter import expfmt
from tests.conftest import CPU, H200

ALL_FIXTURES = [
    CPU / "metrics-before.prom",
    CPU / "metrics-after.prom",
    H200 / "a_nooffload" / "metrics_after.txt",
    H200 / "b_offload" / "metrics_after.txt",
]


def _reference(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.parametrize("path", ALL_FIXTURES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_parse_agrees_with_prometheus_client_on_real_expositions(path):
    text = path.read_text()
    ref = _reference(text)
    names = {name for name, _ in ref}
    ours = {(s.name, s.labels): s.value for s in expfmt.parse(text, names)}
    assert set(ours) == set(ref)
    for key, value in ref.items():
        assert ours[key] == value or (math.isnan(value) and math.isnan(ours[key]))


def test_parse_keeps_only_wanted_names():
    text = (H200 / "b_offload" / "metrics_after.txt").read_text()
    samples = expfmt.parse(text, {"vllm:prefix_cache_hits_total"})
    assert [(s.name, s.value) for s in samples] == [("vllm:prefix_cache_hits_total", 7920.0)]


def test_parse_label_escapes_and_spacing():
    text = 'm{a="x\\"y",b="back\\\\slash",c="new\\nline" , } 1.5 1700000000000\n'
    (s,) = expfmt.parse(text, {"m"})
    assert dict(s.labels) == {"a": 'x"y', "b": "back\\slash", "c": "new\nline"}
    assert s.value == 1.5


def test_parse_special_values():
    text = "a NaN\nb +Inf\nc -Inf\nd 1e+06\n"
    vals = {s.name: s.value for s in expfmt.parse(text, {"a", "b", "c", "d"})}
    assert math.isnan(vals["a"]) and vals["b"] == math.inf and vals["c"] == -math.inf
    assert vals["d"] == 1e6


@pytest.mark.parametrize(
    "body",
    [
        "<html><body>502 Bad Gateway</body></html>\n",
        'm{a="1" 3\n',
        "m{a=1} 3\n",
        "m 1 2 3\n",
        "m abc\n",
        'm{a="1",a="2"} 3\n',
        "m\n",
    ],
)
def test_parse_rejects_malformed(body):
    with pytest.raises(expfmt.ExpositionError):
        expfmt.parse(body, {"m"})


def test_parse_rejects_duplicate_wanted_series():
    with pytest.raises(expfmt.ExpositionError, match="duplicate"):
        expfmt.parse('m{a="1"} 1\nm{a="1"} 2\n', {"m"})


def test_parse_ignores_duplicates_of_unwanted_series():
    assert expfmt.parse("x 1\nx 2\nm 3\n", {"m"})[0].value == 3.0


def test_parse_rejects_garbage_even_in_unwanted_lines():
    with pytest.raises(expfmt.ExpositionError, match="line 2"):
        expfmt.parse("m 1\n\x00\x01binary\n", {"m"})
