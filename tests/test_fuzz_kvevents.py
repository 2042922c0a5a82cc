"""Property tests of the KV-event decoder (exporter.kvevents_codec).

Any frames or payload decode to a Message or raise DecodeError, nothing else; every
batch built in vLLM's wire layouts (0.32+ tagged maps, older positional arrays, int or
bytes block hashes) decodes to exactly what was encoded, also through a JSON record.
"""

from __future__ import annotations

import contextlib
import os

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.kvevents_codec import (
    MASK64,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    decode_frames,
    decode_payload,
    decode_record,
    encode_record,
)

EXAMPLES = int(os.environ.get("KVOE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ENC = msgspec.msgpack.Encoder()

# Anything msgpack can carry, nested: what a confused or hostile publisher could send.
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU"])
    | st.builds(msgspec.msgpack.Ext, st.integers(0, 127), st.binary(max_size=8))
)
ANY = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=30,
)


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_arbitrary_frames_raise_only_decode_error(frames: list[bytes]) -> None:
    with contextlib.suppress(DecodeError):
        decode_frames(frames)


@FUZZ
@given(ANY, st.integers(0, 2**63 - 1))
def test_arbitrary_msgpack_payload_raises_only_decode_error(obj, seq: int) -> None:
    try:
        payload = ENC.encode(obj)
    except (OverflowError, TypeError):
        return
    try:
        msg = decode_frames([b"kv", seq.to_bytes(8, "big"), payload])
    except DecodeError:
        return
    assert msg.seq == seq
    # Whatever decoded can also be recorded for --record-events and read back the same.
    assert decode_record(encode_record(msg)).batch == msg.batch
    for ev in msg.batch.events:
        assert isinstance(ev, BlockStored | BlockRemoved | AllBlocksCleared)
        for h in getattr(ev, "hashes", ()):
            assert 0 <= h <= MASK64


HASH = st.integers(0, MASK64) | st.binary(min_size=1, max_size=32)


def _h(value: int | bytes) -> int:
    return value if isinstance(value, int) else int.from_bytes(value, "big") & MASK64


@st.composite
def events(draw: st.DrawFn) -> tuple[object, object]:
    """(wire form, expected decoded event)."""
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    as_array = draw(st.booleans())
    medium = draw(st.sampled_from(["GPU", "CPU", None]))
    group = draw(st.integers(0, 8))
    hashes = draw(st.lists(HASH, min_size=1, max_size=4))
    if kind == "stored":
        parent = draw(st.none() | HASH)
        tokens = draw(st.lists(st.integers(0, 100_000), max_size=20))
        size = draw(st.integers(0, 256))
        fields = [hashes, parent, tokens, size, None, medium, None, None, group]
        names = [
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
        ]
        expected: object = BlockStored(
            tuple(_h(h) for h in hashes),
            None if parent is None else _h(parent),
            size,
            medium or "GPU",
            group,
            len(tokens),
        )
        tag = "BlockStored"
    elif kind == "removed":
        fields, names = [hashes, medium, group], ["block_hashes", "medium", "group_idx"]
        expected = BlockRemoved(tuple(_h(h) for h in hashes), medium or "GPU", group)
        tag = "BlockRemoved"
    else:
        fields, names, tag = [], [], "AllBlocksCleared"
        expected = AllBlocksCleared("")
    if as_array:
        wire: object = [tag, *fields]
    else:
        # vLLM omits fields equal to their default (None).
        wire = {"type": tag, **{n: v for n, v in zip(names, fields, strict=True) if v is not None}}
    return wire, expected


@FUZZ
@given(
    st.lists(events(), max_size=6),
    st.floats(0, 2e9, allow_nan=False),
    st.none() | st.integers(0, 7),
    st.integers(0, 2**63 - 1),
    st.booleans(),
)
def test_wire_batches_decode_to_what_was_encoded(evs, ts, rank, seq, as_map) -> None:
    wire_events = [w for w, _ in evs]
    batch = (
        {"ts": ts, "events": wire_events, "data_parallel_rank": rank}
        if as_map
        else [ts, wire_events, rank]
    )
    msg = decode_frames([b"kv", seq.to_bytes(8, "big"), ENC.encode(batch)])
    assert msg.seq == seq and msg.topic == "kv"
    assert msg.batch.ts == ts and msg.batch.dp_rank == rank
    assert list(msg.batch.events) == [e for _, e in evs]
    # A recording of the message decodes to the same batch (bytes hashes folded to ints).
    again = decode_record(encode_record(msg))
    assert again.seq == seq and again.batch == msg.batch
    assert decode_payload(ENC.encode(batch))[0] == msg.batch


def test_a_payload_with_a_msgpack_ext_value_can_be_recorded() -> None:
    """Found by atheris: a one-byte mutation of a recorded payload turned a token id into a
    msgpack Ext; the batch decoded, but --record-events could not write it and stopped."""
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "token_ids": [1, msgspec.msgpack.Ext(1, b"x")],
    }
    payload = ENC.encode([1.0, [event | {"block_size": 16}], 0])
    msg = decode_frames([b"kv", (0).to_bytes(8, "big"), payload])
    assert decode_record(encode_record(msg)).batch == msg.batch
