"""Coverage-guided fuzzing of the KV-event decoder with atheris (libFuzzer).

    pip install atheris
    python -m bench.fuzz.fuzz_kvevents -max_total_time=600 -artifact_prefix=/tmp/ /tmp/corpus-kv

The input is split into ZMQ frames; decode_frames() must return a Message or raise
DecodeError, and a decoded message must survive encode_record/decode_record unchanged.
Seeds: the payloads of tests/fixtures/vllm-0.32.0-cpu/kv-events.jsonl.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import atheris
import msgspec
from atheris.import_hook import instrument_imports  # the stubs' top level omits it

with instrument_imports():
    from exporter import kvevents_codec as codec

SEEDS = Path(__file__).resolve().parents[2] / "tests/fixtures/vllm-0.32.0-cpu/kv-events.jsonl"
SEP = b"\x00\xff\x00"  # frame separator inside one fuzz input


def test_one_input(data: bytes) -> None:
    frames = data.split(SEP)
    try:
        msg = codec.decode_frames(frames)
    except codec.DecodeError:
        return
    again = codec.decode_record(codec.encode_record(msg))
    if again.seq != msg.seq or again.batch != msg.batch:
        raise AssertionError(f"record round trip changed {msg.batch} into {again.batch}")


def main() -> None:
    argv = list(sys.argv)
    corpus = [a for a in argv[1:] if not a.startswith("-")]
    if corpus and SEEDS.exists():
        out = Path(corpus[0])
        out.mkdir(parents=True, exist_ok=True)
        enc = msgspec.msgpack.Encoder()
        for i, line in enumerate(SEEDS.read_text().splitlines()[:50]):
            doc = json.loads(line)
            seq = max(int(doc.get("seq", 0)), 0).to_bytes(8, "big")
            payload = enc.encode(doc["payload"])
            (out / f"seed-{i}").write_bytes(SEP.join([b"kv", seq, payload]))
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
