"""CycleInputs: everything one collection cycle hands the model, as one typed value.

The runtime builds it from the sources' snapshots; `kv-offload-exporter replay` builds it
from a recording. The model never sees a source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from exporter.model.advisor.types import MemoryState
from exporter.model.derive.engines import DeriveSettings
from exporter.model.whatif.engine import StreamItemLike
from exporter.window import TargetWindow


@dataclass(frozen=True, slots=True)
class TargetInputs:
    label: str
    window: TargetWindow  # the scrape window, as the target's source filled it
    settings: DeriveSettings  # stale_after, KV bytes override, link, launch flags
    memory: MemoryState | None = None  # container limit, usage, measured offload pool
    # KV events since the last cycle, in arrival order; None: no KV-event consumer for the
    # target (no what-if), () : a consumer that received nothing this cycle.
    kv_items: Sequence[StreamItemLike] | None = None


@dataclass(frozen=True, slots=True)
class CycleInputs:
    now: float
    targets: tuple[TargetInputs, ...]
    pcie_utilization: float | None = None  # busiest direction of the busiest GPU, 0..1
