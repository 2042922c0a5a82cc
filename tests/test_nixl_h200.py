"""The exporter's NIXL families and alerts on real disaggregated runs (issue 17).

A prefill and a decode vLLM 0.26.0 engine on one H200 with NixlConnector / NixlPushConnector
(tests/fixtures/nixl/h200-2026-12-03/: 3 shapes; pull over cuda_ipc, pull with UCX's
defaults (TCP emulation), push, pull through host buffers). Each run's two 1 s /metrics
recordings go through the current exporter at their recorded times (one exporter watching
both engines, as on the H200), and every NIXL family is checked against what the test
computes itself from vLLM's raw counters in the same recording; the alerts run in promtool
on the exported series. Expected values come from the recordings, never from a table here.

What the real runs cannot show stays on synthesized vLLM 0.32 expositions
(tests/fixtures/backends/vllm-0.32-nixl-*.prom): failed transfers (none failed on the H200),
an RDMA link, and 0.32's failure accounting (tests/model/derive/test_backends.py,
tests/model/derive/test_peers.py, alerts/tests/rules_test.yml).
"""

from __future__ import annotations

import functools
import json
import lzma
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from alerts.generate import alerts, rules
from exporter.model.derive.backends import nixl_link_type
from exporter.recording import read_meta, read_scrapes
from testbed import backfill

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "gpu" / "nixl"))
import results  # type: ignore[import-not-found]  # bench/gpu/nixl holds scripts, not a package

RUNS_DIR = Path(__file__).resolve().parent / "fixtures" / "nixl" / "h200-2026-12-03"
RUNS = sorted(p.name for p in RUNS_DIR.iterdir() if (p / "decode" / "metrics.jsonl.xz").exists())
ROLES = ("prefill", "decode")
PUSH = "NixlPushConnector"


def raw(body: str, name: str) -> float | None:
    """A vLLM sample's value (one engine per server in these runs), None when absent."""
    for line in body.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rpartition(" ")[2])
    return None


def exported(text: str, family: str) -> dict[tuple[str, ...], float]:
    """(target, then the other label values in order) -> value of one exporter family."""
    out = {}
    for line in text.splitlines():
        if line.startswith(family + "{"):
            labels, _, value = line[len(family) + 1 :].rpartition("} ")
            pairs = [p.split("=", 1) for p in labels.split('",')]
            out[tuple(v.strip('"') for _, v in pairs)] = float(value)
    return out


def by_target(text: str, family: str) -> dict[str, float]:
    return {k[0]: v for k, v in exported(text, family).items()}


@dataclass(frozen=True)
class Run:
    name: str
    meta: Mapping[str, Mapping[str, Any]]  # role -> meta.json
    bodies: Mapping[str, Sequence[tuple[float, str]]]  # role -> recorded scrapes
    summary: Mapping[str, Any]
    current: Sequence[tuple[float, str]]  # the current exporter, at each recorded time
    recorded: Sequence[tuple[float, str]]  # the exporter of the day (exporter.jsonl.xz)

    def delta(self, role: str, name: str) -> float:
        first, last = self.bodies[role][0][1], self.bodies[role][-1][1]
        return (raw(last, name) or 0.0) - (raw(first, name) or 0.0)

    def transfers(self, role: str) -> float:
        return self.delta(role, "vllm:nixl_xfer_time_seconds_count")

    def address(self, role: str) -> str:
        """The target label the exporter of the day gave the engine."""
        return f"127.0.0.1:{self.summary['ports'][role + '_http']}"


@functools.cache
def load(name: str) -> Run:
    d = RUNS_DIR / name
    meta = {r: json.loads((d / r / "meta.json").read_text()) for r in ROLES}
    bodies = {r: [(s.t, s.body) for s in read_scrapes(d / r) if s.body] for r in ROLES}
    recordings = [
        backfill.Recording(r, bodies[r], kv_bytes_per_token=read_meta(d / r).kv_bytes_per_token)
        for r in ROLES
    ]
    # One cycle per decode scrape, 1 s apart as the exporter of the day cycled; the prefill
    # engine serves its latest scrape at that time.
    times = [t for t, _ in bodies["decode"]]
    current = backfill.run_exporter(recordings, interval=1.0, window=300.0, times=times)
    with lzma.open(d / "exporter.jsonl.xz", "rt", encoding="utf-8") as fh:
        recorded = [(float(x["t"]), x["body"]) for x in map(json.loads, fh) if x.get("body")]
    summary = json.loads((d / "summary.json").read_text())
    return Run(name, meta, bodies, summary, current.scrapes, recorded)


def test_every_run_moved_kv_without_failures() -> None:
    """The recordings are what the tests below assume: each run moved KV over NIXL."""
    assert len(RUNS) >= 10
    for name in RUNS:
        run = load(name)
        assert max(run.transfers(r) for r in ROLES) > 0, name
        assert run.summary["requests"]["failed"] == 0, name


@pytest.mark.parametrize("name", RUNS)
def test_nixl_bandwidth_is_vllms_bytes_over_transfer_time(name: str) -> None:
    """kvoffload_nixl_transfer_bandwidth_bytes_per_second at the end of the run = delta
    vllm:nixl_bytes_transferred_sum / delta vllm:nixl_xfer_time_seconds_sum over the
    recording (the window covers it all), on the engine that counted transfers only; and
    it agrees with run_pd.py's figure and with the exporter that ran beside the engines."""
    run = load(name)
    last = run.current[-1][1]
    bandwidth = by_target(last, "kvoffload_nixl_transfer_bandwidth_bytes_per_second")
    recorded = by_target(run.recorded[-1][1], "kvoffload_nixl_transfer_bandwidth_bytes_per_second")
    for role in ROLES:
        if run.transfers(role) == 0:
            assert role not in bandwidth  # no transfer time: no bandwidth, not 0
            continue
        expected = run.delta(role, "vllm:nixl_bytes_transferred_sum") / run.delta(
            role, "vllm:nixl_xfer_time_seconds_sum"
        )
        assert bandwidth[role] == pytest.approx(expected, rel=1e-9)
        assert bandwidth[role] == pytest.approx(
            run.summary[f"nixl_{role}"]["bandwidth_bytes_per_second"], rel=1e-9
        )
        assert recorded[run.address(role)] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("name", RUNS)
def test_nixl_transfers_are_counted_by_the_engine_that_issues_them(name: str) -> None:
    """Pull (NixlConnector): the decode engine READs and counts; push (NixlPushConnector):
    the prefill engine WRITEs and counts, so the bandwidth and speedup are on the prefill
    target. The exporter follows the counters, whichever engine has them."""
    run = load(name)
    connector = run.meta["decode"]["connector"]
    issuer = "prefill" if connector == PUSH else "decode"
    other = "decode" if issuer == "prefill" else "prefill"
    assert run.transfers(issuer) > 0 and run.transfers(other) == 0
    last = run.current[-1][1]
    assert set(by_target(last, "kvoffload_nixl_transfer_bandwidth_bytes_per_second")) == {issuer}


@pytest.mark.parametrize("name", RUNS)
def test_nixl_speedup_is_transfer_tokens_over_the_recompute_rate(name: str) -> None:
    """kvoffload_nixl_transfer_speedup_ratio = (bandwidth / KV bytes per token) over the
    engine's own marginal recompute rate (kvoffload_recompute_tokens_per_second), or the
    fastest rate of another engine of the model when it has none (the decode engine of a
    pull-host run); 0 when recompute is negligible on every engine of the model."""
    run = load(name)
    checked = 0
    for _, text in run.current:
        bandwidth = by_target(text, "kvoffload_nixl_transfer_bandwidth_bytes_per_second")
        recompute = by_target(text, "kvoffload_recompute_tokens_per_second")
        speedup = by_target(text, "kvoffload_nixl_transfer_speedup_ratio")
        for role, bw in bandwidth.items():
            tokens = bw / float(run.meta[role]["kv_bytes_per_token"])
            rate = recompute.get(role) or max(recompute.values(), default=None)
            if rate:
                assert speedup[role] == pytest.approx(tokens / rate, rel=1e-9)
                checked += 1
            elif role in speedup:
                assert speedup[role] == 0.0  # recompute measured as free: no transfer wins
    if name.startswith("large-"):
        # 32B: recompute is slow enough to measure from the first few requests on.
        assert checked > 0


@pytest.mark.parametrize("name", RUNS)
def test_nixl_failures_and_link_on_both_engines(name: str) -> None:
    """kvoffload_nixl_failed_transfers_total re-exports vLLM's counter on both engines (0 on
    the H200), and kvoffload_nixl_link_info names one link per engine: what
    nixl_link_type makes of the UCX_TLS the engine ran with, as the exporter beside the
    engines (which read /proc/PID/environ) said; without the environment, unknown."""
    run = load(name)
    last = run.current[-1][1]
    failed = by_target(last, "kvoffload_nixl_failed_transfers_total")
    links = {k[0]: k[3] for k in exported(last, "kvoffload_nixl_link_info")}
    day = {k[0]: k[3] for k in exported(run.recorded[-1][1], "kvoffload_nixl_link_info")}
    config = {k[0]: k[3] for k in exported(last, "kvoffload_offload_config_info")}
    for role in ROLES:
        assert failed[role] == raw(run.bodies[role][-1][1], "vllm:nixl_num_failed_transfers_total")
        tls = run.meta[role]["environ"].get("UCX_TLS")
        assert day[run.address(role)] == nixl_link_type(tls)
        assert links[role] == nixl_link_type(None)  # replay: no /proc of the engines
        assert config[role] == "NixlConnector"  # from the series (push included)


# --- alerts, in promtool, on the exported series -------------------------------------------

# The recordings last 10 to 64 s; the alerts wait 10 and 30 minutes. Scaled as the
# end-to-end alerting test does, here 30 minutes to 10 s (10 minutes to 3 s).
FOR_SCALE = 10 / 1800
NIXL_ALERTS = {
    "NixlTransfersFailing": "kvoffload_nixl_failed_transfers_total",
    "DisaggregationSlowerThanRecompute": "kvoffload_nixl_transfer_speedup_ratio",
}


def _values(points: Sequence[float | None]) -> str:
    """promtool's value list: `_` before a series exists, `stale` once it is gone."""
    out, seen = [], False
    for v in points:
        if v is None:
            out.append("stale" if seen else "_")
        else:
            seen = True
            out.append(repr(v))
    return " ".join(out)


def _render(template: str, labels: Mapping[str, str], value: float) -> str:
    """An annotation as Prometheus fills it, for the template fields these alerts use."""
    out = template.replace('{{ $value | printf "%.2f" }}', f"{value:.2f}")
    for k, v in labels.items():
        out = out.replace("{{ $labels." + k + " }}", v)
    assert "{{" not in out, out
    return out


def _seconds(duration: str) -> int:
    assert duration.endswith("s"), duration
    return int(duration[:-1])


def expected_firing(
    alert: str, points: Sequence[float | None], for_s: int, failures: Sequence[float]
) -> bool:
    """At the last step: the alert's condition held at each of the last for_s + 1 steps
    (1 s apart), the condition read off the alert's meaning: speedup below 1, or a failure
    counter that grew within the 10 minutes (all of the recording) before the step."""
    if len(points) < for_s + 1:
        return False
    tail = range(len(points) - for_s - 1, len(points))
    if alert == "DisaggregationSlowerThanRecompute":
        return all((v := points[i]) is not None and v < 1 for i in tail)
    return all(points[i] is not None and failures[i] > failures[0] for i in tail)


@pytest.mark.parametrize("name", RUNS)
def test_nixl_alerts_on_the_real_runs(name: str, promtool: str, tmp_path: Path) -> None:
    """NixlTransfersFailing and DisaggregationSlowerThanRecompute, as generated, evaluated by
    promtool on what the exporter exported over the run (1 s apart, `for` scaled); the
    alerts expected at the end are worked out from the same series here."""
    run = load(name)
    rule_set = rules(for_scale=FOR_SCALE)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rule_set))
    defined = {a.name: a for a in alerts()}
    for_s = {
        r["alert"]: _seconds(r["for"])
        for g in rule_set["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    series, checks = [], []
    engines = sorted(
        {k for _, text in run.current for k in exported(text, NIXL_ALERTS["NixlTransfersFailing"])}
    )
    for alert, family in NIXL_ALERTS.items():
        exp_alerts = []
        for key in engines:
            points = [exported(text, family).get(key) for _, text in run.current]
            failed = [
                exported(text, NIXL_ALERTS["NixlTransfersFailing"]).get(key) or 0.0
                for _, text in run.current
            ]
            labels = dict(zip(("target", "model_name", "engine"), key, strict=True))
            if any(v is not None for v in points):
                selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
                series.append({"series": f"{family}{{{selector}}}", "values": _values(points)})
            if expected_firing(alert, points, for_s[alert], failed):
                value = points[-1]
                assert value is not None
                assert alert == "DisaggregationSlowerThanRecompute"  # none failed on the H200
                exp_alerts.append(
                    {
                        "exp_labels": {"severity": defined[alert].severity, **labels},
                        "exp_annotations": {
                            k: _render(v, labels, value)
                            for k, v in defined[alert].rule(FOR_SCALE)["annotations"].items()
                        },
                    }
                )
        checks.append(
            {"eval_time": f"{len(run.current) - 1}s", "alertname": alert, "exp_alerts": exp_alerts}
        )
    doc = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1s",
        "tests": [{"interval": "1s", "input_series": series, "alert_rule_test": checks}],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(doc, width=1000))
    proc = subprocess.run(
        [promtool, "test", "rules", "test.yml"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_disaggregation_alert_fires_on_a_real_slow_link_and_not_on_a_fast_one() -> None:
    """The point of the alert, on real runs of the 32B shape: over UCX's default path (READ
    as TCP software emulation) the exported speedup stays below 1 long enough to fire;
    over cuda_ipc it stays above 1. Which run is which is read from the UCX tables the
    servers logged (ucx.txt), not from the run's name."""
    verdicts = {}
    for name in RUNS:
        run = load(name)
        if run.meta["decode"]["shape"] != "large":
            continue
        read, _ = results.transports(RUNS_DIR / name)  # the KV's READ, as UCX logged it
        if "software emulation" in read:
            path = "tcp"
        elif read.startswith("cuda_ipc/"):
            path = "cuda_ipc"
        else:
            continue  # push: the KV is written, not read
        speedups = [
            v
            for _, text in run.current
            for v in by_target(text, "kvoffload_nixl_transfer_speedup_ratio").values()
        ]
        assert speedups, name
        verdicts[name] = (path, max(speedups) < 1, min(speedups) > 1)
    assert {p for p, _, _ in verdicts.values()} == {"tcp", "cuda_ipc"}, verdicts
    for name, (path, slower, faster) in verdicts.items():
        assert (slower, faster) == ((True, False) if path == "tcp" else (False, True)), name
