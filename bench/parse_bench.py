"""Exposition parsing: the exporter's targeted parser against prometheus_client's parser.

    python -m bench.parse_bench [--repeats N]

Baseline: prometheus_client.parser.text_string_to_metric_families on the same bytes, in the
same run, followed by the same filtering to the series the exporter reads. Both sides end with
the normalised per-engine quantities, so the comparison is of the whole "body -> numbers" step.
"""

from __future__ import annotations

import argparse
from functools import partial

from prometheus_client.parser import text_string_to_metric_families

from bench.common import measure, median, table
from bench.corpus import data_parallel, single_engine
from exporter import expfmt
from exporter.vllm_metrics import WANTED, normalise


def ours(text: str) -> object:
    return normalise(expfmt.parse(text, WANTED), 0.0)


def baseline(text: str) -> object:
    samples = [
        expfmt.Sample(s.name, tuple(sorted(s.labels.items())), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name in WANTED
    ]
    return normalise(samples, 0.0)


def run(repeats: int) -> list[tuple[str, float, float, float]]:
    out = []
    for name, text in (("1 engine", single_engine()), ("8 DP engines + offload", data_parallel())):
        a = ours(text)
        b = baseline(text)
        assert a == b, "the two paths must produce the same numbers"
        t_ours = median(measure(partial(ours, text), repeats))
        t_base = median(measure(partial(baseline, text), repeats))
        out.append((f"{name} ({len(text) // 1000} KB)", t_ours, t_base, t_base / t_ours))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    rows = [
        (name, f"{o * 1e3:.2f} ms", f"{b * 1e3:.2f} ms", f"{r:.1f}x")
        for name, o, b, r in run(args.repeats)
    ]
    print(
        table(
            rows,
            (
                "corpus",
                "exporter parser (median)",
                "prometheus_client (median)",
                "speedup vs baseline",
            ),
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
