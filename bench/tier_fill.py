"""Whether what the loads cost a burst follows the CPU tier's filling, per offload run of the
bursts (`concurrent`) against its run without offload (docs/whatif.md, "What batch 30
measured": 4B's 9 GiB pair cost 27 % of summed TTFT, its 16 GiB pair on another host nothing,
with the same loads).

    PYTHONPATH=. .venv/bin/python -m bench.tier_fill [tests/fixtures/gpu/matrix] [RUN ...]
        [--json]

The tier is full from its first eviction: the first KV-event batch with a `BlockRemoved` of
medium CPU, seconds after the offload run's first send ("-": it never filled). Each matched
request (matrixkit.matched_requests) is placed by its send time, before or after that, and
in the first `EARLY_S` seconds or after them; per part, the mean TTFT change with the tier of
the requests that loaded (cached tokens above their own without offload) and of the others,
in ms; and per loader the tokens it loaded and the suffix it computed. A cost that comes
with the filling shows after it and not before; one that does not shows on both sides.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.advice_eval import MATRIX
from bench.burst_steps import burst_pairs
from bench.common import loaded_tokens, markdown_table, recordings_main

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import gpukit  # type: ignore[import-not-found]  # bench/gpu holds scripts, not a package
import matrixkit  # type: ignore[import-not-found]

EARLY_S = 30.0  # the first seconds of traffic, against the rest
PARTS = ("before_full", "after_full", "early", "late")


def first_eviction(run: Path) -> float | None:
    """The stamp of the first KV-event batch that removed a block from the CPU tier."""
    for rec in gpukit.iter_jsonl(run / "kv_events.jsonl.xz"):
        ts, events = rec["payload"][0], rec["payload"][1]
        if any(e.get("type") == "BlockRemoved" and e.get("medium") == "CPU" for e in events):
            return float(ts)
    return None


def _mean_ms(xs: Sequence[float]) -> float | None:
    return round(1000 * statistics.fmean(xs), 1) if xs else None


def by_part(base: Path, offload: Path) -> dict[str, Any]:
    """Per part of the offload run (`PARTS`): requests, loaders, and the mean TTFT change of
    the loaders and of the others, ms; and when the tier filled, s after the first send."""
    pairs = matrixkit.matched_requests(
        matrixkit.load_requests(base), matrixkit.load_requests(offload)
    )
    t0 = min(o["t_send"] for _, o in pairs)
    evicted = first_eviction(offload)
    full_s = None if evicted is None else round(evicted - t0, 1)
    parts: dict[str, dict[str, list[float]]] = {p: {"loaders": [], "others": []} for p in PARTS}
    loaded: list[int] = []  # per loader: tokens loaded, and the suffix it computed
    suffix: list[int] = []
    for b, o in pairs:
        t = o["t_send"] - t0
        side = "loaders" if loaded_tokens(b, o) > 0 else "others"
        if side == "loaders":
            loaded.append(loaded_tokens(b, o))
            suffix.append(int(o["prompt_tokens"]) - int(o.get("cached_tokens") or 0))
        change = o["ttft_s"] - b["ttft_s"]
        for part, inside in (
            ("before_full", full_s is None or t < full_s),
            ("after_full", full_s is not None and t >= full_s),
            ("early", t < EARLY_S),
            ("late", t >= EARLY_S),
        ):
            if inside:
                parts[part][side].append(change)
    return {
        "tier_full_s": full_s,
        "loaded_tokens_mean": round(statistics.fmean(loaded)) if loaded else None,
        "suffix_tokens_mean": round(statistics.fmean(suffix)) if suffix else None,
        **{
            part: {
                "requests": len(d["loaders"]) + len(d["others"]),
                "loaders": len(d["loaders"]),
                "loaders_ms": _mean_ms(d["loaders"]),
                "others_ms": _mean_ms(d["others"]),
            }
            for part, d in parts.items()
        },
    }


def table(root: Path = MATRIX, names: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per offload run of the bursts under `root` (or `names`) with a base on its machine."""
    return {
        name: {"base": base, **by_part(root / base, root / name)}
        for name, base in burst_pairs(root, names).items()
    }


def markdown(rows: Mapping[str, Mapping[str, Any]]) -> str:
    def change(part: Mapping[str, Any]) -> str:
        if not part["requests"]:
            return "-"
        f = "{:+.1f}".format
        lo, ot = part["loaders_ms"], part["others_ms"]
        return (
            f"{'-' if lo is None else f(lo)} / {'-' if ot is None else f(ot)} ({part['loaders']})"
        )

    header = [
        "offload run",
        "base",
        "tier full after s",
        "a loader: tokens loaded / computed",
        "before full: loaders / others ms (loaders)",
        "after full",
        f"first {EARLY_S:.0f} s",
        "after them",
    ]
    body = [
        [
            name,
            r["base"],
            "-" if r["tier_full_s"] is None else f"{r['tier_full_s']:.1f}",
            f"{r['loaded_tokens_mean']} / {r['suffix_tokens_mean']}",
            *(change(r[p]) for p in PARTS),
        ]
        for name, r in rows.items()
    ]
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> int:
    return recordings_main(__doc__, MATRIX, table, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
