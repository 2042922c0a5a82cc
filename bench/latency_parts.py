"""Where a TTFT goes, per recording of the real-GPU matrix, and what offload changed in it.

    PYTHONPATH=. .venv/bin/python -m bench.latency_parts [tests/fixtures/gpu/matrix] [RUN ...]
        [--json]

vLLM times every request in three histograms: its queue time (queued to scheduled; a load
from the CPU tier keeps a request there), its prefill time (scheduled to first token) and its
TTFT (arrival to first token). What the TTFT holds beyond the two, "pre" here, runs from the
request's arrival to its queueing in the engine core, which takes new requests between
steps (an arrival waits out the step in progress), plus the hand-back of its first token.
Per recording this prints the mean of each per request from its first to its last scrape
(each histogram's sum over its count), and per offload run the same for its run without
offload (matrixkit.base_run, as `matrix.py truth` pairs them) and the change.

Per offload run it also splits the summed TTFT saved between the requests that loaded (their
cached tokens above the same request's without offload: the hits the tier added) and the
rest, from requests.jsonl: a hit shortens the steps and the queue every other request waits
on too, which a price per loaded token does not show (session 24: 63 % of 32B chat's saving
at 16 GiB went to requests that loaded nothing). The numbers docs/gpu-acceptance.md quotes
per session (sessions 22-24) come from here.
"""

from __future__ import annotations

import json
import lzma
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.advice_eval import MATRIX
from bench.common import markdown_table, recording_metas, recordings_parser
from exporter import expfmt

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import matrixkit  # type: ignore[import-not-found]  # bench/gpu holds scripts, not a package

# The histograms a TTFT splits into; tests/test_latency_parts.py checks each name against
# exporter.vllm_metrics.SERIES, as dashboards/build.py checks its queries' names.
PARTS: Mapping[str, str] = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
}
COLUMNS = ("queue", "prefill", "ttft", "pre")
_SAMPLES = {
    f"{name}{suffix}": (part, i)
    for part, name in PARTS.items()
    for i, suffix in enumerate(("_sum", "_count"))
}


def histogram_totals(body: str) -> dict[str, tuple[float, float]]:
    """Per part: (sum, count) of its histogram in one exposition, every label set added
    (one engine per recording; a data-parallel server's engines together)."""
    totals = {part: [0.0, 0.0] for part in PARTS}
    for sample in expfmt.parse(body, _SAMPLES):
        part, i = _SAMPLES[sample.name]
        totals[part][i] += sample.value
    return {part: (s, n) for part, (s, n) in totals.items()}


def latency_parts(first_body: str, last_body: str) -> dict[str, float] | None:
    """Mean seconds per request of the requests the histograms counted between two scrapes:
    queue, prefill, ttft and pre = ttft - queue - prefill. None where a histogram counted none.
    vLLM counts queue and prefill time at a request's end and its TTFT at its first token, so
    over a window of a few requests the parts need not add up; over minutes they do."""
    a, b = histogram_totals(first_body), histogram_totals(last_body)
    out: dict[str, float] = {}
    for part in PARTS:
        count = b[part][1] - a[part][1]
        if count <= 0:
            return None
        out[part] = (b[part][0] - a[part][0]) / count
    out["pre"] = out["ttft"] - out["queue"] - out["prefill"]
    return out


def first_last_bodies(run: Path) -> tuple[str, str]:
    """The /metrics bodies of a recording's first and last scrape."""
    first = last = ""
    with lzma.open(run / "metrics.jsonl.xz", "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                last = json.loads(line)["body"]
                first = first or last
    return first, last


def spread(
    base: Sequence[Mapping[str, Any]], offload: Sequence[Mapping[str, Any]]
) -> dict[str, float | None] | None:
    """Who the summed TTFT saved went to, over the requests both runs completed: "loaders"
    (requests with more cached tokens than without offload), their "loaded_tokens" (those
    extra tokens), "loaders_saved_s" and "others_saved_s" (TTFT without offload minus with,
    summed), and "others_share" of the whole saving (None when nothing was saved). None when
    no request is matched."""
    pairs = matrixkit.matched_requests(base, offload)
    if not pairs:
        return None
    loaders = loaded = 0
    mine = theirs = 0.0
    for a, b in pairs:
        extra = int(b.get("cached_tokens") or 0) - int(a.get("cached_tokens") or 0)
        saved = float(a["ttft_s"]) - float(b["ttft_s"])
        if extra > 0:
            loaders += 1
            loaded += extra
            mine += saved
        else:
            theirs += saved
    total = mine + theirs
    return {
        "requests": float(len(pairs)),
        "loaders": float(loaders),
        "loaded_tokens": float(loaded),
        "loaders_saved_s": round(mine, 4),
        "others_saved_s": round(theirs, 4),
        "others_share": round(theirs / total, 4) if total > 0 else None,
    }


def _ms(parts: dict[str, float] | None) -> dict[str, float] | None:
    return {k: round(v * 1e3, 2) for k, v in parts.items()} if parts is not None else None


def table(root: Path = MATRIX, names: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per recording (every one under `root`, or `names`): "ms", its parts in milliseconds;
    per offload run also "base" (its run without offload), "base_ms", "change_ms" and
    "spread" (who the saving went to, `spread`)."""
    metas = recording_metas(root, names)
    parts: dict[str, dict[str, float] | None] = {}

    def of(name: str) -> dict[str, float] | None:
        if name not in parts:
            parts[name] = _ms(latency_parts(*first_last_bodies(root / name)))
        return parts[name]

    out: dict[str, dict[str, Any]] = {}
    for name in names or sorted(metas):
        row: dict[str, Any] = {"ms": of(name)}
        base = matrixkit.base_run(metas, name) if metas[name].get("offload") else None
        if base is not None:
            mine, theirs = row["ms"], of(base)
            row.update(base=base, base_ms=theirs)
            if mine is not None and theirs is not None:
                row["change_ms"] = {k: round(mine[k] - theirs[k], 2) for k in COLUMNS}
            row["spread"] = spread(
                matrixkit.load_requests(root / base), matrixkit.load_requests(root / name)
            )
        out[name] = row
    return out


def markdown(rows: Mapping[str, Mapping[str, Any]]) -> str:
    def cells(ms: Mapping[str, float] | None, signed: bool = False) -> list[str]:
        fmt = "{:+.1f}" if signed else "{:.1f}"
        return [fmt.format(ms[k]) if ms else "-" for k in COLUMNS]

    def who(sp: Mapping[str, Any] | None) -> list[str]:
        if not sp:
            return ["-"] * 4
        share = sp["others_share"]
        return [
            f"{sp['loaders']:.0f} of {sp['requests']:.0f}",
            f"{sp['loaders_saved_s']:.2f}",
            f"{sp['others_saved_s']:.2f}",
            f"{share:.0%}" if share is not None else "-",
        ]

    header = [
        "run",
        *COLUMNS,
        "base",
        *(f"change {k}" for k in COLUMNS),
        "loaders",
        "saved by loaders s",
        "saved by others s",
        "others' share",
    ]
    body = [
        [
            name,
            *cells(r["ms"]),
            r.get("base", "-"),
            *cells(r.get("change_ms"), signed=True),
            *who(r.get("spread")),
        ]
        for name, r in rows.items()
    ]
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> int:
    ap = recordings_parser(__doc__, MATRIX, "recordings under ROOT (default: all)")
    a = ap.parse_args(argv)
    rows = table(a.root, a.runs)
    print(json.dumps(rows, indent=1) if a.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
