"""Hysteresis over the advisor's evaluations: a new action must win several in a row before
it replaces the current one, so advice does not flap; urgent actions apply at once, but doubt
that comes and goes does not unseat a decision."""

from __future__ import annotations

from exporter.model.advisor.rules import evaluate
from exporter.model.advisor.types import URGENT, Action, Advice, AdvisorInput, Reason
from exporter.thresholds import DEFAULT, Thresholds
from exporter.vllm_metrics import EngineKey

# Evidence that wavers, not evidence that is gone: a standing decision holds through these
# until they last `confirm` evaluations, as any other change must. The other reasons of
# insufficient_data (a stale target, a window restarted, too little traffic, no KV events)
# take the ground from under the decision, and apply at once.
HELD_THROUGH = frozenset(
    {Reason.SPEEDUP_UNCERTAIN, Reason.RELOAD_BENEFIT_UNMEASURED, Reason.TIER_STILL_FILLING}
)


class Advisor:
    """Applies hysteresis over evaluations, per engine."""

    def __init__(self, thresholds: Thresholds = DEFAULT, confirm: int = 3) -> None:
        self.thresholds = thresholds
        self.confirm = max(1, confirm)
        self._current: dict[tuple[str, EngineKey], Advice] = {}
        self._pending: dict[tuple[str, EngineKey], tuple[Action, int]] = {}

    def update(self, target: str, inp: AdvisorInput) -> Advice:
        key = (target, inp.derived.key)
        fresh = evaluate(inp, self.thresholds)
        current = self._current.get(key)
        # Leaving insufficient_data is a change like any other: a first decision comes from
        # the thinnest evidence the window will hold, and one that does not hold for
        # `confirm` evaluations is not one to act on (14B RAG-Zipf with 32 GiB on the H200
        # flickered into disable_offload for a single second, twice, out of waiting).
        # A standing decision holds through a flicker of doubt (8B chat with 27 GiB on the
        # H200 left its shrink for insufficient_data for 3 s, then took it up again).
        urgent = fresh.action in URGENT and fresh.reason not in HELD_THROUGH
        if current is None or fresh.action == current.action or urgent:
            self._pending.pop(key, None)
            self._current[key] = fresh
            return fresh
        action, count = self._pending.get(key, (fresh.action, 0))
        count = count + 1 if action == fresh.action else 1
        self._pending[key] = (fresh.action, count)
        if count >= self.confirm:
            self._pending.pop(key, None)
            self._current[key] = fresh
            return fresh
        # Keep the standing advice; refresh its numbers, say what is pending.
        held = Advice(
            current.action,
            current.reason,
            current.explanation,
            current.recommended_buffer_bytes,
            fresh.numbers,
            fresh.action,
        )
        self._current[key] = held
        return held

    def forget_missing(self, present: set[tuple[str, EngineKey]]) -> None:
        for key in [k for k in self._current if k not in present]:
            self._current.pop(key, None)
            self._pending.pop(key, None)
