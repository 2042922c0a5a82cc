"""exporter/cli.py: subcommand dispatch, --check-config, --version and `advise`."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from exporter import __version__
from exporter.cli import main
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


ADVICE = {
    "advice": [
        {
            "target": "vllm-0",
            "model_name": "qwen3",
            "engine": "0",
            "action": "enable_offload",
            "reason": "recompute_after_eviction",
            "explanation": "Evicted prefixes are recomputed.",
            "recommended_buffer_bytes": 0.5 * 2**30,
            "pending_action": "keep",
            "numbers": {"kv_usage": 0.95, "offload_hit_ratio": None},
        }
    ]
}


@pytest.fixture
def advice_server() -> Iterator[tuple[str, list[Any]]]:
    """An /advice endpoint serving the documents put in the list (the last one stays)."""
    docs: list[Any] = [ADVICE]
    paths: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            paths.append(self.path)
            body = json.dumps(docs[-1]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", docs
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
        assert set(paths) <= {"/advice"}


def test_advise_prints_each_engines_action_explanation_and_known_numbers(
    advice_server, capsys
) -> None:
    url, _ = advice_server
    assert main(["advise", "--url", url + "/"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "vllm-0  qwen3  engine 0"
    assert out[1] == (
        "  action: enable_offload  (recompute_after_eviction)"
        "  recommended --kv-offloading-size 0.5  [pending: keep]"
    )
    assert out[2] == "  Evicted prefixes are recomputed."
    assert out[3].split() == ["kv_usage", "0.95"]
    assert not any("offload_hit_ratio" in line for line in out)  # unknown: not printed


def test_advise_json_prints_the_document(advice_server, capsys) -> None:
    url, _ = advice_server
    assert main(["advise", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == ADVICE


def test_advise_before_the_first_cycle_says_so(advice_server, capsys) -> None:
    url, docs = advice_server
    docs.append({"advice": []})
    assert main(["advise", "--url", url]) == 0
    assert capsys.readouterr().out.startswith("no advice yet")


def test_advise_unreachable_exporter_is_exit_1(capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["advise", "--url", url, "--timeout", "2"]) == 1
    assert f"cannot read {url}/advice" in capsys.readouterr().err
