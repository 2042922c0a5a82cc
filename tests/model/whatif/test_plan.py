"""exporter/model/whatif/plan.py: the simulators an engine needs, from its derived values."""

from __future__ import annotations

import math

from exporter.model.derive.backends import BackendConfig, BackendDerived
from exporter.model.whatif.engine import SimConfig, WhatIfSettings
from exporter.model.whatif.plan import engine_policy, policy_size, recompute_rate, sim_config
from tests.model.whatif.common import derived

GIB = 1 << 30
PER_BLOCK = 114688 * 16  # 1.75 MiB


def native(policy: str = "arc", threshold: str = "2", source: str = "cmdline") -> BackendDerived:
    return BackendDerived(
        BackendConfig("OffloadingConnector", "CPU", policy, threshold, "", source)
    )


def test_nothing_to_simulate_until_the_bytes_per_block_are_known() -> None:
    s = WhatIfSettings(sizes_bytes=(GIB,))
    assert sim_config(derived(kv_bytes_per_token=None), s, None) is None
    assert sim_config(derived(block_size=None), s, None) is None
    assert sim_config(derived(kv_bytes_per_token=1e-9), s, None) is None


def test_sizes_become_cpu_blocks_and_offload_off_compares_at_the_recommendation() -> None:
    s = WhatIfSettings(sizes_bytes=(GIB // 4, GIB // 2))
    assert sim_config(derived(), s, None) == SimConfig((146, 292), None, None, None, None)
    got = sim_config(derived(), s, GIB / 2)
    assert got == SimConfig((146, 292), None, 292, None, None)
    # The policy comparison runs with the exact model only.
    stack = WhatIfSettings(sizes_bytes=(GIB // 4,), model="stack")
    assert sim_config(derived(), stack, GIB / 2) == SimConfig((146,), None, None)


def test_offload_on_simulates_the_configured_buffer_with_its_own_policy() -> None:
    d = derived(offload_enabled=True, offload_buffer_bytes=GIB / 4, backend=native())
    got = sim_config(d, WhatIfSettings(sizes_bytes=(GIB,)), GIB)  # recommendation unused
    assert got == SimConfig((585,), 146, 146, "arc", 2)


def test_engine_policy_only_from_a_native_connector_command_line() -> None:
    assert engine_policy(derived(backend=native("lru", "0"))) == ("lru", 0)
    assert engine_policy(derived(backend=native("fifo", "x"))) == (None, None)
    assert engine_policy(derived(backend=native(source="metrics"))) == (None, None)
    assert engine_policy(derived()) == (None, None)


def test_policy_size() -> None:
    on = derived(offload_enabled=True, offload_buffer_bytes=GIB / 2)
    assert policy_size(on, GIB) == GIB / 2
    other = BackendDerived(BackendConfig("LMCacheConnectorV1", "", "", "", "", "cmdline"))
    assert (
        policy_size(derived(offload_enabled=True, offload_buffer_bytes=1.0, backend=other), 1)
        is None
    )
    assert policy_size(derived(), GIB) == GIB and policy_size(derived(), 0.0) is None


def test_recompute_rate_is_infinite_when_negligible() -> None:
    assert recompute_rate(derived()) == 23_000.0
    assert recompute_rate(derived(recompute_negligible=True)) == math.inf
