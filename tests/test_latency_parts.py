"""bench/latency_parts.py: vLLM's per-request queue / prefill / TTFT means and the rest
("pre"), per recording and against its run without offload."""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

import pytest

from bench import latency_parts
from bench.advice_eval import MATRIX
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
    table = latency_parts.markdown(rows)
    assert table.splitlines()[0].startswith("| run | queue | prefill | ttft | pre | base |")
    assert "| qwen3-32b-chat-graphs-cpu64k | 23.3 | 187.5 |" in table


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
