"""Baseline for the /metrics load benchmark: the same metric families served the way an
off-the-shelf prometheus_client exporter serves them, rendered on every scrape.

    python -m bench.baseline_server VLLM_URL PORT
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter.catalogue import Family
from exporter.config import Config
from exporter.options import TargetConfig
from exporter.runtime import Exporter, build_sources


def to_client_families(families: Iterable[Family]) -> list[Metric]:
    out: list[Metric] = []
    for fam in families:
        d = fam.definition
        if not len(fam):
            continue
        metric: Metric
        if d.type == "counter":
            metric = CounterMetricFamily(
                d.name.removesuffix("_total"), d.help, labels=list(d.labels)
            )
        else:
            metric = GaugeMetricFamily(d.name, d.help, labels=list(d.labels))
        for values, value in fam.samples:
            metric.add_metric(list(values), value)
        out.append(metric)
    return out


class Fixed:
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics


async def build(url: str) -> list[Metric]:
    cfg = Config(targets=(TargetConfig(url=url),), interval=1.0, window=300.0)
    exp = Exporter(cfg, build_sources(cfg))
    await exp.start()
    await exp.run_cycle()
    await exp.run_cycle()
    families = exp.families()
    await exp.stop()
    return to_client_families(families)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("vllm_url")
    parser.add_argument("port", type=int)
    args = parser.parse_args(argv)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed(asyncio.run(build(args.vllm_url))))

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), content_type="text/plain", charset="utf-8"
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
