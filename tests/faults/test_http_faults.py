"""Fault matrix, HTTP side: one exporter process, one real HTTP endpoint per fault.

Every target starts healthy (two recorded vLLM 0.32 scrapes) and then misbehaves for
good. One exporter scrapes all of them at once, so the faults also must not leak into
each other: the healthy target stays up throughout. For every fault the exporter keeps
answering /metrics, the fault is visible as kvoffload_target_up and a reason, windowed
values of the failed target disappear once its data is stale, and re-exported counters
never go down.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from exporter.vllm_metrics import EngineKey
from testbed.exporter_proc import ExporterProcess
from testbed.procs import http_get
from testbed.replay import ReplayServer, Reply
from tests.conftest import CPU
from tests.faults.common import (
    Recorder,
    monotonic_violations,
    nan_series,
    ratio_violations,
    scrape,
    series_of,
    status_json,
    value,
    wait_until,
)
from tests.helpers import sample_from

pytestmark = [pytest.mark.slow]

BEFORE = (CPU / "metrics-before.prom").read_bytes()
AFTER = (CPU / "metrics-after.prom").read_bytes()
HITS = b'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 7680.0'
USAGE = b'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0'
COMPUTE = (
    b'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-llama",'
    b'source="local_compute"} 32320.0'
)
MAX_ENGINES = 8
ENGINES = 300
EXTRA_SOURCES = 40
SCRAPE_TIMEOUT = 1.0


def _invalid_values() -> bytes:
    body = AFTER
    for old, new in (
        (HITS, HITS.replace(b"7680.0", b"NaN")),
        (USAGE, USAGE.replace(b"0.0", b"+Inf")),
        (COMPUTE, COMPUTE.replace(b"32320.0", b"-5.0")),
    ):
        assert body.count(old) == 1
        body = body.replace(old, new)
    return body


def _many_engines(step: int) -> bytes:
    """ENGINES engines of one model, and EXTRA_SOURCES made-up `source` values on one."""
    lines = []
    for i in range(ENGINES):
        lab = f'engine="{i:03d}",model_name="m"'
        lines += [
            f"vllm:prefix_cache_queries_total{{{lab}}} {1000 * (step + 1)}",
            f"vllm:prefix_cache_hits_total{{{lab}}} {400 * (step + 1)}",
            f"vllm:kv_cache_usage_perc{{{lab}}} 0.25",
        ]
        sources = ["local_compute", "local_cache_hit", "external_kv_transfer"]
        if i == 0:
            sources += [f"made_up_{j}" for j in range(EXTRA_SOURCES)]
        lines += [
            f'vllm:prompt_tokens_by_source_total{{{lab},source="{s}"}} {10 * (step + 1)}'
            for s in sources
        ]
    return ("\n".join(lines) + "\n").encode()


# Per scrape: 6 series of each engine over the cap, and the made-up sources over 16.
DROPPED_PER_SCRAPE = (ENGINES - MAX_ENGINES) * 6 + (3 + EXTRA_SOURCES - 16)

GOOD = [Reply(body=BEFORE), Reply(body=AFTER)]
FAULTS: dict[str, tuple[list[Reply], str | None]] = {
    "healthy": (GOOD, None),
    "http_500": ([*GOOD, Reply(body=b"internal error", status=500)], "http_status"),
    "hang": ([*GOOD, Reply(body=AFTER, delay=3600.0)], "timeout"),
    "truncated": ([*GOOD, Reply(body=AFTER[:20000], truncate=True)], "truncated"),
    "html": ([*GOOD, Reply(body=b"<html><body>502 Bad Gateway</body></html>")], "parse"),
    "binary": ([*GOOD, Reply(body=random.Random(3).randbytes(8192))], "parse"),
    "fifty_megabytes": ([*GOOD, Reply(stream_bytes=50 * 1024 * 1024)], "too_large"),
    "duplicate_series": (
        [*GOOD, Reply(body=AFTER + HITS.replace(b"7680", b"7000") + b"\n")],
        "parse",
    ),
    "invalid_values": ([*GOOD, Reply(body=_invalid_values())], "invalid_value"),
    "many_engines": ([Reply(body=_many_engines(0)), Reply(body=_many_engines(1))], None),
}
DOWN = sorted(k for k, (_, reason) in FAULTS.items() if reason not in (None, "invalid_value"))


@dataclass
class Matrix:
    servers: dict[str, ReplayServer]
    exporter: ExporterProcess
    recorder: Recorder
    final: dict
    status: dict

    def target(self, fault: str) -> str:
        return self.servers[fault].url.removeprefix("http://")

    def events(self) -> list[dict]:
        out = []
        for line in self.exporter.log_path.read_text().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out


def _failures(metrics: dict, target: str, reason: str) -> float:
    return (
        value(metrics, "kvoffload_target_scrape_failures_total", target=target, reason=reason)
        or 0.0
    )


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    servers = {name: ReplayServer(list(replies)).start() for name, (replies, _) in FAULTS.items()}
    args = ["--interval", "1", "--window", "60", "--scrape-timeout", str(SCRAPE_TIMEOUT)]
    args += ["--max-engines-per-target", str(MAX_ENGINES), "--max-body-bytes", "1MiB"]
    args += ["--no-nvml", "--no-procfs", "--no-cgroup", "--log-format", "json"]
    for srv in servers.values():
        args += ["--vllm-url", srv.url]
    exporter = ExporterProcess(tmp_path_factory.mktemp("faults"), args)
    recorder = None
    try:
        exporter.start()
        recorder = Recorder(exporter.url).start()

        def settled() -> bool:
            status, m = scrape(exporter.url)
            if status != 200:
                return False
            targets = {n: s.url.removeprefix("http://") for n, s in servers.items()}
            for name in DOWN:
                if _failures(m, targets[name], FAULTS[name][1] or "") < 5:
                    return False
            return (
                _failures(m, targets["invalid_values"], "invalid_value") >= 5
                and (
                    value(
                        m, "kvoffload_target_series_dropped_total", target=targets["many_engines"]
                    )
                    or 0
                )
                >= 3 * DROPPED_PER_SCRAPE
            )

        wait_until("every fault seen at least 5 times", settled, timeout=120)
        recorder.stop()
        _, final = scrape(exporter.url)
        yield Matrix(servers, exporter, recorder, final, status_json(exporter.url))
    finally:
        if recorder is not None:
            recorder.stop()
        exporter.stop()
        for srv in servers.values():
            srv.stop()


def test_metrics_answered_throughout(matrix: Matrix) -> None:
    rec = matrix.recorder
    assert rec.errors == []
    assert len(rec.statuses) >= 10
    assert set(rec.statuses) == {200}
    for path in ("/healthz", "/readyz"):
        assert http_get(matrix.exporter.url + path)[0] == 200


@pytest.mark.parametrize("fault", DOWN)
def test_fault_marks_target_down_with_reason(matrix: Matrix, fault: str) -> None:
    target, reason = matrix.target(fault), FAULTS[fault][1]
    assert reason is not None
    m = matrix.final
    assert value(m, "kvoffload_target_up", target=target) == 0.0
    assert _failures(m, target, reason) >= 5
    others = [
        s
        for s in series_of(m, "kvoffload_target_scrape_failures_total", target=target)
        if dict(s[1])["reason"] != reason and m[s] > 0
    ]
    assert others == [], f"{fault}: failures under other reasons too"
    # The status page names the reason and the error text.
    entry = next(t for t in matrix.status["targets"] if t["target"] == target)
    assert entry["up"] is False and entry["error_kind"] == reason and entry["error"]
    # One log line for the state change, however many scrapes failed.
    downs = [
        e
        for e in matrix.events()
        if e["event"] == "source_down" and e.get("source") == f"vllm:{target}"
    ]
    assert len(downs) == 1, downs


@pytest.mark.parametrize("fault", DOWN)
def test_failed_target_exports_no_windowed_values_but_keeps_totals(
    matrix: Matrix, fault: str
) -> None:
    """Stale input (no good scrape for more than 2 intervals) derives nothing; the
    re-exported totals stay at vLLM's last good values, not 0 and not invented."""
    target, m = matrix.target(fault), matrix.final
    lab = {"target": target, "model_name": "tiny-llama", "engine": "0"}
    for name in (
        "kvoffload_gpu_prefix_hit_ratio",
        "kvoffload_kv_cache_usage_ratio",
        "kvoffload_prefill_average_tokens_per_second",
    ):
        assert value(m, name, **lab) is None, name
    assert value(m, "kvoffload_prompt_tokens_total", source="local_cache_hit", **lab) == 7680.0
    assert value(m, "kvoffload_prompt_tokens_total", source="local_compute", **lab) == 32320.0


def test_healthy_target_unaffected_by_the_others(matrix: Matrix) -> None:
    target, m = matrix.target("healthy"), matrix.final
    lab = {"target": target, "model_name": "tiny-llama", "engine": "0"}
    assert value(m, "kvoffload_target_up", target=target) == 1.0
    failures = series_of(m, "kvoffload_target_scrape_failures_total", target=target)
    assert failures and all(m[s] == 0 for s in failures)
    assert value(m, "kvoffload_gpu_prefix_hit_ratio", **lab) is not None


def test_hung_target_never_gets_more_than_one_request_at_a_time(matrix: Matrix) -> None:
    hang = matrix.servers["hang"]
    # The exporter kept cycling while the target hung (each scrape ended at the timeout)...
    assert _failures(matrix.final, matrix.target("hang"), "timeout") >= 5
    assert hang.requests >= 2 + 5
    # ...and never stacked a new request on one still waiting.
    assert hang.max_in_flight == 1
    for name, srv in matrix.servers.items():
        assert srv.max_in_flight <= 1, name


def test_invalid_values_are_dropped_counted_and_derive_nothing(matrix: Matrix) -> None:
    target, m = matrix.target("invalid_values"), matrix.final
    lab = {"target": target, "model_name": "tiny-llama", "engine": "0"}
    # The scrape itself works; the bad series are dropped and counted.
    assert value(m, "kvoffload_target_up", target=target) == 1.0
    assert _failures(m, target, "invalid_value") >= 5
    # +Inf usage: no usage gauge (unknown, not 0 and not +Inf).
    assert value(m, "kvoffload_kv_cache_usage_ratio", **lab) is None
    # NaN prefix hits: the scrapes without a valid hit counter add nothing to the window;
    # the hit ratio is exactly the one of the last good interval (before -> after).
    before, after = sample_from(BEFORE.decode(), 0), sample_from(AFTER.decode(), 1)
    ek = EngineKey("tiny-llama", "0")
    d_hits = after.engines[ek].counters["prefix_hits"] - before.engines[ek].counters["prefix_hits"]
    d_q = (
        after.engines[ek].counters["prefix_queries"] - before.engines[ek].counters["prefix_queries"]
    )
    assert 0 < d_hits < d_q
    assert value(m, "kvoffload_gpu_prefix_hit_ratio", **lab) == pytest.approx(d_hits / d_q)
    # The negative counter does not drag the re-exported total down.
    assert value(m, "kvoffload_prompt_tokens_total", source="local_compute", **lab) == 32320.0
    # Series fed by valid values still are derived.
    assert value(m, "kvoffload_prefill_average_tokens_per_second", **lab) is not None
    logged = [e for e in matrix.events() if e["event"] == "invalid_series_dropped"]
    assert len(logged) == 1 and len(logged[0]["series"]) == 3


def test_label_cardinality_is_capped_and_counted(matrix: Matrix) -> None:
    target, m = matrix.target("many_engines"), matrix.final
    assert value(m, "kvoffload_target_up", target=target) == 1.0
    dropped = value(m, "kvoffload_target_series_dropped_total", target=target)
    assert dropped is not None and dropped >= 3 * DROPPED_PER_SCRAPE
    assert dropped % DROPPED_PER_SCRAPE == 0
    assert dropped / DROPPED_PER_SCRAPE <= matrix.servers["many_engines"].requests
    engines = {
        dict(labels)["engine"]
        for (name, labels) in m
        if dict(labels).get("target") == target and "engine" in dict(labels)
    }
    assert engines == {f"{i:03d}" for i in range(MAX_ENGINES)}
    # The split label is capped too: the real sources are kept, the made-up ones beyond
    # 16 are not, and nothing of engines over the cap reaches the output.
    sources = {
        dict(k[1])["source"]
        for k in series_of(m, "kvoffload_prompt_tokens_total", target=target, engine="000")
    }
    assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}
    # The kept set is the same in every scrape, and the cap is logged once.
    for metrics in matrix.recorder.history:
        seen = {
            dict(k[1])["engine"]
            for k in series_of(metrics, "kvoffload_gpu_prefix_hit_ratio", target=target)
        }
        assert seen <= {f"{i:03d}" for i in range(MAX_ENGINES)}
    capped = [e for e in matrix.events() if e["event"] == "engine_cap_exceeded"]
    assert len(capped) == 1 and capped[0]["dropped_engines"] == ENGINES - MAX_ENGINES


def test_counters_never_decrease_and_ratios_stay_in_unit_interval(matrix: Matrix) -> None:
    history = matrix.recorder.history
    assert len(history) >= 10
    assert monotonic_violations(history) == []
    assert ratio_violations(history) == []
    for metrics in history:
        assert nan_series(metrics) == []


def test_log_has_no_tracebacks(matrix: Matrix) -> None:
    text = Path(matrix.exporter.log_path).read_text()
    assert "Traceback" not in text
    assert not [e for e in matrix.events() if e.get("level") in ("error", "critical")]
