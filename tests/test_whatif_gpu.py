"""Ground truth: predictions from a no-offload run against the observed offload runs.

Every experiment under tests/fixtures/gpu/ (layout in bench/whatif_vs_observed.py and
docs/whatif.md) must be predicted within 0.01 absolute at every recorded buffer size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.whatif_vs_observed import experiment, table
from exporter.kvevents_codec import encode_record
from tests.test_whatif_synth import abcab_messages

FIXTURES = Path(__file__).parent / "fixtures"
H200 = FIXTURES / "vllm-0.26.0-h200"
EXPERIMENTS = sorted(p.parent for p in (FIXTURES / "gpu").glob("*/run.json"))


def test_comparison_pipeline_on_the_h200_recording(tmp_path: Path) -> None:
    """The experiment layout end to end, built from the H200 fixtures we have today."""
    base = tmp_path / "nooffload"
    base.mkdir()
    (base / "kv-events.jsonl").write_text(
        "".join(encode_record(m) + "\n" for m in abcab_messages())
    )
    for name in ("metrics_before.txt", "metrics_after.txt"):
        shutil.copy(H200 / "a_nooffload" / name, base / name)
    shutil.copytree(H200 / "b_offload", tmp_path / "offload-0.5GiB")
    (tmp_path / "run.json").write_text(
        json.dumps(
            {
                "block_size": 16,
                "kv_bytes_per_block": 1_835_008,
                "runs": [
                    {"dir": "nooffload"},
                    {"dir": "offload-0.5GiB", "offload_bytes": 1 << 29},
                ],
            }
        )
    )
    (row,) = experiment(tmp_path, seeds=4)
    assert row.blocks == 292
    assert row.observed == pytest.approx(7360 / 40000)
    assert row.error <= 0.01
    assert "| offload-0.5GiB | 0.5 GiB | 292 |" in table([row])


@pytest.mark.skipif(not EXPERIMENTS, reason="no GPU experiments recorded in tests/fixtures/gpu")
@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.name for p in EXPERIMENTS])
def test_prediction_matches_observed_offload_runs(path: Path) -> None:
    rows = experiment(path, seeds=8)
    assert rows, "the experiment has no offload run"
    bad = [r for r in rows if r.error > 0.01]
    assert not bad, "\n" + table(rows)
