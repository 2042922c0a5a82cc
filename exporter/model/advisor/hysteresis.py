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
    """Applies hysteresis over evaluations, per engine: a new action replaces the standing
    one once it won `confirm` evaluations in a row and, where the standing one is a decision
    and a clock is given, has been the evaluations' answer for `confirm_seconds`. Counting
    evaluations alone makes the delay the collection interval's: three at 5 s span 10 s,
    three at 1 s span 2, and at 1 s the what-if's first seconds of a decision could leave an
    action and come back within that."""

    def __init__(
        self, thresholds: Thresholds = DEFAULT, confirm: int = 3, confirm_seconds: float = 0.0
    ) -> None:
        self.thresholds = thresholds
        self.confirm = max(1, confirm)
        self.confirm_seconds = max(0.0, confirm_seconds)
        self._current: dict[tuple[str, EngineKey], Advice] = {}
        # The candidate action, how many evaluations in a row said it, and since when.
        self._pending: dict[tuple[str, EngineKey], tuple[Action, int, float | None]] = {}

    def update(self, target: str, inp: AdvisorInput, now: float | None = None) -> Advice:
        """`now`: the evaluation's time in seconds (any monotonic origin); without it only
        the evaluations are counted."""
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
        action, count, since = self._pending.get(key, (fresh.action, 0, now))
        if action != fresh.action:
            count, since = 0, now
        count += 1
        self._pending[key] = (fresh.action, count, since)
        lasted = now - since if now is not None and since is not None else None
        # A standing decision is one the operator may have acted on (a vLLM restart with a
        # new flag): unseating it also takes the seconds. Leaving insufficient_data does not,
        # there is no advice to protect, only the evaluations.
        decided = current.action != Action.INSUFFICIENT_DATA
        if count >= self.confirm and (
            not decided
            or self.confirm_seconds <= 0
            or lasted is None
            or lasted >= self.confirm_seconds
        ):
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
