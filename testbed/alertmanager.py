"""A real Alertmanager (Debian's prometheus-alertmanager) and a webhook receiver to catch
what it sends, both on 127.0.0.1."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from testbed.procs import free_port, start, stop, wait_http

ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"


class WebhookReceiver:
    """Collects Alertmanager webhook notifications, by path (= receiver name)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.received: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                with outer._lock:
                    outer.received.append((self.path.strip("/"), body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def alerts(self, receiver: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self.received)
        return [
            a for path, body in items if receiver in (None, path) for a in body.get("alerts", [])
        ]

    def wait_for(
        self, alertname: str, timeout: float = 60.0, status: str = "firing", **labels: str
    ) -> tuple[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                items = list(self.received)
            for path, body in items:
                for a in body.get("alerts", []):
                    lab = a.get("labels", {})
                    if (
                        lab.get("alertname") == alertname
                        and a.get("status") == status
                        and all(lab.get(k) == v for k, v in labels.items())
                    ):
                        return path, a
            time.sleep(0.5)
        seen = [(p, [a["labels"].get("alertname") for a in b.get("alerts", [])]) for p, b in items]
        raise TimeoutError(
            f"{alertname} ({status}) did not reach the receiver in {timeout:.0f}s; got {seen}"
        )


def config_for_test(source: Path, receiver_url: str) -> dict[str, Any]:
    """The committed Alertmanager config with webhooks pointed at `receiver_url` and the
    grouping waits shortened so a test does not wait minutes; routes and inhibitions are
    left exactly as committed."""
    cfg = yaml.safe_load(source.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{source}: not a YAML mapping")
    for r in cfg["receivers"]:
        for hook in r.get("webhook_configs", []):
            hook["url"] = f"{receiver_url}/{r['name']}"

    def fast(route: dict[str, Any]) -> None:
        for key in ("group_wait", "group_interval"):
            if key in route:
                route[key] = "1s"
        for child in route.get("routes", []):
            fast(child)

    fast(cfg["route"])
    return cfg


@dataclass
class Alertmanager:
    workdir: Path
    config: dict[str, Any]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Alertmanager:
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / "alertmanager.yml"
        path.write_text(yaml.safe_dump(self.config))
        cmd = [
            ALERTMANAGER,
            f"--config.file={path}",
            f"--storage.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ]
        log = self.workdir / "alertmanager.log"
        self.proc = start(cmd, log)
        wait_http(self.url + "/-/ready", 30, self.proc, log)
        return self

    def stop(self) -> None:
        stop(self.proc)
        self.proc = None
