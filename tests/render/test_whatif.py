"""exporter/render/whatif.py: the what-if families of one target's engines."""

from __future__ import annotations

from exporter.model.advisor.types import PolicyPoint, WhatIfPoint, WhatIfState
from exporter.render.whatif import whatif_families
from exporter.vllm_metrics import EngineKey

GIB = 1 << 30
NAMES = [
    "kvoffload_whatif_offload_hit_ratio",
    "kvoffload_whatif_ttft_saved_seconds_per_second",
    "kvoffload_whatif_configured_hit_ratio",
    "kvoffload_whatif_policy_hit_ratio",
]


def test_families_in_order_with_sizes_as_whole_bytes() -> None:
    e0, e1, e2 = EngineKey("m", "0"), EngineKey("m", "1"), EngineKey("m", "2")
    state = WhatIfState(
        (WhatIfPoint(float(GIB // 4), 0.1, -0.5), WhatIfPoint(float(16 * GIB), 0.2, None)),
        100.0,
        0.15,
    )
    unconfigured = WhatIfState((WhatIfPoint(float(GIB // 4), 0.3, 0.25),), 0.0)
    points = (PolicyPoint("lru", 0, GIB / 4, 0.1, True), PolicyPoint("arc", 2, GIB / 4, 0.3))
    fams = whatif_families("t", [(e0, state, points), (e1, None, ()), (e2, unconfigured, ())])
    assert [f.definition.name for f in fams] == NAMES
    s = {f.definition.name: list(f.samples) for f in fams}
    assert s["kvoffload_whatif_offload_hit_ratio"] == [
        (("t", "m", "0", "268435456"), 0.1),
        (("t", "m", "0", "17179869184"), 0.2),
        (("t", "m", "2", "268435456"), 0.3),
    ]
    # absent while a rate is unknown; negative kept
    assert s["kvoffload_whatif_ttft_saved_seconds_per_second"] == [
        (("t", "m", "0", "268435456"), -0.5),
        (("t", "m", "2", "268435456"), 0.25),
    ]
    assert s["kvoffload_whatif_configured_hit_ratio"] == [(("t", "m", "0"), 0.15)]
    assert s["kvoffload_whatif_policy_hit_ratio"] == [
        (("t", "m", "0", "lru", "0"), 0.1),
        (("t", "m", "0", "arc", "2"), 0.3),
    ]


def test_no_engines_no_series() -> None:
    assert all(len(f) == 0 for f in whatif_families("t", []))
