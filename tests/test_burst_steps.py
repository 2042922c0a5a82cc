"""bench.burst_steps: a burst's steps from the KV events on the recorded bursts, and the
engine-step log's reading (bench/gpu/steplog.py) on a log whose spans are known."""

from __future__ import annotations

from typing import Any

import pytest

from bench import burst_steps
from bench.advice_eval import MATRIX

PAIRS = {
    "qwen3-0.6b-concurrent-cpu64k": "qwen3-0.6b-concurrent-none",
    "qwen3-0.6b-concurrent-cpu192k": "qwen3-0.6b-concurrent-none",
    "qwen3-0.6b-concurrent-cpu64k-rep": "qwen3-0.6b-concurrent-none-rep",
    "qwen3-0.6b-concurrent-graphs-cpu64k": "qwen3-0.6b-concurrent-graphs-none",
}


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    return burst_steps.table(MATRIX, [*PAIRS, *set(PAIRS.values())])


@pytest.fixture(scope="module")
def every_pair() -> dict[str, dict[str, Any]]:
    return burst_steps.table(MATRIX)


def test_a_0_6b_loader_waits_steps_after_the_one_that_served_the_others(
    rows: dict[str, dict[str, Any]],
) -> None:
    """docs/gpu-acceptance.md, "Steps in the KV events": without offload the requests that
    would load got their first token with the step that served the rest of their burst (within
    a few ms of its end); with the tier they waited tens of ms after it, on both card types,
    eager more than with CUDA graphs. Every burst is 12 requests and its first step ends
    after the send by the time the server takes to admit them."""
    assert set(rows) == set(PAIRS)
    for name, row in rows.items():
        assert row["base"] == PAIRS[name]
        assert row["bursts_loading"] >= 45 and 2 <= row["loaders_per_burst"] <= 4
        without, with_ = row["loaders_after_ms"]["base"], row["loaders_after_ms"]["offload"]
        assert without < 10 and with_ > without + 20, (name, without, with_)
    graphs = rows["qwen3-0.6b-concurrent-graphs-cpu64k"]["loaders_waited_more_ms"]
    eager = [r["loaders_waited_more_ms"] for n, r in rows.items() if "graphs" not in n]
    assert min(eager) > 1.5 * graphs


def test_where_a_0_6b_request_loads_the_others_of_its_burst_wait_a_launch(
    rows: dict[str, dict[str, Any]],
) -> None:
    """docs/whatif.md, "The launch a load adds": in the 0.6B bursts in which a request
    loaded, the requests that loaded nothing came back 21-35 ms later with the tier (a step
    launch on that engine), the loaders later still; the what-if charges the former since
    session 32."""
    for name, row in rows.items():
        change = row["ttft_change_ms"]
        assert 15 < change["others"] < change["loaders"], (name, change)


def _step(i: int, ms: float, r: dict[str, int], **more: Any) -> dict[str, Any]:
    t0 = 100.0 + i / 10
    return {
        "i": i,
        "t0": t0,
        "t1": t0 + 0.001,
        "t2": t0 + 0.001 + ms / 1000,
        "t3": t0 + 0.002 + ms / 1000,
        "n": sum(r.values()),
        "r": r,
        **more,
    }


def test_the_step_log_gives_a_steps_fixed_cost_and_each_loads_steps() -> None:
    """A step's model time is 4 ms plus 20 us a token here; request b's load is submitted in
    step 1 (nothing computed), reported done in step 2, and b computes its suffix in step 5,
    after two idle steps folded into it."""
    lines = [
        {"pid": 1, "start": 99.0, "vllm": "0.26.0"},
        _step(0, 4 + 0.02 * 1000, {"a": 1000}, store={"6": "a"}),
        _step(1, 4, {}, load={"7": "b"}),
        _step(2, 4 + 0.02 * 24, {"c": 24}, done=["6", "7"], recv=["b"]),
        _step(3, 4 + 0.02 * 1, {"c": 1}),
        _step(5, 4 + 0.02 * 41, {"b": 40, "c": 1}, idle=2, idle_t0=100.4),
    ]
    out = burst_steps.engine_steps(lines)
    assert out["step_time"] == {"fixed_ms": pytest.approx(4.0), "per_token_us": pytest.approx(20)}
    assert (out["steps"], out["idle_steps"], out["loads"]) == (5, 2, 1)
    (b,) = out["loaders"]
    assert (b["request"], b["steps_to_done"], b["steps_to_computed"], b["idle_steps"]) == (
        "b",
        1,
        3,
        2,
    )
    assert b["ms_to_done"] == pytest.approx(100.5, abs=1)  # step 2 ends 0.1 s after step 1
    assert (b["suffix_tokens"], b["suffix_step_tokens"]) == (40, 41)
    # A load never reported done is left out, not counted as instant.
    lost = burst_steps.engine_steps([*lines, _step(6, 4, {}, load={"9": "x"})])
    assert [x["request"] for x in lost["loaders"]] == ["b"] and lost["loads"] == 2


def test_a_recording_without_a_step_log_has_no_engine_rows(
    rows: dict[str, dict[str, Any]],
) -> None:
    assert all("engine" not in r for r in rows.values())
    assert burst_steps.engine_steps([])["step_time"] is None


def test_the_command_prints_the_docs_table_row(capsys: pytest.CaptureFixture[str]) -> None:
    names = ["qwen3-0.6b-concurrent-cpu64k-rep", "qwen3-0.6b-concurrent-none-rep"]
    assert burst_steps.main([str(MATRIX), *names]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row == (
        "| qwen3-0.6b-concurrent-cpu64k-rep | qwen3-0.6b-concurrent-none-rep | 50 | 2.48 "
        "| 80.0 / 93.5 | 7.6 / 51.3 | 43.3 | +56.2 / +21.4 | +6.0 (11) | +27.9 % |"
    )
    assert burst_steps.main([str(MATRIX), *names, "--json"]) == 0
    out = capsys.readouterr().out
    assert '"loaders_waited_more_ms": 43.3' in out and '"summed_ttft_change": 0.2789' in out


def test_the_rank_order_of_two_series() -> None:
    """Spearman's rho as the docs quote it: 1 for the same order, -1 reversed, ties at their
    mean rank, and no number where it would mean nothing."""
    rho = burst_steps.rank_correlation
    assert rho([1, 2, 3, 4], [10, 20, 30, 400]) == pytest.approx(1.0)
    assert rho([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # One neighbours' swap in five: 1 - 6 * 2 / (5 * 24).
    assert rho([1, 2, 3, 4, 5], [1, 3, 2, 4, 5]) == pytest.approx(0.9)
    assert rho([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)
    assert rho([1, 2], [2, 1]) is None and rho([1, 1, 1], [1, 2, 3]) is None
    rows = {
        "a": {"first_step_ms": {"base": 70.0, "offload": 90.0}, "summed_ttft_change": 0.1},
        "b": {"first_step_ms": {"base": 70.0, "offload": 60.0}, "summed_ttft_change": -0.2},
        "c": {"first_step_ms": {"base": 70.0, "offload": 75.0}, "summed_ttft_change": -0.05},
        "d": {"first_step_ms": {"base": None, "offload": 75.0}, "summed_ttft_change": 0.3},
    }
    assert burst_steps.first_step_order(rows) == {"pairs": 3, "rho": 1.0}


def test_a_step_planned_while_the_last_ran_is_timed_from_the_last_ones_output() -> None:
    """vLLM's async scheduling plans step k+1 before step k's output is back: step k+1's
    model time starts when step k's output came, not at its own plan."""

    def planned_early(i: int, t1: float, t2: float, n: int) -> dict[str, Any]:
        return {"i": i, "t0": t1 - 0.001, "t1": t1, "t2": t2, "t3": t2 + 0.001, "n": n, "r": {}}

    # Each step 2 ms plus 10 us a token, planned 1 ms after the previous one was.
    lines, t2 = [], 10.0
    for i, n in enumerate((100, 400, 50, 800)):
        start = t2
        t2 = start + 0.002 + 1e-5 * n
        lines.append(planned_early(i, 10.0 + 0.001 * i, t2, n))
    fit = burst_steps.engine_steps(lines)["step_time"]
    assert fit == {"fixed_ms": pytest.approx(2.0), "per_token_us": pytest.approx(10.0)}


STEPS = {
    "qwen3-8b-concurrent-cpu16g-steps": "qwen3-8b-concurrent-none-steps",
    "qwen3-8b-concurrent-graphs-cpu16g-steps": "qwen3-8b-concurrent-graphs-none-steps",
    "qwen3-0.6b-concurrent-cpu64k-steps": "qwen3-0.6b-concurrent-none-steps",
}


def test_batch_28s_loaders_computed_two_steps_after_their_load() -> None:
    """docs/gpu-acceptance.md, "What batch 28 measured": every load's copy was reported done
    in the step that submitted it, and the loader's suffix came two steps later (vLLM's batch
    queue had planned the next one without it), at the median on every pair; those two steps
    took the 0.6B loaders about what the KV events measured as the loads' extra wait on that
    host, and the 8B loaders less with CUDA graphs than eager."""
    rows = burst_steps.table(MATRIX, [*STEPS, *STEPS.values()])
    assert {n: r["base"] for n, r in rows.items()} == STEPS
    waited = {}
    for name, row in rows.items():
        base, off = row["engine"]["base"], row["engine"]["offload"]
        assert base["loads"] == 0 and off["loads"] >= 100
        med = off["loader_medians"]
        assert (med["steps_to_done"], med["steps_to_computed"]) == (0, 2), name
        waited[name] = med["ms_to_computed"]
    small = rows["qwen3-0.6b-concurrent-cpu64k-steps"]
    assert waited["qwen3-0.6b-concurrent-cpu64k-steps"] == pytest.approx(
        small["loaders_waited_more_ms"], rel=0.25
    )
    assert (
        waited["qwen3-8b-concurrent-graphs-cpu16g-steps"]
        < (waited["qwen3-8b-concurrent-cpu16g-steps"])
    )


def test_a_steps_submission_is_from_its_plan_to_the_next_plan_made_before_its_output() -> None:
    """`submission`: step 0's successor was planned 30 ms after step 0's plan and before its
    output came back (async scheduling), so step 0 counts 30 ms; step 1's successor waited for
    its output (not overlapped), step 2's had empty steps folded in (`idle`), and step 4
    computed nothing: none of those count. Over two spans, the first holds the 30 ms step and
    the second the 10 ms one."""

    def step(i: int, t0: float, t2: float, n: int, **more: Any) -> dict[str, Any]:
        return {"i": i, "t0": t0, "t1": t0 + 0.002, "t2": t2, "t3": t2 + 0.001, "n": n, **more}

    lines = [
        {"pid": 1, "start": 99.0, "vllm": "0.26.0"},
        step(0, 100.000, 100.050, 500),
        step(1, 100.032, 100.090, 20),  # planned 30 ms after step 0's plan, before its output
        step(2, 100.100, 100.150, 20),  # after step 1's output: step 1 does not count
        step(3, 100.120, 100.170, 8, idle=2, idle_t0=100.11),
        step(4, 100.200, 100.210, 0),
        step(5, 101.000, 101.050, 300),
        step(6, 101.012, 101.080, 10),
    ]
    out = burst_steps.submission(lines, parts=2)
    assert (out["steps"], out["median_ms"]) == (2, 20.0)
    assert out["by_part_ms"] == [30.0, 10.0]
    assert out["schedule_ms"] == 2.0 and out["update_ms"] == 1.0
    assert burst_steps.submission([])["median_ms"] is None


def test_on_the_eager_4b_bursts_the_hosts_speed_orders_what_the_tier_cost(
    every_pair: dict[str, dict[str, Any]],
) -> None:
    """docs/whatif.md, "What a step's submission says": over every step-logged eager 4B pair
    the tier run's submission against its base's orders the summed TTFT change, and the
    harmful enable's pair (16 GiB from `-none-rep2`) had the tier run submit its steps
    slower than its base by more than any pair that paid; with CUDA graphs the tier's runs
    submit faster than their bases (a loader's suffix step replays a graph)."""
    rows = every_pair
    eager4 = {n: r for n, r in rows.items() if r["shape"] == "qwen3-4b" and r["eager"]}
    logged = {n: r for n, r in eager4.items() if "engine" in r and r["max_tokens"] == 1}
    (key, order), *others = burst_steps.submission_order(logged).items()
    assert key == "qwen3-4b eager" and not others and order["pairs"] == len(logged) >= 8
    decoding = {n: r for n, r in eager4.items() if r["max_tokens"] > 1}
    assert list(burst_steps.submission_order(eager4)) == ["qwen3-4b eager", "qwen3-4b eager decode"]
    assert decoding and all("-decode-" in n for n in decoding)
    assert order["rho"] > 0.8

    def ratio(r: dict[str, Any]) -> float:
        base, tier = (r["engine"][k]["submission"]["median_ms"] for k in ("base", "offload"))
        return float(tier / base - 1)

    harmful = logged["qwen3-4b-concurrent-cpu16g-rep2"]
    assert harmful["base"] == "qwen3-4b-concurrent-none-rep2"
    paid = [ratio(r) for r in logged.values() if r["summed_ttft_change"] <= -0.03]
    assert paid and ratio(harmful) > max(paid) + 0.2
    graphs = [r for r in rows.values() if "engine" in r and not r["eager"]]
    assert graphs and all(ratio(r) < 0 for r in graphs)


def test_a_load_jobs_cpu_work_is_read_within_a_run() -> None:
    """`load_job_cost`: steps whose submission and plan grow 3 ms and 1 ms a load job (and
    with their tokens and requests) give those back, and the implied wait is each job's 4 ms
    times the requests its step carried; a run without a load job has none."""

    def step(i: int, n: int, reqs: int, loads: int) -> dict[str, Any]:
        t0 = 100.0 + i
        sched = (0.5 + 0.2 * reqs + 1.0 * loads) / 1000
        return {
            "i": i,
            "t0": t0,
            "t1": t0 + sched,
            "t2": t0 + 0.5,
            "t3": t0 + 0.501,
            "n": n,
            "r": {f"q{k}": n // reqs for k in range(reqs)},
            "load": {f"j{i}-{k}": f"q{k}" for k in range(loads)},
        }

    shapes = [(512 * (1 + i % 3), 1 + i % 5, i % 4 if i % 5 else 0) for i in range(40)]
    steps = [step(i, n, r, min(loads, r)) for i, (n, r, loads) in enumerate(shapes)]
    submitted = [
        20.0 + 4.0 * s["n"] / 1000 + 0.3 * len(s["r"]) + 3.0 * len(s["load"]) for s in steps
    ]
    out = burst_steps.load_job_cost(steps, steps, submitted)
    assert out is not None
    assert (out["submission_ms"], out["schedule_ms"]) == (3.0, 1.0)
    assert out["submission_se_ms"] == out["schedule_se_ms"] == 0.0
    carried = sum(len(s["load"]) * len(s["r"]) for s in steps)
    assert out["jobs"] == sum(len(s["load"]) for s in steps) > 0
    assert out["implied_wait_s"] == pytest.approx(4.0 * carried / 1000, abs=1e-3)
    for s in steps:
        s["load"] = {}
    assert burst_steps.load_job_cost(steps, steps, submitted) is None


def test_a_load_jobs_own_cpu_work_is_a_minority_of_what_the_eager_4b_tier_cost(
    every_pair: dict[str, dict[str, Any]],
) -> None:
    """docs/whatif.md, "What a step's submission says": held at its run's host speed, a load
    job's submission and plan imply a wait of under a tenth of the base's summed TTFT on
    every step-logged tier run, and under half of the change of every eager 4B pair that
    cost."""
    logged = {n: r for n, r in every_pair.items() if "engine" in r}
    shares = {}
    for name, r in logged.items():
        job = r["engine"]["offload"]["submission"]["per_load_job"]
        assert job is not None and job["jobs"] > 100, name
        shares[name] = job["implied_wait_s"] / r["summed_ttft_base_s"]
    assert len(shares) >= 15 and max(shares.values()) < 0.1
    costly = [
        n
        for n, r in logged.items()
        if r["shape"] == "qwen3-4b" and r["eager"] and r["summed_ttft_change"] >= 0.03
    ]
    assert len(costly) >= 5
    assert all(shares[n] < logged[n]["summed_ttft_change"] / 2 for n in costly)


def test_a_load_job_costs_more_on_a_host_whose_launches_slowed(
    every_pair: dict[str, dict[str, Any]],
) -> None:
    """docs/whatif.md, "What batch 40 measured": the same decoding 8B bursts with 16 GiB on
    two hosts. On batch 39's the kernel launches the driver timed had slowed by half before
    the tier run began, and its load jobs took longer, by about as much (beyond both
    standard errors); its decode steps, each one CUDA graph, did not slow."""
    slow, fast = (
        every_pair["qwen3-8b-bursts-decode-graphs-cpu16g"],
        every_pair["qwen3-8b-bursts-decode-graphs-cpu16g-host"],
    )

    def launch_us(r: dict[str, Any]) -> float:
        probe = r["engine"]["offload"]["host_probe"]
        return float(probe["before"] + probe["after"]) / 2

    jobs = [r["engine"]["offload"]["submission"]["per_load_job"] for r in (slow, fast)]
    launch = launch_us(slow) / launch_us(fast)
    job = jobs[0]["submission_ms"] / jobs[1]["submission_ms"]
    assert launch > 1.3 and job > 1.3 and abs(job / launch - 1) < 0.2
    assert jobs[0]["submission_ms"] - jobs[1]["submission_ms"] > 2 * (
        jobs[0]["submission_se_ms"] + jobs[1]["submission_se_ms"]
    )
    # Over the run without offload on the slowing host, whose launches went from about 7 us
    # to about 10, a step's submission held within 5 % from its first sixth to its last.
    base = slow["engine"]["base"]
    assert base["host_probe"]["after"] / base["host_probe"]["before"] > 1.3
    parts = base["submission"]["by_part_ms"]
    assert max(parts) - min(parts) <= 0.05 * base["submission"]["median_ms"]


def test_the_host_probe_is_read_from_a_runs_meta(tmp_path: Any) -> None:
    """meta.json's `host_probe` (the driver's, since batch 37): the fastest launch before and
    after the traffic; a run without it, or whose probe failed, says so."""
    import json

    def run(name: str, meta: dict[str, Any]) -> Any:
        d = tmp_path / name
        d.mkdir()
        (d / "meta.json").write_text(json.dumps(meta))
        return d

    probed = run(
        "probed",
        {
            "host_probe": {
                "before": {"python_ns": 49.0, "launch_us": 6.1, "launch_us_median": 6.2},
                "after": {"python_ns": 50.0, "error": "RuntimeError: torch sees no CUDA device"},
            }
        },
    )
    assert burst_steps.host_probe(probed) == {"before": 6.1, "after": None}
    assert burst_steps.host_probe(run("old", {"vllm_argv": []})) is None
    rows = burst_steps.table(
        MATRIX, ["qwen3-8b-concurrent-cpu16g-steps", "qwen3-8b-concurrent-none-steps"]
    )
    (row,) = rows.values()
    assert row["engine"]["base"]["host_probe"] is row["engine"]["offload"]["host_probe"] is None
