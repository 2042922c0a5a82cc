"""exporter/model/derive/compute.py: a computed token's least cost, from the weights and the
GPU's peak, and no floor where either is unknown."""

from __future__ import annotations

import pytest

from exporter.model.derive.compute import (
    PEAK_DENSE_BF16_FLOPS,
    computed_token_floor,
    peak_flops,
)

GIB = 1 << 30


def test_qwen3_14b_on_an_h200_costs_at_least_its_weights_over_the_peak() -> None:
    # "Model loading took 27.52 GiB" (the matrix's 14B runs) over 989 TFLOP/s.
    floor = computed_token_floor(27.52 * GIB, ("NVIDIA H200",))
    assert floor == pytest.approx(29.88e-6, rel=1e-3)


def test_no_floor_without_the_weights_or_a_known_peak() -> None:
    assert computed_token_floor(None, ("NVIDIA H200",)) is None
    assert computed_token_floor(0, ("NVIDIA H200",)) is None
    assert computed_token_floor(27.52 * GIB, ()) is None  # no GPU seen (no NVML)
    assert computed_token_floor(27.52 * GIB, ("Some Future GPU",)) is None
    # One unknown GPU beside a known one: which one the engine runs on is not known.
    assert peak_flops(("NVIDIA H200", "Some Future GPU")) is None


def test_an_operator_peak_stands_in_for_the_table() -> None:
    assert peak_flops(("Some Future GPU",), 2e15) == 2e15
    assert computed_token_floor(2e9, (), 2e15) == pytest.approx(1e-6)
    assert peak_flops(("NVIDIA H200",), 0.0) == PEAK_DENSE_BF16_FLOPS["NVIDIA H200"]


def test_several_gpus_price_at_the_fastest_the_lowest_floor() -> None:
    assert peak_flops(("NVIDIA L4", "NVIDIA H200")) == PEAK_DENSE_BF16_FLOPS["NVIDIA H200"]


def test_the_table_holds_dense_peaks_only() -> None:
    # A sparsity peak (2x) would halve the floor, not break it; a peak below the dense
    # datasheet value would raise the floor above a token's cost. The H200's is 989 TFLOP/s.
    assert PEAK_DENSE_BF16_FLOPS["NVIDIA H200"] == 989e12
    assert all(1e14 <= v <= 1e15 for v in PEAK_DENSE_BF16_FLOPS.values())
