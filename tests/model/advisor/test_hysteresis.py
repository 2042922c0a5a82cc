"""exporter/model/advisor/hysteresis.py: the Advisor holds advice until a new action is
confirmed, applies urgent ones at once, and forgets engines that are gone."""

from __future__ import annotations

from exporter.model.advisor.hysteresis import Advisor
from exporter.model.advisor.rules import evaluate
from exporter.model.advisor.types import Action, MemoryState
from exporter.model.derive.fits import OffloadFit
from exporter.vllm_metrics import EngineKey
from tests.model.advisor.common import EK, GIB, ON, base, inp


def test_hysteresis_holds_advice_until_the_new_one_is_confirmed():
    adv = Advisor(confirm=3)
    keep = inp(base(**ON))
    drop = inp(base(**{**ON, "offload_hit_ratio": 0.001, "reuse_ratio": 0.002}))
    assert adv.update("t", keep).action == Action.KEEP
    first = adv.update("t", drop)
    assert first.action == Action.KEEP and first.candidate == Action.DISABLE_OFFLOAD
    assert adv.update("t", keep).action == Action.KEEP  # flapping resets the count
    assert adv.update("t", drop).action == Action.KEEP
    assert adv.update("t", drop).action == Action.KEEP
    assert adv.update("t", drop).action == Action.DISABLE_OFFLOAD


def test_hysteresis_does_not_delay_oom_risk():
    adv = Advisor(confirm=5)
    adv.update("t", inp(base(**ON)))
    mem = MemoryState(limit_bytes=16 * GIB, usage_bytes=15.5 * GIB, pool_bytes=1 * GIB)
    assert adv.update("t", inp(base(**ON), memory=mem)).action == Action.REDUCE_BUFFER_OOM_RISK


def test_advisor_forget_missing_drops_the_standing_advice_and_the_pending_count():
    adv = Advisor(confirm=2)
    keep = inp(base(**ON))
    drop = inp(base(**{**ON, "offload_hit_ratio": 0.001, "reuse_ratio": 0.002}))
    assert adv.update("t", keep).action == Action.KEEP
    assert adv.update("t", drop).candidate == Action.DISABLE_OFFLOAD  # 1 of 2
    adv.forget_missing(set())
    # Gone and back: no standing advice to hold, so the first evaluation applies at once.
    assert adv.update("t", drop).action == Action.DISABLE_OFFLOAD
    assert adv.update("t", keep).action == Action.DISABLE_OFFLOAD  # held again
    adv.forget_missing({("t", EK)})  # still present: nothing forgotten
    assert adv.update("t", keep).action == Action.KEEP  # 2 of 2


def test_advisor_keeps_engines_and_targets_apart():
    adv = Advisor(confirm=2)
    keep = inp(base(**ON))
    drop = inp(base(**{**ON, "offload_hit_ratio": 0.001, "reuse_ratio": 0.002}))
    other = inp(base(**{**ON, "key": EngineKey("qwen3-dummy", "1")}))
    adv.update("a", keep)
    adv.update("a", other)
    adv.update("b", keep)
    assert adv.update("a", drop).action == Action.KEEP
    # The other engine and the other target have counts of their own.
    assert adv.update("b", drop).action == Action.KEEP
    assert adv.update("a", drop).action == Action.DISABLE_OFFLOAD
    assert adv.update("a", other).action == Action.KEEP


def test_advisor_leaves_insufficient_data_only_once_the_decision_is_confirmed():
    adv = Advisor(confirm=3)
    stale = inp(base(fresh=False))
    keep = inp(base(**ON))
    drop = inp(base(**{**ON, "offload_hit_ratio": 0.001, "reuse_ratio": 0.002}))
    assert adv.update("t", stale).action == Action.INSUFFICIENT_DATA
    # A first decision is a change like any other: one evaluation of it is not enough.
    held = adv.update("t", drop)
    assert (held.action, held.candidate) == (Action.INSUFFICIENT_DATA, Action.DISABLE_OFFLOAD)
    assert held.numbers == evaluate(drop).numbers  # the latest numbers, the standing action
    # A flicker back to waiting restarts the count: disable never stood.
    assert adv.update("t", stale).action == Action.INSUFFICIENT_DATA
    assert [adv.update("t", keep).action for _ in range(3)] == [
        Action.INSUFFICIENT_DATA,
        Action.INSUFFICIENT_DATA,
        Action.KEEP,
    ]
    # And going back to waiting is immediate: the evidence behind the keep is gone.
    assert adv.update("t", stale).action == Action.INSUFFICIENT_DATA


def test_advisor_confirm_below_one_means_every_evaluation_counts():
    adv = Advisor(confirm=0)
    assert adv.confirm == 1
    adv.update("t", inp(base(**ON)))
    drop = inp(base(**{**ON, "offload_hit_ratio": 0.001, "reuse_ratio": 0.002}))
    assert adv.update("t", drop).action == Action.DISABLE_OFFLOAD


def test_a_decision_holds_through_doubt_that_does_not_last():
    adv = Advisor(confirm=3)
    keep = inp(base(**ON))
    # A loaded token 25 +- 40 us against 19 +- 72 us: whether it saves is not measured.
    noisy = OffloadFit(
        0.0, 25.2e-6, 18.7e-6, 7, 0.99, saving_stderr=18e-6, computed_stderr=20e-6,
        loaded_stderr=36e-6,
    )  # fmt: skip
    unsure = inp(base(**{**ON, "offload_fit": noisy, "transfer_speedup": 5.25}))
    assert evaluate(unsure).reason == "reload_benefit_unmeasured"
    assert adv.update("t", keep).action == Action.KEEP
    held = adv.update("t", unsure)
    assert (held.action, held.candidate) == (Action.KEEP, Action.INSUFFICIENT_DATA)
    assert adv.update("t", keep).action == Action.KEEP  # the doubt passed: the count restarts
    assert [adv.update("t", unsure).action for _ in range(3)] == [
        Action.KEEP,
        Action.KEEP,
        Action.INSUFFICIENT_DATA,
    ]
    # Once waiting, a decision needs its confirmations again; a stale target, evidence that
    # is gone rather than in doubt, ends it at once.
    assert [adv.update("t", keep).action for _ in range(3)][-1] == Action.KEEP
    assert adv.update("t", inp(base(fresh=False))).action == Action.INSUFFICIENT_DATA


def test_a_new_action_must_also_last_the_confirm_seconds():
    """Three evaluations a second apart are not enough when it must last 10 s; the clock
    starts when the candidate first appears, and a candidate that changes starts it again."""
    adv = Advisor(confirm=3, confirm_seconds=10.0)
    keep = inp(base(**ON))
    drop = inp(base(**{**ON, "offload_hit_ratio": 0.001, "reuse_ratio": 0.002}))
    assert adv.update("t", keep, 100.0).action == Action.KEEP
    for t in range(101, 111):  # the candidate since 101 s: 9 s at 110 s
        held = adv.update("t", drop, float(t))
        assert held.action == Action.KEEP and held.candidate == Action.DISABLE_OFFLOAD, t
    assert adv.update("t", keep, 111.0).action == Action.KEEP  # it left: the clock restarts
    for t in range(112, 122):
        assert adv.update("t", drop, float(t)).action == Action.KEEP, t
    assert adv.update("t", drop, 122.0).action == Action.DISABLE_OFFLOAD  # 10 s, 11 in a row


def test_the_confirm_seconds_add_to_the_count_not_replace_it():
    """Evaluations 10 s apart: 10 s have passed at the second, but three must still win."""
    adv = Advisor(confirm=3, confirm_seconds=10.0)
    keep = inp(base(**ON))
    drop = inp(base(**{**ON, "offload_hit_ratio": 0.001, "reuse_ratio": 0.002}))
    adv.update("t", keep, 0.0)
    assert adv.update("t", drop, 10.0).action == Action.KEEP
    assert adv.update("t", drop, 20.0).action == Action.KEEP
    assert adv.update("t", drop, 30.0).action == Action.DISABLE_OFFLOAD
    # Without a clock only the evaluations count.
    adv = Advisor(confirm=2, confirm_seconds=10.0)
    adv.update("t", keep)
    assert adv.update("t", drop).action == Action.KEEP
    assert adv.update("t", drop).action == Action.DISABLE_OFFLOAD


def test_urgent_advice_does_not_wait_the_confirm_seconds():
    adv = Advisor(confirm=3, confirm_seconds=60.0)
    adv.update("t", inp(base(**ON)), 0.0)
    mem = MemoryState(limit_bytes=16 * GIB, usage_bytes=15.5 * GIB, pool_bytes=1 * GIB)
    urgent = adv.update("t", inp(base(**ON), memory=mem), 1.0)
    assert urgent.action == Action.REDUCE_BUFFER_OOM_RISK


def test_a_first_decision_needs_the_evaluations_not_the_seconds():
    """Out of insufficient_data there is no decision to protect: three evaluations in a row
    decide, a second apart; unseating that decision then takes the seconds too."""
    adv = Advisor(confirm=3, confirm_seconds=10.0)
    stale = inp(base(fresh=False))
    keep = inp(base(**ON))
    drop = inp(base(**{**ON, "offload_hit_ratio": 0.001, "reuse_ratio": 0.002}))
    assert adv.update("t", stale, 0.0).action == Action.INSUFFICIENT_DATA
    assert [adv.update("t", keep, float(t)).action for t in (1, 2, 3)] == [
        Action.INSUFFICIENT_DATA,
        Action.INSUFFICIENT_DATA,
        Action.KEEP,
    ]
    assert [adv.update("t", drop, float(t)).action for t in (4, 5, 6)] == [Action.KEEP] * 3
    assert adv.update("t", drop, 14.0).action == Action.DISABLE_OFFLOAD
