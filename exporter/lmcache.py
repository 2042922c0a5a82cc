"""LMCache's series onto vLLM's engine key, before normalisation (exporter/vllm_metrics.py).

Used by the vLLM scraper; pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from exporter.expfmt import Sample

# --- LMCache: onto vLLM's engine key -------------------------------------------------------

LMCACHE_PREFIX = "lmcache:"
LMCACHE_ENGINE = "0"
# Gauges that are per-worker shares of one whole (bytes held): summed over workers.
LMCACHE_SUMMED = frozenset({"lmcache:local_cache_usage"})


def lmcache_samples(samples: Sequence[Sample]) -> list[Sample]:
    """Replace `lmcache:*` samples with one sample per (served model, engine "0").

    LMCache labels its series by worker (`worker_id`, `role`) and model, not by vLLM's DP
    `engine`. Under tensor parallelism every worker counts the same tokens (each moves its
    shard of the same prefix), so token counters and timings take the maximum over the
    workers of a role, then add up the roles (lookups are counted by the scheduler role,
    retrieves and stores by the workers); the bytes a worker holds are summed. The model
    key is LMCache's `served_model_name`, else its `model_name`, which is what vLLM's own
    `model_name` label holds. Non-LMCache samples pass through untouched.
    """
    if not any(s.name.startswith(LMCACHE_PREFIX) for s in samples):
        return list(samples)
    out: list[Sample] = []
    per_role: dict[tuple[str, str, str], float] = {}  # (name, model, role) -> max
    summed: dict[tuple[str, str], float] = {}
    order: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for s in samples:
        if not s.name.startswith(LMCACHE_PREFIX):
            out.append(s)
            continue
        if not math.isfinite(s.value):
            continue
        model = s.label("served_model_name") or s.label("model_name")
        if not model:
            continue
        key = (s.name, model)
        if key not in seen:
            seen.add(key)
            order.append(key)
        if s.name in LMCACHE_SUMMED:
            summed[key] = summed.get(key, 0.0) + s.value
            continue
        rk = (s.name, model, s.label("role") or "")
        per_role[rk] = max(per_role.get(rk, -math.inf), s.value)
    by_key: dict[tuple[str, str], float] = dict(summed)
    for (name, model, _), v in per_role.items():
        by_key[(name, model)] = by_key.get((name, model), 0.0) + v
    for name, model in order:
        value = by_key[(name, model)]
        out.append(Sample(name, (("engine", LMCACHE_ENGINE), ("model_name", model)), value))
    return out


# --- what the engine runs ------------------------------------------------------------------
