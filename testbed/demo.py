"""The README's main job: does CPU KV offload pay off here? Answered end to end.

A real vLLM CPU server (tiny random model) publishes its KV-cache events to the exporter,
which replays them through its what-if simulator; a workload of requests sharing long
document prefixes runs until the evidence reaches the advisor's default thresholds; then
the demo prints the what-if curve and the advice, and waits for the alert that the real
Prometheus (the project's rules) sends through the real Alertmanager to a webhook.

    ./run demo [--keep] [--assumed-load-bandwidth 14GB]

--keep leaves everything running (URLs printed) until Ctrl-C, SIGTERM or SIGHUP; any of
those signals stops every process the demo started.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from alerts.generate import rules
from exporter.config import parse_bytes
from exporter.render.status_page import card_from_json, render_text
from exporter.thresholds import DEFAULT
from testbed.alertmanager import Alertmanager, WebhookReceiver, config_for_test
from testbed.exporter_proc import ExporterProcess
from testbed.procs import free_port, http_get
from testbed.prometheus import Prometheus
from testbed.vllm_cpu import (
    BLOCK_SIZE,
    VllmServer,
    WorkloadStats,
    kv_bytes_per_token,
    shared_documents_workload,
)

REPO = Path(__file__).resolve().parent.parent
# The alert rules wait 30 minutes before firing (advice must stand); the demo cannot.
DEMO_FOR_SECONDS = 10.0
# GPU KV pool of the CPU server: 20 blocks of 128 tokens hold one or two documents.
NUM_GPU_BLOCKS = 20
# The tiny model's KV is 1 KiB per token (128 KiB per block), so its CPU tiers are MiB-sized.
WHATIF_MIB = (1, 2, 4, 8, 16, 32)
ALERT_FOR_ACTION = {
    "enable_offload": "OffloadRecommended",
    "disable_offload": "OffloadNotPayingOff",
    "grow_buffer": "OffloadBufferTooSmall",
}
BANDWIDTH_WHY = (
    "a PCIe Gen4 x16 host: ~25 GB/s host-to-device in practice, times 0.56, the share of the "
    "link vLLM's block copies reached on the H200 (docs/advisor.md)"
)


class StopSignalError(Exception):
    """SIGTERM or SIGHUP: unwind, so every child is stopped."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    # The first signal unwinds; later ones must not interrupt stopping the children.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise StopSignalError(signal.Signals(signum).name)


def _say(text: str = "") -> None:
    print(text, flush=True)


def _advice(exporter: ExporterProcess) -> list[dict[str, Any]]:
    try:
        status, body = http_get(exporter.url + "/advice", timeout=5)
    except OSError:
        return []
    return list(json.loads(body)["advice"]) if status == 200 else []


def _progress(item: dict[str, Any] | None, stats: WorkloadStats) -> str:
    if item is None:
        return f"waiting for the first scrape ({stats.requests} requests sent)"
    n = item["numbers"]
    th = item["thresholds"]
    covered = n.get("window_covered_seconds") or 0.0
    tokens = n.get("prompt_tokens") or 0.0
    need_s = max(0.0, th["min_window_seconds"] - covered)
    rate = tokens / covered if covered > 0 else 0.0
    need_tok = max(0.0, th["min_prompt_tokens"] - tokens)
    eta = max(need_s, need_tok / rate if rate > 0 else need_s)
    head = f"advice in ~{eta:.0f} s" if eta > 0 else f"evidence complete, {item['reason']}"
    return (
        f"{head}: window {covered:.0f}/{th['min_window_seconds']:.0f} s, "
        f"{tokens:,.0f}/{th['min_prompt_tokens']:,.0f} prompt tokens "
        f"({stats.requests} requests)"
    )


def _print_alert(path: str, alert: dict[str, Any]) -> None:
    lab, ann = alert.get("labels", {}), alert.get("annotations", {})
    _say(
        f"\nAlertmanager -> webhook receiver '{path}': {lab.get('alertname')} "
        f"({alert.get('status')}, severity {lab.get('severity')})"
    )
    _say(f"  summary:     {ann.get('summary', '')}")
    _say(f"  description: {ann.get('description', '')}")
    _say(f"  runbook:     {ann.get('runbook_url', '')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep everything running")
    parser.add_argument(
        "--assumed-load-bandwidth",
        default="14GB",
        help="reload bytes/s to assume (no GPU here); default: " + BANDWIDTH_WHY,
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="give up after this (s)")
    args = parser.parse_args(argv)
    bandwidth = parse_bytes(args.assumed_load_bandwidth)

    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kvoe-demo-"))
    stop_load = threading.Event()
    stats = WorkloadStats()
    try:
        with ExitStack() as stack:
            rc = _run(args, bandwidth, work, stack, stop_load, stats, t_start)
            if args.keep and rc == 0:
                _say("running; Ctrl-C (or SIGTERM/SIGHUP) stops everything")
                while True:
                    time.sleep(3600)
            for sig in STOP_SIGNALS:  # a signal now must not interrupt stopping the children
                signal.signal(sig, signal.SIG_IGN)
            return rc
    except (KeyboardInterrupt, StopSignalError) as exc:
        _say(f"\nstopped ({type(exc).__name__} {exc}); every process the demo started is down")
        return 130 if isinstance(exc, KeyboardInterrupt) else 143
    finally:
        stop_load.set()


@dataclass
class Stack:
    """Every server the demo runs, each stopped by the ExitStack it was registered with."""

    vllm: VllmServer
    receiver: WebhookReceiver
    alertmanager: Alertmanager
    exporter: ExporterProcess
    prometheus: Prometheus


def _start_stack(work: Path, bandwidth: int, stack: ExitStack) -> Stack:
    """vLLM CPU (started, not yet ready), the exporter beside it, Prometheus with the
    project's rules, a real Alertmanager and a webhook receiver."""
    kv_endpoint = f"tcp://127.0.0.1:{free_port()}"
    vllm = VllmServer(work / "vllm", num_gpu_blocks=NUM_GPU_BLOCKS, kv_events_endpoint=kv_endpoint)
    stack.callback(vllm.stop)
    _say(
        f"starting vLLM CPU {vllm.url} (tiny random model, {NUM_GPU_BLOCKS} KV blocks of "
        f"{BLOCK_SIZE} tokens, KV events -> {kv_endpoint}; about half a minute on 2 cores) ..."
    )
    vllm.spawn()
    receiver = WebhookReceiver().start()
    stack.callback(receiver.stop)
    am = Alertmanager(
        work / "alertmanager",
        config_for_test(REPO / "alerts" / "alertmanager.yml", receiver.url),
    )
    stack.callback(am.stop)
    am.start()
    exporter = ExporterProcess(
        work,
        [
            "--vllm-url",
            vllm.url,
            "--interval",
            "1",
            "--window",
            "180",
            "--kv-bytes-per-token",
            str(kv_bytes_per_token()),
            "--kv-events-bind",
            kv_endpoint,
            "--whatif-sizes",
            ",".join(f"{m}MiB" for m in WHATIF_MIB),
            "--assumed-load-bandwidth",
            str(bandwidth),
            "--no-nvml",
        ],
    )
    stack.callback(exporter.stop)
    exporter.start(ready=True)
    rules_file = work / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules(for_scale=DEMO_FOR_SECONDS / 1800)))
    prom = Prometheus(
        work / "prometheus",
        scrape_targets=[exporter.address],
        rule_files=[rules_file],
        alertmanager=am.address,
    )
    stack.callback(prom.stop)
    prom.start()
    _say(
        f"exporter {exporter.url} (KV events bound at {kv_endpoint}), Prometheus {prom.url} "
        f"(alerts/rules.yml, 'for: 30m' shortened to {DEMO_FOR_SECONDS:g} s), "
        f"Alertmanager {am.url} (alerts/alertmanager.yml, group waits 1 s, webhooks -> "
        f"{receiver.url})"
    )
    _say(
        f"no GPU here, so the reload rate is an assumption: --assumed-load-bandwidth "
        f"{bandwidth / 1e9:g} GB/s, {BANDWIDTH_WHY}; everything else is measured on vLLM CPU"
    )
    return Stack(vllm, receiver, am, exporter, prom)


def _start_workload(
    url: str, stack: ExitStack, stop_load: threading.Event, stats: WorkloadStats
) -> None:
    load = threading.Thread(
        target=shared_documents_workload,
        args=(url, stop_load, stats),
        name="workload",
        daemon=True,
    )
    load.start()
    stack.callback(load.join, 70)
    stack.callback(stop_load.set)
    _say(
        "workload: 16 shared documents of 800-1700 tokens (Zipf popularity) + a fresh question "
        "each, ~4 requests/s; the GPU pool holds one or two documents, so most come back "
        "after eviction"
    )
    _say(
        f"evidence the advisor needs (defaults, exporter/thresholds.py): "
        f"{DEFAULT.min_window_seconds:.0f} s of window and "
        f"{DEFAULT.min_prompt_tokens:,.0f} prompt tokens"
    )


def _wait_for_advice(
    exporter: ExporterProcess, stats: WorkloadStats, deadline: float
) -> dict[str, Any] | None:
    """The first decided advice before the deadline, with a progress line meanwhile."""
    last_print = 0.0
    tty = sys.stdout.isatty()
    try:
        while time.monotonic() < deadline:
            items = _advice(exporter)
            item = items[0] if items else None
            if item is not None and item["action"] != "insufficient_data":
                return item
            line = _progress(item, stats)
            if tty:
                print("\r" + line.ljust(100), end="", flush=True)
            elif time.monotonic() - last_print >= 10:
                _say(line)
                last_print = time.monotonic()
            time.sleep(1)
        return None
    finally:
        if tty:
            print()


def _show_alert(receiver: WebhookReceiver, action: str, deadline: float) -> bool:
    """The alert the action raises, as Alertmanager delivered it; False if it never came."""
    alertname = ALERT_FOR_ACTION.get(action)
    if alertname is None:
        _say(f"\n{action} raises no alert (alerts/rules.yml)")
        return True
    _say(
        f"\nwaiting for {alertname}: Prometheus evaluates alerts/rules.yml on the "
        f"exporter's kvoffload_advice, fires after {DEMO_FOR_SECONDS:g} s, Alertmanager "
        "routes it ..."
    )
    try:
        remaining = max(30.0, deadline - time.monotonic() + 60)
        path, alert = receiver.wait_for(alertname, timeout=remaining)
    except TimeoutError as exc:
        _say(str(exc))
        return False
    _print_alert(path, alert)
    return True


def _run(
    args: argparse.Namespace,
    bandwidth: int,
    work: Path,
    stack: ExitStack,
    stop_load: threading.Event,
    stats: WorkloadStats,
    t_start: float,
) -> int:
    _say(f"working directory: {work}")
    s = _start_stack(work, bandwidth, stack)
    s.vllm.wait_ready()
    _say(f"vLLM ready after {time.monotonic() - t_start:.0f} s")
    _start_workload(s.vllm.url, stack, stop_load, stats)
    deadline = t_start + args.timeout
    decided = _wait_for_advice(s.exporter, stats, deadline)
    if decided is None:
        _say(f"no decided advice within {args.timeout:.0f} s; the latest:")
        for it in _advice(s.exporter):
            _say(render_text(card_from_json(it)))
        return 1
    _say(
        f"\nadvice after {time.monotonic() - t_start:.0f} s "
        f"({stats.requests} requests, {stats.prompt_tokens:,} prompt tokens sent):\n"
    )
    _say(render_text(card_from_json(decided)))
    if not _show_alert(s.receiver, decided["action"], deadline):
        return 1
    if not args.keep:
        stop_load.set()
    _say(f"\ndone in {time.monotonic() - t_start:.0f} s")
    url = s.exporter.url
    _say(
        f"look at: {url}/ (status page), {url}/advice, `kv-offload-exporter advise --url "
        f"{url}`, {s.prometheus.url}/alerts, {s.alertmanager.url}"
    )
    if args.keep:
        _say(f"vLLM {s.vllm.url}; logs in {work}; the workload keeps running")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
