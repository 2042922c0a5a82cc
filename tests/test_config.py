from __future__ import annotations

import argparse

import pytest

from exporter.cli import serve_parser
from exporter.config import ConfigError, load_config, parse_bytes, parse_listen


def args(*argv: str) -> argparse.Namespace:
    return serve_parser().parse_args(list(argv))


def test_defaults_and_flag():
    cfg = load_config(args("--vllm-url", "http://127.0.0.1:8000"), {})
    assert cfg.interval == 5.0 and cfg.window == 300.0 and cfg.listen == ":9747"
    assert cfg.targets[0].label == "127.0.0.1:8000"
    assert cfg.targets[0].metrics_url == "http://127.0.0.1:8000/metrics"


def test_precedence_flag_over_env_over_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "interval: 3\nwindow: 120\nlisten: 127.0.0.1:1111\n"
        "targets:\n  - url: http://a:8000\n    name: a\n"
    )
    env = {"KVOE_WINDOW": "60", "KVOE_LISTEN": "127.0.0.1:2222"}
    cfg = load_config(args("--config", str(f), "--listen", "127.0.0.1:3333"), env)
    assert cfg.interval == 3.0  # file
    assert cfg.window == 60.0  # env beats file
    assert cfg.listen == "127.0.0.1:3333"  # flag beats env
    assert [t.label for t in cfg.targets] == ["a"]


def test_env_list_of_urls():
    cfg = load_config(args(), {"KVOE_VLLM_URLS": "http://a:1, http://b:2"})
    assert [t.url for t in cfg.targets] == ["http://a:1", "http://b:2"]


def test_repeated_flag_gives_several_targets():
    cfg = load_config(args("--vllm-url", "http://a:1", "--vllm-url", "http://b:2"), {})
    assert [t.label for t in cfg.targets] == ["a:1", "b:2"]


def test_all_problems_are_reported_together(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("interval: -1\nbogus: 1\nmax_body_bytes: lots\n")
    with pytest.raises(ConfigError) as exc:
        load_config(args("--config", str(f), "--vllm-url", "ftp://x", "--listen", "nope"), {})
    text = str(exc.value)
    for needle in ("bogus", "max_body_bytes", "ftp://x", "--interval", "nope"):
        assert needle in text


def test_missing_target_is_an_error():
    with pytest.raises(ConfigError, match="no vLLM target"):
        load_config(args(), {})


def test_parse_helpers():
    assert parse_bytes("0.5GiB") == 1 << 29
    assert parse_bytes("16MiB") == 16 << 20
    assert parse_bytes("1e9") == 10**9
    assert parse_listen(":9747") == ("0.0.0.0", 9747)
    assert parse_listen("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError):
        parse_bytes("-1")


def test_check_config_exit_codes(capsys):
    from exporter.cli import main

    assert main(["--check-config", "--vllm-url", "http://127.0.0.1:8000"]) == 0
    assert main(["--check-config"]) == 2
    assert "no vLLM target" in capsys.readouterr().err
