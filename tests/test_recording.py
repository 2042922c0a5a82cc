"""exporter/recording.py: the recording format, written by Writer and read back."""

from __future__ import annotations

import lzma
from pathlib import Path

import pytest

from exporter.recording import (
    Meta,
    RecordingError,
    Writer,
    has_kv_events,
    kv_events_path,
    read_kv_events,
    read_meta,
    read_scrapes,
)
from exporter.replay import scrape_interval


def test_read_scrapes_bad_lines_are_errors_with_their_number(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"t": 1.0, "body": "x"}\nnot json\n')
    with pytest.raises(RecordingError, match=r"metrics.jsonl:2"):
        read_scrapes(bad)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    data = lzma.compress(b'{"t": 1.0, "body": "x"}\n' * 100)
    (truncated / "metrics.jsonl.xz").write_bytes(data[: len(data) // 2])
    with pytest.raises(RecordingError):
        read_scrapes(truncated)


def test_writer_round_trip_keeps_failed_scrapes_and_meta(tmp_path: Path) -> None:
    w = Writer(tmp_path / "rec")
    w.write_scrape(10.0, b"# body one\n")
    w.write_scrape(11.0, None, "GET http://x/metrics: HTTP 500")
    w.write_meta(
        {
            "kv_bytes_per_token": 114688,
            "vllm_argv": ["vllm", "serve", "m"],
            "machine": "GPU-a",
            "gpu_names": ["NVIDIA H200"],
            "model_weight_bytes": 29549374996,
        }
    )
    w.close()
    got = read_scrapes(tmp_path / "rec")
    assert [(s.t, s.body, s.error) for s in got] == [
        (10.0, "# body one\n", None),
        (11.0, None, "GET http://x/metrics: HTTP 500"),
    ]
    assert read_meta(tmp_path / "rec") == Meta(
        ("vllm", "serve", "m"),
        None,
        114688.0,
        machine="GPU-a",
        gpu_names=("NVIDIA H200",),
        model_weight_bytes=29549374996.0,
        other={},
    )
    # The GPU kit's recordings name the machine and the GPU by its UUID and name (bench/gpu
    # meta.json).
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "meta.json").write_text(
        '{"gpu": {"uuid": "GPU-3d59", "name": "NVIDIA H200"}}'
    )
    assert read_meta(tmp_path / "kit").machine == "GPU-3d59"
    assert read_meta(tmp_path / "kit").gpu_names == ("NVIDIA H200",)
    assert scrape_interval(got) == 1.0
    assert list(read_kv_events(tmp_path / "rec")) == []


def test_read_scrapes_sorts_by_time_and_skips_blank_lines(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        '{"t": 12.0, "body": "b"}\n\n{"t": 11.0, "body": "a", "error": null}\n'
    )
    assert [(s.t, s.body, s.error) for s in read_scrapes(tmp_path)] == [
        (11.0, "a", None),
        (12.0, "b", None),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"body": "x"}', "not a {t, body} line"),
        ('{"t": 0, "body": "x"}', "t must be a time"),
        ('{"t": 1.0, "body": 3}', "body a string"),
        ("[1, 2]", "not a {t, body} line"),
    ],
)
def test_read_scrapes_rejects_a_line_that_is_not_a_scrape(
    tmp_path: Path, line: str, message: str
) -> None:
    (tmp_path / "metrics.jsonl").write_text(line + "\n")
    with pytest.raises(RecordingError, match=r"metrics.jsonl:1: ") as exc:
        read_scrapes(tmp_path)
    assert message in str(exc.value)


def test_read_scrapes_needs_a_metrics_file_with_scrapes(tmp_path: Path) -> None:
    with pytest.raises(RecordingError, match=r"no metrics\.jsonl or metrics\.jsonl\.xz"):
        read_scrapes(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(RecordingError, match="no scrapes"):
        read_scrapes(tmp_path)


def test_read_scrapes_reads_xz_as_plain(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl.xz").write_bytes(lzma.compress(b'{"t": 5.0, "body": "x"}\n'))
    assert [(s.t, s.body) for s in read_scrapes(tmp_path)] == [(5.0, "x")]


def test_read_meta_keeps_unknown_keys_and_drops_values_that_are_not_positive(
    tmp_path: Path,
) -> None:
    assert read_meta(tmp_path) == Meta()  # no meta.json: nothing known
    (tmp_path / "meta.json").write_text(
        '{"link_bandwidth_bytes_per_second": -1, "kv_bytes_per_token": true, "gpu": "H200"}'
    )
    meta = read_meta(tmp_path)
    assert (meta.vllm_argv, meta.link_bandwidth, meta.kv_bytes_per_token) == (None, None, None)
    assert meta.other == {"gpu": "H200"}
    (tmp_path / "meta.json").write_text('{"link_bandwidth_bytes_per_second": 6.3e10}')
    assert read_meta(tmp_path).link_bandwidth == 6.3e10
    (tmp_path / "meta.json").write_text("[1]")
    with pytest.raises(RecordingError, match="expected a JSON object"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text("{")
    with pytest.raises(RecordingError, match=r"meta\.json"):
        read_meta(tmp_path)


def test_kv_events_are_optional_and_read_from_the_path_the_source_appends_to(
    tmp_path: Path,
) -> None:
    assert not has_kv_events(tmp_path)
    assert list(read_kv_events(tmp_path)) == []
    line = '{"topic": "kv", "seq": 7, "payload": [1.5, [], 0]}'
    kv_events_path(tmp_path).write_text(line + "\nnot json\n")
    assert has_kv_events(tmp_path)
    (msg,) = read_kv_events(tmp_path)
    assert (msg.topic, msg.seq, msg.batch.ts, msg.batch.dp_rank) == ("kv", 7, 1.5, 0)


def test_writer_appends_across_instances_and_replaces_meta(tmp_path: Path) -> None:
    for t in (1.0, 2.0):
        w = Writer(tmp_path / "rec")
        w.write_scrape(t, b"x")
        w.write_meta({"kv_bytes_per_token": t})
        w.close()
    assert [s.t for s in read_scrapes(tmp_path / "rec")] == [1.0, 2.0]
    assert read_meta(tmp_path / "rec").kv_bytes_per_token == 2.0
    assert not (tmp_path / "rec" / "meta.json.tmp").exists()
    Writer(tmp_path / "unused").close()  # nothing written: no directory made
    assert not (tmp_path / "unused").exists()
