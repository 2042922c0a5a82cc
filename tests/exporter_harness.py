"""Run an Exporter in-process against real HTTP endpoints, cycling it by hand."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

from aiohttp.test_utils import TestClient, TestServer

from exporter.config import Config
from exporter.options import TargetConfig
from exporter.runtime import Exporter, build_sources
from exporter.server import make_app


def config(*urls: str, **kw: object) -> Config:
    base = Config(targets=tuple(TargetConfig(url=u) for u in urls), interval=1.0, window=300.0)
    return replace(base, **kw)  # type: ignore[arg-type]


@asynccontextmanager
async def running(cfg: Config) -> AsyncIterator[tuple[Exporter, TestClient]]:
    exporter = Exporter(cfg, build_sources(cfg))
    app = make_app(exporter, run_loop=False)
    async with TestClient(TestServer(app)) as client:
        yield exporter, client


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one series in exposition text, or None."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None
