"""Whom a load keeps waiting, per offload run and its run without offload (the same request
sequence, paired by `matrixkit.matched_requests`): the mean TTFT change with the tier of the
requests that loaded (cached tokens above their own without offload, as in
`bench.latency_parts`), of those whose wait for a first token overlapped a loader's, and of
the rest.

    PYTHONPATH=. .venv/bin/python -m bench.beside_loaders [tests/fixtures/gpu/matrix] [RUN ...]
        [--json]

The what-if charges the requests kept waiting for the launch of a loader's later step only
where requests come in bursts (docs/whatif.md, "The launch a load adds"); where they come one
at a time, the requests beside a loader came back no later than the rest, and this says so.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.advice_eval import MATRIX
from bench.common import loaded_tokens, markdown_table, recording_metas, recordings_main

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import matrixkit  # type: ignore[import-not-found]  # bench/gpu holds scripts, not a package

GROUPS = ("loaders", "beside", "rest")


def beside_loaders(
    base: Sequence[Mapping[str, Any]], offload: Sequence[Mapping[str, Any]]
) -> dict[str, dict[str, float | None]]:
    """Per group of `GROUPS`: "n" (requests) and "ms" (mean TTFT with the tier less without,
    None for none), over the requests both runs completed. A request is "beside" a loader
    where its wait (send to first token, with the tier) overlapped a loader's."""
    pairs = [(b, o, loaded_tokens(b, o) > 0) for b, o in matrixkit.matched_requests(base, offload)]
    loads = [
        (float(o["t_send"]), float(o["t_send"]) + float(o["ttft_s"]))
        for _, o, loader in pairs
        if loader
    ]
    changes: dict[str, list[float]] = {g: [] for g in GROUPS}
    for b, o, loader in pairs:
        start, end = float(o["t_send"]), float(o["t_send"]) + float(o["ttft_s"])
        if loader:
            group = "loaders"
        elif any(s < end and start < e for s, e in loads):
            group = "beside"
        else:
            group = "rest"
        changes[group].append(float(o["ttft_s"]) - float(b["ttft_s"]))
    return {
        g: {
            "n": float(len(v)),
            "ms": round(1e3 * statistics.fmean(v), 1) if v else None,
        }
        for g, v in changes.items()
    }


def table(root: Path = MATRIX, names: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per offload run under `root` (or `names`) with a run without offload on its machine:
    its base, its workload and `beside_loaders`."""
    metas = recording_metas(root, names)
    out: dict[str, dict[str, Any]] = {}
    for name in names or sorted(metas):
        if not metas[name].get("offload"):
            continue
        base = matrixkit.base_run(metas, name)
        if base is None:
            continue
        out[name] = {
            "base": base,
            "workload": (metas[name].get("workload") or {}).get("name"),
            **beside_loaders(
                matrixkit.load_requests(root / base), matrixkit.load_requests(root / name)
            ),
        }
    return out


def markdown(rows: Mapping[str, Mapping[str, Any]]) -> str:
    def cell(group: Mapping[str, float | None]) -> str:
        ms = group["ms"]
        return "-" if ms is None else f"{ms:+.1f} ({group['n']:.0f})"

    header = [
        "offload run",
        "base",
        "workload",
        *(f"{g}: TTFT change ms (requests)" for g in GROUPS),
    ]
    body = [
        [name, r["base"], str(r["workload"]), *(cell(r[g]) for g in GROUPS)]
        for name, r in rows.items()
    ]
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> int:
    return recordings_main(__doc__, MATRIX, table, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
