"""The state file (--state-file): each engine's TTFT fit with offload off, kept on disk.

Enabling offload restarts vLLM; where the exporter runs as a sidecar in vLLM's pod
(deploy/base), it restarts too, and the fit it measured before offload, which the advice
after enabling is compared with (docs/advisor.md, "What enabling delivered"), would be lost
with its memory. The file carries it across:

    {"version": 1, "targets": {"<target label>": [{"model_name": ..., "engine": ...,
      "kv_bytes_per_token": <float or null>, "requests_per_second": <float or null>,
      "machine": <NVML GPU UUIDs or null>, "scale": <float, 1 when absent>,
      "fit": {"overhead_seconds", "seconds_per_token", "points", "r2", "stderr",
              "overhead_stderr", "covariance"}}, ...]}}

targets in the order they were last measured (the most recent last), as Pipeline.before
keeps them. Written whole to a temporary file and renamed over the old one, so a reader
never sees half a file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exporter.model.derive.engines import CostBefore
from exporter.model.derive.fits import PrefillFit
from exporter.vllm_metrics import EngineKey

VERSION = 1
_FIT_FIELDS = (
    "overhead_seconds",
    "seconds_per_token",
    "points",
    "r2",
    "stderr",
    "overhead_stderr",
    "covariance",
)

Remembered = Mapping[str, Mapping[EngineKey, CostBefore]]


class StateError(ValueError):
    """A state file that cannot be read: not JSON, another version, or malformed entries."""


def dump(remembered: Remembered) -> str:
    targets = {
        label: [
            {
                "model_name": key.model_name,
                "engine": key.engine,
                "kv_bytes_per_token": cost.kv_bytes_per_token,
                "requests_per_second": cost.requests_per_second,
                "machine": cost.machine,
                "scale": cost.scale,
                "fit": {name: getattr(cost.fit, name) for name in _FIT_FIELDS},
            }
            for key, cost in engines.items()
        ]
        for label, engines in remembered.items()
    }
    return json.dumps({"version": VERSION, "targets": targets}, indent=1, allow_nan=False) + "\n"


def _number(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise StateError(f"{what}: expected a finite number, got {value!r}")
    return float(value)


def _fit(doc: Any, where: str) -> PrefillFit:
    if not isinstance(doc, dict):
        raise StateError(f"{where}: fit is not an object")
    values = {name: _number(doc.get(name), f"{where}.fit.{name}") for name in _FIT_FIELDS}
    for name in ("overhead_seconds", "seconds_per_token", "points", "r2"):
        if values[name] is None:
            raise StateError(f"{where}.fit.{name}: missing")
    return PrefillFit(
        overhead_seconds=values["overhead_seconds"] or 0.0,
        seconds_per_token=values["seconds_per_token"] or 0.0,
        points=int(values["points"] or 0),
        r2=values["r2"] or 0.0,
        stderr=values["stderr"],
        overhead_stderr=values["overhead_stderr"],
        covariance=values["covariance"],
    )


def parse(text: str) -> dict[str, dict[EngineKey, CostBefore]]:
    """The remembered fits in the file's order; StateError names what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StateError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        version = doc.get("version") if isinstance(doc, dict) else None
        raise StateError(f"version {version!r}, this exporter reads version {VERSION}")
    targets = doc.get("targets")
    if not isinstance(targets, dict):
        raise StateError("targets is not an object")
    out: dict[str, dict[EngineKey, CostBefore]] = {}
    for label, engines in targets.items():
        if not isinstance(engines, list):
            raise StateError(f"targets[{label!r}] is not a list")
        fits: dict[EngineKey, CostBefore] = {}
        for i, entry in enumerate(engines):
            where = f"targets[{label!r}][{i}]"
            if not isinstance(entry, dict):
                raise StateError(f"{where} is not an object")
            model, engine = entry.get("model_name"), entry.get("engine")
            if not isinstance(model, str) or not isinstance(engine, str):
                raise StateError(f"{where}: model_name and engine must be strings")
            machine = entry.get("machine")
            if machine is not None and not isinstance(machine, str):
                raise StateError(f"{where}: machine must be a string")
            # Absent in the files of the first version with a state file: no correction.
            scale = _number(entry.get("scale"), f"{where}.scale")
            if scale is not None and scale <= 0:
                raise StateError(f"{where}.scale: must be positive, got {scale!r}")
            fits[EngineKey(model, engine)] = CostBefore(
                _fit(entry.get("fit"), where),
                _number(entry.get("kv_bytes_per_token"), f"{where}.kv_bytes_per_token"),
                _number(entry.get("requests_per_second"), f"{where}.requests_per_second"),
                machine,
                1.0 if scale is None else scale,
            )
        out[label] = fits
    return out


def load(path: Path) -> dict[str, dict[EngineKey, CostBefore]]:
    """Nothing remembered where the file does not exist yet (the first start)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise StateError(f"cannot read {path}: {exc}") from exc
    return parse(text)


def save(path: Path, remembered: Remembered) -> None:
    """Atomically replace the file (OSError when the directory is not writable)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(dump(remembered))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
