"""exporter/kvevents_codec.py: vLLM's KV-event wire format (map and positional events,
bytes hashes, older layouts), the fast decoder against the generic one, and the
--record-events JSON lines."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.whatif_vs_observed import open_text
from exporter.kvevents_codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    Message,
    ReadStats,
    decode_batch,
    decode_frames,
    decode_payload,
    decode_record,
    encode_record,
    read_file,
    read_records,
)
from tests.helpers import GPU

FIXTURES = Path(__file__).parent / "fixtures"
CPU_EVENTS = FIXTURES / "vllm-0.32.0-cpu" / "kv-events.jsonl"
ENC = msgspec.msgpack.Encoder()


def test_decode_map_events_as_vllm_032_sends_them() -> None:
    line = CPU_EVENTS.read_text().splitlines()[1]
    msg = decode_record(line)
    assert msg.seq == 1 and msg.topic == "kv" and msg.batch.dp_rank == 0
    kinds = [type(e) for e in msg.batch.events]
    assert kinds.count(BlockRemoved) == 6 and kinds[-1] is BlockStored
    stored = msg.batch.events[-1]
    assert isinstance(stored, BlockStored)
    assert len(stored.hashes) == 12 and stored.block_size == 128 and stored.medium == "GPU"
    assert stored.num_tokens == 1536


def test_decode_positional_events_and_bytes_hashes() -> None:
    h = bytes(range(32))
    folded = int.from_bytes(h, "big") & ((1 << 64) - 1)  # vLLM's int conversion
    payload = ENC.encode(
        [
            1.5,
            [
                ["BlockStored", [h], None, [1, 2], 16, None, "CPU"],
                ["BlockStored", [7], 3, [1], 16, None],  # before the medium field
                ["BlockRemoved", [h], "GPU"],
                ["AllBlocksCleared"],
            ],
            2,
        ]
    )
    batch, _ = decode_payload(payload)
    a, b, c, d = batch.events
    assert isinstance(a, BlockStored) and a.hashes == (folded,) and a.medium == "CPU"
    assert isinstance(b, BlockStored) and b.medium == "GPU" and b.parent == 3
    assert isinstance(c, BlockRemoved) and c.hashes == (folded,)
    assert isinstance(d, AllBlocksCleared)
    assert batch.dp_rank == 2


def test_decode_batch_as_a_map_from_older_releases() -> None:
    batch = decode_batch({"ts": 3.0, "events": [{"type": "AllBlocksCleared"}]})
    assert batch.ts == 3.0 and batch.dp_rank is None and len(batch.events) == 1


@pytest.mark.parametrize(
    "payload",
    [
        [1.0, [{"type": "Nope"}], 0],
        [1.0, [{"type": "BlockStored", "block_hashes": "x"}], 0],
        [float("nan"), [], 0],
        [1.0, [], -1],
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}], 0],
        "text",
        [1.0],
    ],
)
def test_decode_rejects_malformed_batches(payload: Any) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_decode_frames_checks_shape() -> None:
    payload = ENC.encode([1.0, [], 0])
    assert decode_frames([b"kv", (5).to_bytes(8, "big"), payload]).seq == 5
    for frames in ([b"kv", b"\x00", payload], [b"kv", payload], [b"kv", b"\0" * 8, b"\xc1"]):
        with pytest.raises(DecodeError):
            decode_frames(frames)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decode_payload_never_raises_anything_but_decode_error(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode_payload(data)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
        max_leaves=20,
    )
)
def test_decode_batch_fuzz(doc: Any) -> None:
    with contextlib.suppress(DecodeError):
        decode_batch(doc)


def test_fast_decoder_agrees_with_the_generic_one() -> None:
    for line in CPU_EVENTS.read_text().splitlines():
        payload = ENC.encode(json.loads(line)["payload"])
        fast, raw = decode_payload(payload, keep_raw=False)
        slow, _ = decode_payload(payload)
        assert raw is None and fast == slow
    # Older layouts fall back to the generic path.
    legacy = ENC.encode([1.0, [["BlockRemoved", [5], "GPU"]], 0])
    assert decode_payload(legacy, keep_raw=False)[0].events == (BlockRemoved((5,), "GPU", 0),)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fast_decoder_never_raises_anything_but_decode_error(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode_payload(data, keep_raw=False)


def test_records_survive_values_json_cannot_hold() -> None:
    # A msgpack Ext among the token ids (one flipped byte of a real payload) must not stop
    # --record-events: the batch is written and reads back the same.
    ext = msgspec.msgpack.Ext(1, b"x")
    event = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, ext], "block_size": 16}
    msg = decode_frames([b"kv", (0).to_bytes(8, "big"), ENC.encode([1.0, [event], 0])])
    assert decode_record(encode_record(msg)).batch == msg.batch


def test_record_roundtrip_of_the_recorded_file() -> None:
    for line in CPU_EVENTS.read_text().splitlines():
        msg = decode_record(line)
        again = decode_record(encode_record(msg))
        assert again.batch == msg.batch and again.seq == msg.seq


def test_recorded_file_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text(
        CPU_EVENTS.read_text().splitlines()[0] + "\nnot json\n" + json.dumps({"seq": 1}) + "\n"
    )
    stats = ReadStats()
    got: list[Message] = list(read_file(path, stats))
    assert len(got) == 1 and stats.bad_lines == 2


def test_tiering_run_writes_to_the_fs_tier_in_kv_events() -> None:
    """0.26's fs tier publishes hash-only BlockStored events with medium "FS" (0.32: STORAGE)."""
    media: dict[tuple[str, str], int] = {}
    with open_text(GPU / "small-tier" / "kv_events.jsonl") as fh:
        for msg in read_records(fh):
            for ev in msg.raw[1]:
                key = (str(ev["type"]), str(ev.get("medium")))
                media[key] = media.get(key, 0) + 1
    assert media[("BlockStored", "FS")] > 0 and ("BlockRemoved", "FS") not in media
    assert not any(m == "STORAGE" for _, m in media)
