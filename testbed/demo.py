"""The README's main job: a real vLLM CPU server, the exporter and Prometheus, the seed
workload, and the numbers the exporter derived from it.

    ./run demo [--keep]     (--keep leaves everything running until Ctrl-C)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from testbed.exporter_proc import ExporterProcess
from testbed.procs import http_get
from testbed.prometheus import Prometheus
from testbed.vllm_cpu import VllmServer, kv_bytes_per_token, seed_workload


def _fmt(value: object, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _print_engine(e: dict[str, object]) -> None:
    w = e["window"]
    assert isinstance(w, dict)
    rows = [
        ("offload enabled", e["offload_enabled"], 0),
        ("GPU prefix hit ratio", e["gpu_prefix_hit_ratio"], 3),
        ("prompt tokens recomputed", w.get("prompt_by_source:local_compute"), 0),
        ("prompt tokens from GPU cache", w.get("prompt_by_source:local_cache_hit"), 0),
        ("marginal recompute tokens/s", e["recompute_tokens_per_second"], 0),
        ("prefill overhead per request s", e["prefill_request_overhead_seconds"], 4),
        ("average prefill tokens/s", e["prefill_average_tokens_per_second"], 0),
    ]
    for label, value, digits in rows:
        print(f"  {label:32s} {_fmt(value, digits)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep", action="store_true", help="keep the servers running")
    parser.add_argument("--batches", type=int, default=5)
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="kvoe-demo-"))
    print(f"working directory: {work}")
    print("starting vLLM CPU with a tiny random model (about a minute on 2 cores) ...")
    vllm = VllmServer(work / "vllm").start()
    exporter = prom = None
    try:
        exporter = ExporterProcess(
            work,
            [
                "--vllm-url",
                vllm.url,
                "--interval",
                "1",
                "--window",
                "120",
                "--kv-bytes-per-token",
                str(kv_bytes_per_token()),
            ],
        ).start()
        prom = Prometheus(work / "prometheus", scrape_targets=[exporter.address]).start()
        print(f"vLLM {vllm.url}  exporter {exporter.url}  Prometheus {prom.url}")
        print(f"seed workload: {args.batches} batches of A (cold), A (GPU hit), B, C, A again")
        records = seed_workload(vllm.url, batches=args.batches, pause=0.2)
        for name in ("A_cold", "A_gpu_hit", "A_after_evict"):
            ms = sorted(r.seconds * 1e3 for r in records if r.name == name)
            print(f"  {name:14s} median {ms[len(ms) // 2]:6.1f} ms")
        time.sleep(3)
        _, body = http_get(exporter.url + "/api/v1/status")
        status = json.loads(body)
        for t in status["targets"]:
            for e in t["engines"]:
                print(
                    f"\nengine {e['model_name']}/{e['engine']}, "
                    f"last {status['window_seconds']:g} s:"
                )
                _print_engine(e)
        print(
            f"\nlook at: {exporter.url}/ (status page), {exporter.url}/metrics, "
            f"{prom.url}/graph?g0.expr=kvoffload_gpu_prefix_hit_ratio"
        )
        if args.keep:
            print("running; Ctrl-C stops everything")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        for p in (prom, exporter):
            if p is not None:
                p.stop()
        vllm.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
