"""`kv-offload-exporter replay`: a recording through the whole pipeline on its own clock, and
`--record` writing what replay reads."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from bench.advice_eval import _judge, _requests, matrixkit
from exporter.cli import main
from exporter.config import Config
from exporter.model.advisor.types import Action
from exporter.options import TargetConfig
from exporter.recording import Scrape, read_meta, read_scrapes
from exporter.replay import at_interval, recordings, replay_one
from exporter.runtime import Exporter, build_sources
from exporter.thresholds import DEFAULT
from testbed.replay import ReplayServer, Reply
from tests.nvml_doubles import FakeClock

GPU = Path(__file__).parent / "fixtures" / "gpu"
LARGE_B = GPU / "large-b"
MATRIX = GPU / "matrix"
GIB = 1 << 30


def recording_of(run: Path, dest: Path, *, meta: bool = True) -> Path:
    """A recording directory from a GPU acceptance run's files (the same formats)."""
    dest.mkdir(parents=True)
    shutil.copy(run / "vllm_metrics.jsonl.xz", dest / "metrics.jsonl.xz")
    shutil.copy(run / "kv_events.jsonl.xz", dest / "kv_events.jsonl.xz")
    if meta:
        info = json.loads((run / "run.json").read_text())
        cmd = (run / "cmd.txt").read_text().split("\n\n")[0].strip()
        argv = [p.strip("'") for p in re.findall(r"'[^']*'|\S+", cmd)]
        doc = {"vllm_argv": argv, "kv_bytes_per_token": info["kv_bytes_per_token"]}
        (dest / "meta.json").write_text(json.dumps(doc))
    return dest


def short_run_config(**kw: object) -> Config:
    # The recorded runs are 24-40 s long: decide after 15 s instead of the default 120.
    return replace(Config(thresholds=replace(DEFAULT, min_window_seconds=15)), **kw)  # type: ignore[arg-type]


def test_replay_of_a_recorded_offload_run_gives_its_timeline_and_curve(tmp_path: Path) -> None:
    rec = recording_of(LARGE_B, tmp_path / "large-b")
    r = replay_one(rec, short_run_config())
    assert r.scrapes == 25 and r.target == "large-b"
    first = r.timeline[0]
    assert (first.t, first.action, first.reason) == (0.0, "insufficient_data", "window_too_short")
    # Entries are changes only: no two consecutive entries of an engine are the same.
    pairs = list(zip(r.timeline, r.timeline[1:], strict=False))
    assert all(
        (a.action, a.reason, a.pending_action) != (b.action, b.reason, b.pending_action)
        or a.recommended_buffer_bytes != b.recommended_buffer_bytes
        for a, b in pairs
    )
    (engine,) = r.final.targets[0].engines
    assert engine.whatif is not None
    sizes = [p.cpu_buffer_bytes for p in engine.whatif.points]
    assert sizes == [float(b) for b in Config().whatif_sizes]
    ratios = [p.hit_ratio for p in engine.whatif.points]
    assert ratios == sorted(ratios) and ratios[-1] > 0  # a bigger LRU tier never hits less


def test_replay_reproduces_what_the_live_exporter_decided(tmp_path: Path) -> None:
    """The same bodies at the same times: the live exporter (recording with --record) and
    the replay of its recording reach the same advice at every cycle."""
    scrapes = read_scrapes(recording_of(LARGE_B, tmp_path / "src", meta=False))
    clock = FakeClock(scrapes[0].t)
    out = tmp_path / "recorded"
    with ReplayServer([Reply(body=(s.body or "").encode()) for s in scrapes]) as srv:
        cfg = short_run_config(
            targets=(TargetConfig(url=srv.url, name="live", kv_bytes_per_token=262144),),
            interval=1.0,
            nvml=False,
            procfs=False,
            cgroup=False,
            kv_events=False,
            record=str(out),
        )
        exporter = Exporter(cfg, build_sources(cfg, clock), clock=clock)

        async def drive() -> list[tuple[str, str]]:
            await exporter.start()
            seen = []
            try:
                for s in scrapes:
                    clock.t = s.t
                    await exporter.run_cycle()
                    seen += [(str(a.action), str(a.reason)) for _, a in exporter.advice["live"]]
            finally:
                await exporter.stop()
            return seen

        import asyncio

        live = asyncio.run(drive())
    recorded = read_scrapes(out)
    assert [s.t for s in recorded] == [s.t for s in scrapes]
    assert read_meta(out).vllm_argv is None  # procfs off: nothing to say about the command
    assert read_meta(out).kv_bytes_per_token == 262144
    cfg = short_run_config(kv_bytes_per_token=262144.0)
    r = replay_one(out, cfg)
    replayed = []
    last = None
    steps = iter(r.timeline)
    # Expand the change-only timeline back to one entry per cycle.
    pending = next(steps, None)
    for s in recorded:
        while pending is not None and pending.t <= s.t - recorded[0].t + 1e-9:
            last = (pending.action, pending.reason)
            pending = next(steps, None)
        replayed.append(last)
    assert replayed == live
    assert any(action != "insufficient_data" for action, _ in live)


def test_replay_json_document_has_the_specified_fields(tmp_path: Path, capsys) -> None:
    rec = recording_of(LARGE_B, tmp_path / "large-b")
    assert main(["replay", str(rec), "--json", "--threshold", "min_window_seconds=15"]) == 0
    doc = json.loads(capsys.readouterr().out)
    step_keys = {
        "t",
        "target",
        "model_name",
        "engine",
        "action",
        "reason",
        "recommended_buffer_bytes",
        "pending_action",
    }
    assert doc["timeline"] and all(set(s) == step_keys for s in doc["timeline"])
    (final,) = doc["final"]
    assert step_keys - {"t"} <= set(final)
    assert {"explanation", "numbers", "whatif"} <= set(final)
    assert final["action"] in {str(a) for a in Action}
    for point in final["whatif"]:
        assert set(point) == {
            "cpu_buffer_bytes",
            "offload_hit_ratio",
            "ttft_saved_seconds_per_second",
        }
    assert len(final["whatif"]) == len(Config().whatif_sizes)


def test_replay_flags_apply_as_live(tmp_path: Path) -> None:
    rec = recording_of(LARGE_B, tmp_path / "large-b")
    default = replay_one(rec, Config())
    # Default thresholds need 120 s of data: a 24 s recording never decides.
    assert {s.action for s in default.timeline} == {"insufficient_data"}
    sizes = (1 * GIB, 3 * GIB)
    custom = replay_one(rec, short_run_config(whatif_sizes=sizes))
    (engine,) = custom.final.targets[0].engines
    assert engine.whatif is not None
    assert [p.cpu_buffer_bytes for p in engine.whatif.points] == [float(s) for s in sizes]


def test_a_coarser_interval_replays_one_scrape_per_interval(tmp_path: Path, capsys) -> None:
    """What an exporter at --interval 5 would have collected from a recording made every
    second: scrapes that jitter around the cadence count as on time, a finer interval than
    the recording's keeps every scrape (it cannot invent any)."""
    jitter = (0.0, 0.02, -0.03, 0.01, 0.0, -0.02, 0.03, 0.0, 0.01, -0.01, 0.0, 0.02)
    scrapes = [Scrape(1000.0 + i + d, "") for i, d in enumerate(jitter)]
    assert [s.t - 1000 for s in at_interval(scrapes, 5.0)] == pytest.approx([0.0, 4.98, 10.0])
    assert at_interval(scrapes, 1.0) == scrapes and at_interval(scrapes, 0.2) == scrapes
    assert at_interval([], 5.0) == []
    rec = recording_of(LARGE_B, tmp_path / "large-b")
    every = replay_one(rec, short_run_config())
    coarse = replay_one(rec, short_run_config(interval=5.0))
    assert (every.scrapes, coarse.scrapes) == (25, 5)
    assert coarse.timeline[0].t == 0.0
    assert all(min(s.t % 5, 5 - s.t % 5) < 0.5 for s in coarse.timeline)
    flags = ["--interval", "5", "--threshold", "min_window_seconds=15"]
    assert main(["replay", str(rec), *flags]) == 0
    assert "large-b: 5 scrapes" in capsys.readouterr().out


def test_a_folder_of_recordings_replays_each(tmp_path: Path, capsys) -> None:
    recording_of(LARGE_B, tmp_path / "all" / "a")
    recording_of(LARGE_B, tmp_path / "all" / "b", meta=False)
    assert [p.name for p in recordings(tmp_path / "all")] == ["a", "b"]
    assert main(["replay", str(tmp_path / "all"), "--threshold", "min_window_seconds=15"]) == 0
    text = capsys.readouterr().out
    assert "a: 25 scrapes" in text and "b: 25 scrapes" in text


def test_without_kv_events_a_cache_that_turned_over_is_a_question_not_nothing_to_catch(
    tmp_path: Path,
) -> None:
    """32B multi-turn chat without offload, recorded without its KV events (vLLM publishes
    them only when asked): every request finishes at once, so the usage gauge reads 0 at the
    last scrape, yet the window computed many times what the GPU cache holds. The events
    are what tell whether those evicted prefixes come back (on this sequence they do, and
    offload paid), so the advice asks for them instead of saying there is nothing to catch."""
    run = MATRIX / "qwen3-32b-chat-none"
    rec = tmp_path / "no-events"
    rec.mkdir()
    for name in ("metrics.jsonl.xz", "meta.json"):
        shutil.copy(run / name, rec / name)
    r = replay_one(rec, Config())
    (engine,) = r.final.targets[0].engines
    a = engine.advice
    assert (a.action, a.reason) == (Action.INSUFFICIENT_DATA, "kv_events_off")
    n = a.numbers
    assert n["kv_cache_usage_ratio"] == 0.0 and n["gpu_cache_turnover"] is not None
    last = read_scrapes(rec)[-1].body
    (capacity,) = (float(v) for v in re.findall(r'kv_cache_size_tokens="(\d+)"', last))
    computed = n["prompt_tokens"] * (1.0 - n["gpu_prefix_hit_ratio"])  # offload off
    assert n["gpu_cache_turnover"] == pytest.approx(computed / capacity)
    assert n["gpu_cache_turnover"] > 1.0
    assert f"{n['gpu_cache_turnover']:.1f} times" in a.explanation


def test_bad_recordings_are_clear_errors(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["replay", str(empty)]) == 1
    assert "not a recording" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"t": 1.0, "body": "x"}\n')
    (bad / "meta.json").write_text('{"vllm_argv": "vllm serve"}')
    assert main(["replay", str(bad)]) == 1
    assert "vllm_argv must be a list" in capsys.readouterr().err


def test_replay_after_the_run_without_offload_remembers_a_computed_tokens_cost(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """32B chat with 48 GiB: every request loads its history and computes a similar few hundred
    tokens, so the recording alone, without the model's weight bytes (no floor), cannot price
    a computed token and the advice waits. Replayed after the same engine's run without
    offload (`--prior`), the cost measured there is remembered, as a live exporter remembers
    it across the restart that enables offload, and the advice settles on the side the two
    runs' measured TTFTs put it; the cost of another model's engine (other KV bytes per token)
    is not used."""
    off = MATRIX / "qwen3-32b-chat-none-rep"
    on = tmp_path / "qwen3-32b-chat-cpu192k"
    shutil.copytree(MATRIX / on.name, on)
    meta = json.loads((on / "meta.json").read_text())
    del meta["model_weight_bytes"]  # the floor decides it alone (docs/advisor.md): not here
    (on / "meta.json").write_text(json.dumps(meta))
    truth = matrixkit.paired_truth(_requests(off), _requests(on))
    alone = replay_one(on, Config())
    (engine,) = alone.final.targets[0].engines
    assert engine.advice.action == Action.INSUFFICIENT_DATA
    assert alone.before == {}  # offload on all along: nothing measured with it off

    base = replay_one(off, Config())
    ((key, cost),) = base.before.items()
    assert cost.fit.significant and cost.kv_bytes_per_token == 262_144  # the 32B shape
    # Another model served under the same name after the restart: its cost does not carry.
    (other,) = replay_one(MATRIX / "qwen3-8b-chat-none", Config()).before.values()
    assert other.kv_bytes_per_token == 147_456 and other.fit.significant
    (engine,) = replay_one(on, Config(), before={key: other}).final.targets[0].engines
    assert engine.advice.action == Action.INSUFFICIENT_DATA
    after = replay_one(on, Config(), before=base.before)
    (engine,) = after.final.targets[0].engines
    assert engine.derived.offload_fit is not None and engine.derived.offload_fit.computed_before
    # Judged as bench/advice_eval.py judges it: agrees with the truth, not harmful.
    assert _judge(str(engine.advice.action), truth["verdict"], True) == (True, False)
    assert truth["verdict"] == "pays"
    assert engine.advice.action in (Action.KEEP, Action.SHRINK_BUFFER)
    assert "before offload was enabled" in engine.advice.explanation

    assert main(["replay", str(on), "--prior", str(off), "--json"]) == 0
    (final,) = json.loads(capsys.readouterr().out)["final"]
    assert final["action"] == str(engine.advice.action)


def test_the_weights_in_meta_json_bound_a_computed_token_and_decide_alone(
    tmp_path: Path,
) -> None:
    """14B chat with 16 GiB (pays 24 %, docs/gpu-acceptance.md): the window alone prices a
    loaded token but not a computed one, and without the weights the advice waits. With the
    weight bytes vLLM logged (meta.json) and the H200's peak, a computed token costs at least
    29.9 us: the fit is bounded there and the advice keeps the tier. An operator's peak on
    the command line stands in for an unknown GPU's."""
    run = MATRIX / "qwen3-14b-chat-cpu16g"
    # The label is what the pair measured on its machine, not this run's name.
    truth = matrixkit.paired_truth(_requests(MATRIX / "qwen3-14b-chat-none-ctl"), _requests(run))
    assert truth["verdict"] == "pays"
    (engine,) = replay_one(run, Config()).final.targets[0].engines
    fit = engine.derived.offload_fit
    assert fit is not None and fit.computed_floor
    assert engine.derived.computed_token_floor == pytest.approx(29.88e-6, rel=1e-3)
    assert _judge(str(engine.advice.action), truth["verdict"], True) == (True, False)
    assert engine.advice.action == Action.KEEP
    assert "at its floor" in engine.advice.explanation
    assert engine.advice.numbers["computed_token_floor_seconds"] == pytest.approx(29.88e-6, 1e-3)

    bare = tmp_path / run.name
    shutil.copytree(run, bare)
    meta = json.loads((bare / "meta.json").read_text())
    weights = meta.pop("model_weight_bytes")
    meta["gpu"]["name"] = "Some Future GPU"
    (bare / "meta.json").write_text(json.dumps(meta))
    (engine,) = replay_one(bare, Config()).final.targets[0].engines
    assert engine.derived.computed_token_floor is None
    assert engine.advice.action == Action.INSUFFICIENT_DATA
    given = Config(model_weight_bytes=int(weights), gpu_peak_flops=989e12)
    (engine,) = replay_one(bare, given).final.targets[0].engines
    assert engine.advice.action == Action.KEEP


def test_after_enabling_a_slower_engine_is_told_to_turn_offload_off() -> None:
    """0.6B concurrent with 21 GiB: offload slowed every request (those that loaded nothing
    too), which no per-token fit of the window alone shows, so the recording alone waits.
    Replayed after the same engine's run without offload, the summed TTFT of the window's
    requests is compared with what that traffic cost the engine before: the advice turns
    offload off, on the side the two runs' measured TTFTs put it."""
    on, off = MATRIX / "qwen3-0.6b-concurrent-cpu192k", MATRIX / "qwen3-0.6b-concurrent-none"
    truth = matrixkit.paired_truth(_requests(off), _requests(on))
    (engine,) = replay_one(on, Config()).final.targets[0].engines
    assert engine.advice.action == Action.INSUFFICIENT_DATA and engine.derived.delivered is None
    base = replay_one(off, Config())
    ((cost),) = base.before.values()
    assert not cost.fit.significant  # a token's cost unidentified, the total still priced
    assert cost.requests_per_second is not None
    (engine,) = replay_one(on, Config(), before=base.before).final.targets[0].engines
    dv = engine.derived.delivered
    assert dv is not None and (dv.share(2.0) or 0.0) < 0
    assert engine.advice.reason == "delivered_saving_immaterial"
    assert _judge(str(engine.advice.action), truth["verdict"], True) == (True, False)
    assert truth["verdict"] == "costs"


def test_a_fit_from_another_machine_is_not_compared() -> None:
    """8B concurrent: its control without offload ran on session 7's machine, the 9 GiB run on
    session 6's, whose run without offload of the same sequence was 7.6 % faster. A pod that
    enabled offload and came back on another node would compare across that drift; the GPU
    UUIDs in meta.json (NVML's, live) tell the machines apart, and the fit from the other
    one is not used, neither for what enabling delivered nor for a computed token's cost."""
    on, ctl = MATRIX / "qwen3-8b-concurrent-cpu64k", MATRIX / "qwen3-8b-concurrent-none-ctl"
    assert read_meta(on).machine != read_meta(ctl).machine is not None
    before = replay_one(ctl, Config()).before
    ((key, cost),) = before.items()
    assert cost.machine == read_meta(ctl).machine
    (engine,) = replay_one(on, Config(), before=before).final.targets[0].engines
    assert engine.derived.delivered is None
    assert engine.derived.offload_fit is None or not engine.derived.offload_fit.computed_before
    # The same fit with no machine known (no NVML then) is compared, as before this guard.
    anywhere = {key: replace(cost, machine=None)}
    (engine,) = replay_one(on, Config(), before=anywhere).final.targets[0].engines
    assert engine.derived.delivered is not None


def test_what_enabling_delivered_is_priced_by_a_fit_corrected_on_its_own_window() -> None:
    """32B unique with 48 GiB (nothing loads; offload neutral): the TTFT fit of the run
    without offload predicts more summed TTFT than its own window had, and priced the
    window with offload 8 % above what it took, "a saving" on traffic that loaded nothing.
    The fit's scale (the window's TTFT over its prediction), remembered with it, takes that
    bias out: the delivered share then lands within 0.03 of the two runs' measured change."""
    on, off = MATRIX / "qwen3-32b-unique-cpu192k", MATRIX / "qwen3-32b-unique-none-rep"
    truth = matrixkit.paired_truth(_requests(off), _requests(on))
    base = replay_one(off, Config())
    ((key, cost),) = base.before.items()
    (last,) = base.final.targets[0].engines
    w = last.derived.window
    predicted, _ = cost.fit.predict(w["ttft_requests"], w["prompt_by_source:local_compute"])
    assert cost.scale == pytest.approx(w["ttft_seconds"] / predicted)
    assert cost.scale < 0.97  # the fit overstates its own window here
    (engine,) = replay_one(on, Config(), before=base.before).final.targets[0].engines
    dv = engine.derived.delivered
    assert dv is not None and dv.share() is not None
    assert abs(dv.share() + truth["relative_change"]) < 0.03
    raw = replace(cost, scale=1.0)
    (engine,) = replay_one(on, Config(), before={key: raw}).final.targets[0].engines
    assert engine.derived.delivered is not None
    assert abs((engine.derived.delivered.share() or 0.0) + truth["relative_change"]) > 0.05
