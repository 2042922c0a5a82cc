"""A computed token's least TTFT cost from physics (pure): the weights it multiplies.

Prefilling a token takes at least 2 FLOPs per weight, so at least `weight bytes / dense BF16
peak` seconds of the GPU (a BF16 weight is 2 bytes; FP8 halves the bytes and doubles the
peak, so the same quotient). The window's TTFT fits cannot price a computed token where every
request loads and computes a similar few hundred tokens, and on RAG-Zipf they price it below
this floor (docs/gpu-acceptance.md, "A computed token's floor"); the floor bounds them from
below. It needs the model's weight bytes per GPU (`--model-weight-bytes`, what vLLM logs as
"Model loading took X GiB") and the GPU's peak.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

# Dense (no sparsity) BF16 tensor-core peak in FLOP/s per NVML GPU name, from NVIDIA's
# datasheets. A peak too high only lowers the floor; one too low would raise it above what a
# token costs, so a GPU not listed has no floor unless --gpu-peak-flops says its peak.
PEAK_DENSE_BF16_FLOPS: Mapping[str, float] = MappingProxyType(
    {
        "NVIDIA H200": 989e12,
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 NVL": 835e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA A100-SXM4-40GB": 312e12,
        "NVIDIA A100 80GB PCIe": 312e12,
        "NVIDIA A100-PCIE-40GB": 312e12,
        "NVIDIA L40S": 362e12,
        "NVIDIA L4": 121e12,
    }
)


def peak_flops(gpu_names: Sequence[str], override: float | None = None) -> float | None:
    """The dense BF16 peak to price a token at: `override` where given, else the fastest of
    the GPUs seen (a sidecar sees its node's GPUs, not which ones the engine runs on: the
    fastest gives the lowest floor); None if any of them is not in the table."""
    if override is not None and override > 0:
        return override
    peaks = [PEAK_DENSE_BF16_FLOPS.get(name) for name in gpu_names]
    if not peaks or any(p is None for p in peaks):
        return None
    return max(p for p in peaks if p is not None)


def computed_token_floor(
    weight_bytes: float | None, gpu_names: Sequence[str], override: float | None = None
) -> float | None:
    """Seconds of GPU time a prefilled token takes at least; None without both facts."""
    peak = peak_flops(gpu_names, override)
    if weight_bytes is None or weight_bytes <= 0 or peak is None:
        return None
    return weight_bytes / peak
