"""Per-cycle values of every engine over the window: the status page's time series.

A pure ring buffer: `History.record()` takes the cycle's time and one frozen `EnginePoint`
per engine (built by `cycle_points()` from the advisor's inputs and its advice, the values
the exporter already computed), keeps the points of the last `window` seconds and
remembers since when each engine's action has stood. No I/O, no clock: the caller passes
the time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from exporter.model.advisor.types import Advice, AdvisorInput
from exporter.vllm_metrics import EngineKey


@dataclass(frozen=True, slots=True, order=True)
class EngineRef:
    target: str
    model_name: str
    engine: str


@dataclass(frozen=True, slots=True)
class EnginePoint:
    """One engine's values at the end of one collection cycle (None: not measured)."""

    t: float
    action: str
    offload_hit_ratio: float | None = None
    gpu_prefix_hit_ratio: float | None = None
    # Share of the window's prompt tokens that were prefixes recomputed after GPU eviction.
    recompute_after_eviction_share: float | None = None
    recompute_tokens_per_second: float | None = None  # marginal, from the prefill fit
    reload_tokens_per_second: float | None = None  # measured copies, or the estimate
    reload_estimated: bool = False
    pcie_utilization: float | None = None  # busiest direction of the busiest GPU, 0..1
    pool_bytes: float | None = None  # pinned/shared offload pool
    memory_usage_bytes: float | None = None  # container, non-reclaimable
    memory_limit_bytes: float | None = None


def engine_point(t: float, inp: AdvisorInput, advice: Advice) -> EnginePoint:
    """The values of one engine's evaluation, as the status page charts them."""
    d = inp.derived
    prompt = d.window.get("prompt_tokens")
    share = None
    if inp.whatif is not None and prompt:
        share = min(1.0, inp.whatif.recomputed_after_eviction_tokens / prompt)
    mem = inp.memory
    return EnginePoint(
        t=t,
        action=str(advice.action),
        offload_hit_ratio=d.offload_hit_ratio,
        gpu_prefix_hit_ratio=d.gpu_prefix_hit_ratio,
        recompute_after_eviction_share=share,
        recompute_tokens_per_second=d.recompute_tokens_per_second,
        reload_tokens_per_second=d.transfer_tokens_per_second,
        reload_estimated=d.transfer_estimated,
        pcie_utilization=inp.pcie_utilization,
        pool_bytes=mem.pool_bytes if mem is not None else None,
        memory_usage_bytes=mem.usage_bytes if mem is not None else None,
        memory_limit_bytes=mem.limit_bytes if mem is not None else None,
    )


def cycle_points(
    t: float,
    advice: Mapping[str, Sequence[tuple[EngineKey, Advice]]],
    inputs: Mapping[tuple[str, EngineKey], AdvisorInput],
) -> dict[EngineRef, EnginePoint]:
    """One point per engine that got advice this cycle (`Exporter.advice`, with the
    `AdvisorInput` each evaluation used, keyed by (target, engine key))."""
    out: dict[EngineRef, EnginePoint] = {}
    for target, pairs in advice.items():
        for key, adv in pairs:
            inp = inputs.get((target, key))
            if inp is None:
                continue
            k = inp.derived.key
            out[EngineRef(target, k.model_name, k.engine)] = engine_point(t, inp, adv)
    return out


class History:
    """The last `window` seconds of per-cycle points, per engine; and since when each
    engine's current action has stood."""

    def __init__(self, window: float, max_points: int = 3600) -> None:
        self.window = window
        self.max_points = max_points  # a bound even with a tiny interval
        self._points: dict[EngineRef, deque[EnginePoint]] = {}
        self._since: dict[EngineRef, float] = {}

    def record(self, t: float, points: Mapping[EngineRef, EnginePoint]) -> None:
        for ref, p in points.items():
            q = self._points.get(ref)
            if q is None:
                q = self._points[ref] = deque(maxlen=self.max_points)
            if not q or q[-1].action != p.action or ref not in self._since:
                self._since[ref] = t
            q.append(p)
        horizon = t - self.window
        for ref in list(self._points):
            q = self._points[ref]
            while q and q[0].t < horizon:
                q.popleft()
            if not q:  # an engine gone for a whole window is forgotten
                del self._points[ref]
                self._since.pop(ref, None)

    def engines(self) -> list[EngineRef]:
        return sorted(self._points)

    def points(self, ref: EngineRef) -> tuple[EnginePoint, ...]:
        return tuple(self._points.get(ref, ()))

    def since(self, ref: EngineRef) -> float | None:
        """When the engine's current action was first seen (in the history's time)."""
        return self._since.get(ref)

    def series(
        self, ref: EngineRef, field: str
    ) -> tuple[tuple[float, float], ...]:  # (t, value) where measured
        return tuple(
            (p.t, float(v)) for p in self.points(ref) if (v := getattr(p, field)) is not None
        )
