"""Across targets: a decode engine (NIXL) takes the recompute rate of a prefill engine of its
model, to judge its transfer speed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from exporter.model.derive.backends import speedup
from exporter.model.derive.engines import EngineDerived


def with_peer_recompute(
    derived: Mapping[str, Sequence[EngineDerived]],
) -> dict[str, list[EngineDerived]]:
    """Fill the NIXL speedup of engines that cannot measure their own recompute speed.

    A decode engine of a disaggregated pair hardly prefills, so its marginal recompute
    rate stays unknown; the prefill engine serving the same model measures it. An engine
    without its own rate takes the fastest rate measured for the same model_name by any
    engine of any target this exporter watches (the conservative choice: the speedup
    against the fastest recompute is the smallest).
    """
    best: dict[str, float] = {}
    negligible: set[str] = set()
    for engines in derived.values():
        for d in engines:
            r = d.recompute_tokens_per_second
            if r:
                best[d.key.model_name] = max(best.get(d.key.model_name, 0.0), r)
            elif d.recompute_negligible:
                negligible.add(d.key.model_name)
    out: dict[str, list[EngineDerived]] = {}
    for target, engines in derived.items():
        row = []
        for item in engines:
            d = item
            b = d.backend
            if (
                b is not None
                and b.nixl_tokens_per_second is not None
                and b.nixl_speedup is None
                and (d.key.model_name in best or d.key.model_name in negligible)
            ):
                s = speedup(
                    b.nixl_tokens_per_second,
                    best.get(d.key.model_name),
                    d.key.model_name in negligible,
                )
                d = replace(d, backend=replace(b, nixl_speedup=s, recompute_from_peer=True))
            row.append(d)
        out[target] = row
    return out
