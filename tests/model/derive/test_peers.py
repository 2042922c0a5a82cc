"""exporter/model/derive/peers.py: a NIXL decode engine takes the recompute rate of a
prefill engine of its model (a real H200 prefill engine, synthesized decode engines)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from exporter import expfmt
from exporter.model.derive.engines import DeriveSettings, EngineDerived, derive_engine
from exporter.model.derive.peers import with_peer_recompute
from exporter.vllm_metrics import WANTED, EngineKey, normalise
from exporter.window import TargetWindow
from tests.helpers import KV_BYTES_PER_TOKEN_32B, LARGE, gpu_scrapes, synth, window_derived


def _engine_after_run(config: str, ek: EngineKey, kv_bytes_per_token: float) -> EngineDerived:
    """A real no-offload H200 run's engine after both workloads (its 1 s scrapes)."""
    win = TargetWindow(300.0)
    scrapes = gpu_scrapes(config)
    for s in scrapes:
        win.add(normalise(expfmt.parse(s["body"], WANTED), float(s["t"])))
    d = derive_engine(
        win,
        ek,
        float(scrapes[-1]["t"]),
        DeriveSettings(stale_after=3.0, kv_bytes_per_token=kv_bytes_per_token),
    )
    assert d is not None
    return d


@pytest.fixture(scope="module")
def prefill_engine() -> EngineDerived:
    """The 32B shape without offload: its marginal recompute rate is measured."""
    d = _engine_after_run("large-a", LARGE, KV_BYTES_PER_TOKEN_32B)
    assert d.recompute_tokens_per_second is not None
    return d


@pytest.mark.parametrize(
    ("name", "faster"), [("vllm-0.32-nixl-rdma", True), ("vllm-0.32-nixl-tcp", False)]
)
def test_nixl_speedup_uses_the_prefill_engines_recompute_rate(
    prefill_engine: EngineDerived, name: str, faster: bool
) -> None:
    """A real prefill engine (large-a, H200) beside a synthesized decode engine of the same
    model: the decode engine's transfer speed against the prefill engine's recompute."""
    decode = window_derived(
        synth(name, "before"),
        synth(name, "after"),
        LARGE,
        kv_bytes_per_token=KV_BYTES_PER_TOKEN_32B,
    )
    filled = with_peer_recompute({"prefill": [prefill_engine], "decode": [decode]})
    (d,) = filled["decode"]
    assert filled["prefill"] == [prefill_engine]
    assert d.backend is not None and decode.backend is not None
    tokens = decode.backend.nixl_tokens_per_second
    recompute = prefill_engine.recompute_tokens_per_second
    assert tokens is not None and recompute is not None
    assert d.backend.nixl_speedup == pytest.approx(tokens / recompute)
    assert d.backend.recompute_from_peer
    assert (d.backend.nixl_speedup > 1.0) is faster
    # an engine of another model gets nothing
    other = replace(decode, key=EngineKey("other", "0"))
    (o,) = with_peer_recompute({"p": [prefill_engine], "d": [other]})["d"]
    assert o.backend is not None and o.backend.nixl_speedup is None
    # recompute free at the margin (no measurable per-token cost): no transfer can win
    free = replace(prefill_engine, recompute_tokens_per_second=None, recompute_negligible=True)
    (z,) = with_peer_recompute({"p": [free], "d": [decode]})["d"]
    assert z.backend is not None and z.backend.nixl_speedup == 0.0
