"""The status page's view value from the exporter's state (in memory only, no I/O).

`card_extras()` adds what a card needs beyond `advice_json()` to each `/advice` item (since
when, the configured buffer, the what-if curve, the assumed reload rate), so the page and
`kv-offload-exporter advise --url` build the same `Card` from the same JSON.
`status_view()` adds the per-engine time series from `Exporter.history`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from exporter.model.advisor.types import AdvisorInput
from exporter.model.history import EngineRef, History
from exporter.render.status_page import (
    Chart,
    EngineView,
    SourceRow,
    StatusView,
    card_from_json,
)
from exporter.render.svg import Line, Mark
from exporter.thresholds import Thresholds

if TYPE_CHECKING:
    from exporter.runtime import Exporter
    from exporter.vllm_metrics import EngineKey


def card_extras(exp: Exporter, target: str, key: EngineKey) -> dict[str, Any]:
    inp: AdvisorInput | None = exp.inputs.get((target, key))
    d = inp.derived if inp is not None else None
    whatif = inp.whatif if inp is not None else None
    assumed = float(exp.cfg.assumed_load_bandwidth) or None
    return {
        "since": exp.history.since(EngineRef(target, key.model_name, key.engine)),
        "offload_enabled": bool(d and d.offload_enabled),
        "configured_buffer_bytes": d.offload_buffer_bytes if d and d.offload_enabled else None,
        "whatif": [
            {
                "cpu_buffer_bytes": p.cpu_buffer_bytes,
                "hit_ratio": p.hit_ratio,
                "ttft_saved_seconds_per_second": p.ttft_saved_seconds_per_second,
            }
            for p in (whatif.points if whatif is not None else ())
        ],
        # The reload rate behind the advice is the operator's assumption, not a measurement.
        "assumed_load_bandwidth_bytes_per_second": assumed
        if d is not None and d.transfer_estimated and d.load_bandwidth is None
        else None,
    }


def engine_charts(history: History, ref: EngineRef, th: Thresholds) -> tuple[Chart, ...]:
    pts = history.points(ref)
    last = pts[-1] if pts else None

    def line(label: str, field: str, dashed: bool = False) -> Line:
        return Line(label, history.series(ref, field), dashed)

    offload_on = last is not None and last.offload_hit_ratio is not None
    reload_label = "reload" + (
        " (estimated: no offload measured)" if last is not None and last.reload_estimated else ""
    )
    return (
        Chart(
            "Offload hit ratio vs GPU prefix hit ratio",
            "ratio",
            (
                line(
                    "offload hit ratio" + ("" if offload_on else " (offload off)"),
                    "offload_hit_ratio",
                ),
                line("GPU prefix hit ratio", "gpu_prefix_hit_ratio"),
            ),
            (
                Mark(
                    f"offload material {th.offload_hit_ratio_material:.0%}",
                    th.offload_hit_ratio_material,
                ),
            ),
            no_data="no data: no vLLM prefix-cache counters in the window",
        ),
        Chart(
            "Recompute after eviction (share of prompt tokens)",
            "ratio",
            (line("recomputed after GPU eviction", "recompute_after_eviction_share"),),
            (Mark(f"material {th.recompute_share_material:.0%}", th.recompute_share_material),),
            no_data="no data: needs vLLM's KV events (--kv-events-config) at the exporter",
        ),
        Chart(
            "Reload vs recompute speed (tokens/s)",
            "tokens/s",
            (
                line(
                    reload_label, "reload_tokens_per_second", bool(last and last.reload_estimated)
                ),
                line("marginal recompute", "recompute_tokens_per_second"),
            ),
            no_data="no data: the prefill fit and the reload rate are not identified yet",
            log=True,
        ),
        Chart(
            "PCIe utilisation (busiest direction)",
            "ratio",
            (line("PCIe", "pcie_utilization"),),
            (Mark(f"busy {th.pcie_utilization_high:.0%}", th.pcie_utilization_high),),
            no_data="no data: no GPU visible to NVML (or --no-nvml)",
        ),
        Chart(
            "Pinned memory vs container limit",
            "bytes",
            (
                line("pinned offload pool", "pool_bytes"),
                line("container memory in use", "memory_usage_bytes"),
                line("container limit", "memory_limit_bytes", dashed=True),
            ),
            no_data="no data: no container memory limit or offload pool found (cgroup, /proc)",
        ),
    )


def advice_items(exp: Exporter) -> list[dict[str, Any]]:
    from exporter.render.advice_json import advice_json

    th = exp.cfg.thresholds
    return [
        advice_json(target, key, advice, th) | card_extras(exp, target, key)
        for target, pairs in exp.advice.items()
        for key, advice in pairs
    ]


def _health(h: Any) -> str:
    if h.up:
        return ""
    return f"{h.error_kind or ''}: {h.error or ''}".strip(": ")


def status_view(
    exp: Exporter, now: float, items: Sequence[Mapping[str, Any]] | None = None
) -> StatusView:
    from exporter import __version__

    th = exp.cfg.thresholds
    engines = []
    for item in items if items is not None else advice_items(exp):
        card = card_from_json(item)
        ref = EngineRef(card.target, card.model_name, card.engine)
        engines.append(EngineView(card, engine_charts(exp.history, ref, th)))
    targets = tuple(
        SourceRow(
            f"vLLM {t.config.label}",
            t.health.up,
            f"{t.config.url}, vLLM {t.version or 'unknown'}"
            + (f"; {_health(t.health)}" if not t.health.up else ""),
        )
        for t in exp.targets
    )
    collectors = tuple(
        SourceRow(s.name, s.health.up, _health(s.health))
        for s in exp.sources
        if s not in exp.targets
    )
    return StatusView(
        version=__version__,
        now=now,
        window_seconds=exp.cfg.window,
        interval_seconds=exp.cfg.interval,
        cycles=exp.cycles,
        refresh_seconds=max(5, round(exp.cfg.interval * 2)),
        targets=targets,
        engines=tuple(engines),
        collectors=collectors,
    )
