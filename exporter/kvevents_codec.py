"""vLLM KV-cache event wire format: ZMQ frames and recorded JSON lines -> typed batches.

Pure parsing, no sockets. vLLM's layout changed across releases, so everything is
accepted the way msgspec's generic decoder returns it: an EventBatch as a
`[ts, events, dp_rank]` array (or an older map), each event as a map tagged "type"
(0.32+) or a positional array with the tag first (older releases and third-party
encoders). Block hashes arrive as 64-bit ints, or as raw bytes with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; bytes are folded to the same int vLLM itself
would send, so a live stream and a recording of it yield the same keys.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgspec

MASK64 = (1 << 64) - 1
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
END_SEQ = -1  # vLLM's replay end marker, 8-byte signed big-endian


class DecodeError(ValueError):
    """A frame, payload or event that does not have vLLM's KV-event shape."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    hashes: tuple[int, ...]
    parent: int | None
    block_size: int
    medium: str
    group_idx: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    hashes: tuple[int, ...]
    medium: str
    group_idx: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str = ""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None


@dataclass(frozen=True, slots=True)
class Message:
    """One published ZMQ message: [topic, seq, payload], payload already decoded."""

    topic: str
    seq: int
    batch: EventBatch
    raw: Any  # the generically decoded payload, kept for --record-events


def block_hash(value: Any) -> int:
    if isinstance(value, bool):
        raise DecodeError("block hash is a boolean")
    if isinstance(value, int):
        return value & MASK64
    if isinstance(value, bytes | bytearray):
        # Same fold as vLLM's maybe_convert_block_hash, so int and bytes streams agree.
        return int.from_bytes(value, "big") & MASK64
    raise DecodeError(f"block hash of type {type(value).__name__}")


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise DecodeError("block_hashes is not a list")
    return tuple(block_hash(h) for h in value)


def _int(value: Any, what: str, default: int = 0) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeError(f"{what} is not an integer")
    return value


def _medium(value: Any) -> str:
    # Releases before the medium field only published GPU events.
    if value is None:
        return MEDIUM_GPU
    if not isinstance(value, str):
        raise DecodeError("medium is not a string")
    return value


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _as_map(tag: str, raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    fields = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
    values = list(raw[1:])
    return dict(zip(fields, values, strict=False))


def decode_event(raw: Any) -> Event:
    """One event, as a tagged map or a positional array with the tag first."""
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list | tuple) and raw:
        tag = raw[0]
    else:
        raise DecodeError("event is neither a map nor a tagged array")
    if tag == "BlockStored":
        m = _as_map(tag, raw)
        parent = m.get("parent_block_hash")
        tokens = m.get("token_ids")
        size = _int(m.get("block_size"), "block_size")
        if size < 0:
            raise DecodeError("negative block_size")
        return BlockStored(
            hashes=_hashes(m.get("block_hashes")),
            parent=None if parent is None else block_hash(parent),
            block_size=size,
            medium=_medium(m.get("medium")),
            group_idx=_int(m.get("group_idx"), "group_idx"),
            num_tokens=len(tokens) if isinstance(tokens, list | tuple) else 0,
        )
    if tag == "BlockRemoved":
        m = _as_map(tag, raw)
        return BlockRemoved(
            hashes=_hashes(m.get("block_hashes")),
            medium=_medium(m.get("medium")),
            group_idx=_int(m.get("group_idx"), "group_idx"),
        )
    if tag == "AllBlocksCleared":
        medium = raw.get("medium") if isinstance(raw, dict) else None
        return AllBlocksCleared(medium if isinstance(medium, str) else "")
    raise DecodeError(f"unknown event type {tag!r}")


def decode_batch(raw: Any) -> EventBatch:
    """A generically decoded EventBatch: [ts, events, dp_rank] or a map of the same."""
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list | tuple) and len(raw) in (2, 3):
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) == 3 else None
    else:
        raise DecodeError("payload is not an EventBatch")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise DecodeError("batch timestamp is not a finite number")
    if not isinstance(events, list | tuple):
        raise DecodeError("batch events is not a list")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise DecodeError("data_parallel_rank is not a non-negative integer")
    return EventBatch(float(ts), tuple(decode_event(e) for e in events), rank)


_DECODER = msgspec.msgpack.Decoder()


# Typed fast path for the 0.32+ layout (array batch, maps tagged "type"): token ids are
# skipped as raw msgpack instead of becoming Python ints, which is most of the decoding
# work. Anything it rejects goes through the generic path above.
class _FastStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")
    block_size: int = 0
    medium: str | None = None
    group_idx: int | None = None


class _FastRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _FastCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    medium: str | None = None


_FAST = msgspec.msgpack.Decoder(
    tuple[float, list[_FastStored | _FastRemoved | _FastCleared], int | None]
)


def _array_len(raw: msgspec.Raw) -> int:
    """Length of a msgpack array from its header, without decoding the items."""
    b = bytes(raw)
    if not b:
        return 0
    head = b[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC and len(b) >= 3:
        return int.from_bytes(b[1:3], "big")
    if head == 0xDD and len(b) >= 5:
        return int.from_bytes(b[1:5], "big")
    return 0


def _fast_event(e: _FastStored | _FastRemoved | _FastCleared) -> Event:
    if isinstance(e, _FastStored):
        if e.block_size < 0:
            raise DecodeError("negative block_size")
        return BlockStored(
            hashes=tuple(block_hash(h) for h in e.block_hashes),
            parent=None if e.parent_block_hash is None else block_hash(e.parent_block_hash),
            block_size=e.block_size,
            medium=e.medium or MEDIUM_GPU,
            group_idx=e.group_idx or 0,
            num_tokens=_array_len(e.token_ids),
        )
    if isinstance(e, _FastRemoved):
        return BlockRemoved(
            hashes=tuple(block_hash(h) for h in e.block_hashes),
            medium=e.medium or MEDIUM_GPU,
            group_idx=e.group_idx or 0,
        )
    return AllBlocksCleared(e.medium or "")


def _decode_fast(payload: bytes) -> EventBatch | None:
    try:
        ts, events, rank = _FAST.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return None
    if not math.isfinite(ts) or (rank is not None and rank < 0):
        return None
    return EventBatch(ts, tuple(_fast_event(e) for e in events), rank)


def decode_payload(payload: bytes, *, keep_raw: bool = True) -> tuple[EventBatch, Any]:
    """Decode one message payload; `raw` (the generic decoding) only when asked for."""
    if not keep_raw:
        batch = _decode_fast(payload)
        if batch is not None:
            return batch, None
    try:
        raw = _DECODER.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise DecodeError(f"payload is not msgpack: {exc}") from None
    return decode_batch(raw), raw


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise DecodeError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def decode_frames(frames: Sequence[bytes]) -> Message:
    """A live message: [topic, seq (8-byte big-endian), msgpack payload]."""
    if len(frames) != 3:
        raise DecodeError(f"{len(frames)} frames, expected 3 (topic, seq, payload)")
    topic, seq_frame, payload = frames
    seq = decode_seq(seq_frame)
    if seq < 0:
        raise DecodeError("negative sequence number outside a replay")
    batch, raw = decode_payload(payload)
    return Message(topic.decode("utf-8", "replace"), seq, batch, raw)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big") & MASK64
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    # msgpack Ext and timestamps have no JSON form; nothing the simulator reads can be
    # one (hashes and sizes are validated), so a placeholder keeps list lengths intact.
    return None


def encode_record(msg: Message) -> str:
    """One JSON line, the format of tests/fixtures/vllm-0.32.0-cpu/kv-events.jsonl."""
    return json.dumps(
        {"topic": msg.topic, "seq": msg.seq, "payload": _jsonable(msg.raw)},
        separators=(",", ":"),
    )


def decode_record(line: str) -> Message:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DecodeError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or "payload" not in doc:
        raise DecodeError("record is not an object with a payload")
    seq = doc.get("seq", -1)
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise DecodeError("record seq is not an integer")
    topic = doc.get("topic", "")
    return Message(str(topic), seq, decode_batch(doc["payload"]), doc["payload"])


@dataclass(slots=True)
class ReadStats:
    lines: int = 0
    bad_lines: int = 0
    bytes_read: int = 0


def read_records(stream: IO[str], stats: ReadStats | None = None) -> Iterator[Message]:
    """Messages of a recorded file; malformed lines are counted in `stats` and skipped."""
    for line in stream:
        if stats is not None:
            stats.lines += 1
            stats.bytes_read += len(line)
        if not line.strip():
            continue
        try:
            yield decode_record(line)
        except DecodeError:
            if stats is not None:
                stats.bad_lines += 1


def read_file(path: str | Path, stats: ReadStats | None = None) -> Iterator[Message]:
    with Path(path).open(encoding="utf-8") as fh:
        yield from read_records(fh, stats)
