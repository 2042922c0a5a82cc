"""Coverage-guided fuzzing of the exposition parser with atheris (libFuzzer).

    pip install atheris
    python -m bench.fuzz.fuzz_expfmt -max_total_time=600 -artifact_prefix=/tmp/ /tmp/corpus-expfmt

Checks on every input: parse() returns or raises ExpositionError, nothing else; and when
prometheus_client's reference parser accepts the text, both agree on every sample of the
names asked for. Seeds: the recorded vLLM expositions under tests/fixtures.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import atheris
from atheris.import_hook import instrument_imports  # the stubs' top level omits it

with instrument_imports():
    from exporter import expfmt

from prometheus_client.parser import text_string_to_metric_families

WANTED = {"a", "b_total", "vllm:prefix_cache_hits_total", "vllm:kv_cache_usage_perc"}
SEEDS = Path(__file__).resolve().parents[2] / "tests" / "fixtures"


# Inputs where prometheus_client accepts what we reject (or reads differently) on purpose,
# or where the reference parser is lax: underscores in numbers (Python's float()),
# leading blanks, blanks before `{`, tabs and other whitespace (\v, \f, \r) as separators.
# All listed in docs/reliability.md.
_KNOWN = re.compile(r"[0-9.]_[0-9]|[^\S \n]|(?:^|\n) +[^ \n]| +\{")


def _known_difference(text: str) -> bool:
    return _KNOWN.search(text) is not None


def _reference(text: str) -> list[tuple[str, tuple[tuple[str, str], ...], float]] | None:
    try:
        return [
            (s.name, tuple(sorted(s.labels.items())), float(s.value))
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name in WANTED
        ]
    except Exception:  # the reference rejects it: only our no-crash property applies
        return None


def test_one_input(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    try:
        ours = expfmt.parse(text, WANTED)
    except expfmt.ExpositionError:
        return
    ref = _reference(text)
    if ref is None or _known_difference(text):
        return
    mine = [(s.name, s.labels, s.value) for s in ours]
    if len(mine) != len(ref) or any(
        a[:2] != b[:2] or not (a[2] == b[2] or (math.isnan(a[2]) and math.isnan(b[2])))
        for a, b in zip(mine, ref, strict=True)
    ):
        raise AssertionError(f"disagreement on {text!r}: ours {mine} reference {ref}")


def main() -> None:
    argv = list(sys.argv)
    corpus = [a for a in argv[1:] if not a.startswith("-")]
    if corpus:
        Path(corpus[0]).mkdir(parents=True, exist_ok=True)
        for seed in sorted(SEEDS.rglob("*.prom")) + sorted(SEEDS.rglob("metrics_*.txt")):
            (Path(corpus[0]) / seed.name).write_bytes(seed.read_bytes()[:4096])
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
