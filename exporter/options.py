"""What configures the exporter, as data: one flag's definition, a source's registration, and
a vLLM target. Neutral ground: config.py builds flags, KVOE_* variables and YAML keys from
these, and the sources declare theirs without importing config.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from exporter.vllm_metrics import DEFAULT_MAX_ENGINES


@dataclass(frozen=True, slots=True)
class Option:
    flag: str  # --flag name without dashes
    kind: str  # str | float | int | bool | bytes | list | bytes_list
    default: Any
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def key(self) -> str:
        return self.flag.replace("-", "_").replace(".", "_")

    @property
    def env(self) -> str:
        return "KVOE_" + self.key.upper()


@dataclass(frozen=True, slots=True)
class Registration:
    """A source, registered once, as node_exporter's registerCollector: its name is the
    on/off flag (--NAME / --no-NAME, KVOE_NAME, YAML NAME), `options` are its own flags."""

    name: str
    default: bool
    help: str
    options: tuple[Option, ...] = ()

    @property
    def switch(self) -> Option:
        return Option(self.name.replace("_", "-"), "bool", self.default, self.help)


@dataclass(frozen=True, slots=True)
class TargetConfig:
    url: str
    name: str = ""
    pid: int | None = None
    kv_bytes_per_token: float | None = None
    model_weight_bytes: float | None = None  # per GPU, for a computed token's floor
    max_engines: int = DEFAULT_MAX_ENGINES  # engine label sets kept per scrape

    @property
    def label(self) -> str:
        """The `target` label: the configured name, else host:port like Prometheus' instance."""
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        return parts.netloc or self.url

    @property
    def metrics_url(self) -> str:
        parts = urlsplit(self.url)
        if parts.path and parts.path not in ("", "/"):
            return self.url
        return self.url.rstrip("/") + "/metrics"

    @property
    def base_url(self) -> str:
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}"
