"""A realistic vLLM exposition corpus for benchmarks.

One engine: the real /metrics of the vLLM CPU server after the seed workload
(tests/fixtures/vllm-0.32.0-cpu/metrics-after.prom). Eight data-parallel engines with offload:
the same families repeated per `engine` label, plus the offload series of the real H200 run
(tests/fixtures/vllm-0.26.0-h200/b_offload/metrics_after.txt) per engine; about 400 KB.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CPU = REPO / "tests" / "fixtures" / "vllm-0.32.0-cpu" / "metrics-after.prom"
H200 = REPO / "tests" / "fixtures" / "vllm-0.26.0-h200" / "b_offload" / "metrics_after.txt"


def single_engine() -> str:
    return CPU.read_text()


def data_parallel(engines: int = 8) -> str:
    """Every per-engine sample repeated for engines 0..N-1, families kept contiguous."""

    def spread(lines: list[str]) -> list[str]:
        out = []
        for line in lines:
            if line.startswith("#") or 'engine="0"' not in line:
                out.append(line)
                continue
            out.extend(line.replace('engine="0"', f'engine="{e}"') for e in range(engines))
        return out

    cpu = [line for line in CPU.read_text().splitlines() if line.strip()]
    offload = [
        line.replace('model_name="qwen3-dummy"', 'model_name="tiny-llama"')
        for line in H200.read_text().splitlines()
        if "kv_offload" in line and line.strip()
    ]
    return "\n".join(spread(cpu) + spread(offload)) + "\n"


if __name__ == "__main__":
    text = data_parallel()
    print(
        f"single engine: {len(single_engine()):,} bytes; 8 engines: {len(text):,} bytes, "
        f"{text.count(chr(10)):,} lines"
    )
