"""A timeline of vLLM's engine steps, for the GPU matrix only (never the exporter).

Why: the what-if's remaining misses sit in how a load is scheduled. A request whose prefix
loads from the CPU tier leaves the step it would have shared, waits for its copy, and computes
its suffix in a later step (docs/gpu-acceptance.md, "The eager 8B bursts again"); what that
later step costs, and how many steps the wait spans, no vLLM metric says, and the KV events
only time the steps that stored a block. This records, per step, when the scheduler planned it
and when it took the step's output back (the model's forward and sampling lie between; with
vLLM's async scheduling, its default in 0.26, a step is planned while the one before it still
runs, and starts when that one's output is back), the
tokens each request computed, and the connector's transfer jobs submitted and completed, so a
recording tells a loader's steps apart from the others'.

How: `matrix.py` puts a generated `sitecustomize.py` on the vLLM server's PYTHONPATH when a
scenario sets `"step_log": true`; it calls `install(path)` in every Python process of the
server. Nothing is imported from vLLM here until vLLM imports its scheduler module itself; then
`Scheduler.schedule` and `Scheduler.update_from_output` are wrapped (one `time.time()` pair
and one JSON line a step). The engine core writes `KVOE_STEP_LOG` (one process; a second
writer appends under its own pid). A failure in the log never reaches vLLM: it is counted and
written once as an `error` line.

Lines (JSON, one a step; steps that did nothing are folded into the next line's `idle`):
  {"pid", "start", "vllm"}                                       first line of a process
  {"i": step index, "t0"/"t1": schedule() entered/returned, "t2"/"t3": update_from_output()
   entered/returned (unix s), "n": tokens scheduled, "r": {request id: tokens},
   "new": requests scheduled the first time, "wait": requests waiting, "remote": of them
   waiting for their KV to load, "load"/"store": {job id: request id} submitted in the step,
   "done": job ids whose transfer the workers reported done, "recv": request ids whose load
   the scheduler saw done, "xfer": {"load"|"store": [bytes, seconds]} the workers timed for
   the copies they finished, "idle": empty steps since the last line, "idle_t0": the first's
   t0}
  {"error": "...", "count": n}                                    a failure, once
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

ENV = "KVOE_STEP_LOG"
TARGET = "vllm.v1.core.sched.scheduler"
_WAITING_FOR_REMOTE = "WAITING_FOR_REMOTE_KVS"


class StepLog:
    """The writer: one per process, opened on the first step."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fh: IO[str] | None = None
        self.lock = threading.Lock()
        self.index = 0
        self.idle = 0
        self.idle_t0: float | None = None
        self.errors = 0
        # schedule() times by id(scheduler_output): with async scheduling vLLM plans step k+1
        # before it takes step k's output back.
        self.planned: dict[int, tuple[float, float, int | None, int | None]] = {}

    def _write(self, rec: dict[str, Any]) -> None:
        if self.fh is None:
            # Open for the life of the process: one line a step, each flushed (line-buffered).
            self.fh = Path(self.path).open("a", buffering=1)  # noqa: SIM115
            head = {"pid": os.getpid(), "start": time.time(), "vllm": _version()}
            self.fh.write(json.dumps(head) + "\n")
        self.fh.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def failed(self, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1:
            try:
                with self.lock:
                    self._write({"error": f"{type(exc).__name__}: {exc}", "count": 1})
            except OSError:
                pass

    def planned_step(self, scheduler: Any, out: Any, t0: float, t1: float) -> None:
        wait, remote = _waiting(scheduler)
        self.planned[id(out)] = (t0, t1, wait, remote)

    def step(self, out: Any, model_out: Any, t2: float, t3: float) -> None:
        t0, t1, wait, remote = self.planned.pop(id(out), (None, None, None, None))
        tokens = dict(getattr(out, "num_scheduled_tokens", None) or {})
        total = int(getattr(out, "total_num_scheduled_tokens", 0) or 0)
        load, store = _jobs(getattr(out, "kv_connector_metadata", None))
        done, recv, xfer = _finished(getattr(model_out, "kv_connector_output", None))
        with self.lock:
            i = self.index
            self.index += 1
            if total == 0 and not (load or store or done or recv or xfer):
                if self.idle == 0:
                    self.idle_t0 = t0
                self.idle += 1
                return
            rec: dict[str, Any] = {
                "i": i,
                "t0": _r(t0),
                "t1": _r(t1),
                "t2": _r(t2),
                "t3": _r(t3),
                "n": total,
                "r": {str(k): int(v) for k, v in tokens.items()},
                "new": len(getattr(out, "scheduled_new_reqs", None) or ()),
                "wait": wait,
                "remote": remote,
            }
            for key, val in (
                ("load", load),
                ("store", store),
                ("done", done),
                ("recv", recv),
                ("xfer", xfer),
            ):
                if val:
                    rec[key] = val
            if self.idle:
                rec["idle"], rec["idle_t0"] = self.idle, _r(self.idle_t0)
                self.idle, self.idle_t0 = 0, None
            self._write(rec)


def _r(t: float | None) -> float | None:
    return None if t is None else round(t, 6)


def _version() -> str | None:
    mod = sys.modules.get("vllm")
    v = getattr(mod, "__version__", None)
    return str(v) if v is not None else None


def _waiting(scheduler: Any) -> tuple[int | None, int | None]:
    """Requests waiting, and of them the ones waiting for a load (None where this vLLM keeps
    its queue otherwise)."""
    try:
        queue = list(getattr(scheduler, "waiting", ()))
        queue += list(getattr(scheduler, "skipped_waiting", ()) or ())
    except TypeError:
        return None, None
    remote = sum(
        1 for r in queue if getattr(getattr(r, "status", None), "name", "") == _WAITING_FOR_REMOTE
    )
    return len(queue), remote


def _jobs(meta: Any) -> tuple[dict[str, str], dict[str, str]]:
    """The OffloadingConnector's transfer jobs planned in a step: {job id: request id}."""

    def of(attr: str) -> dict[str, str]:
        jobs = getattr(meta, attr, None) or {}
        return {str(k): str(getattr(v, "req_id", "")) for k, v in dict(jobs).items()}

    return of("load_jobs"), of("store_jobs")


def _finished(kv_out: Any) -> tuple[list[str], list[str], dict[str, list[float]]]:
    """Jobs the workers reported done, loads the scheduler saw done, and the copies' bytes and
    seconds the workers timed ({"load"|"store": [bytes, s]}, where any)."""
    if kv_out is None:
        return [], [], {}
    worker = getattr(kv_out, "kv_connector_worker_meta", None)
    done = sorted(str(j) for j in (getattr(worker, "completed_jobs", None) or {}))
    recv = sorted(str(r) for r in (getattr(kv_out, "finished_recving", None) or ()))
    stats = getattr(worker, "transfer_stats", None)
    xfer = {}
    for kind in ("load", "store"):
        one = getattr(stats, kind, None)
        if one is not None and (one.bytes or one.time):
            xfer[kind] = [int(one.bytes), round(float(one.time), 6)]
    return done, recv, xfer


def patch(module: types.ModuleType, log: StepLog) -> bool:
    """Wrap the module's Scheduler; False where it has none (another vLLM layout)."""
    cls = getattr(module, "Scheduler", None)
    if cls is None or getattr(cls, "_kvoe_step_log", False):
        return False
    schedule, update = cls.schedule, cls.update_from_output

    def schedule_logged(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        out = schedule(self, *args, **kwargs)
        try:
            log.planned_step(self, out, t0, time.time())
        except Exception as exc:  # the log never stops the engine
            log.failed(exc)
        return out

    def update_logged(self: Any, *args: Any, **kwargs: Any) -> Any:
        t2 = time.time()
        result = update(self, *args, **kwargs)
        try:
            named = ("scheduler_output", "model_runner_output")
            out, model_out = (*args, *(kwargs.get(k) for k in named[len(args) :]))[:2]
            log.step(out, model_out, t2, time.time())
        except Exception as exc:
            log.failed(exc)
        return result

    cls.schedule = schedule_logged
    cls.update_from_output = update_logged
    cls._kvoe_step_log = True
    return True


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when the scheduler module is found by the others, its loader is
    wrapped so that the module is patched right after it ran."""

    def __init__(self, log: StepLog) -> None:
        self.log = log
        self.busy = False

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET or self.busy:
            return None
        self.busy = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self.busy = False
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        log, run = self.log, loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            try:
                patch(module, log)
            except Exception as exc:
                log.failed(exc)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install(path: str | None = None) -> StepLog | None:
    """Log this process's engine steps to path (default: $KVOE_STEP_LOG); None if unset."""
    path = path or os.environ.get(ENV)
    if not path:
        return None
    log = StepLog(path)
    module = sys.modules.get(TARGET)
    if module is not None:
        patch(module, log)
    else:
        sys.meta_path.insert(0, _Finder(log))
    return log


SITECUSTOMIZE = """\
# Written by bench/gpu/matrix.py for a scenario with "step_log": the engine-step timeline
# (bench/gpu/steplog.py). Any error here leaves vLLM as it is. Python imports only the first
# sitecustomize on its path, so the one this shadows (if any) runs after it.
import importlib.util as _u
import os as _os
import sys as _sys


def _load(name, path):
    _s = _u.spec_from_file_location(name, path)
    _m = _u.module_from_spec(_s)
    _s.loader.exec_module(_m)
    return _m


try:
    _load("kvoe_steplog", {path!r}).install()
except Exception as _e:  # noqa: BLE001
    print(f"kvoe step log not installed: {{_e!r}}", file=_sys.stderr)
_here = _os.path.dirname(_os.path.abspath(__file__))
for _d in _sys.path:
    _f = _os.path.join(_d or ".", "sitecustomize.py")
    if _os.path.abspath(_d or ".") != _here and _os.path.isfile(_f):
        _load("_kvoe_shadowed_sitecustomize", _f)
        break
"""


def sitecustomize(kit_module: str) -> str:
    """The sitecustomize.py that installs this module (at kit_module) in a vLLM process."""
    return SITECUSTOMIZE.format(path=kit_module)
