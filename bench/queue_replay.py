"""What a shorter prefill saves the requests queued behind it: a one-server queue replayed
over each offload pair of the real-GPU matrix.

    PYTHONPATH=. .venv/bin/python -m bench.queue_replay [tests/fixtures/gpu/matrix] [RUN ...]
        [--c0-ms MS] [--json]

The what-if prices a hit at one cost per token (docs/whatif.md), so its saving grows in
proportion to the hits. bench/latency_parts.py shows where that falls short: on 32B chat with
16 GiB most of the saving went to requests that loaded nothing, at 32 GiB little did
(docs/gpu-acceptance.md, Session 24). This asks whether an engine modelled as one server in
arrival order explains that. Per offload run and its run without offload (matrixkit.base_run):

- each request of the run without offload is served for `c0 + c1 x tokens it computed`;
- its arrival is its first token's time less the mean TTFT of the requests whose first token
  came in the same second: what vLLM's TTFT histogram tells a 1 s scrape, no per-request
  time (requests.jsonl holds them; the exporter would not);
- `c1` is set (bisection) so that the replay's summed TTFT is the one measured without
  offload, for each `c0` of a grid (0-80 ms), and the `c0` kept is the one whose replay
  matches the TTFT measured in each second best (least squares over the seconds: the summed
  TTFT alone does not tell a request's cost from a token's); `--c0-ms` fixes it instead;
- the same arrivals are replayed with the tokens the offload run computed (its cached tokens
  where they exceed the run without offload's), and the difference is the gross saving: what
  the hits save their own requests and every request behind them, before any cost of a load
  or a store.

It prints the gross saving beside the hits alone at `c1` (no queue: `c1 x tokens loaded`)
and the summed TTFT the pair measured. A research tool: nothing in the exporter uses it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.advice_eval import MATRIX
from bench.common import markdown_table, recording_metas, recordings_parser

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import matrixkit  # type: ignore[import-not-found]  # bench/gpu holds scripts, not a package

# Seconds of queueing a bisection on c1 cannot reach above: a per-token service this long
# (2 ms) is far beyond any shape measured (32B: about 0.1 ms).
_C1_MAX = 2e-3


# The per-request costs tried (seconds): from none to a 32B prefill's worth.
C0_GRID = (0.0, 0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08)


def replay_each(
    arrivals: Sequence[float], tokens: Sequence[float], c0: float, c1: float
) -> list[float]:
    """Per request (in the given order), the time from its arrival to its service's end when
    requests are served one at a time in arrival order (ties in the given order), each for
    c0 + c1 x its tokens."""
    free = float("-inf")
    out = [0.0] * len(arrivals)
    for k in sorted(range(len(arrivals)), key=lambda k: arrivals[k]):
        start = max(arrivals[k], free)
        free = start + c0 + c1 * tokens[k]
        out[k] = free - arrivals[k]
    return out


def replay(arrivals: Sequence[float], tokens: Sequence[float], c0: float, c1: float) -> float:
    """The summed time of `replay_each`."""
    return sum(replay_each(arrivals, tokens, c0, c1))


def arrivals_from_interval_means(
    first_tokens: Sequence[float], ttfts: Sequence[float], interval_s: float = 1.0
) -> list[float]:
    """Each request's arrival as its first token's time less the mean TTFT of the requests
    whose first token came in the same interval (counted from the first one)."""
    if not first_tokens:
        return []
    t0 = min(first_tokens)
    groups: dict[int, list[float]] = {}
    keys = [int((t - t0) // interval_s) for t in first_tokens]
    for key, ttft in zip(keys, ttfts, strict=True):
        groups.setdefault(key, []).append(ttft)
    means = {key: sum(v) / len(v) for key, v in groups.items()}
    return [t - means[key] for t, key in zip(first_tokens, keys, strict=True)]


def fit_c1(
    arrivals: Sequence[float], tokens: Sequence[float], c0: float, summed_ttft: float
) -> float | None:
    """The per-token service at which the replay's summed TTFT is `summed_ttft` (the replay
    grows with c1); None when no c1 in [0, 2 ms] reaches it."""
    lo, hi = 0.0, _C1_MAX
    if replay(arrivals, tokens, c0, lo) > summed_ttft or replay(arrivals, tokens, c0, hi) < (
        summed_ttft
    ):
        return None
    for _ in range(50):
        mid = (lo + hi) / 2
        if replay(arrivals, tokens, c0, mid) > summed_ttft:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def fit_service(
    arrivals: Sequence[float],
    tokens: Sequence[float],
    first_tokens: Sequence[float],
    ttfts: Sequence[float],
    interval_s: float = 1.0,
    grid: Sequence[float] = C0_GRID,
) -> tuple[float, float] | None:
    """(c0, c1): of the grid's c0, each with the c1 that gives the summed TTFT, the one whose
    replay puts the TTFT measured in each interval (by first token) best; None when no c0
    fits."""
    if not first_tokens:
        return None
    t0 = min(first_tokens)
    keys = [int((t - t0) // interval_s) for t in first_tokens]
    measured: dict[int, float] = {}
    for key, ttft in zip(keys, ttfts, strict=True):
        measured[key] = measured.get(key, 0.0) + ttft
    best: tuple[float, float, float] | None = None
    for c0 in grid:
        c1 = fit_c1(arrivals, tokens, c0, sum(ttfts))
        if c1 is None:
            continue
        replayed: dict[int, float] = {}
        for key, t in zip(keys, replay_each(arrivals, tokens, c0, c1), strict=True):
            replayed[key] = replayed.get(key, 0.0) + t
        err = sum((replayed[k] - v) ** 2 for k, v in measured.items())
        if best is None or err < best[0]:
            best = (err, c0, c1)
    return (best[1], best[2]) if best is not None else None


def pair(
    base: Sequence[Mapping[str, Any]],
    offload: Sequence[Mapping[str, Any]],
    c0: float | None = None,
) -> dict[str, float | None] | None:
    """The queue replay of one pair (module doc; `c0` None: fitted, `fit_service`): None
    when no request is matched."""
    pairs = matrixkit.matched_requests(base, offload)
    if not pairs:
        return None
    first = [float(a["t_send"]) + float(a["ttft_s"]) for a, _ in pairs]
    ttfts = [float(a["ttft_s"]) for a, _ in pairs]
    arrivals = arrivals_from_interval_means(first, ttfts)
    prompt = [int(a["prompt_tokens"]) for a, _ in pairs]
    cached = [int(a.get("cached_tokens") or 0) for a, _ in pairs]
    cached_on = [
        max(c, int(b.get("cached_tokens") or 0)) for c, (_, b) in zip(cached, pairs, strict=True)
    ]
    before = [float(max(p - c, 0)) for p, c in zip(prompt, cached, strict=True)]
    after = [float(max(p - c, 0)) for p, c in zip(prompt, cached_on, strict=True)]
    measured_base = sum(ttfts)
    measured_on = sum(float(b["ttft_s"]) for _, b in pairs)
    if c0 is None:
        fitted = fit_service(arrivals, before, first, ttfts)
        c0, c1 = fitted if fitted is not None else (None, None)
    else:
        c1 = fit_c1(arrivals, before, c0, measured_base)
    gross = hits = None
    if c0 is not None and c1 is not None:
        gross = replay(arrivals, before, c0, c1) - replay(arrivals, after, c0, c1)
        hits = c1 * (sum(before) - sum(after))
    return {
        "requests": float(len(pairs)),
        "c0_s": c0,
        "c1_s": c1,
        "loaded_tokens": sum(before) - sum(after),
        "hits_alone_s": hits,
        "queue_replay_saved_s": gross,
        "measured_saved_s": measured_base - measured_on,
    }


def table(
    root: Path = MATRIX, names: Sequence[str] = (), c0: float | None = None
) -> dict[str, dict[str, Any] | None]:
    """Per offload run under `root` (or `names`) with a run without offload: `pair`. A name
    given that has none to pair with is an error, not a silent omission."""
    metas = recording_metas(root, names)
    out: dict[str, dict[str, Any] | None] = {}
    for name in names or sorted(metas):
        base = matrixkit.base_run(metas, name) if metas[name].get("offload") else None
        if base is None:
            if names:
                raise SystemExit(
                    f"{name} has no run without offload to replay against (name offload runs)"
                )
            continue
        row = pair(matrixkit.load_requests(root / base), matrixkit.load_requests(root / name), c0)
        out[name] = {"base": base, **row} if row is not None else None
    return out


def markdown(rows: Mapping[str, Mapping[str, Any] | None]) -> str:
    def num(v: Any, fmt: str) -> str:
        return fmt.format(v) if isinstance(v, int | float) else "-"

    header = ["run", "base", "c0 ms", "c1 us", "hits alone s", "queue replay s", "measured s"]
    body = []
    for name, row in rows.items():
        r = row or {}
        c0, c1 = r.get("c0_s"), r.get("c1_s")
        body.append(
            [
                name,
                r.get("base", "-"),
                num(c0 * 1e3 if c0 is not None else None, "{:.0f}"),
                num(c1 * 1e6 if c1 is not None else None, "{:.1f}"),
                num(r.get("hits_alone_s"), "{:.2f}"),
                num(r.get("queue_replay_saved_s"), "{:.2f}"),
                num(r.get("measured_saved_s"), "{:.2f}"),
            ]
        )
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> int:
    ap = recordings_parser(__doc__, MATRIX, "offload recordings under ROOT (default: all)")
    ap.add_argument(
        "--c0-ms", type=float, default=None, help="service per request (ms; default: fitted)"
    )
    a = ap.parse_args(argv)
    rows = table(a.root, a.runs, a.c0_ms / 1e3 if a.c0_ms is not None else None)
    print(json.dumps(rows, indent=1) if a.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
