"""One cycle of the model, from CycleInputs to what is rendered: derive, step the what-if
simulation, advise, plan the simulation for the next cycle.

`Pipeline` keeps the state that spans cycles and nothing else: the advisor's hysteresis,
the what-if simulation of each target, the last recommended buffer of each engine and the
cost of a computed token each engine last measured with offload off (kept across restarts:
enabling offload restarts vLLM, and the fits with offload on may need it). It
does no I/O and reads no clock (the time is CycleInputs.now), so the live exporter and
`kv-offload-exporter replay` run the very same steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from exporter.model.advisor.hysteresis import Advisor
from exporter.model.advisor.types import (
    Advice,
    AdvisorInput,
    MemoryState,
    PolicyPoint,
    TierEvidence,
    WhatIfState,
)
from exporter.model.derive.engines import CostBefore, EngineDerived, derive_target
from exporter.model.derive.peers import with_peer_recompute
from exporter.model.inputs import CycleInputs, TargetInputs
from exporter.model.whatif.engine import EngineSnapshot, WhatIf, WhatIfSettings
from exporter.model.whatif.plan import sim_config
from exporter.model.whatif.view import engine_rank, policy_points, tier_evidence, whatif_state
from exporter.thresholds import DEFAULT, Thresholds
from exporter.vllm_metrics import EngineKey

# Targets whose costs with offload off are remembered: far more than one exporter watches,
# a bound only against targets that come and go (discovery) for months.
MAX_REMEMBERED = 1024


@dataclass(frozen=True, slots=True)
class EngineResult:
    derived: EngineDerived
    advice: Advice
    inputs: AdvisorInput  # what the advisor saw (the status page charts it)
    whatif: WhatIfState | None  # the curve over the window (None: not simulated yet)
    policies: tuple[PolicyPoint, ...]  # the policy comparison, planned for the next cycle


@dataclass(frozen=True, slots=True)
class TargetResult:
    label: str
    covered_seconds: float
    engines: tuple[EngineResult, ...]
    # The simulation state per DP rank; None where the target has no KV-event consumer.
    simulation: Mapping[int, EngineSnapshot] | None


@dataclass(frozen=True, slots=True)
class CycleResult:
    now: float
    targets: tuple[TargetResult, ...]

    def derived(self) -> dict[str, list[EngineDerived]]:
        return {t.label: [e.derived for e in t.engines] for t in self.targets}

    def advice(self) -> dict[str, list[tuple[EngineKey, Advice]]]:
        return {t.label: [(e.derived.key, e.advice) for e in t.engines] for t in self.targets}

    def inputs(self) -> dict[tuple[str, EngineKey], AdvisorInput]:
        return {(t.label, e.derived.key): e.inputs for t in self.targets for e in t.engines}


def memory_for(d: EngineDerived, memory: MemoryState | None) -> MemoryState | None:
    """The target's memory as the advisor sees it for one engine: with the measured pool /
    flag ratio (1.75 on vLLM 0.26), which sizes its recommendations."""
    if memory is not None and memory.pool_bytes and d.offload_buffer_bytes:
        return replace(memory, pool_to_buffer_ratio=memory.pool_bytes / d.offload_buffer_bytes)
    return memory


class Pipeline:
    def __init__(
        self,
        thresholds: Thresholds = DEFAULT,
        *,
        confirm: int = 3,
        confirm_seconds: float = 0.0,
        whatif: WhatIfSettings | None = None,
    ) -> None:
        self.advisor = Advisor(thresholds, confirm=confirm, confirm_seconds=confirm_seconds)
        self.whatif_settings = whatif or WhatIfSettings()
        self._whatif: dict[str, WhatIf] = {}
        self._recommended: dict[tuple[str, EngineKey], float | None] = {}
        self._before: dict[str, dict[EngineKey, CostBefore]] = {}

    def before(self, label: str) -> dict[EngineKey, CostBefore]:
        """The TTFT fit each engine of the target last measured with offload off."""
        return dict(self._before.get(label, {}))

    def remembered(self) -> dict[str, dict[EngineKey, CostBefore]]:
        """Every target's fits with offload off, the most recently measured target last
        (what --state-file keeps)."""
        return {label: dict(fits) for label, fits in self._before.items()}

    def remember_before(self, label: str, fits: Mapping[EngineKey, CostBefore]) -> None:
        """Take these as the target's fits with offload off (also how a replay follows a
        recording of the same engine without offload)."""
        if not fits:
            return
        target = self._before.pop(label, {})
        target.update(fits)
        self._before[label] = target  # the most recently measured target last
        while len(self._before) > MAX_REMEMBERED:
            del self._before[next(iter(self._before))]

    def simulation(self, label: str) -> WhatIf | None:
        return self._whatif.get(label)

    def _plan(self, w: WhatIf, label: str, d: EngineDerived) -> None:
        """Configure engine d's simulators for the next step from what is known now."""
        rank = engine_rank(d.key)
        cfg = sim_config(d, self.whatif_settings, self._recommended.get((label, d.key)))
        if rank is not None and cfg is not None:
            w.configure(rank, cfg)

    def step(self, inputs: CycleInputs) -> CycleResult:
        # 1. The KV events since the last cycle, through the configuration planned then.
        for t in inputs.targets:
            if t.kv_items is not None:
                w = self._whatif.get(t.label)
                if w is None:
                    w = self._whatif[t.label] = WhatIf(self.whatif_settings)
                w.step(t.kv_items)
        # 2. Derivations; a decode engine (NIXL) takes the recompute rate of a prefill
        # engine of its model.
        derived = with_peer_recompute(
            {
                t.label: derive_target(t.window, inputs.now, t.settings, self.before(t.label))
                for t in inputs.targets
            }
        )
        covered = {t.label: t.window.covered_seconds() for t in inputs.targets}
        machine = {t.label: t.settings.machine for t in inputs.targets}
        for label, ds in derived.items():
            self.remember_before(
                label,
                {
                    d.key: CostBefore(
                        d.ttft_fit,
                        d.kv_bytes_per_token,
                        rate,
                        machine[label],
                        d.ttft_fit_scale or 1.0,
                    )
                    for d in ds
                    if not d.offload_enabled
                    and d.ttft_fit is not None
                    and d.ttft_fit.stderr is not None
                    and (rate := _request_rate(d, covered[label])) is not None
                },
            )
        # 3. Advice, the what-if read with the plan made from the previous recommendation.
        present: set[tuple[str, EngineKey]] = set()
        advised: dict[str, list[tuple[AdvisorInput, Advice]]] = {}
        for t in inputs.targets:
            rows = advised.setdefault(t.label, [])
            for d in derived.get(t.label, []):
                state, policies = self._whatif_view(t, d)
                inp = AdvisorInput(
                    derived=d,
                    covered_seconds=t.window.covered_seconds(),
                    whatif=state,
                    memory=memory_for(d, t.memory),
                    pcie_utilization=inputs.pcie_utilization,
                    policy_alternatives=policies,
                    evidence=self._evidence(t.label, d),
                )
                advice = self.advisor.update(t.label, inp, inputs.now)
                self._recommended[(t.label, d.key)] = advice.recommended_buffer_bytes
                rows.append((inp, advice))
                present.add((t.label, d.key))
        self.advisor.forget_missing(present)
        for key in [k for k in self._recommended if k not in present]:
            del self._recommended[key]
        # 4. The plan for the next step, with this cycle's recommendations: the policy
        # comparison of an engine without offload runs at the recommended size.
        out: list[TargetResult] = []
        for t in inputs.targets:
            engines = []
            for inp, advice in advised[t.label]:
                policies = self._policies(t, inp.derived)
                engines.append(EngineResult(inp.derived, advice, inp, inp.whatif, policies))
            w = self._whatif.get(t.label)
            out.append(
                TargetResult(
                    t.label,
                    t.window.covered_seconds(),
                    tuple(engines),
                    w.snapshots() if w is not None else None,
                )
            )
        return CycleResult(inputs.now, tuple(out))

    def _evidence(self, label: str, d: EngineDerived) -> TierEvidence | None:
        w = self._whatif.get(label)
        rank = engine_rank(d.key)
        if w is None or rank is None:
            return None
        return tier_evidence(w.snapshots().get(rank), d)

    def _whatif_view(
        self, t: TargetInputs, d: EngineDerived
    ) -> tuple[WhatIfState | None, tuple[PolicyPoint, ...]]:
        """Plan engine d with the current recommendation, then read its what-if."""
        w = self._whatif.get(t.label)
        rank = engine_rank(d.key)
        if w is None:
            return None, ()
        es = w.snapshots().get(rank) if rank is not None else None
        state = whatif_state(es, t.window, d, self.whatif_settings.sizes_bytes)
        return state, self._policies(t, d)

    def _policies(self, t: TargetInputs, d: EngineDerived) -> tuple[PolicyPoint, ...]:
        """Plan engine d with the current recommendation, then read its policy comparison
        (the curve does not depend on the plan: after the advice only this is read again)."""
        w = self._whatif.get(t.label)
        if w is None:
            return ()
        self._plan(w, t.label, d)
        rank = engine_rank(d.key)
        es = w.snapshots().get(rank) if rank is not None else None
        planned = w.planned(rank) if rank is not None else None
        rec = self._recommended.get((t.label, d.key))
        return policy_points(es, t.window, d, planned, rec)


def forget(result: CycleResult, labels: Sequence[str]) -> CycleResult:
    """The result without the named targets (a target removed from the configuration)."""
    return replace(result, targets=tuple(t for t in result.targets if t.label not in labels))


def _request_rate(d: EngineDerived, seconds: float) -> float | None:
    """Requests per second over the window the engine's TTFT fit was measured on."""
    n = d.window.get("ttft_requests")
    return n / seconds if n and seconds > 0 else None
