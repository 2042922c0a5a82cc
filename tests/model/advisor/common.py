"""Hand-built advisor inputs: an engine with plenty of evidence, overridden per case."""

from __future__ import annotations

from exporter.model.advisor.types import AdvisorInput, WhatIfPoint
from exporter.model.derive.engines import EngineDerived
from exporter.model.derive.fits import OffloadFit
from exporter.vllm_metrics import EngineKey

GIB = 1 << 30
EK = EngineKey("qwen3-dummy", "0")


def base(**kw: object) -> EngineDerived:
    """A fresh engine with plenty of evidence; override what the case is about."""
    defaults: dict[str, object] = dict(
        key=EK,
        fresh=True,
        offload_enabled=False,
        offload_buffer_bytes=None,
        gpu_capacity_tokens=2336.0,
        block_size=16,
        kv_usage=0.95,
        gpu_prefix_hit_ratio=0.2,
        offload_hit_ratio=None,
        offload_lookup_hit_ratio=None,
        load_bandwidth=None,
        store_bandwidth=None,
        reuse_ratio=None,
        kv_bytes_per_token=114688.0,
        kv_bytes_per_token_method="offload_loads",
        prefill_fit=None,
        offload_fit=None,
        recompute_tokens_per_second=23_000.0,
        recompute_negligible=False,
        prefill_average_tokens_per_second=20_000.0,
        transfer_tokens_per_second=110_000.0,
        transfer_estimated=True,
        transfer_speedup=110_000 / 23_000,
        transfer_speedup_lower=0.8 * 110_000 / 23_000,
        window={"prompt_tokens": 400_000.0, "preemptions": 3.0},
        totals={},
    )
    defaults.update(kw)
    return EngineDerived(**defaults)  # type: ignore[arg-type]


CURVE = (
    WhatIfPoint(0.25 * GIB, 0.10),
    WhatIfPoint(0.5 * GIB, 0.17),
    WhatIfPoint(1 * GIB, 0.18),
    WhatIfPoint(2 * GIB, 0.18),
)


def inp(d: EngineDerived, **kw: object) -> AdvisorInput:
    return AdvisorInput(derived=d, covered_seconds=300.0, **kw)  # type: ignore[arg-type]


# Laptop-like measured TTFT costs: 40 us per recomputed token, 10 us per loaded one.
PAYS = OffloadFit(
    0.014, 40e-6, 10e-6, 60, 0.99, saving_stderr=2e-6, computed_stderr=1.5e-6, loaded_stderr=1e-6
)
ON = dict(
    offload_enabled=True,
    offload_buffer_bytes=0.5 * GIB,
    offload_hit_ratio=0.17,
    reuse_ratio=0.3,
    load_bandwidth=12.6e9,
    transfer_estimated=False,
    offload_fit=PAYS,
)
