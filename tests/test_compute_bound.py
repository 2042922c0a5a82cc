"""bench/compute_bound.py: a computed token's floor from the weights and the GPU's peak,
against what the real-GPU matrix measured (docs/gpu-acceptance.md, "A computed token's
floor")."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from bench.compute_bound import GIB, measure, rows, summary, table
from bench.store_cost import MATRIX
from exporter.recording import read_meta
from exporter.thresholds import Thresholds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "gpu"))
import matrixkit as mk  # type: ignore[import-not-found]  # bench/gpu holds scripts


@pytest.fixture(scope="module")
def matrix_rows():  # type: ignore[no-untyped-def]
    return rows()


def test_the_weights_come_from_vllms_loading_line() -> None:
    log = (MATRIX / "qwen3-14b-chat-cpu16g" / "server_log.txt").read_text()
    assert mk.weight_bytes(log) == pytest.approx(27.52 * GIB)
    assert mk.weight_bytes("INFO nothing about the model\n") is None
    # Every recording's meta.json carries what its own log says (bench/gpu/matrix.py finalize).
    for meta in sorted(MATRIX.glob("*/meta.json")):
        log = (meta.parent / "server_log.txt").read_text(errors="replace")
        assert read_meta(meta.parent).model_weight_bytes == mk.weight_bytes(log), meta.parent.name


def test_the_floor_lies_above_a_measured_interval_only_by_chance(matrix_rows) -> None:  # type: ignore[no-untyped-def]
    """Physics: a computed token costs at least its weight FLOPs at the GPU's peak. Where the
    run without offload measures that cost (its fit significant), the floor is at or below
    the upper end of its interval; on RAG-Zipf the fit's point estimate is below the floor
    (14B: 26.1 +- 4.0 us against 29.9), so the fits err low there, not the floor high. The
    intervals are +- 2 standard errors (~95 %), so one in twenty may miss by chance: at most
    5 % of the pairs (since session 17 one of 34, the 14B RAG-Zipf control, 21.0 +- 8.2 us)."""
    s = summary(matrix_rows)
    assert s.floor_checked >= 25
    assert len(s.floor_above_the_baseline_interval) <= math.ceil(0.05 * s.floor_checked)


def test_what_the_floor_proves_never_costs(matrix_rows) -> None:  # type: ignore[no-untyped-def]
    """A saving proven by the floor, net of the stores at store_cost_factor_max times their
    copy time, is never a run whose pair measured a cost; and it decides runs the window's
    own fit leaves open (chat with a tier that holds the histories: a computed token's cost
    is not identified there, a loaded one's is)."""
    s = summary(matrix_rows)
    assert s.proves_a_saving_where_it_costs == []
    proven = set(s.proves_a_saving)
    by_run = {r.run: r for r in matrix_rows}
    chat = by_run["qwen3-14b-chat-cpu192k"]
    assert chat.own_computed_us is not None and chat.own_computed_stderr_us is not None
    assert chat.own_computed_us - 2 * chat.own_computed_stderr_us <= 0  # unidentified alone
    assert "qwen3-14b-chat-cpu192k" in proven and chat.truth == "pays"
    m = Thresholds().ttft_saving_material
    for r in matrix_rows:
        if r.net_share_at_least is not None and r.net_share_at_least >= m:
            assert r.truth in ("pays", "neutral"), r
    assert "| qwen3-14b-chat-cpu192k |" in table(matrix_rows)


def test_an_unknown_gpu_or_a_log_without_the_weights_gives_no_floor(tmp_path: Path) -> None:
    """No peak for the GPU's name, or no weights in meta.json: no floor and nothing proven,
    the rest of the row as measured."""
    for name in ("qwen3-14b-chat-cpu16g", "qwen3-14b-chat-none-ctl"):
        shutil.copytree(MATRIX / name, tmp_path / name)
    meta_path = tmp_path / "qwen3-14b-chat-cpu16g" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["gpu"]["name"] = "Some Future GPU"
    meta_path.write_text(json.dumps(meta))
    r = measure(tmp_path, "qwen3-14b-chat-cpu16g", "qwen3-14b-chat-none-ctl", "pays", 2.0)
    assert r.floor_us is None and r.saving_at_least_s is None and r.net_share_at_least is None
    assert r.baseline_us is not None and r.loaded_us is not None
    meta["gpu"]["name"] = "NVIDIA H200"
    del meta["model_weight_bytes"]
    meta_path.write_text(json.dumps(meta))
    r = measure(tmp_path, "qwen3-14b-chat-cpu16g", "qwen3-14b-chat-none-ctl", "pays", 2.0)
    assert r.weights_gib is None and r.floor_us is None
