"""exporter/whatif_cli.py: `kv-offload-exporter whatif`, the curve of a recorded event file."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from exporter.kvevents_codec import encode_record, read_file
from exporter.model.whatif.simulator import blocks_for_bytes, replay
from exporter.whatif_cli import run
from tests.test_whatif_synth import abcab_messages

MIB = 1 << 20


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The A, A, B, C, A workload (prefixes evicted from a small GPU cache, then re-sent),
    written as --record-events writes it."""
    path = tmp_path_factory.mktemp("whatif") / "events.jsonl"
    lines = [encode_record(m) for m in abcab_messages(batches=3)]
    path.write_text("\n".join(lines) + "\n")
    return path


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = run(list(argv), out, err)
    return rc, out.getvalue(), err.getvalue()


def as_json(*argv: str) -> dict[str, Any]:
    rc, out, err = cli(*argv, "--json")
    assert rc == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc


def test_whatif_json_is_the_simulators_curve(events: Path) -> None:
    doc = as_json("--events", str(events), "--blocks", "8,64,512")
    curve = replay(list(read_file(events)), [8, 64, 512])
    assert doc["stored_tokens"] == curve.stored_tokens > 0
    assert doc["recomputed_after_eviction_tokens"] == curve.recomputed_after_eviction_tokens
    assert [s["cpu_buffer_blocks"] for s in doc["sizes"]] == [8, 64, 512]
    assert [s["cpu_buffer_bytes"] for s in doc["sizes"]] == [None, None, None]  # no bytes/block
    for i, s in enumerate(doc["sizes"]):
        assert s["hit_tokens"] == round(curve.sizes[i].hit_tokens)
        assert s["hit_ratio"] == curve.hit_ratio(i)
        assert "share_of_prompt_tokens" not in s
    ratios = [s["hit_ratio"] for s in doc["sizes"]]
    assert ratios == sorted(ratios) and ratios[-1] > 0  # the re-sent prefixes come back


def test_whatif_sizes_in_bytes_need_the_bytes_per_block(events: Path) -> None:
    per_block = 16 * 114_688
    doc = as_json(
        "--events", str(events), "--sizes", "64MiB,256MiB", "--kv-bytes-per-block", str(per_block)
    )
    assert [s["cpu_buffer_bytes"] for s in doc["sizes"]] == [64 * MIB, 256 * MIB]
    assert [s["cpu_buffer_blocks"] for s in doc["sizes"]] == [
        blocks_for_bytes(64 * MIB, per_block, 1),
        blocks_for_bytes(256 * MIB, per_block, 1),
    ]
    blocks = as_json("--events", str(events), "--blocks", "4", "--kv-bytes-per-block", "1000")
    assert blocks["sizes"][0]["cpu_buffer_bytes"] == 4000
    rc, out, err = cli("--events", str(events), "--sizes", "1GiB")
    assert (rc, out) == (2, "")
    assert "--sizes needs --kv-bytes-per-block" in err


def test_whatif_prompt_tokens_add_each_sizes_share(events: Path) -> None:
    doc = as_json("--events", str(events), "--blocks", "512", "--prompt-tokens", "100000")
    (size,) = doc["sizes"]
    assert size["share_of_prompt_tokens"] == pytest.approx(size["hit_tokens"] / 100_000, abs=1e-5)


def test_whatif_table_has_a_row_per_size(events: Path) -> None:
    rc, out, _ = cli(
        "--events", str(events), "--sizes", "1MiB,2GiB", "--kv-bytes-per-block", "65536",
        "--prompt-tokens", "1000000", "--no-progress",
    )  # fmt: skip
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"{events}: ") and "batches" in lines[0]
    assert " ".join(lines[1].split()) == "cpu buffer blocks hit tokens hit ratio of prompt"
    assert lines[2].split()[:3] == ["1", "MiB", "16"]
    assert lines[3].split()[:3] == ["2", "GiB", "32768"]
    assert len(lines) == 4 and all(line.endswith("%") for line in lines[2:])


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--blocks", "4", "--seeds", "0"], "--seeds must be at least 1"),
        (["--blocks", "4", "--sample-rate", "0"], "--sample-rate must be in (0, 1]"),
        (["--blocks", "4,-1"], "sizes must not be negative"),
        (["--blocks", ","], "--blocks: empty list"),
    ],
)
def test_whatif_bad_arguments_are_exit_2(events: Path, extra: list[str], needle: str) -> None:
    rc, out, err = cli("--events", str(events), *extra)
    assert (rc, out) == (2, "")
    assert err.startswith("kv-offload-exporter whatif: ") and needle in err


def test_whatif_missing_or_empty_event_file(tmp_path: Path) -> None:
    rc, _, err = cli("--events", str(tmp_path / "none.jsonl"), "--blocks", "4")
    assert rc == 2 and "none.jsonl" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("not json\n")
    rc, out, err = cli("--events", str(empty), "--blocks", "4")
    assert (rc, out) == (1, "")
    assert "no KV-event messages" in err


def test_whatif_plot_draws_the_curve(events: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "curve.png"
    rc, _, err = cli("--events", str(events), "--blocks", "8,512", "--plot", str(png))
    assert rc == 0, err
    assert png.read_bytes().startswith(b"\x89PNG")
