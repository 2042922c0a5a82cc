"""The exporter as users run it: the console script in its own process."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from testbed.procs import free_port, http_get, start, stop, wait_http


@dataclass
class ExporterProcess:
    workdir: Path
    args: list[str]
    port: int = field(default_factory=free_port)
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"exporter-{self.port}.log"

    def start(self, ready: bool = True) -> ExporterProcess:
        cmd = [sys.executable, "-m", "exporter", "--listen", self.address, *self.args]
        self.proc = start(cmd, self.log_path, env=self.env)
        wait_http(self.url + ("/readyz" if ready else "/healthz"), 60, self.proc, self.log_path)
        return self

    def metrics(self) -> str:
        status, body = http_get(self.url + "/metrics")
        assert status == 200, status
        return body.decode()

    def stop(self) -> None:
        stop(self.proc)
        self.proc = None
