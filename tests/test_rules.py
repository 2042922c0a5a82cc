"""Rules, their unit tests and the Alertmanager config, checked with the real tools."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from alerts.generate import alerts, rules
from exporter.catalogue import CATALOGUE
from exporter.vllm_metrics import WANTED
from tests.conftest import need

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "alerts" / "rules.yml"
AM = REPO / "alerts" / "alertmanager.yml"
ISSUE_ALERTS = {
    "OffloadRecommended",
    "OffloadNotPayingOff",
    "OffloadBufferTooSmall",
    "OffloadStoresWithoutReuse",
    "PinnedMemoryNearLimit",
    "PCIeSaturated",
    "KVCacheSaturated",
    "ExporterTargetDown",
    "CollectorDown",
    "KVEventGaps",
}
# Issue 11: one alert per KV transfer backend, firing only while the backend is in use.
BACKEND_ALERTS = {
    "SecondaryTierNotEarningKeep",
    "SimpleOffloadDroppingStores",
    "NixlTransfersFailing",
    "DisaggregationSlowerThanRecompute",
}
# Raw vLLM series the recording rules may use beyond what the exporter reads.
VLLM_EXTRA = {"vllm:time_to_first_token_seconds_bucket"}


def tool(name: str) -> str:
    path = shutil.which(name)
    need(path is not None, name)
    assert path is not None
    return path


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)


def test_committed_rules_are_what_the_generator_makes():
    committed = yaml.safe_load(RULES.read_text())
    assert committed == rules()


def test_promtool_check_rules():
    proc = run(tool("promtool"), "check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_unit_tests_pass():
    proc = run(tool("promtool"), "test", "rules", "alerts/tests/rules_test.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_of_the_issue_exists_and_is_unit_tested():
    names = {a.name for a in alerts()}
    assert names >= ISSUE_ALERTS  # the issue-5 alerts, unchanged
    assert names == ISSUE_ALERTS | BACKEND_ALERTS
    tests = (REPO / "alerts" / "tests" / "rules_test.yml").read_text()
    for name in names:
        # Each alert has at least one case that expects it to fire.
        assert re.search(rf"alertname: {name}\n\s+exp_alerts:\n\s+- exp_labels", tests), name


def test_every_alert_has_a_runbook_and_severity():
    runbook = (REPO / "docs" / "runbooks.md").read_text()
    for a in alerts():
        assert f"## {a.name}" in runbook, f"docs/runbooks.md lacks a section for {a.name}"
        assert a.severity in ("critical", "warning", "info")


def test_rule_metric_names_exist():
    text = RULES.read_text()
    for name in set(re.findall(r"\bkvoffload_[a-z0-9_]*[a-z0-9]\b", text)):
        assert name in CATALOGUE, name
    for name in set(re.findall(r"\bvllm:[a-z0-9_:]*[a-z0-9]\b", text)):
        assert name in WANTED or name in VLLM_EXTRA, name


def test_alertmanager_config_is_valid():
    proc = run(tool("amtool"), "check-config", str(AM))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["severity=critical", "alertname=PinnedMemoryNearLimit"], "pager"),
        (["severity=warning", "alertname=OffloadNotPayingOff"], "ticket"),
        (["severity=info", "alertname=OffloadRecommended"], "advice"),
        (["alertname=SomethingElse"], "ticket"),
    ],
)
def test_alertmanager_routes(labels, receiver):
    proc = run(
        tool("amtool"),
        "config",
        "routes",
        "test",
        f"--config.file={AM}",
        f"--verify.receivers={receiver}",
        *labels,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_severity_has_a_route():
    cfg = yaml.safe_load(AM.read_text())
    routed = {m.split("=")[1].strip('"') for r in cfg["route"]["routes"] for m in r["matchers"]}
    assert {a.severity for a in alerts()} <= routed
