"""Property tests of the exposition parser: no crash on any input, and agreement with
prometheus_client's reference parser on every valid exposition hypothesis can build."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from exporter import expfmt
from exporter.vllm_metrics import WANTED

# KVOE_FUZZ_EXAMPLES=20000 for a long run; the default keeps the suite quick.
EXAMPLES = int(os.environ.get("KVOE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

METRIC_NAME = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,24}", fullmatch=True)
LABEL_NAME = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,12}", fullmatch=True).filter(
    lambda n: not n.startswith("__")
)
# Label values: any text, including the three characters the format escapes.
LABEL_VALUE = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)) | st.sampled_from('\\"\n{}=,# '),
    max_size=20,
)
SPECIAL = st.sampled_from(["NaN", "+Inf", "-Inf", "Inf", "nan", "inf", "-inf", "+inf"])
FINITE = st.floats(allow_nan=False, allow_infinity=False)
# Exponent and sign spellings Prometheus itself writes or accepts.
NUMBER_TEXT = st.one_of(
    FINITE.map(repr),
    st.integers(-(10**18), 10**18).map(str),
    FINITE.map(lambda v: f"{v:e}"),
    FINITE.map(lambda v: f"{v:E}"),
    st.integers(0, 10**6).map(lambda v: f"+{v}"),
    SPECIAL,
)

# Exposition-ish noise: single characters of the grammar and whole tokens.
TOKENS = st.sampled_from(
    [
        *'abc_:{}="\\, \t\n#+-.0123456789eEInfNa',
        "vllm:prefix_cache_hits_total",
        'engine="0"',
        "NaN",
        "+Inf",
        "\x00",
        "é",
    ]
)
EXPOSITION_NOISE = st.lists(TOKENS, max_size=120).map("".join)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def expositions(draw: st.DrawFn) -> tuple[str, list[tuple[str, tuple[tuple[str, str], ...]]]]:
    """A valid text exposition and the (name, labels) of its samples, in order."""
    names = draw(st.lists(METRIC_NAME, min_size=1, max_size=6, unique=True))
    lines: list[str] = []
    series: list[tuple[str, tuple[tuple[str, str], ...]]] = []
    for name in names:
        if draw(st.booleans()):
            help_text = draw(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",))))
            help_text = help_text.replace("\\", "\\\\").replace("\n", "\\n")
            lines.append(f"# HELP {name} {help_text}")
        if draw(st.booleans()):
            lines.append(f"# TYPE {name} {draw(st.sampled_from(['gauge', 'untyped']))}")
        seen: set[tuple[tuple[str, str], ...]] = set()
        for _ in range(draw(st.integers(1, 4))):
            labels = draw(st.dictionaries(LABEL_NAME, LABEL_VALUE, max_size=4))
            key = tuple(sorted(labels.items()))
            if key in seen:
                continue
            seen.add(key)
            sep = draw(st.sampled_from([",", ", ", " , "]))
            trailing = draw(st.sampled_from(["", ","])) if labels else ""
            inner = sep.join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + trailing
            label_text = f"{{{inner}}}" if labels or draw(st.booleans()) else ""
            value = draw(NUMBER_TEXT)
            stamp = f" {draw(st.integers(0, 2**53))}" if draw(st.booleans()) else ""
            lines.append(f"{name}{label_text} {value}{stamp}")
            series.append((name, key))
            if draw(st.integers(0, 9)) == 0:
                lines.append(draw(st.sampled_from(["", "# a comment", "#", "   "])))
    end = draw(st.sampled_from(["\n", ""]))
    return "\n".join(lines) + end, series


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@FUZZ
@given(EXPOSITION_NOISE, st.sets(METRIC_NAME, max_size=3))
@example("vllm:prefix_cache_hits_total{", {"vllm:prefix_cache_hits_total"})
@example('a{b="\\', {"a"})
@example("a 1 2 3", {"a"})
@example("a{} ", {"a"})
def test_parse_never_raises_anything_but_exposition_error(text: str, wanted: set[str]) -> None:
    wanted |= set(WANTED) | {"a", "abc", "a:b"}
    try:
        samples = expfmt.parse(text, wanted)
    except expfmt.ExpositionError:
        return
    for s in samples:
        assert s.name in wanted
        assert isinstance(s.value, float)


@FUZZ
@given(st.binary(max_size=400))
def test_parse_of_arbitrary_decoded_bytes(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    with contextlib.suppress(expfmt.ExpositionError):
        expfmt.parse(text, WANTED | {"a"})


@FUZZ
@given(expositions(), st.data())
def test_parse_agrees_with_prometheus_client(case, data: st.DataObject) -> None:
    text, series = case
    all_names = sorted({n for n, _ in series})
    wanted = set(data.draw(st.lists(st.sampled_from(all_names), unique=True)) or all_names)
    ours = expfmt.parse(text, wanted)
    reference = [
        (s.name, tuple(sorted(s.labels.items())), float(s.value))
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name in wanted
    ]
    assert [(s.name, s.labels) for s in ours] == [(n, ls) for n, ls, _ in reference]
    assert [(n, ls) for n, ls, _ in reference] == [(n, ls) for n, ls in series if n in wanted]
    for mine, (_, _, ref) in zip(ours, reference, strict=True):
        assert _same(mine.value, ref), (mine, ref)


@FUZZ
@given(expositions())
def test_unwanted_lines_never_change_wanted_samples(case) -> None:
    """Parsing for a subset gives exactly that subset of the full parse."""
    text, series = case
    names = sorted({n for n, _ in series})
    full = expfmt.parse(text, set(names))
    part = expfmt.parse(text, set(names[::2]))

    def key(s: expfmt.Sample) -> tuple[str, expfmt.Labels, str]:
        return s.name, s.labels, repr(s.value)  # repr: NaN equals NaN

    assert [key(s) for s in part] == [key(s) for s in full if s.name in set(names[::2])]


BLANK_VARIANTS = {
    # Found by probing beyond the generator above (and fixed); prometheus_client (and Go's
    # expfmt) accept these. The first used to lose a wanted sample silently.
    "tab_before_value": "a\t1\n",
    "leading_blank": " a 1\n",
    # Found by atheris (bench/fuzz/fuzz_expfmt.py): other whitespace after the name.
    "vertical_tab_before_value": " \na\x0b 1",
    "blank_before_labels": 'a {b="c"} 1\n',
}


@pytest.mark.parametrize("text", BLANK_VARIANTS.values(), ids=BLANK_VARIANTS.keys())
def test_blank_variants_agree_with_prometheus_client(text: str) -> None:
    reference = [
        (s.name, float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples
    ]
    ours = [(s.name, s.value) for s in expfmt.parse(text, {"a"})]
    assert ours == reference
    assert ours  # the wanted sample is there


def _outcome(text: str, wanted: set[str]) -> tuple[str, object]:
    try:
        return "ok", [(s.name, s.labels, repr(s.value)) for s in expfmt.parse(text, wanted)]
    except expfmt.ExpositionError as exc:
        return "error", str(exc)


# Noise shaped like a vLLM body: lines that start with names, comments, bad first characters.
LINE_NOISE = st.lists(
    st.lists(TOKENS, max_size=12).map("".join)
    | st.sampled_from(['a{b="c"} 1', "a 1", "a", 'abc{x="1"} 2', "a:b 3", "a 1{", "{a} 1", ""]),
    max_size=12,
).map("\n".join)


@FUZZ
@given(EXPOSITION_NOISE | LINE_NOISE | expositions().map(lambda c: c[0]))
@example('a 1\nb{x="1"} 2\n# c\n')
@example("a 1\n a 2\n")  # a blank-led line: the per-line loop
@example("a 1\n\xa0\n{b} 2\na 3\n")  # whitespace-only, then a bad line, then a duplicate
@example('a 1{x="y"}\n')  # blank before a brace: no wanted name here
@example('a 1{x="y"}\nb {c="d"} 1\n')  # ... unless some line has " {": names cut at blanks
@example("a")
def test_found_lines_answer_as_the_per_line_loop(text: str) -> None:
    """The regex path (wanted names the re engine can find) gives the same samples and the
    same errors as the per-line loop, which a name it cannot find ("\\n") forces."""
    wanted = {"a", "abc", "a:b", "vllm:prefix_cache_hits_total"}
    assert _outcome(text, wanted) == _outcome(text, wanted | {"\n"})
