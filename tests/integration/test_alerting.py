"""Exporter -> real Prometheus evaluating alerts/rules.yml -> real Alertmanager -> webhook.

The rules are the committed ones with their `for:` durations scaled down (30m -> 4s) so the
test does not wait half an hour; Alertmanager runs the committed routes and inhibitions with
webhooks pointed at a local receiver and grouping waits shortened.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from alerts.generate import rules
from testbed.alertmanager import Alertmanager, WebhookReceiver, config_for_test
from testbed.exporter_proc import ExporterProcess
from testbed.procs import free_port, http_get
from testbed.prometheus import Prometheus
from testbed.recorded import request_sequence
from testbed.replay import ReplayServer, Reply
from tests.conftest import H200

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
FAST = [
    "--interval",
    "0.5",
    "--window",
    "120",
    "--advice-confirm-cycles",
    "1",
    "--advice-confirm-seconds",
    "0",
    "--threshold",
    "min_window_seconds=5",
    "--threshold",
    "min_prompt_tokens=20000",
]


@pytest.fixture
def stack(tmp_path, prometheus_available):
    receiver = WebhookReceiver().start()
    am = Alertmanager(
        tmp_path / "am", config_for_test(REPO / "alerts" / "alertmanager.yml", receiver.url)
    ).start()
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules(for_scale=4 / 1800)))
    started: list[object] = []

    def launch(exporter_args: list[str]) -> tuple[ExporterProcess, Prometheus]:
        exp = ExporterProcess(tmp_path, [*exporter_args, *FAST]).start(ready=False)
        prom = Prometheus(
            tmp_path / "prom",
            scrape_targets=[exp.address],
            rule_files=[rules_file],
            alertmanager=am.address,
        ).start()
        started.extend([prom, exp])
        return exp, prom

    yield launch, receiver
    for p in reversed(started):
        p.stop()  # type: ignore[attr-defined]
    am.stop()
    receiver.stop()


def test_h200_small_model_offload_run_reaches_the_ticket_receiver(stack):
    launch, receiver = stack
    seq = request_sequence(H200 / "b_offload")
    with ReplayServer([Reply(body=s.encode()) for s in seq], version="0.26.0") as vllm:
        exp, _prom = launch(["--vllm-url", vllm.url])
        path, alert = receiver.wait_for(
            "OffloadNotPayingOff", timeout=90, target=vllm.url.removeprefix("http://")
        )
        assert path == "ticket"
        assert alert["labels"]["severity"] == "warning"
        assert alert["annotations"]["runbook_url"].endswith("#offloadnotpayingoff")
        status, body = http_get(exp.url + "/advice")
        assert status == 200 and b"reload_slower_than_recompute" in body
        # Nothing recommends offload for the same engine.
        assert not [
            a for a in receiver.alerts() if a["labels"]["alertname"] == "OffloadRecommended"
        ]


def test_dead_target_alerts_and_inhibits_the_rest(stack):
    launch, receiver = stack
    dead = f"http://127.0.0.1:{free_port()}"
    seq = request_sequence(H200 / "b_offload")
    with ReplayServer([Reply(body=s.encode()) for s in seq]) as vllm:
        launch(["--vllm-url", vllm.url, "--vllm-url", dead])
        path, _ = receiver.wait_for(
            "ExporterTargetDown", timeout=90, target=dead.removeprefix("http://")
        )
        assert path == "ticket"
        # The live target's alert still arrives: inhibition is per target.
        receiver.wait_for(
            "OffloadNotPayingOff", timeout=90, target=vllm.url.removeprefix("http://")
        )
        assert not [
            a
            for a in receiver.alerts()
            if a["labels"].get("target") == dead.removeprefix("http://")
            and a["labels"]["alertname"] != "ExporterTargetDown"
        ]
