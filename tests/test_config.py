from __future__ import annotations

import argparse

import pytest

from exporter.cli import serve_parser
from exporter.config import ConfigError, load_config, parse_bytes, parse_listen


def args(*argv: str) -> argparse.Namespace:
    return serve_parser().parse_args(list(argv))


def test_defaults_and_flag():
    cfg = load_config(args("--vllm-url", "http://127.0.0.1:8000"), {})
    assert cfg.interval == 1.0 and cfg.window == 300.0 and cfg.listen == ":9747"
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


def test_the_weights_and_the_peak_for_a_computed_tokens_floor(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "model_weight_bytes: 27.52GiB\ntargets:\n  - url: http://a:8000\n"
        "  - url: http://b:8000\n    model_weight_bytes: 61.03GiB\n"
    )
    cfg = load_config(args("--config", str(f), "--gpu-peak-flops", "989e12"), {})
    assert cfg.model_weight_bytes == int(27.52 * (1 << 30)) and cfg.gpu_peak_flops == 989e12
    assert [t.model_weight_bytes for t in cfg.targets] == [None, int(61.03 * (1 << 30))]
    bad = tmp_path / "bad.yaml"
    bad.write_text("targets:\n  - url: http://a:8000\n    model_weight_bytes: heavy\n")
    with pytest.raises(ConfigError) as exc:
        load_config(args("--config", str(bad), "--gpu-peak-flops", "-1"), {})
    assert "heavy" in str(exc.value) and "--gpu-peak-flops" in str(exc.value)


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


def test_every_option_is_a_config_field_and_every_field_an_option():
    from dataclasses import fields

    from exporter.config import OPTIONS, Config

    keys = {o.key for o in OPTIONS}
    assert len(keys) == len(OPTIONS), "two options share a key"
    # targets/thresholds are built from several options; extra keeps unknown YAML keys.
    derived = {"targets", "thresholds", "kv_events_targets", "extra"}
    assert {f.name for f in fields(Config)} - derived == keys - {"vllm_url", "threshold"}


def test_each_registered_source_brings_its_switch_and_flags():
    import argparse

    from exporter.config import OPTIONS, add_arguments, load_config
    from exporter.sources.registry import REGISTRATIONS

    names = [r.name for r in REGISTRATIONS]
    assert names == ["nvml", "procfs", "cgroup", "kv_events"]
    for reg in REGISTRATIONS:
        assert reg.switch in OPTIONS and all(o in OPTIONS for o in reg.options)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--vllm-url", "http://127.0.0.1:8000", "--no-kv-events"])
    env = {"KVOE_NVML": "false", "KVOE_PATH_CGROUP": "/x"}
    cfg = load_config(args, env)
    assert (cfg.kv_events, cfg.nvml, cfg.procfs, cfg.path_cgroup) == (False, False, True, "/x")


def test_the_hysteresis_in_evaluations_and_in_seconds(tmp_path):
    cfg = load_config(args("--vllm-url", "http://a:1"), {})
    assert (cfg.advice_confirm_cycles, cfg.advice_confirm_seconds) == (3, 30.0)
    f = tmp_path / "c.yaml"
    f.write_text("advice_confirm_seconds: 0\n")
    cfg = load_config(args("--config", str(f), "--vllm-url", "http://a:1"), {})
    assert cfg.advice_confirm_seconds == 0.0
    with pytest.raises(ConfigError) as exc:
        load_config(
            args(
                "--vllm-url",
                "http://a:1",
                "--advice-confirm-seconds",
                "-1",
                "--advice-confirm-cycles",
                "0",
            ),
            {},
        )
    assert "--advice-confirm-seconds" in str(exc.value)
    assert "--advice-confirm-cycles" in str(exc.value)
