"""Thresholds shared by the advisor, the alerting rules and the dashboards.

One table, so a dashboard's red line, an alert's condition and the advisor's decision
never disagree. Defaults come from the published measurements (DEVELOPERS.md facts,
docs/advisor.md explains each one).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Thresholds:
    # GPU KV under pressure: vLLM's own "KV Cache" dashboard colours 0.9 orange, 0.98 red.
    kv_usage_high: float = 0.90
    kv_usage_critical: float = 0.98
    # Prefix reuse that eviction destroys must be a meaningful share of prompt tokens
    # before offload is worth its pinned memory: the published A/B/C/A run had 19%.
    recompute_share_material: float = 0.05
    # An offload hit ratio below this over the window means the tier is not paying.
    offload_hit_ratio_material: float = 0.02
    # Loaded / stored bytes: the published run offloaded 2.82 GB and reloaded 0.84 GB (0.30);
    # below 0.05 nearly everything stored is never read back.
    reuse_ratio_low: float = 0.05
    # Reload must beat marginal recompute with margin: fixed per-load costs are not in
    # the copy-time counter (the H200 0.6B run showed 4.6x "faster" copies and no gain).
    transfer_speedup_min: float = 1.5
    # With offload on, the share of TTFT (of the same traffic without offload) the window's
    # balance must save: the 3 % that defines "pays" in docs/advisor.md. A balance whose
    # upper bound stays below it turns offload off; one whose lower bound clears it stands
    # in for the speedup margin, since it measures the per-load and store costs itself.
    ttft_saving_material: float = 0.03
    # How much a store may cost the TTFT, as a multiple of vLLM's store copy time, when a
    # keep or resize must be proven from the window alone. The balance charges the copy time
    # (factor 1); on the H200 runs whose requests barely overlapped (0.6B and 8B long
    # context), storing raised a computed token's prefill cost by 0.9-2.0x its copy time
    # (bench/store_cost.py). The balance must still save at its lower end with the stores at
    # this factor: a cheaper store only delays a keep, a dearer one would make it harmful.
    store_cost_factor_max: float = 2.0
    # Pinned pool + the rest of the container against its memory limit: pinned memory is
    # never swapped or reclaimed, so the OOM killer is the failure mode.
    memory_usage_high: float = 0.90
    # PCIe busy: share of the link's theoretical bandwidth in either direction.
    pcie_utilization_high: float = 0.80
    # The what-if must gain this much hit ratio to justify a different buffer size.
    whatif_gain_material: float = 0.02
    # Smallest buffer reaching this share of the best achievable what-if hit ratio.
    whatif_knee_share: float = 0.90
    # Of the chunks the CPU tier dropped (KV events), the share never loaded above which a
    # store threshold is worth recommending, once this many chunks were dropped.
    wasted_store_share_high: float = 0.80
    min_dropped_chunks: float = 100.0
    # Evidence needed before advising: window coverage and prompt tokens seen.
    min_window_seconds: float = 120.0
    min_prompt_tokens: float = 50_000.0


DEFAULT = Thresholds()
