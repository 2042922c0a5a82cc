"""exporter/cli.py: subcommand dispatch, --check-config, --version, and `advise` against a
running exporter (the status page's card) and a dead URL."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from exporter import __version__
from exporter.cli import main
from exporter.model.advisor.text import gib
from exporter.model.advisor.types import ACTION_INFO, Action
from testbed.browser import served_replay
from testbed.procs import free_port


def test_check_config_exit_codes(capsys):
    assert main(["--check-config", "--vllm-url", "http://127.0.0.1:8000"]) == 0
    assert main(["--check-config"]) == 2
    assert "no vLLM target" in capsys.readouterr().err


def test_main_serve_is_the_default_subcommand(capsys) -> None:
    argv = ["--check-config", "--vllm-url", "http://a:1", "--vllm-url", "http://b:2"]
    assert main(["serve", *argv]) == 0
    named = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == named == "configuration OK: 2 target(s), listen :9747\n"


def test_main_version_prints_the_package_version(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kv-offload-exporter {__version__}"


def test_main_bad_config_is_exit_2_with_every_problem(capsys) -> None:
    assert main(["--check-config", "--vllm-url", "ftp://x", "--interval", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kv-offload-exporter: ")
    assert "ftp://x" in err and "--interval" in err


def test_main_whatif_subcommand_runs_the_whatif_cli(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["whatif", "--blocks", "4"])  # its own parser: --events is required
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kv-offload-exporter whatif ") and "--events" in err
    assert main(["whatif", "--events", str(tmp_path / "none.jsonl"), "--blocks", "4"]) == 2


async def test_advise_prints_the_status_pages_card(capsys) -> None:
    async with served_replay("large-b") as (url, r):
        rc = await asyncio.to_thread(main, ["advise", "--url", url, "--timeout", "5"])
        ((_, [(_, advice)]),) = r.exporter.advice.items()  # what the exporter decided
    out = capsys.readouterr().out
    assert rc == 0
    assert advice.action != Action.INSUFFICIENT_DATA and advice.recommended_buffer_bytes
    assert "target large-b (http://127.0.0.1:" in out and "): up" in out
    title = ACTION_INFO[advice.action].headline
    assert f"{title}: {advice.action} ({advice.reason})" in out
    recommended = gib(advice.recommended_buffer_bytes)
    assert (
        f"CPU buffer: configured 1.14 GiB; recommended {recommended} (--kv-offloading-size" in out
    )
    assert "<- configured" in out and "<- recommended" in out
    assert "numbers:" in out


async def test_advise_json_is_the_advice_document(capsys) -> None:
    async with served_replay("large-b") as (url, r):
        rc = await asyncio.to_thread(main, ["advise", "--url", url, "--json"])
        ((_, [(_, advice)]),) = r.exporter.advice.items()
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert doc["advice"][0]["action"] == str(advice.action) and doc["advice"][0]["whatif"]


def test_advise_on_a_dead_url_says_so(capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    rc = main(["advise", "--url", url, "--timeout", "2"])
    captured = capsys.readouterr()
    assert rc == 1
    assert f"no answer from an exporter at {url}" in captured.err and "refused" in captured.err
    assert captured.out == ""


def test_a_reader_that_goes_away_ends_a_report_quietly() -> None:
    """`replay ... | head`: the pipe closes before the report is written."""
    run = Path(__file__).parent / "fixtures" / "gpu" / "matrix" / "qwen3-0.6b-unique-none"
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "replay", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).parent.parent,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # before the replay has printed a line
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err.decode()
    assert err == b""
