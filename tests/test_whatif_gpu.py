"""Ground truth: predictions from a no-offload run against the observed offload runs.

Every experiment under tests/fixtures/gpu/ (layout in bench/whatif_vs_observed.py and
docs/whatif.md; recorded on an H200 with vLLM 0.26.0, see tests/fixtures/gpu/README.md) must
be predicted within 0.01 absolute at every recorded buffer size, policy and store threshold.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from bench.whatif_vs_observed import (
    GPU,
    TARGET,
    counters,
    experiment,
    experiments,
    observed,
    read_messages,
    table,
)
from exporter.kvevents_codec import MEDIUM_CPU, BlockRemoved, BlockStored, encode_record
from exporter.model.whatif.simulator import TraceBuilder, VllmCpuTier, blocks_for_bytes
from tests.test_whatif_synth import abcab_messages

FIXTURES = Path(__file__).parent / "fixtures"
H200 = FIXTURES / "vllm-0.26.0-h200"
EXPERIMENTS = experiments(GPU)


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


def test_gpu_experiments_are_recorded() -> None:
    names = {p.name for p in EXPERIMENTS}
    assert {"small-eager-W1", "small-eager-W2", "large-eager-W1", "large-eager-W2"} <= names


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.name for p in EXPERIMENTS])
def test_prediction_matches_observed_offload_runs(path: Path) -> None:
    rows = experiment(path, seeds=8)
    modelled = [r for r in rows if r.modelled]
    assert modelled, "the experiment has no offload run the model covers"
    bad = [r for r in modelled if r.error > TARGET]
    assert not bad, "\n" + table(rows)
    # The observed share is what vLLM's own counters say, not a number copied into run.json.
    for r in modelled:
        ext, prompt = observed(path / r.label)
        assert r.observed == ext / prompt
        assert r.predicted_min - 1e-9 <= r.predicted <= r.predicted_max + 1e-9


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.name for p in EXPERIMENTS])
def test_experiment_inputs_match_the_recordings(path: Path) -> None:
    """What the comparison takes as given, checked against the raw recordings."""
    spec = json.loads((path / "run.json").read_text())
    base = spec["runs"][0]
    assert "offload_bytes" not in base
    msgs = read_messages(path / base["dir"] / "kv-events.jsonl")
    # The no-offload stream is complete: no sequence gap from the server's first batch on.
    seqs = [m.seq for m in msgs]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert not any(
        ev.medium == MEDIUM_CPU
        for m in msgs
        for ev in m.batch.events
        if isinstance(ev, BlockStored | BlockRemoved)
    )
    t0, t1 = base["count"]
    a, b = base["workload_window"]
    assert t0 < a and b < t1  # every batch of the workload is counted
    block_size = {
        ev.block_size for m in msgs for ev in m.batch.events if isinstance(ev, BlockStored)
    }
    assert block_size == {spec["block_size"]}
    _, prompt = observed(path / base["dir"])
    for run in spec["runs"][1:]:
        # Same prompts in every run (fixed seeds): the same prompt-token count.
        assert observed(path / run["dir"])[1] == prompt
        # The CPU pool the model is given is the one vLLM allocated: its CPU events never
        # hold more blocks, and they fill it (both workloads together outgrow every pool)
        # unless a store threshold keeps most blocks out.
        data = path / run["data"]
        events = data / "kv_events.jsonl"
        resident: set[int] = set()
        peak = 0
        for m in read_messages(events):
            for ev in m.batch.events:
                if isinstance(ev, BlockStored | BlockRemoved) and ev.medium == MEDIUM_CPU:
                    if isinstance(ev, BlockStored):
                        resident.update(ev.hashes)
                    else:
                        resident.difference_update(ev.hashes)
                    peak = max(peak, len(resident))
        capacity = blocks_for_bytes(run["offload_bytes"], spec["kv_bytes_per_block"])
        if run.get("store_threshold"):
            assert 0 < peak <= capacity  # only blocks looked up twice are stored
        else:
            assert peak == capacity


def _runs_by_server() -> list[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """(experiment, spec, offload run) once per recorded offload server."""
    seen: set[str] = set()
    out = []
    for path in EXPERIMENTS:
        spec = json.loads((path / "run.json").read_text())
        for run in spec["runs"][1:]:
            if run.get("whatif", True) is False or run["data"] in seen:
                continue
            seen.add(run["data"])
            out.append((path, spec, run))
    return out


SERVERS = _runs_by_server()


@pytest.mark.parametrize(("path", "spec", "run"), SERVERS, ids=[s[2]["config"] for s in SERVERS])
def test_simulated_tier_stores_and_loads_what_vllm_did(
    path: Path, spec: dict[str, Any], run: dict[str, Any]
) -> None:
    """Beyond the hit share: the blocks the simulated tier stores and loads and its failed
    allocations over the whole server run, against vLLM's own CPU events, load bytes and
    allocation-failure counter, within the spread of set orders."""
    msgs = read_messages(path / spec["runs"][0]["dir"] / "kv-events.jsonl")
    data = path / run["data"]
    stored = sum(
        len(ev.hashes)
        for m in read_messages(data / "kv_events.jsonl")
        for ev in m.batch.events
        if isinstance(ev, BlockStored) and ev.medium == MEDIUM_CPU
    )
    before, after = (
        counters(data / "metrics_before_W1.prom"),
        counters(data / "metrics_after_W2.prom"),
    )
    loaded = (after.get("load_bytes", 0.0) - before.get("load_bytes", 0.0)) / spec[
        "kv_bytes_per_block"
    ]
    capacity = blocks_for_bytes(run["offload_bytes"], spec["kv_bytes_per_block"])
    sims = []
    for seed in range(16):
        tier = VllmCpuTier(
            capacity,
            policy=run.get("eviction_policy", "lru"),
            store_threshold=int(run.get("store_threshold", 0)),
            seed=seed,
        )
        builder = TraceBuilder()
        for m in msgs:
            tier.process_batch(m.batch.ts, builder.process(m.batch, m.seq))
        tier.finish()
        sims.append((tier.stores, tier.loads, tier.allocation_failures))
    failures = after.get("alloc_failures", 0.0) - before.get("alloc_failures", 0.0)
    for i, seen in enumerate((stored, loaded, failures)):
        assert min(s[i] for s in sims) <= seen <= max(s[i] for s in sims), (seen, sims)
