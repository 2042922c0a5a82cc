"""The recording format: what one vLLM server showed the exporter, replayable offline.

A recording is a directory:

- `metrics.jsonl` or `metrics.jsonl.xz`: one line per scrape of the server's /metrics,
  `{"t": <unix seconds>, "body": "<the exposition text>"}`;
- `kv_events.jsonl` or `kv_events.jsonl.xz` (optional): one line per ZMQ message,
  `{"topic": ..., "seq": <int>, "payload": [ts, [event maps], dp_rank]}`, block hashes as
  integers (the format of `--record-events`);
- `meta.json` (optional): what a live exporter learns from /proc and NVML,
  `{"vllm_argv": [...], "link_bandwidth_bytes_per_second": <float>,
  "kv_bytes_per_token": <int>, "machine": "<GPU UUIDs>", "gpu_names": ["<NVML name>"],
  "model_weight_bytes": <int, as configured>}`; other keys are kept and ignored.

`kv-offload-exporter --record DIR` writes it (one subdirectory per target), and
`kv-offload-exporter replay DIR` reads it (exporter/replay.py).
"""

from __future__ import annotations

import json
import lzma
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from exporter.kvevents_codec import Message, ReadStats, read_records

METRICS = "metrics.jsonl"
KV_EVENTS = "kv_events.jsonl"
META = "meta.json"


class RecordingError(ValueError):
    """A recording that cannot be replayed: missing or unreadable files, bad lines."""


@dataclass(frozen=True, slots=True)
class Scrape:
    t: float
    body: str | None  # None: the scrape failed (the line's "error" says why)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Meta:
    vllm_argv: tuple[str, ...] | None = None
    link_bandwidth: float | None = None  # bytes/s, theoretical host link
    kv_bytes_per_token: float | None = None
    machine: str | None = None  # the GPUs' NVML UUIDs (the GPU kit's meta: gpu.uuid)
    # The GPUs' NVML names (`gpu_names`, else the GPU kit's gpu.name) and the model's weight
    # bytes per GPU, as vLLM logged them: a computed token's floor (model/derive/compute.py).
    gpu_names: tuple[str, ...] = ()
    model_weight_bytes: float | None = None
    other: Mapping[str, Any] = field(default_factory=dict)


def _find(directory: Path, name: str) -> Path | None:
    for candidate in (directory / name, directory / (name + ".xz")):
        if candidate.is_file():
            return candidate
    return None


def open_text(path: Path) -> IO[str]:
    """A recording file for reading as text, xz-compressed or plain."""
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _positive(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def read_meta(directory: Path) -> Meta:
    path = directory / META
    if not path.is_file():
        return Meta()
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RecordingError(f"{path}: {exc}") from None
    if not isinstance(doc, dict):
        raise RecordingError(f"{path}: expected a JSON object")
    argv = doc.get("vllm_argv")
    if argv is not None and not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        raise RecordingError(f"{path}: vllm_argv must be a list of strings")
    known = (
        "vllm_argv",
        "link_bandwidth_bytes_per_second",
        "kv_bytes_per_token",
        "machine",
        "gpu_names",
        "model_weight_bytes",
    )
    return Meta(
        vllm_argv=tuple(argv) if argv is not None else None,
        link_bandwidth=_positive(doc.get("link_bandwidth_bytes_per_second")),
        kv_bytes_per_token=_positive(doc.get("kv_bytes_per_token")),
        machine=_machine(doc),
        gpu_names=_gpu_names(doc),
        model_weight_bytes=_positive(doc.get("model_weight_bytes")),
        other={k: v for k, v in doc.items() if k not in known},
    )


def _gpu_names(doc: Mapping[str, Any]) -> tuple[str, ...]:
    """`gpu_names` as --record writes it, else the GPU kit's `gpu.name` (bench/gpu)."""
    names = doc.get("gpu_names")
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        return tuple(names)
    gpu = doc.get("gpu")
    name = gpu.get("name") if isinstance(gpu, dict) else None
    return (name,) if isinstance(name, str) and name else ()


def _machine(doc: Mapping[str, Any]) -> str | None:
    """`machine` as --record writes it, else the GPU kit's `gpu.uuid` (bench/gpu)."""
    machine = doc.get("machine")
    if isinstance(machine, str) and machine:
        return machine
    gpu = doc.get("gpu")
    uuid = gpu.get("uuid") if isinstance(gpu, dict) else None
    return uuid if isinstance(uuid, str) and uuid else None


def read_scrapes(directory: Path) -> list[Scrape]:
    """The scrapes in time order; a line that is not a scrape is an error, with its number."""
    path = _find(directory, METRICS)
    if path is None:
        raise RecordingError(f"{directory}: no {METRICS} or {METRICS}.xz")
    out: list[Scrape] = []
    try:
        with open_text(path) as fh:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                    t, body = doc["t"], doc.get("body")
                except (ValueError, KeyError, TypeError, AttributeError):
                    raise RecordingError(f"{path}:{number}: not a {{t, body}} line") from None
                if not (body is None or isinstance(body, str)) or _positive(t) is None:
                    raise RecordingError(f"{path}:{number}: t must be a time, body a string")
                error = doc.get("error")
                out.append(Scrape(float(t), body, str(error) if error is not None else None))
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise RecordingError(f"{path}: {exc}") from None
    if not out:
        raise RecordingError(f"{path}: no scrapes")
    out.sort(key=lambda s: s.t)
    return out


def has_kv_events(directory: Path) -> bool:
    return _find(directory, KV_EVENTS) is not None


def read_kv_events(directory: Path, stats: ReadStats | None = None) -> Iterator[Message]:
    """The recorded messages in file order; malformed lines are counted and skipped."""
    path = _find(directory, KV_EVENTS)
    if path is None:
        return
    try:
        with open_text(path) as fh:
            yield from read_records(fh, stats)
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise RecordingError(f"{path}: {exc}") from None


class Writer:
    """Appends to one recording directory (plain JSON lines; compress them afterwards with
    `xz`, which replay reads as is). Owned by the event loop's caller; the runtime runs
    `write_*` in a worker thread, one at a time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._metrics: IO[str] | None = None

    def write_scrape(self, t: float, body: bytes | None, error: str | None = None) -> None:
        """One scrape; a failed one has no body and says why (replay fails it the same way)."""
        if self._metrics is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Kept open across cycles, closed by close().
            self._metrics = (self.directory / METRICS).open("a", encoding="utf-8")
        doc: dict[str, Any] = {"t": t, "body": body.decode("utf-8", "replace") if body else None}
        if error is not None:
            doc["error"] = error
        line = json.dumps(doc)
        self._metrics.write(line + "\n")
        self._metrics.flush()

    def write_meta(self, meta: Mapping[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / (META + ".tmp")
        tmp.write_text(json.dumps(dict(meta), indent=1, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(self.directory / META)

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


def kv_events_path(directory: Path) -> Path:
    """Where the KV-event source appends the target's messages (--record-events' format)."""
    return directory / KV_EVENTS
