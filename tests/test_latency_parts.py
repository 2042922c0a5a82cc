"""bench/latency_parts.py: vLLM's per-request queue / prefill / TTFT means and the rest
("pre"), per recording and against its run without offload."""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path
from typing import Any

import pytest

from bench import latency_parts
from bench.advice_eval import MATRIX
from exporter.model.derive.compute import computed_token_floor
from exporter.vllm_metrics import SERIES


def _body(
    queue: tuple[float, float], prefill: tuple[float, float], ttft: tuple[float, float]
) -> str:
    """An exposition with each histogram split over two engines (sum, count halved), and a
    bucket line the parts must ignore."""
    lines = []
    for part, (s, n) in zip(latency_parts.PARTS.values(), (queue, prefill, ttft), strict=True):
        lines.append(f"# TYPE {part} histogram")
        for engine in ("0", "1"):
            labels = f'{{engine="{engine}",model_name="m"}}'
            lines.append(f'{part}_bucket{{engine="{engine}",le="+Inf",model_name="m"}} {n / 2}')
            lines.append(f"{part}_sum{labels} {s / 2}")
            lines.append(f"{part}_count{labels} {n / 2}")
    return "\n".join(lines) + "\n"


def test_the_parts_are_histograms_the_exporter_knows() -> None:
    for name in latency_parts.PARTS.values():
        assert SERIES[name].type == "histogram", name


def test_a_ttft_splits_into_queue_prefill_and_the_rest() -> None:
    first = _body((1.0, 10), (2.0, 10), (4.0, 10))
    last = _body((1.5, 20), (4.0, 20), (8.0, 20))
    parts = latency_parts.latency_parts(first, last)
    assert parts == pytest.approx({"queue": 0.05, "prefill": 0.2, "ttft": 0.4, "pre": 0.15})
    # Nothing finished between the two scrapes: no mean, rather than a zero.
    assert latency_parts.latency_parts(last, last) is None


def test_an_offload_run_is_compared_with_its_run_without_offload(tmp_path: Path) -> None:
    for name in ("qwen3-32b-chat-graphs-none", "qwen3-32b-chat-graphs-cpu64k"):
        shutil.copytree(MATRIX / name, tmp_path / name)
    rows = latency_parts.table(tmp_path)
    base, on = rows["qwen3-32b-chat-graphs-none"], rows["qwen3-32b-chat-graphs-cpu64k"]
    assert "base" not in base and on["base"] == "qwen3-32b-chat-graphs-none"
    assert on["base_ms"] == base["ms"]
    # What the H200 measured (session 23): the loads waited in vLLM's queue, the hits cut
    # prefill time, and the arrivals waited out shorter steps.
    change = on["change_ms"]
    assert change["queue"] > 10 and change["prefill"] < -100 and change["pre"] < -20
    for row in (base["ms"], on["ms"]):
        assert row["pre"] == pytest.approx(row["ttft"] - row["queue"] - row["prefill"], abs=0.02)
    # Who the saving went to: the 154 requests that loaded, and the rest, which waited on
    # shorter steps (session 24: most of the saving at this size).
    sp = on["spread"]
    assert sp["requests"] == 526 and sp["loaders"] == 154 and sp["loaded_tokens"] > 0
    total = sp["loaders_saved_s"] + sp["others_saved_s"]
    assert sp["others_share"] == pytest.approx(sp["others_saved_s"] / total, abs=1e-3)
    assert sp["others_saved_s"] > sp["loaders_saved_s"] > 0
    assert "spread" not in base
    table = latency_parts.markdown(rows)
    assert table.splitlines()[0].startswith(
        "| run | queue | prefill | ttft | pre | prefill at the compute floor | base |"
    )
    # 32B with graphs on an H200: its prefill within a factor of the floor either way.
    assert 0.1 < base["floor_share"] < 1 and on["base_floor_share"] == base["floor_share"]
    assert "| saved by others s | others' share |" in table.splitlines()[0]
    assert "| qwen3-32b-chat-graphs-cpu64k | 23.3 | 187.5 |" in table
    assert "| 154 of 526 |" in table
    assert table.splitlines()[0].endswith(
        "| others alone: ms saved each (n) | others behind one: ms saved each (n) "
        "| GPU busy (NVML) | PCIe to host MB/s |"
    )
    assert table.splitlines()[2].endswith("| - | - |")  # recorded without NVML samples


def test_a_store_costs_small_shapes_on_every_request_and_32b_none() -> None:
    """Batch 21 (session 27): on unique prompts nothing loads, so what offload changes is
    the stores'. Served with CUDA graphs, 0.6B and 8B pay a few milliseconds on the requests
    that arrived with nothing ahead of them as on the rest, which no queue explains; 32B
    unique (eager) pays about nothing on either."""
    rows = latency_parts.table(
        MATRIX,
        [
            "qwen3-8b-unique-graphs-cpu64k",
            "qwen3-0.6b-unique-graphs-cpu64k",
            "qwen3-32b-unique-cpu64k",
        ],
    )
    for name in ("qwen3-8b-unique-graphs-cpu64k", "qwen3-0.6b-unique-graphs-cpu64k"):
        sp = rows[name]["spread"]
        assert sp["loaders"] == 0 and sp["alone"] > sp["behind"] > 50
        assert sp["alone_saved_ms"] < -2.0 and sp["behind_saved_ms"] < -2.0
        # Inside vLLM's prefill time, the engine's steps, not the queue before them.
        change = rows[name]["change_ms"]
        assert change["prefill"] > 2.0 and abs(change["queue"]) < 0.5
    big = rows["qwen3-32b-unique-cpu64k"]["spread"]
    assert abs(big["alone_saved_ms"]) < 1.0 and abs(big["behind_saved_ms"]) < 1.0
    # NVML beside the graphs runs: a GPU mostly idle, and the stores' bytes on the link
    # (4,247 prompt tokens/s at 144 KiB a token on 8B: 626 MB/s).
    eight = rows["qwen3-8b-unique-graphs-cpu64k"]["gpu"]
    assert eight["busy"] < 0.2 and 500 < eight["pcie_to_host_mb_s"] < 1000
    assert "gpu" not in rows["qwen3-32b-unique-cpu64k"]  # recorded before the sampler
    without = latency_parts.table(MATRIX, ["qwen3-8b-unique-graphs-none"])
    assert without["qwen3-8b-unique-graphs-none"]["gpu"]["pcie_to_host_mb_s"] < 10
    assert latency_parts.gpu_means(MATRIX / "qwen3-8b-unique-graphs-none", []) is None


def _store_paid(rows: dict[str, dict[str, Any]], name: str) -> float:
    """What a request arriving alone paid for the stores, as a share of its prompt's copy
    time: the recording's own KV bytes a token and link bandwidth (NVML), over the prompt
    tokens a request sent."""
    meta = json.loads((MATRIX / name / "meta.json").read_text())
    sequence = meta["workload"]["sequence"]
    per_request = sequence["prompt_tokens"] / sequence["requests"]
    copy_ms = 1e3 * per_request * meta["kv_bytes_per_token"]
    copy_ms /= meta["link_bandwidth_bytes_per_second"]
    sp = rows[name]["spread"]
    assert sp["loaders"] == 0
    return float(-sp["alone_saved_ms"] / copy_ms)


def _stores_paid(
    names: list[str],
) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """latency_parts' rows of the recordings, and each one's `_store_paid`."""
    rows = latency_parts.table(MATRIX, names)
    return rows, {name: _store_paid(rows, name) for name in names}


def test_an_idle_32b_engine_still_hides_most_of_a_store() -> None:
    """Batch 22 (session 28): 32B unique prompts at a quarter of the rate, the engine idle
    between requests. Its requests that arrived alone paid well under their prompt's copy
    time, where the smaller shapes' on batch 21's host paid more than theirs: not a busy
    engine hides a 32B store (batches 23 and 24, below: nor the shape)."""
    names = [
        "qwen3-32b-unique-idle-cpu64k",
        "qwen3-8b-unique-graphs-cpu64k",
        "qwen3-0.6b-unique-graphs-cpu64k",
    ]
    rows, paid = _stores_paid(names)
    idle = rows["qwen3-32b-unique-idle-cpu64k"]
    # Idle: most requests arrived alone, the GPU busy a small part of the time.
    assert idle["spread"]["alone"] > 4 * idle["spread"]["behind"]
    assert idle["gpu"]["busy"] < 0.2
    assert 0 < paid["qwen3-32b-unique-idle-cpu64k"] < 0.5
    assert paid["qwen3-8b-unique-graphs-cpu64k"] > 1.0
    assert paid["qwen3-0.6b-unique-graphs-cpu64k"] > 1.0


def test_the_part_of_a_store_paid_follows_neither_the_shape_nor_its_prefill_time() -> None:
    """Batches 23 and 24 (session 29, one H100 host): 14B and 8B on the same unique prompts.
    Were the part of a store a request pays set by how long the shape's prefill takes a
    token, 8B would pay more of its copy than 14B and 14B more than 32B; 8B pays more than
    14B, but 32B (batch 22, an H200 host) more than both, and 8B on this host a small part
    of what batch 21's H200 host made it pay at four times the rate: no rule by shape, which
    is why the what-if still charges the copy time (docs/gpu-acceptance.md, "What batches 23
    to 25 measured")."""
    names = [
        "qwen3-8b-unique-idle-cpu64k",
        "qwen3-14b-unique-idle-cpu64k",
        "qwen3-14b-unique-cpu64k",
        "qwen3-32b-unique-idle-cpu64k",
        "qwen3-8b-unique-cpu64k",
    ]
    rows, paid = _stores_paid(names)
    cards = {
        name: json.loads((MATRIX / name / "meta.json").read_text())["gpu"]["name"] for name in names
    }
    h100 = names[:3]
    assert {cards[n] for n in h100} == {"NVIDIA H100 80GB HBM3"}
    assert {cards[n] for n in names[3:]} == {"NVIDIA H200"}
    assert (
        len({json.loads((MATRIX / n / "meta.json").read_text())["gpu"]["uuid"] for n in h100}) == 1
    )

    def prefill_us_a_token(name: str) -> float:
        base = rows[name]["base"]
        sequence = json.loads((MATRIX / base / "meta.json").read_text())["workload"]["sequence"]
        return float(
            1e3
            * rows[name]["base_ms"]["prefill"]
            * sequence["requests"]
            / sequence["prompt_tokens"]
        )

    idle = [
        "qwen3-8b-unique-idle-cpu64k",
        "qwen3-14b-unique-idle-cpu64k",
        "qwen3-32b-unique-idle-cpu64k",
    ]
    # Prefill per token orders the shapes 8B < 14B < 32B ...
    assert [prefill_us_a_token(n) for n in idle] == sorted(prefill_us_a_token(n) for n in idle)
    # ... and the part of its copy a lone request paid does not fall along it.
    assert paid["qwen3-8b-unique-idle-cpu64k"] > paid["qwen3-14b-unique-idle-cpu64k"]
    assert paid["qwen3-32b-unique-idle-cpu64k"] > paid["qwen3-14b-unique-idle-cpu64k"]
    # Every one of them paid well under its copy; 8B on the H200 host at four times the rate
    # paid more than its copy, over five times what it paid here.
    assert all(0 < paid[n] < 0.5 for n in [*idle, "qwen3-14b-unique-cpu64k"])
    assert paid["qwen3-8b-unique-cpu64k"] > max(1.0, 5 * paid["qwen3-8b-unique-idle-cpu64k"])


def test_a_busy_8b_engine_paid_more_of_a_store_than_an_idle_one_on_either_card() -> None:
    """Batch 25 (session 30): batch 21's 8B pair at 4 requests/s again, on an H100 host
    (another than batch 24's). A lone request paid about three times the part it paid at 1
    request/s (batch 24), as much as the H200's other 8B pair at that rate (27 GiB against
    its control), and a third of what batch 21's pair paid: the rate raises the part, the
    card type does not set it, and batch 21's two copies were that pair's
    (docs/gpu-acceptance.md, "What batches 23 to 25 measured")."""
    names = [
        "qwen3-8b-unique-idle-cpu64k",
        "qwen3-8b-unique-cpu64k-rep",
        "qwen3-8b-unique-cpu192k",
        "qwen3-8b-unique-cpu64k",
    ]
    _, paid = _stores_paid(names)
    gpus = {name: json.loads((MATRIX / name / "meta.json").read_text())["gpu"] for name in names}
    assert [gpus[n]["name"] for n in names] == ["NVIDIA H100 80GB HBM3"] * 2 + ["NVIDIA H200"] * 2
    assert len({gpus[n]["uuid"] for n in names}) == 4
    idle, busy, other, first = (paid[n] for n in names)
    assert 2 * idle < busy < first / 2
    assert other == pytest.approx(busy, rel=0.2)


def test_in_eager_bursts_the_requests_that_loaded_saved_themselves_nothing() -> None:
    """Batch 26 (session 30) and the 8B bursts before it: twelve requests sent at once, of
    which about one in five loads an evicted prefix with the tier on. Served eager, what
    offload saved went to the requests that loaded nothing (shorter shared steps), and a
    request that loaded saved itself a few ms or lost them, on either card; served with CUDA
    graphs each saved itself more than any eager one. The what-if charges a load the same
    wait in both (view.StepSharing.load_wait_share) and so over-predicts the eager bursts
    (+0.101 s/s for the +0.046 batch 26 measured; docs/gpu-acceptance.md, "The eager 8B
    bursts again")."""
    eager = [
        "qwen3-8b-concurrent-cpu16g-rep",
        "qwen3-8b-concurrent-cpu16g",
        "qwen3-8b-concurrent-cpu64k",
        "qwen3-8b-concurrent-cpu192k",
    ]
    graphs = [
        "qwen3-8b-concurrent-graphs-cpu16g",
        "qwen3-8b-concurrent-graphs-cpu64k",
        "qwen3-8b-concurrent-graphs-cpu192k",
    ]
    rows = latency_parts.table(MATRIX, eager + graphs)
    each: dict[str, float] = {}
    for name in eager + graphs:
        sp = rows[name]["spread"]
        assert sp["loaders"] > 0.15 * sp["requests"]
        each[name] = 1e3 * sp["loaders_saved_s"] / sp["loaders"]
    assert max(each[n] for n in eager) < min(each[n] for n in graphs)
    assert all(abs(each[n]) < 25 for n in eager)
    # Eager, the others took (nearly) all of it where offload paid.
    paying = [n for n in eager if rows[n]["spread"]["others_saved_s"] > 1.0]
    assert len(paying) == 3
    assert all(rows[n]["spread"]["others_share"] > 0.9 for n in paying)


def _req(
    i: int, ttft: float, cached: int, status: int = 200, sent: float | None = None
) -> dict[str, object]:
    r: dict[str, object] = {"i": i, "ttft_s": ttft, "cached_tokens": cached, "status": status}
    if sent is not None:
        r["t_send"] = sent
    return r


def test_the_saving_splits_between_the_requests_that_loaded_and_the_rest() -> None:
    # Sent at 0, 0.5 (the first still waits for its first token until 1.0), 2 and 3.
    base = [
        _req(0, 1.0, 0, sent=0.0),
        _req(1, 0.5, 256, sent=0.5),
        _req(2, 0.4, 0, sent=2.0),
        _req(3, 9.0, 0, sent=3.0),
    ]
    offload = [
        _req(0, 0.4, 512),  # loaded 512 tokens more: saved 0.6 s
        _req(1, 0.3, 256),  # the same hits as without offload: shorter waits, 0.2 s
        _req(2, 0.5, 0),  # slower by 0.1 s
        _req(3, 1.0, 0, status=500),  # failed with offload: not matched
        _req(4, 1.0, 0),  # not in the run without offload
    ]
    sp = latency_parts.spread(base, offload)
    assert sp == {
        "requests": 3.0,
        "loaders": 1.0,
        "loaded_tokens": 512.0,
        "loaders_saved_s": pytest.approx(0.6),
        "others_saved_s": pytest.approx(0.1),
        "others_share": pytest.approx(0.1 / 0.7, abs=1e-4),
        # Of the others, request 2 arrived alone (slower by 100 ms), request 1 behind 0.
        "alone": 1.0,
        "alone_saved_ms": pytest.approx(-100.0),
        "behind": 1.0,
        "behind_saved_ms": pytest.approx(200.0),
    }
    # Records without send times: the split is unknown, not zero.
    unsent = [{k: v for k, v in r.items() if k != "t_send"} for r in base]
    sp = latency_parts.spread(unsent, offload)
    assert sp is not None and sp["alone"] == sp["behind"] == 0.0
    assert sp["alone_saved_ms"] is None and sp["behind_saved_ms"] is None
    # Offload cost: no share of a saving to speak of.
    slower = [_req(0, 1.1, 512), _req(1, 0.6, 256), _req(2, 0.4, 0)]
    assert latency_parts.spread(base, slower)["others_share"] is None  # type: ignore[index]
    assert latency_parts.spread(base, []) is None


def test_a_recording_without_a_finished_request_has_no_parts(tmp_path: Path) -> None:
    run = tmp_path / "qwen3-0.6b-unique-none"
    run.mkdir()
    (run / "meta.json").write_text(json.dumps({"pair": "p", "offload": None}))
    body = _body((0.0, 3), (0.0, 3), (0.0, 3))
    with lzma.open(run / "metrics.jsonl.xz", "wt") as fh:
        for t in (0.0, 1.0):
            fh.write(json.dumps({"t": t, "body": body}) + "\n")
    assert latency_parts.table(tmp_path) == {"qwen3-0.6b-unique-none": {"ms": None}}
    with pytest.raises(SystemExit, match="no recording named nope"):
        latency_parts.table(tmp_path, ["nope"])


def test_the_command_prints_json_or_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert latency_parts.main([str(MATRIX), "qwen3-32b-chat-graphs-cpu64k", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert list(rows) == ["qwen3-32b-chat-graphs-cpu64k"]
    assert rows["qwen3-32b-chat-graphs-cpu64k"]["base"] == "qwen3-32b-chat-graphs-none"
    assert latency_parts.main([str(MATRIX), "qwen3-32b-chat-graphs-none"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[2].startswith("| qwen3-32b-chat-graphs-none | 0.2 | 327.3 |")


def test_engines_near_their_compute_floor_paid_a_small_part_of_a_store() -> None:
    """The table in docs/gpu-acceptance.md ("What batches 23 to 25 measured"): on every
    unique-prompt pair, how near its run without offload prefilled to its compute floor (the
    exporter's computed-token floor from meta.json's weight bytes and GPU, over vLLM's
    prefill time) against what a lone request then paid for the stores. Near the floor
    every engine paid well under its copy, on either card; further from it the part paid
    ranges from nothing to several copies (0.6B's at a twentieth of the floor among them),
    so the quotient bounds a store's price near the floor and says nothing below it."""
    names = sorted(
        d.name
        for d in MATRIX.iterdir()
        if "-unique-" in d.name
        and (d / "meta.json").is_file()
        and json.loads((d / "meta.json").read_text()).get("offload") is not None
    )
    assert len(names) >= 13
    rows, paid = _stores_paid(names)
    near = {name: rows[name]["base_floor_share"] for name in names}
    for name in names:
        # The same quotient by hand: the floor from meta.json's weight bytes and GPU, the
        # tokens a request computed (unique prompts: all it sent), vLLM's prefill time.
        meta = json.loads((MATRIX / rows[name]["base"] / "meta.json").read_text())
        sequence = meta["workload"]["sequence"]
        floor = computed_token_floor(meta["model_weight_bytes"], [meta["gpu"]["name"]])
        assert floor is not None
        per_request_s = floor * sequence["prompt_tokens"] / sequence["requests"]
        by_hand = per_request_s / (rows[name]["base_ms"]["prefill"] / 1e3)
        assert near[name] == pytest.approx(by_hand, abs=0.002)
    close = [n for n in names if near[n] >= 0.6]
    below = [n for n in names if near[n] < 0.6]
    assert len(close) >= 4 and len(below) >= 9
    assert {json.loads((MATRIX / n / "meta.json").read_text())["gpu"]["name"] for n in close} == {
        "NVIDIA H100 80GB HBM3",
        "NVIDIA H200",
    }
    assert max(paid[n] for n in close) < 0.5
    # Below it, no order: the farthest (0.6B) and the middle (8B, 32B) each hold a pair that
    # paid under its copy and one that paid over it.
    for group in ([n for n in below if near[n] < 0.1], [n for n in below if near[n] >= 0.1]):
        assert min(paid[n] for n in group) < 1.0 < max(paid[n] for n in group)
