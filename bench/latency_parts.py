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
at 16 GiB went to requests that loaded nothing). The rest split again by whether each arrived
alone or behind another request (session 27: on unique prompts the stores cost 0.6B and 8B
about their copy time on every request, alone or not, and 32B at 4 requests/s none; session
28: 32B at 1 request/s, its engine idle, a quarter of it; session 29: 14B and 8B on an H100
host a tenth to a fifth, whatever the shape). Per recording, how near its prefill ran to the
compute floor (`floor_share`): at 0.6 of it or nearer those shares stayed under a quarter of
a copy; below it they do not follow it (session 30, all thirteen unique-prompt pairs). The
numbers docs/gpu-acceptance.md quotes per session (sessions 22-30) come from here, and where a
recording has NVML samples (batch 21 on) how busy the GPU was and what it sent to the host.
"""

from __future__ import annotations

import json
import lzma
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.advice_eval import MATRIX
from bench.common import loaded_tokens, markdown_table, recording_metas, recordings_main
from exporter import expfmt
from exporter.model.derive.compute import computed_token_floor

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
    summed), and "others_share" of the whole saving (None when nothing was saved). The
    others split again by what they found on arrival in the run without offload: "alone"
    (no earlier request still waiting for its first token) or "behind" one, each with its
    count and its mean TTFT saved a request in milliseconds (None where there is no such
    request, or the records have no send times): a cost that lands on the requests that
    arrive alone is their own steps', not a queue's (session 27: the stores on unique
    prompts). None when no request is matched."""
    pairs = matrixkit.matched_requests(base, offload)
    if not pairs:
        return None
    behind_one = _behind_one_on_arrival(base)
    loaders = loaded = 0
    mine = theirs = 0.0
    saved_by: dict[bool, list[float]] = {False: [], True: []}
    for a, b in pairs:
        extra = loaded_tokens(a, b)
        saved = float(a["ttft_s"]) - float(b["ttft_s"])
        if extra > 0:
            loaders += 1
            loaded += extra
            mine += saved
        else:
            theirs += saved
            behind = behind_one.get(int(a["i"]))
            if behind is not None:
                saved_by[behind].append(saved)
    total = mine + theirs

    def mean_ms(xs: list[float]) -> float | None:
        return round(1e3 * sum(xs) / len(xs), 2) if xs else None

    return {
        "requests": float(len(pairs)),
        "loaders": float(loaders),
        "loaded_tokens": float(loaded),
        "loaders_saved_s": round(mine, 4),
        "others_saved_s": round(theirs, 4),
        "others_share": round(theirs / total, 4) if total > 0 else None,
        "alone": float(len(saved_by[False])),
        "alone_saved_ms": mean_ms(saved_by[False]),
        "behind": float(len(saved_by[True])),
        "behind_saved_ms": mean_ms(saved_by[True]),
    }


def _behind_one_on_arrival(records: Sequence[Mapping[str, Any]]) -> dict[int, bool]:
    """Per completed request with a send time: whether an earlier one was still waiting for
    its first token (send time plus TTFT: its prefill, not its decode) when it was sent."""
    sent = sorted(
        (float(r["t_send"]), float(r["t_send"]) + float(r["ttft_s"]), int(r["i"]))
        for r in records
        if r.get("status") == 200 and r.get("t_send") is not None
    )
    out: dict[int, bool] = {}
    last_first_token = float("-inf")
    for t_send, first_token, i in sent:
        out[i] = last_first_token > t_send
        last_first_token = max(last_first_token, first_token)
    return out


def gpu_means(run: Path, records: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    """The recording's NVML samples (gpu.jsonl.xz, batch 21 on) over its traffic (first send
    to last end in requests.jsonl), averaged: "busy" (the share of time a kernel ran, 0..1)
    and "pcie_to_host_mb_s" (MB/s the GPU sent: the stores, with offload on). None without
    samples, or none within the traffic."""
    path = run / "gpu.jsonl.xz"
    sent = [r for r in records if r.get("t_send") is not None and r.get("t_end") is not None]
    if not path.exists() or not sent:
        return None
    t0 = min(float(r["t_send"]) for r in sent)
    t1 = max(float(r["t_end"]) for r in sent)
    busy: list[float] = []
    tx: list[float] = []
    with lzma.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            x = json.loads(line)
            if "gpu_util" in x and t0 <= float(x["t"]) <= t1:
                busy.append(float(x["gpu_util"]))
                tx.append(float(x.get("pcie_tx_bytes_per_second") or 0.0))
    if not busy:
        return None
    return {
        "busy": round(sum(busy) / len(busy), 4),
        "pcie_to_host_mb_s": round(sum(tx) / len(tx) / 1e6, 1),
    }


def _ms(parts: dict[str, float] | None) -> dict[str, float] | None:
    return {k: round(v * 1e3, 2) for k, v in parts.items()} if parts is not None else None


def floor_share(meta: Mapping[str, Any], ms: Mapping[str, float] | None) -> float | None:
    """How near a recording's prefill ran to its compute floor: the exporter's computed-token
    floor (weight bytes over the GPU's dense peak) times the tokens a request computed, over
    vLLM's mean prefill time. Near 1 the steps are the GPU's; far below, the CPU's, or shared
    with other requests' (session 29: engines at 0.6 or more paid a quarter of a store's copy
    or less, docs/gpu-acceptance.md "What batches 23 to 25 measured"). None without the
    weight bytes, a GPU the floor knows, or a prefill time."""
    totals = meta.get("totals") or {}
    requests = int(totals.get("requests") or 0)
    computed = int(totals.get("prompt_tokens") or 0) - int(totals.get("cached_tokens") or 0)
    name = (meta.get("gpu") or {}).get("name")
    floor = computed_token_floor(meta.get("model_weight_bytes"), [name] if name else [])
    if floor is None or not ms or ms["prefill"] <= 0 or requests <= 0 or computed <= 0:
        return None
    return round(floor * computed / requests / (ms["prefill"] / 1e3), 3)


def table(root: Path = MATRIX, names: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per recording (every one under `root`, or `names`): "ms", its parts in milliseconds,
    "floor_share" where its meta.json allows (`floor_share`) and "gpu" where it has NVML
    samples (`gpu_means`); per offload run also "base" (its run without offload), "base_ms",
    "base_floor_share", "change_ms" and "spread" (who the saving went to, `spread`)."""
    metas = recording_metas(root, names)
    parts: dict[str, dict[str, float] | None] = {}

    def of(name: str) -> dict[str, float] | None:
        if name not in parts:
            parts[name] = _ms(latency_parts(*first_last_bodies(root / name)))
        return parts[name]

    out: dict[str, dict[str, Any]] = {}
    for name in names or sorted(metas):
        row: dict[str, Any] = {"ms": of(name)}
        share = floor_share(metas[name], row["ms"])
        if share is not None:
            row["floor_share"] = share
        if (root / name / "gpu.jsonl.xz").exists():
            row["gpu"] = gpu_means(root / name, matrixkit.load_requests(root / name))
        base = matrixkit.base_run(metas, name) if metas[name].get("offload") else None
        if base is not None:
            mine, theirs = row["ms"], of(base)
            row.update(base=base, base_ms=theirs)
            share = floor_share(metas[base], theirs)
            if share is not None:
                row["base_floor_share"] = share
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

    def gpu(g: Mapping[str, float] | None) -> list[str]:
        if not g:
            return ["-"] * 2
        return [f"{g['busy']:.1%}", f"{g['pcie_to_host_mb_s']:.0f}"]

    def who(sp: Mapping[str, Any] | None) -> list[str]:
        if not sp:
            return ["-"] * 6

        def each(key: str) -> str:
            ms = sp.get(f"{key}_saved_ms")
            return f"{ms:+.2f} ({sp[key]:.0f})" if ms is not None else "-"

        share = sp["others_share"]
        return [
            f"{sp['loaders']:.0f} of {sp['requests']:.0f}",
            f"{sp['loaders_saved_s']:.2f}",
            f"{sp['others_saved_s']:.2f}",
            f"{share:.0%}" if share is not None else "-",
            each("alone"),
            each("behind"),
        ]

    def near(share: float | None) -> str:
        return f"{share:.2f}" if share is not None else "-"

    header = [
        "run",
        *COLUMNS,
        "prefill at the compute floor",
        "base",
        *(f"change {k}" for k in COLUMNS),
        "loaders",
        "saved by loaders s",
        "saved by others s",
        "others' share",
        "others alone: ms saved each (n)",
        "others behind one: ms saved each (n)",
        "GPU busy (NVML)",
        "PCIe to host MB/s",
    ]
    body = [
        [
            name,
            *cells(r["ms"]),
            near(r.get("floor_share")),
            r.get("base", "-"),
            *cells(r.get("change_ms"), signed=True),
            *who(r.get("spread")),
            *gpu(r.get("gpu")),
        ]
        for name, r in rows.items()
    ]
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> int:
    return recordings_main(__doc__, MATRIX, table, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
