"""The window's balance of offload: the TTFT its loaded tokens saved against what its stores
cost, as a share of the TTFT the same traffic would have had without offload (pure).

The TTFT fit (fits.OffloadFit) prices a loaded token against a computed one, every per-load
cost included (the wait for an asynchronous load, lookups, the copy), but it cannot see the
other half of offload's bill: every computed block is stored to the CPU tier, and the
stores slow the computing requests. With offload on, both regressions' token costs are
measured with the stores running, so:

    TTFT without offload - TTFT with = (c_computed - c_loaded) x loaded
                                       - s x (loaded + computed)

where s is the store cost per computed token: a loaded token would have been computed
without offload but not stored either, and the computed ones would not have been stored.
s is taken as vLLM's store copy time over the computed tokens, all of it on the critical
path. On the H200 matrix (docs/gpu-acceptance.md) prefill time rose by 1.2-1.8 s against
1.3-1.6 s of store copy time in the short-prefix runs where offload did not pay, but on
10 k-token prefills a computed token's TTFT cost rose by 1.6-4.0x its copy time
(bench/store_cost.py): there the balance leans toward offload (docs/advisor.md, "Its
limit").

A computed token's floor (the GPU time its weights take) is a cost with no store in it, so
where a loaded token is priced at the floor it saved (floor - c_loaded) and carries no store:

    TTFT without offload - TTFT with >= (floor - c_loaded) x loaded - s x computed

The balance takes whichever of the two saves more (OffloadBalance.priced).

The issue's truth (docs/advisor.md) says offload pays when it cuts summed TTFT by 3 % or
more of the time without it; the balance states its estimate in that very unit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from exporter.model.derive.fits import OffloadFit, PrefillFit

LOADED = "prompt_by_source:external_kv_transfer"
COMPUTED = "prompt_by_source:local_compute"
# The window sums the balance needs, over the same intervals (TargetWindow.sums).
KEYS = (LOADED, COMPUTED, "store_seconds", "ttft_seconds")
# A request that loads is computed two engine steps after its load job goes out with a step
# (vLLM 0.26's OffloadingConnector: the worker reports the job done with the next step's
# output, and the suffix is scheduled in the step after), where without offload it would
# have been computed in that first step: the median of every loader in the matrix's step
# logs (bench.burst_steps: 22 offload runs, 0.6B to 14B, with and without CUDA graphs).
LOAD_STEPS = 2
# Fewer gaps than this give no step time: a mean of a handful of gaps is one request's
# decode, not the engine's.
MIN_DECODE_GAPS = 100
DELIVERED_KEYS = ("ttft_requests", LOADED, COMPUTED, "ttft_seconds")
# The TTFT fit with offload off: summed TTFT on requests and computed tokens per interval.
TTFT_FIT_KEYS = ("ttft_requests", COMPUTED, "ttft_seconds")


@dataclass(frozen=True, slots=True)
class OffloadBalance:
    loaded_tokens: float
    computed_tokens: float
    saved_seconds: float  # loaded tokens x the measured saving per loaded token
    store_seconds: float  # the store cost charged to every loaded and computed token
    stderr_seconds: float  # of saved_seconds, from the saving's standard error
    ttft_seconds: float  # summed TTFT over the window, with offload
    # Above saved_seconds, where wider (a computed token at its floor: saving_upper_stderr).
    upper_stderr_seconds: float | None = None
    # What the loaded tokens saved were a computed token to cost only its floor
    # (compute.computed_token_floor), and its standard error; None without a floor.
    floor_saved_seconds: float | None = None
    floor_stderr_seconds: float = 0.0
    # The window's loads at LOAD_STEPS engine steps each, a step at the engine's decode step
    # time (decode_step_seconds); 0 where the window has no step time (no decode).
    load_step_seconds: float = 0.0

    def priced(
        self, z: float = 0.0, store_factor: float = 1.0, tokens: tuple[float, float] | None = None
    ) -> tuple[float, float]:
        """(TTFT the loaded tokens saved, TTFT the stores cost) at the window's prices: the
        saving per loaded token shifted by z standard errors, the stores at store_factor
        times their copy time; for the window's own tokens, or for `tokens` = (loaded, total
        prompt tokens) of the same traffic at another size (the what-if).

        The fit's computed token was measured with its store running, so a loaded token's
        measured saving includes a store it never had to pay for (hence the stores charged
        to loaded tokens too). The floor is a cost with no store in it: where a loaded token
        saves more priced at the floor than at the fit less its store, the floor decides,
        and only the tokens computed with offload pay stores. Charging the stores to the
        loaded tokens as well there would count them twice (8B chat with 27 GiB on the H200:
        3.94 s saved at the floor against 4.01 s of stores, 2.98 s of them on loaded
        tokens)."""
        window = self.loaded_tokens + self.computed_tokens
        loaded, total = tokens if tokens is not None else (self.loaded_tokens, window)
        se = self.stderr_seconds
        if z > 0 and self.upper_stderr_seconds is not None:
            se = self.upper_stderr_seconds
        per_loaded = (self.saved_seconds + z * se) / self.loaded_tokens
        per_store = store_factor * self.store_seconds / window
        if self.floor_saved_seconds is not None:
            at_floor = (
                self.floor_saved_seconds + z * self.floor_stderr_seconds
            ) / self.loaded_tokens
            if at_floor > per_loaded - per_store:
                return at_floor * loaded, per_store * (total - loaded)
        return per_loaded * loaded, per_store * total

    def net(
        self, z: float = 0.0, store_factor: float = 1.0, tokens: tuple[float, float] | None = None
    ) -> float:
        """TTFT saved net of the stores (priced); negative: offload cost."""
        saved, stores = self.priced(z, store_factor, tokens)
        return saved - stores

    @property
    def net_seconds(self) -> float:
        """TTFT the window's traffic saved through offload (negative: offload cost)."""
        return self.net()

    @property
    def net_stderr_seconds(self) -> float:
        """The net's standard error below it (above it may be wider: upper_stderr_seconds)."""
        return (self.net_seconds - self.net(-2.0)) / 2

    def share(
        self, z: float = 0.0, store_factor: float = 1.0, load_steps: bool = False
    ) -> float | None:
        """Net saving (shifted by z standard errors, the stores charged at store_factor
        times their copy time, with `load_steps` every load's steps charged on top: the
        fit may have priced them already, so this is a bound, not an estimate) over the
        TTFT the traffic would have had without offload."""
        net = self.net(z, store_factor) - (self.load_step_seconds if load_steps else 0.0)
        without = self.ttft_seconds + net
        if without <= 0:
            return None
        return net / without


def decode_step_seconds(steps: Mapping[str, float] | None) -> float | None:
    """The engine's step time while requests decode: vLLM's mean inter-token latency over
    the window (its sums `itl_seconds` / `itl_gaps`), or None with fewer than
    MIN_DECODE_GAPS gaps. On 4B's bursts with 32 tokens decoded per request (eager, H100)
    it read 22.47 ms, the engine's step log 23.51 ms per decode step (docs/whatif.md,
    bench.step_time)."""
    gaps, seconds = (steps or {}).get("itl_gaps"), (steps or {}).get("itl_seconds")
    if gaps is None or seconds is None or gaps < MIN_DECODE_GAPS or seconds <= 0:
        return None
    return seconds / gaps


def offload_balance(
    fit: OffloadFit | None,
    sums: Mapping[str, float] | None,
    floor: float | None = None,
    steps: Mapping[str, float] | None = None,
) -> OffloadBalance | None:
    """None without a valid TTFT fit with an error estimate, or without store timing.
    `floor`: the least a computed token costs (compute.computed_token_floor), or None.
    `steps`: the window's sums (EngineDerived.window: `load_ops`, the load jobs, and the
    inter-token latency's), or None."""
    if fit is None or not fit.valid or fit.saving_stderr is None or sums is None:
        return None
    loaded, computed = sums[LOADED], sums[COMPUTED]
    store, ttft = sums["store_seconds"], sums["ttft_seconds"]
    if loaded <= 0 or computed <= 0 or store < 0 or ttft <= 0:
        return None
    return OffloadBalance(
        loaded_tokens=loaded,
        computed_tokens=computed,
        saved_seconds=fit.saving_seconds_per_token * loaded,
        store_seconds=store * (loaded + computed) / computed,
        stderr_seconds=fit.saving_stderr * loaded,
        ttft_seconds=ttft,
        upper_stderr_seconds=(
            fit.saving_upper_stderr * loaded
            if fit.saving_upper_stderr is not None and fit.saving_upper_stderr != fit.saving_stderr
            else None
        ),
        floor_saved_seconds=(
            (floor - fit.loaded_seconds_per_token) * loaded if floor is not None else None
        ),
        floor_stderr_seconds=(fit.loaded_stderr or 0.0) * loaded,
        load_step_seconds=(
            LOAD_STEPS * steps.get("load_ops", 0.0) * step
            if steps is not None and (step := decode_step_seconds(steps)) is not None
            else 0.0
        ),
    )


# How far (as a factor, 1 + SAME_LOAD either way) the window's request rate may stray from
# the rate the fit before offload was measured at for the two to be compared: the fit prices
# requests and tokens, not the queueing a busier engine adds to every request.
SAME_LOAD = 0.25


@dataclass(frozen=True, slots=True)
class DeliveredSaving:
    """What enabling offload delivered: the summed TTFT the window's requests and tokens
    would have had by the engine's own TTFT fit from before offload was enabled (a loaded
    token priced as the computed token it replaces), against the summed TTFT measured.

    It needs no split of a request's cost into loaded, computed and per-request parts, so
    it holds where the offload fit cannot separate them; and it sees every cost offload
    adds, the stores and the scheduler's own work included (on the H200 the 0.6B engine's
    requests that loaded nothing were 4-38 % slower with offload on, far beyond the store
    copy time the balance charges). On the H200 matrix it came within 0.052 of the truth's
    relative change on every offload run, the truth inside its interval on each
    (docs/gpu-acceptance.md)."""

    without_seconds: float  # the window's traffic priced by the fit from before
    ttft_seconds: float  # measured, offload on
    stderr_seconds: float  # of without_seconds, from the fit's covariance

    @property
    def net_seconds(self) -> float:
        return self.without_seconds - self.ttft_seconds

    def share(self, z: float = 0.0) -> float | None:
        """TTFT saved (shifted by z standard errors) over the TTFT without offload."""
        without = self.without_seconds + z * self.stderr_seconds
        if without <= 0:
            return None
        return (without - self.ttft_seconds) / without


def delivered_saving(
    before: PrefillFit | None,
    before_rate: float | None,
    before_scale: float,
    sums: Mapping[str, float] | None,
    seconds: float,
) -> DeliveredSaving | None:
    """None without a fit from before with its covariance, without the window's sums, or
    where the window's request rate is more than SAME_LOAD above or below the rate before
    (as a factor: 1.25 times, or 1/1.25). `before_scale` (fits.total_scale of the window the
    fit was measured on) corrects the fit's own bias on summed TTFT: on the H200 matrix the
    fits predicted 0.98-1.19x their own window's TTFT, and that bias, carried into the
    window with offload, was most of the gap to the truth (0.081 at worst without the
    correction, 0.052 with it; docs/gpu-acceptance.md)."""
    if before is None or sums is None or seconds <= 0 or not before_rate:
        return None
    requests, ttft = sums["ttft_requests"], sums["ttft_seconds"]
    tokens = sums[LOADED] + sums[COMPUTED]
    if requests <= 0 or ttft <= 0:
        return None
    ratio = requests / seconds / before_rate
    if max(ratio, 1.0 / ratio) > 1.0 + SAME_LOAD:
        return None
    without, stderr = before.predict(requests, tokens)
    if stderr is None or without <= 0 or before_scale <= 0:
        return None
    return DeliveredSaving(without * before_scale, ttft, stderr * before_scale)


def request_cost(fit: OffloadFit | None, before: PrefillFit | None) -> tuple[float, float] | None:
    """What offload adds to the TTFT of every request, loaded or not, and its standard
    error: the per-request cost of the window's TTFT fit with offload on less that of the
    engine's TTFT fit from before it was enabled. It is the cost of the engine steps the tier
    adds to a request's way (docs/whatif.md, "What a tier costs every request"), which the
    balance does not charge. On the matrix's 39 pairs whose requests came in bursts it was
    within 1.3 standard errors of what the same bursts' paired requests measured, from -14
    to +81 ms a request (bench.burst_parts). None where either fit lacks the per-request
    cost's error: an offload fit whose computed token's cost was given, not fitted."""
    if fit is None or before is None or fit.overhead_stderr is None:
        return None
    if before.overhead_stderr is None:
        return None
    return (
        fit.overhead_seconds - before.overhead_seconds,
        math.hypot(fit.overhead_stderr, before.overhead_stderr),
    )
