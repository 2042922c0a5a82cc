"""exporter/options.py: Option, Registration and TargetConfig, configuration as data."""

from __future__ import annotations

import dataclasses

import pytest

from exporter.options import Option, Registration, TargetConfig
from exporter.vllm_metrics import DEFAULT_MAX_ENGINES


def test_option_key_and_env_follow_the_flag() -> None:
    o = Option("path.procfs", "str", "/proc", "procfs root")
    assert o.key == "path_procfs" and o.env == "KVOE_PATH_PROCFS"
    w = Option("web.config.file", "str", "", "web config")
    assert w.key == "web_config_file" and w.env == "KVOE_WEB_CONFIG_FILE"
    d = Option("kv-events-topic", "str", "kv", "topic")
    assert d.key == "kv_events_topic" and d.env == "KVOE_KV_EVENTS_TOPIC"


def test_registration_switch_is_a_bool_option_named_after_the_source() -> None:
    extra = Option("kv-events-port", "int", 5557, "port")
    reg = Registration("kv_events", False, "subscribe to KV events", (extra,))
    switch = reg.switch
    assert switch == Option("kv-events", "bool", False, "subscribe to KV events")
    assert (switch.key, switch.env) == ("kv_events", "KVOE_KV_EVENTS")
    assert Registration("nvml", True, "GPU").switch.default is True
    assert reg.options == (extra,)


@pytest.mark.parametrize(
    ("url", "label", "metrics", "base"),
    [
        ("http://10.0.0.5:8000", "10.0.0.5:8000", "http://10.0.0.5:8000/metrics", "http://10.0.0.5:8000"),
        ("http://h:8000/", "h:8000", "http://h:8000/metrics", "http://h:8000"),
        ("https://h/vllm/metrics", "h", "https://h/vllm/metrics", "https://h"),
        ("http://h:1/custom?x=1", "h:1", "http://h:1/custom?x=1", "http://h:1"),
    ],
)  # fmt: skip
def test_target_config_label_metrics_url_and_base_url(
    url: str, label: str, metrics: str, base: str
) -> None:
    t = TargetConfig(url=url)
    assert (t.label, t.metrics_url, t.base_url) == (label, metrics, base)


def test_target_config_name_wins_as_label_and_defaults() -> None:
    t = TargetConfig(url="http://h:8000", name="prefill-0")
    assert t.label == "prefill-0"
    assert (t.pid, t.kv_bytes_per_token, t.max_engines) == (None, None, DEFAULT_MAX_ENGINES)
    assert TargetConfig(url="not a url").label == "not a url"  # no netloc: the text itself
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.url = "http://x"  # type: ignore[misc]
