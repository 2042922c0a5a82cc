"""A real Prometheus (Debian's package) on 127.0.0.1 for tests and the demo."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from testbed.procs import free_port, http_get, start, stop, wait_http

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


@dataclass
class Prometheus:
    workdir: Path
    scrape_targets: list[str] = field(default_factory=list)  # host:port of exporters
    scrape_interval: str = "1s"
    rule_files: list[Path] = field(default_factory=list)
    alertmanager: str | None = None  # host:port
    config: dict[str, Any] | None = None  # full config overrides the fields above
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def render_config(self) -> dict[str, Any]:
        if self.config is not None:
            return self.config
        cfg: dict[str, Any] = {
            "global": {
                "scrape_interval": self.scrape_interval,
                "evaluation_interval": self.scrape_interval,
            },
            "scrape_configs": [
                {
                    "job_name": "kv-offload-exporter",
                    "static_configs": [{"targets": self.scrape_targets}],
                }
            ],
        }
        if self.rule_files:
            cfg["rule_files"] = [str(p) for p in self.rule_files]
        if self.alertmanager:
            cfg["alerting"] = {
                "alertmanagers": [{"static_configs": [{"targets": [self.alertmanager]}]}]
            }
        return cfg

    def start(self, extra_args: list[str] | None = None) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.workdir / "prometheus.yml"
        cfg_path.write_text(yaml.safe_dump(self.render_config()))
        cmd = [
            PROMETHEUS,
            f"--config.file={cfg_path}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",
            *(extra_args or []),
        ]
        log = self.workdir / "prometheus.log"
        self.proc = start(cmd, log)
        wait_http(self.url + "/-/ready", 60, self.proc, log)
        return self

    def stop(self) -> None:
        stop(self.proc)
        self.proc = None

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        status, body = http_get(url, timeout=10)
        data = json.loads(body)
        if status != 200 or data.get("status") != "success":
            raise RuntimeError(f"{url}: HTTP {status}: {data}")
        return data["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def wait_for(self, expr: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(0.5)
        raise TimeoutError(f"no result for {expr!r} after {timeout:.0f}s")
