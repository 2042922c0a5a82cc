"""Every benchmark runs at a tiny size, so none of them rots (docs/performance.md).

These assert that each benchmark runs its real code paths end to end and prints its table
with the named baseline beside it, never how fast anything is. Soak (tests/faults/
test_soak_short.py), the NVML poller cost and the GPU probe (tests/nvml_doubles.py) and the
what-if vs observed comparison (tests/test_whatif_gpu.py) have their own tests.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def bench(module: str, *args: str, timeout: float = 240) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"bench.{module} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def ratio(text: str, row: str) -> float:
    """The `N.NNx` figure on the line that starts with `row`."""
    line = next(x for x in text.splitlines() if x.strip().startswith(row))
    m = re.search(r"([\d.]+)x", line)
    assert m, line
    return float(m.group(1))


def test_parse_bench() -> None:
    out = bench("parse_bench", "--repeats", "1")
    assert "prometheus_client" in out
    assert ratio(out, "8 DP engines") > 0


def test_cycle_bench_with_recorded_nvml() -> None:
    out = bench("cycle_bench", "--targets", "1,2", "--cycles", "1", "--engines", "2")
    rows = [x for x in out.splitlines() if re.match(r"^[12]\s+[\d.]+ ms", x)]
    assert len(rows) == 2, out
    assert "NVML poller thread" in out


@pytest.mark.slow
def test_scrape_load() -> None:
    out = bench("scrape_load", "--connections", "2", "--duration", "1")
    assert "exporter (cached exposition)" in out
    assert "baseline (render per scrape)" in out


def test_whatif_bench() -> None:
    out = bench("whatif_bench", "--requests", "150", "--sizes", "2", "--repeat", "1")
    assert "baseline: OrderedDict LRU per size" in out
    assert ratio(out, "stack one-pass, exact") > 0


def test_whatif_growth() -> None:
    out = bench("whatif_growth", "--blocks", "2000,4000", "--reuse", "4000")
    lines = [x for x in out.splitlines() if "stack one-pass, exact" in x]
    assert len(lines) == 2, out
    assert all(ratio(x, x.split()[0]) > 0 for x in lines)


def test_exporter_cpu() -> None:
    # Two checkouts' worth of runs from this one: the interleaving and the ratios, no timing.
    out = bench(
        "exporter_cpu",
        *("--duration", "2", "--warmup", "1", "--children", "2"),
        *("--exporter-root", f"a={REPO}", "--exporter-root", f"b={REPO}", "--host-off", "b"),
    )
    table = out[out.index("CPU of one core") :]
    for name in ("a ", "b ", "b host off"):
        line = next(x for x in table.splitlines() if x.startswith(name) and "MiB" in x)
        assert ratio(line, name) > 0, out
    assert "procfs:" in out and "cgroup:" in out  # the host collectors found the corpus server
