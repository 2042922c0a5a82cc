"""The engine-step log of the GPU matrix (bench/gpu/steplog.py): what a line holds, that it
never stops the engine, that the import hook patches vLLM's scheduler when vLLM imports it,
and on the real vLLM CPU server that every token the engine computed is in a step."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
KIT = REPO / "bench" / "gpu"
sys.path.insert(0, str(KIT))

import matrix  # noqa: E402
import steplog  # noqa: E402

from bench import burst_steps  # noqa: E402
from testbed.vllm_cpu import VLLM_PYTHON, VllmServer, complete  # noqa: E402
from tests.conftest import need  # noqa: E402


@dataclass
class Job:
    req_id: str


@dataclass
class Meta:
    load_jobs: dict[int, Job] = field(default_factory=dict)
    store_jobs: dict[int, Job] = field(default_factory=dict)


@dataclass
class Out:
    num_scheduled_tokens: dict[str, int]
    kv_connector_metadata: Any = None
    scheduled_new_reqs: list[object] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


def fake_scheduler_module(plan: list[Out]) -> types.ModuleType:
    """A module with a Scheduler that plans the given steps in turn, as vLLM's does: schedule()
    returns a step's plan, update_from_output(plan, model output) takes its output back."""
    module = types.ModuleType("fake_scheduler")

    class Scheduler:
        def __init__(self) -> None:
            self.waiting: list[object] = []
            self.steps = iter(plan)

        def schedule(self) -> Out:
            return next(self.steps)

        def update_from_output(self, scheduler_output: Out, model_runner_output: Any) -> str:
            return f"outputs of {sorted(scheduler_output.num_scheduled_tokens)}"

    module.Scheduler = Scheduler  # type: ignore[attr-defined]
    return module


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_line_holds_each_requests_tokens_and_the_connectors_transfers(tmp_path: Path) -> None:
    out = tmp_path / "steps.jsonl"
    log = steplog.StepLog(str(out))
    plan = [
        Out({"a": 1000, "b": 24}, Meta(store_jobs={1: Job("a")}), [object()]),
        Out({}, Meta(load_jobs={2: Job("c")})),
        Out({}),
        Out({}),
        Out({"c": 40}),
    ]
    module = fake_scheduler_module(plan)
    assert steplog.patch(module, log) and not steplog.patch(module, log)
    sched = module.Scheduler()
    done = [
        None,
        None,
        types.SimpleNamespace(
            kv_connector_output=types.SimpleNamespace(
                kv_connector_worker_meta=types.SimpleNamespace(
                    completed_jobs={1: 1, 2: 1},
                    transfer_stats=types.SimpleNamespace(
                        load=types.SimpleNamespace(bytes=4096, time=0.0012),
                        store=types.SimpleNamespace(bytes=0, time=0.0),
                    ),
                ),
                finished_recving={"c"},
            )
        ),
        None,
        None,
    ]
    for model_out in done:
        step = sched.schedule()
        assert sched.update_from_output(step, model_out) == (
            f"outputs of {sorted(step.num_scheduled_tokens)}"
        )
    head, *steps = lines(out)
    assert head["pid"] > 0 and "start" in head
    first, load, finished, last = steps
    assert first["r"] == {"a": 1000, "b": 24} and first["n"] == 1024 and first["new"] == 1
    assert first["store"] == {"1": "a"} and "load" not in first
    assert first["t0"] <= first["t1"] <= first["t2"] <= first["t3"]
    # A step that only submitted a load, one that only saw transfers done: both kept.
    assert load["n"] == 0 and load["load"] == {"2": "c"}
    assert finished["done"] == ["1", "2"] and finished["recv"] == ["c"]
    assert finished["xfer"] == {"load": [4096, 0.0012]}  # the store timed nothing: left out
    # The empty step between is folded into the next line.
    assert (last["i"], last["idle"], last["r"]) == (4, 1, {"c": 40})
    assert finished["t3"] <= last["idle_t0"] <= last["t0"]


def test_a_failing_log_never_reaches_the_engine(tmp_path: Path) -> None:
    class Broken:
        @property
        def load_jobs(self) -> dict[int, Job]:
            raise RuntimeError("a vLLM with another layout")

    out = tmp_path / "steps.jsonl"
    log = steplog.StepLog(str(out))
    module = fake_scheduler_module([Out({"a": 5}, Broken()), Out({"a": 1}, Broken())])
    steplog.patch(module, log)
    sched = module.Scheduler()
    for _ in range(2):
        step = sched.schedule()
        assert sched.update_from_output(step, None) == "outputs of ['a']"
    errors = [x for x in lines(out) if "error" in x]
    assert errors == [{"error": "RuntimeError: a vLLM with another layout", "count": 1}]
    assert log.errors == 2


def run_python(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_sitecustomize_patches_the_scheduler_when_vllm_imports_it(tmp_path: Path) -> None:
    """In a fresh interpreter, as in vLLM's engine process: the generated sitecustomize loads
    the kit's steplog, which patches the scheduler module only once it is imported."""
    pkg = tmp_path / "pkgs" / "vllm" / "v1" / "core" / "sched"
    pkg.mkdir(parents=True)
    for d in (pkg, *pkg.parents[: len(pkg.relative_to(tmp_path / "pkgs").parts) - 1]):
        (d / "__init__.py").write_text("")
    (pkg / "scheduler.py").write_text(
        textwrap.dedent(
            """
            class Scheduler:
                def __init__(self):
                    self.waiting = []

                def schedule(self):
                    import types
                    return types.SimpleNamespace(
                        num_scheduled_tokens={"r1": 7}, total_num_scheduled_tokens=7,
                        scheduled_new_reqs=[1], kv_connector_metadata=None)

                def update_from_output(self, out, model_out):
                    return "ok"
            """
        )
    )
    # A sitecustomize of the environment's own, which the generated one shadows, still runs.
    other = tmp_path / "other-site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = '1'\n")
    out = tmp_path / "steps.jsonl"
    env = matrix.step_log_env(
        {"PYTHONPATH": f"{tmp_path / 'pkgs'}:{other}"}, tmp_path / "work", KIT, out
    )
    script = (
        "import os, sys\n"
        "assert 'vllm.v1.core.sched.scheduler' not in sys.modules\n"
        "from vllm.v1.core.sched.scheduler import Scheduler\n"
        "s = Scheduler(); print(s.update_from_output(s.schedule(), None))\n"
        "print(os.environ.get('SHADOWED_RAN'))\n"
    )
    res = run_python(script, env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["ok", "1"] and "not installed" not in res.stderr
    _, step = lines(out)
    assert (step["r"], step["new"], step["wait"], step["remote"]) == ({"r1": 7}, 1, 0, 0)
    # Without the variable nothing is installed: the same interpreter, no log.
    env.pop(steplog.ENV)
    out.unlink()
    res = run_python(script, env)
    assert res.returncode == 0 and res.stdout.split() == ["ok", "1"] and not out.exists()


@pytest.mark.vllm
def test_on_the_real_cpu_server_every_computed_token_is_in_a_step(tmp_path: Path) -> None:
    """vLLM 0.32's CPU server with the log as the matrix turns it on: each request's steps
    add up to the tokens it computed (its prompt less the prefix cache's hit, and one token a
    step for the rest of its output), under the id its response carries."""
    need(VLLM_PYTHON.exists(), f"vLLM CPU ({VLLM_PYTHON})")
    out = tmp_path / "steps.jsonl"
    env = matrix.step_log_env({}, tmp_path / "work", KIT, out)
    server = VllmServer(tmp_path / "vllm", env=env).start()
    try:
        shared = list(range(1, 257))  # two blocks of 128: the second prompt hits both
        first = complete(server.url, [*shared, *range(300, 340)], max_tokens=3)
        second = complete(server.url, [*shared, *range(400, 470)], max_tokens=3)
    finally:
        server.stop()
    deadline = time.time() + 10
    while not out.exists() and time.time() < deadline:
        time.sleep(0.1)
    recs = lines(out)
    assert recs[0]["vllm"].startswith("0.32") and not [r for r in recs if "error" in r]
    steps = [r for r in recs if "i" in r]
    for resp, computed in ((first, 296), (second, 70)):
        mine = [s["r"][k] for s in steps for k in s["r"] if k.startswith(resp["id"])]
        # The prompt's first step, then one token a step for the two decoded after the first.
        assert mine == [computed, 1, 1], (resp["id"], mine)
    assert all(s["t0"] <= s["t1"] <= s["t2"] <= s["t3"] for s in steps)
    assert [s["i"] for s in steps] == sorted(s["i"] for s in steps)
    # What bench.burst_steps reads from it: a step time on tokens, no load (CPU: no tier).
    read = burst_steps.engine_steps(recs)
    assert read["steps"] == len(steps) and read["loads"] == 0 and read["loaders"] == []
    # Its values are timings of a shared CPU (no timing asserts: a loaded host has read a
    # negative cost per token), only that the fit is made.
    fit = read["step_time"]
    assert fit is not None and math.isfinite(fit["per_token_us"] + fit["fixed_ms"])


def test_the_outputs_taken_back_by_keyword_are_logged_too(tmp_path: Path) -> None:
    out = tmp_path / "steps.jsonl"
    module = fake_scheduler_module([Out({"a": 3}), Out({"b": 4})])
    steplog.patch(module, steplog.StepLog(str(out)))
    sched = module.Scheduler()
    first = sched.schedule()
    assert sched.update_from_output(first, model_runner_output=None) == "outputs of ['a']"
    second = sched.schedule()
    assert (
        sched.update_from_output(scheduler_output=second, model_runner_output=None)
        == "outputs of ['b']"
    )
    assert [x["r"] for x in lines(out) if "i" in x] == [{"a": 3}, {"b": 4}]
