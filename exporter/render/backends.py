"""Families of the KV transfer backends: tiering, simple offload, LMCache, NIXL."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from exporter.catalogue import Family
from exporter.model.derive.engines import EngineDerived


def backend_families(per_target: Iterable[tuple[str, Sequence[EngineDerived]]]) -> list[Family]:
    info = Family("kvoffload_offload_config_info")
    tier_hit = Family("kvoffload_tier_hit_ratio")
    tier_read = Family("kvoffload_tier_read_bandwidth_bytes_per_second")
    tier_write = Family("kvoffload_tier_write_bandwidth_bytes_per_second")
    tier_read_total = Family("kvoffload_tier_read_bytes_total")
    tier_write_total = Family("kvoffload_tier_write_bytes_total")
    simple_stored = Family("kvoffload_simple_offload_stored_ratio")
    simple_dropped = Family("kvoffload_simple_offload_dropped_ratio")
    lmc_retrieve = Family("kvoffload_lmcache_retrieve_tokens_per_second")
    lmc_store = Family("kvoffload_lmcache_store_tokens_per_second")
    nixl_bw = Family("kvoffload_nixl_transfer_bandwidth_bytes_per_second")
    nixl_speed = Family("kvoffload_nixl_transfer_speedup_ratio")
    nixl_failed = Family("kvoffload_nixl_failed_transfers_total")
    nixl_link = Family("kvoffload_nixl_link_info")
    for target, engines in per_target:
        for d in engines:
            b = d.backend
            if b is None:
                continue
            labels = [target, d.key.model_name, d.key.engine]
            info.add([*labels, *b.config.labels()], 1.0)
            for t in b.tiers:
                tl = [*labels, t.tier]
                for fam, value in (
                    (tier_hit, t.hit_ratio),
                    (tier_read, t.read_bandwidth),
                    (tier_write, t.write_bandwidth),
                    (tier_read_total, t.read_bytes_total),
                    (tier_write_total, t.write_bytes_total),
                ):
                    if value is not None:
                        fam.add(tl, value)
            for fam, value in (
                (simple_stored, b.simple_stored_ratio),
                (simple_dropped, b.simple_dropped_ratio),
                (lmc_retrieve, b.lmcache_retrieve_tokens_per_second),
                (lmc_store, b.lmcache_store_tokens_per_second),
                (nixl_bw, b.nixl_bandwidth),
                (nixl_speed, b.nixl_speedup),
                (nixl_failed, b.nixl_failed_total),
            ):
                if value is not None:
                    fam.add(labels, value)
            if b.nixl_in_use:
                nixl_link.add([*labels, b.nixl_link], 1.0)
    return [
        info,
        tier_hit,
        tier_read,
        tier_write,
        tier_read_total,
        tier_write_total,
        simple_stored,
        simple_dropped,
        lmc_retrieve,
        lmc_store,
        nixl_bw,
        nixl_speed,
        nixl_failed,
        nixl_link,
    ]
