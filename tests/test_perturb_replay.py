"""bench/perturb_replay.py: recordings with scrapes or KV-event messages lost, replayed and
judged beside the recording as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import perturb_replay
from bench.advice_eval import MATRIX, Truths
from exporter.config import Config
from exporter.recording import KV_EVENTS, METRICS, read_scrapes
from exporter.replay import replay_one

RUN = MATRIX / "qwen3-0.6b-long-context-none"
ON = "qwen3-0.6b-long-context-cpu64k"


def test_a_perturbed_copy_drops_lines_of_one_file_the_same_way_for_a_seed(
    tmp_path: Path,
) -> None:
    scrapes = read_scrapes(RUN)
    a = perturb_replay.perturbed(RUN, tmp_path / "a", METRICS, 0.1, seed=7)
    b = perturb_replay.perturbed(RUN, tmp_path / "b", METRICS, 0.1, seed=7)
    c = perturb_replay.perturbed(RUN, tmp_path / "c", METRICS, 0.1, seed=8)
    kept = [s.t for s in read_scrapes(a)]
    assert kept == [s.t for s in read_scrapes(b)] != [s.t for s in read_scrapes(c)]
    assert 0 < len(scrapes) - len(kept) < len(scrapes) // 2
    assert set(kept) < {s.t for s in scrapes}
    # Every other file is there as it was.
    for name in ("meta.json", f"{KV_EVENTS}.xz"):
        assert (a / name).read_bytes() == (RUN / name).read_bytes()
    none = perturb_replay.perturbed(RUN, tmp_path / "none", METRICS, 0.0, seed=7)
    assert [s.t for s in read_scrapes(none)] == [s.t for s in scrapes]


def test_events_dropped_leave_the_what_if_fewer_blocks(tmp_path: Path) -> None:
    """A message lost is a step's blocks the what-if never saw: fewer evicted prefixes
    recomputed (a block it never saw stored is new, not recomputed)."""
    lossy = perturb_replay.perturbed(RUN, tmp_path, KV_EVENTS, 0.3, seed=7)

    def final(rec: Path):  # type: ignore[no-untyped-def]
        r = replay_one(rec, Config())
        (e,) = (x for t in r.final.targets for x in t.engines)
        assert e.whatif is not None
        return e

    lost, whole = final(lossy), final(RUN)
    seen, all_seen = (e.whatif.recomputed_after_eviction_tokens for e in (lost, whole))
    assert 0 < seen < all_seen
    # The sequence numbers tell the what-if what it missed, and the advice says so.
    assert whole.advice.numbers["kv_event_batches_lost_ratio"] == 0.0
    assert 0.2 < lost.advice.numbers["kv_event_batches_lost_ratio"] < 0.4
    assert "KV-event batches were lost" in lost.advice.explanation
    assert "were lost" not in whole.advice.explanation


def test_the_command_judges_each_replay_against_the_measured_truth(capsys) -> None:  # type: ignore[no-untyped-def]
    assert perturb_replay.main([str(MATRIX), RUN.name, ON, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["mode"]: r for r in doc["summary"]}
    assert list(rows) == list(perturb_replay.MODES)
    base = rows["as recorded"]
    assert base["runs"] == 2 and base["same_as_recorded"] == 2 and base["changed"] == []
    truths = Truths(MATRIX)
    size = json.loads((MATRIX / ON / "meta.json").read_text())["offload"]["size_gib"] * (1 << 30)
    verdict = truths.measured_at(ON)[size]["verdict"]  # its family's pair of its size
    assert verdict in ("pays", "neutral", "costs")
    judged = 0
    for o in doc["runs"]:
        if o["mode"] == "as recorded":
            r = replay_one(MATRIX / o["run"], Config())
            (e,) = (x for t in r.final.targets for x in t.engines)
            assert (o["action"], o["reason"]) == (str(e.advice.action), str(e.advice.reason))
        # Unless it grows or shrinks, the offload run's advice speaks about its own size.
        if o["run"] == ON and o["action"] not in ("grow_buffer", "shrink_buffer"):
            assert o["truth"] == verdict
            assert o["harmful"] == (
                (o["action"] == "disable_offload" and verdict == "pays")
                or (o["action"] == "keep" and verdict == "costs")
            )
            judged += 1
    assert judged == 3


@pytest.mark.parametrize("share", ["1.0", "-0.1"])
def test_a_share_outside_0_to_1_is_a_usage_error(share: str) -> None:
    with pytest.raises(SystemExit) as e:
        perturb_replay.main([str(MATRIX), RUN.name, "--drop-events", share])
    assert e.value.code == 2
