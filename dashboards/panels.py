"""The three dashboards as data. Thresholds come from exporter/thresholds.py.

Every panel says which scenario proves it (spec.Scenario). A panel whose exporter
metrics are not in exporter/catalogue.csv yet must be listed in PENDING: the
generator then skips it with a warning. A panel with unknown names that is not in
PENDING makes the generator fail.
"""

from __future__ import annotations

from dashboards.spec import (
    ENGINE,
    TARGET,
    TARGET_ENGINE,
    VLLM,
    Color,
    Dashboard,
    Mapping,
    Panel,
    Query,
    Row,
    Scenario,
    Step,
    Variable,
    on_exporter,
    rate,
)
from exporter.model.advisor.types import ACTION_INFO, Action, Reason, Tone
from exporter.thresholds import DEFAULT as T

# Colour boundaries that are not advisor/alert thresholds (those come from
# exporter/thresholds.py); tests/test_dashboards.py allows no other literal.
LOCAL_STEPS = {
    "no_saving": 0.0,  # TTFT saved per second: below 0 offload makes requests slower
    "no_request_cost": 0.0,  # TTFT the tier adds to each request: above 0 it slows every one
    "up": 1.0,  # a target is up
    "pool_rounding": 1.05,  # offload pool more than 5% above the configured buffer
    "any_replays": 0.01,  # PCIe replays per second worth a look
}

LIVE = frozenset({Scenario.LIVE})
OFFLOAD = frozenset({Scenario.OFFLOAD})
GPU = frozenset({Scenario.GPU})
BOTH = frozenset({Scenario.LIVE, Scenario.OFFLOAD})
BACKENDS = frozenset({Scenario.BACKENDS})

DATASOURCE_UID = "kvoe-prometheus"
# The runbooks (docs/runbooks.md) as operators reach them from Grafana. One constant:
# point it at wherever the repository's docs are served.
RUNBOOKS_URL = (
    "https://github.com/kv-offload-exporter/kv-offload-exporter/blob/main/docs/runbooks.md"
)

# ---------------------------------------------------------------------------------------
# PENDING: panels designed and tested but waiting for exporter metrics (catalogue rows).
# The generator skips a pending panel whose names are still unknown (with a warning) and
# includes it, with a reminder to remove it from here, once they all exist.
# ---------------------------------------------------------------------------------------
PENDING: dict[str, str] = {}

VARIABLES: tuple[Variable, ...] = (
    Variable(
        "job",
        "Exporter job",
        "label_values(kvoffload_target_up, job)",
        "Prometheus jobs that scrape the exporter (vLLM itself may be scraped by another).",
    ),
    Variable(
        "target",
        "vLLM target",
        'label_values(kvoffload_target_up{job=~"$job"}, target)',
        "The vLLM server as the exporter names it (its --vllm-url host:port, or its name).",
    ),
    Variable(
        "instance",
        "vLLM instance",
        "label_values(vllm:cache_config_info, instance)",
        "vLLM servers as Prometheus scrapes them directly: the panels built on vllm:* "
        "series (TTFT, offload throughput, lookups, allocation failures) filter on it.",
    ),
    Variable(
        "model_name",
        "Model",
        'label_values(kvoffload_offload_enabled{job=~"$job", target=~"$target"}, model_name)',
        "Served model name.",
    ),
    Variable(
        "engine",
        "Engine",
        "label_values(kvoffload_offload_enabled"
        '{job=~"$job", target=~"$target", model_name=~"$model_name"}, engine)',
        "Data-parallel engine index.",
    ),
)

EL = "{{model_name}}/{{engine}} {{target}}"  # legend of per-engine exporter series
VL = "{{model_name}}/{{engine}} {{instance}}"  # legend of per-engine vLLM series

# The advisor's actions as kvoffload_advice_info shows them: one row per Action, from
# exporter/model/advisor/types.py's ACTION_INFO (title and tone); only the colours are ours.
TONE_COLORS: dict[Tone, Color] = {
    Tone.OK: Color.OK,
    Tone.INFO: Color.INFO,
    Tone.WARN: Color.WARN,
    Tone.BAD: Color.BAD,
    Tone.NEUTRAL: Color.NEUTRAL,
}
ACTION_MAPPINGS = tuple(
    Mapping(action.value, info.title, TONE_COLORS[info.tone])
    for action, info in ACTION_INFO.items()
)
# Buffer sizes arrive as a label in bytes; powers of two (the default --whatif-sizes are
# 0.25..16 GiB) get a readable name on the bar chart's axis.
SIZE_MAPPINGS = tuple(
    Mapping(str(1 << k), f"{1 << (k % 10)} {('KiB', 'MiB', 'GiB', 'TiB')[k // 10 - 1]}")
    for k in range(10, 45)
)
ON_OFF = (Mapping("0", "off", Color.NEUTRAL), Mapping("1", "on", Color.OK))
UP_DOWN = (Mapping("0", "down", Color.BAD), Mapping("1", "up", Color.OK))


def low_is_bad(limit: float) -> tuple[Step, ...]:
    return (Step(None, Color.BAD), Step(limit, Color.OK))


def high_is_bad(limit: float, critical: float | None = None) -> tuple[Step, ...]:
    steps = [Step(None, Color.OK), Step(limit, Color.WARN if critical else Color.BAD)]
    if critical is not None:
        steps.append(Step(critical, Color.BAD))
    return tuple(steps)


def quantiles(bucket: str, qs: tuple[float, ...], legend: str = VL) -> tuple[Query, ...]:
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (le, instance, model_name, engine) "
            f"({rate(bucket, VLLM)}))",
            f"p{round(q * 100)} {legend}",
        )
        for q in qs
    )


def mean_per_request(histogram: str, legend: str) -> Query:
    """A vLLM histogram's mean per observation (per request for the request_* families)."""
    by = "sum by (instance, model_name, engine) "
    return Query(
        f"{by}({rate(histogram + '_sum', VLLM)}) / {by}({rate(histogram + '_count', VLLM)})",
        f"{legend} {VL}",
    )


# ---------------------------------------------------------------------------------------
# 1. Decision
# ---------------------------------------------------------------------------------------

DECISION = Dashboard(
    uid="kvoe-decision",
    title="KV offload: decision",
    file="kv-offload-decision.json",
    description=(
        "Should CPU KV offloading be on, at what size, is it paying, is it dangerous: the "
        "exporter's advice per engine and the evidence behind it."
    ),
    rows=(
        Row(
            "Advice",
            (
                Panel(
                    key="decision.advice",
                    title="Current advice per engine",
                    kind="table",
                    unit="none",
                    width=12,
                    height=7,
                    description=(
                        "What the advisor recommends for each engine now, with its reason code "
                        "(docs/advisor.md explains each). A new advice must win several "
                        "evaluations in a row before it replaces the current one. "
                        "'insufficient data' means the window holds too few prompt tokens or "
                        "too short a coverage to decide; send traffic and wait."
                    ),
                    queries=(
                        Query(
                            "max by (target, model_name, engine, action, reason) "
                            f"(kvoffload_advice_info{{{ENGINE}}})",
                            instant=True,
                            table=True,
                        ),
                    ),
                    mappings=ACTION_MAPPINGS,
                    hidden_columns=("Time", "Value"),
                    runbooks=("OffloadRecommended", "OffloadNotPayingOff", "OffloadBufferTooSmall"),
                    # The recorded H200 run ends decided (grow_buffer): the preview shows it.
                    preview=Scenario.GPU,
                    scenarios=BOTH | GPU,
                ),
                Panel(
                    key="decision.buffer",
                    title="CPU buffer: recommended vs configured",
                    kind="stat",
                    unit="bytes",
                    width=6,
                    height=7,
                    description=(
                        "Configured: --kv-offloading-size of the engine. Recommended: the size "
                        "the advisor suggests when its action is about the size (grow, shrink, "
                        "reduce for OOM risk, enable); absent otherwise. The recommendation is the "
                        "smallest buffer that reaches most of the best what-if hit ratio."
                    ),
                    queries=(
                        Query(
                            f"kvoffload_offload_buffer_bytes{{{ENGINE}}}",
                            "configured " + EL,
                            instant=True,
                        ),
                        Query(
                            f"kvoffload_advice_recommended_buffer_bytes{{{ENGINE}}}",
                            "recommended " + EL,
                            instant=True,
                        ),
                    ),
                    preview=Scenario.GPU,
                    scenarios=OFFLOAD | GPU,
                ),
                Panel(
                    key="decision.enabled",
                    title="Offload configured",
                    kind="stat",
                    unit="none",
                    width=6,
                    height=7,
                    description=(
                        "Whether the engine runs with CPU KV offloading (--kv-offloading-size or "
                        "an OffloadingConnector). Off: the panels below show what offload could "
                        "save (GPU prefix hit ratio, recomputed tokens, what-if curve)."
                    ),
                    queries=(Query(f"kvoffload_offload_enabled{{{ENGINE}}}", EL, instant=True),),
                    mappings=ON_OFF,
                    scenarios=BOTH,
                ),
            ),
        ),
        Row(
            "Is it paying?",
            (
                Panel(
                    key="decision.hit_ratios",
                    title="Offload hit ratio vs GPU prefix hit ratio",
                    width=8,
                    kind="timeseries",
                    unit="percentunit",
                    min=0,
                    max=1,
                    description=(
                        "Offload hit ratio: share of all prompt tokens whose KV was loaded from "
                        "the CPU tier instead of recomputed. GPU prefix hit ratio: share of "
                        "looked-up prompt tokens found in GPU memory. Offload pays only when its "
                        "hit ratio is material (dashed line, "
                        f"{T.offload_hit_ratio_material:.0%}); a high GPU ratio with a low "
                        "offload ratio means the GPU cache already holds the reuse."
                    ),
                    queries=(
                        Query(f"kvoffload_offload_hit_ratio{{{ENGINE}}}", "offload " + EL),
                        Query(f"kvoffload_gpu_prefix_hit_ratio{{{ENGINE}}}", "GPU prefix " + EL),
                    ),
                    steps=low_is_bad(T.offload_hit_ratio_material),
                    threshold_lines=True,
                    runbooks=("OffloadNotPayingOff",),
                    preview=Scenario.OFFLOAD,
                    scenarios=BOTH,
                ),
                Panel(
                    key="decision.ttft",
                    title="Time to first token (p50, p90, p99)",
                    width=8,
                    kind="timeseries",
                    unit="s",
                    min=0,
                    description=(
                        "TTFT quantiles from vLLM's own histogram (vllm:time_to_first_token_"
                        "seconds, scraped from vLLM directly). Offload that pays lowers these "
                        "for prompts with a reused prefix; compare before and after enabling it."
                    ),
                    queries=quantiles("vllm:time_to_first_token_seconds_bucket", (0.5, 0.9, 0.99)),
                    scenarios=BOTH,
                ),
                Panel(
                    key="decision.queue_prefill",
                    title="A request's queue and prefill time (mean)",
                    width=8,
                    kind="timeseries",
                    unit="s",
                    min=0,
                    description=(
                        "Mean seconds a request waited to be scheduled (queue) and then took "
                        "to its first token (prefill), from vLLM's own histograms "
                        "(vllm:request_queue_time_seconds, vllm:request_prefill_time_seconds). "
                        "With a CPU tier the two sides of its bill part here: a load's wait "
                        "is queue time, what it saves is prefill time. The 8B bursts decoding "
                        "256 tokens with 16 GiB queued 23 ms longer and prefilled 42 ms "
                        "shorter a request than without (bench.latency_parts; docs/whatif.md, "
                        "what batch 41 measured); compare before and after enabling."
                    ),
                    queries=(
                        mean_per_request("vllm:request_queue_time_seconds", "queue"),
                        mean_per_request("vllm:request_prefill_time_seconds", "prefill"),
                    ),
                    preview=Scenario.GPU,
                    scenarios=BOTH | GPU,
                ),
                Panel(
                    key="decision.speedup",
                    title="Transfer speedup: reload vs recompute",
                    width=6,
                    kind="timeseries",
                    unit="suffix:×",
                    min=0,
                    description=(
                        "How many times faster the offload tier reloads a token than the GPU "
                        "recomputes it (load bandwidth / KV bytes per token, over the marginal "
                        "prefill speed). Below the dashed line "
                        f"({T.transfer_speedup_min:g}×) offload cannot save prefill time: small "
                        "models on fast GPUs recompute faster than PCIe reloads. Without "
                        "measured loads the speedup is an estimate from the PCIe link or "
                        "--assumed-load-bandwidth (kvoffload_transfer_rate_estimated = 1)."
                    ),
                    queries=(Query(f"kvoffload_transfer_speedup_ratio{{{ENGINE}}}", EL),),
                    steps=low_is_bad(T.transfer_speedup_min),
                    threshold_lines=True,
                    runbooks=("OffloadNotPayingOff",),
                    see_also=("kvoe-transfers",),
                    scenarios=LIVE,
                ),
                Panel(
                    key="decision.reuse",
                    title="Reuse ratio: loaded / stored bytes",
                    kind="timeseries",
                    unit="percentunit",
                    min=0,
                    width=6,
                    description=(
                        "Of the bytes written to the CPU tier, how many came back. Below "
                        f"{T.reuse_ratio_low:.0%} (dashed) nearly everything offloaded is never "
                        "read again: offload costs PCIe bandwidth and pinned memory for nothing "
                        "(raise store_threshold or disable it)."
                    ),
                    queries=(Query(f"kvoffload_offload_reuse_ratio{{{ENGINE}}}", EL),),
                    steps=low_is_bad(T.reuse_ratio_low),
                    threshold_lines=True,
                    runbooks=("OffloadStoresWithoutReuse",),
                    see_also=("kvoe-transfers",),
                    scenarios=OFFLOAD,
                ),
                Panel(
                    key="decision.ttft_saved",
                    title="TTFT saved by offload, per second",
                    kind="timeseries",
                    unit="s",
                    width=6,
                    description=(
                        "Seconds of time-to-first-token that offload saves per second of "
                        "wall time (summed over requests), net of its stores: loaded tokens "
                        "times the saving per token from a fit of TTFT on computed and loaded "
                        "tokens per scrape interval, minus vLLM's store copy time charged to "
                        "every loaded and computed token. Below zero (red) offload makes "
                        "requests slower (docs/advisor.md, the window's balance). \"against "
                        "before\": the same window priced at the engine's own TTFT fit from "
                        "before offload was enabled, every cost of offload included "
                        "(docs/advisor.md, what enabling delivered); only after the exporter "
                        "saw the engine without offload."
                    ),
                    queries=(
                        Query(f"kvoffload_offload_ttft_saved_seconds_per_second{{{ENGINE}}}", EL),
                        Query(
                            "kvoffload_offload_delivered_ttft_saved_seconds_per_second"
                            f"{{{ENGINE}}}",
                            f"{EL} against before",
                        ),
                    ),
                    steps=low_is_bad(LOCAL_STEPS["no_saving"]),
                    threshold_lines=True,
                    scenarios=GPU,
                ),
                Panel(
                    key="decision.request_cost",
                    title="TTFT offload adds to every request",
                    kind="timeseries",
                    unit="s",
                    width=6,
                    description=(
                        "Seconds of time-to-first-token the CPU tier adds to each request, "
                        "whether it loads from the tier or not: the fixed cost per request of "
                        "the window's TTFT fit with offload on, less that of the engine's fit "
                        "from before offload was enabled. It is the engine steps the tier "
                        "puts in a request's way, apart from what its loads save (TTFT saved by "
                        "offload, left). "
                        "Above zero (red) every request pays it; the advice names it only "
                        "where it exceeds twice its standard error (docs/advisor.md, what "
                        "enabling delivered). Only after the exporter saw the engine without "
                        "offload, and only where the window priced requests, computed and "
                        "loaded tokens apart."
                    ),
                    queries=(
                        Query(f"kvoffload_offload_request_ttft_cost_seconds{{{ENGINE}}}", EL),
                    ),
                    steps=high_is_bad(LOCAL_STEPS["no_request_cost"]),
                    threshold_lines=True,
                    scenarios=GPU,
                ),
            ),
        ),
        Row(
            "Should it be on, and at what size?",
            (
                Panel(
                    key="decision.recomputed_after_eviction",
                    title="Prompt tokens recomputed after eviction",
                    kind="timeseries",
                    unit="percentunit",
                    min=0,
                    width=8,
                    description=(
                        "Share of prompt tokens that were in the GPU prefix cache before and had "
                        "been evicted when they were needed again (from KV events). This is "
                        "what an offload tier could have served; above "
                        f"{T.recompute_share_material:.0%} (dashed) enabling offload is worth "
                        "considering."
                    ),
                    queries=(
                        Query(
                            "sum by (target, model_name, engine) ("
                            + rate("kvoffload_recomputed_after_eviction_tokens_total")
                            + ") / sum by (target, model_name, engine) ("
                            + rate("kvoffload_prompt_tokens_total")
                            + ")",
                            EL,
                        ),
                    ),
                    steps=high_is_bad(T.recompute_share_material),
                    threshold_lines=True,
                    scenarios=LIVE,
                ),
                Panel(
                    key="decision.whatif_curve",
                    title="What-if: offload hit ratio vs CPU buffer size",
                    width=8,
                    kind="barchart",
                    unit="percentunit",
                    min=0,
                    max=1,
                    x_field="cpu_buffer_bytes",
                    axis_label="simulated offload hit ratio",
                    mappings=SIZE_MAPPINGS,
                    description=(
                        "The offload hit ratio a CPU tier of each size (--whatif-sizes) would "
                        "have reached, simulated from the engine's KV cache events over the "
                        "window. The curve flattens where more memory stops paying: the "
                        "advisor recommends the smallest size reaching "
                        f"{T.whatif_knee_share:.0%} of the best ratio. Shows the latest result "
                        "in the time range; pick one engine."
                    ),
                    queries=(
                        Query(
                            f"last_over_time(kvoffload_whatif_offload_hit_ratio{{{ENGINE}}}[$__range])",
                            instant=True,
                            table=True,
                        ),
                    ),
                    scenarios=LIVE,
                ),
                Panel(
                    key="decision.whatif_ttft_saved",
                    title="What-if: prefill time saved vs CPU buffer size",
                    width=8,
                    kind="barchart",
                    unit="s",
                    x_field="cpu_buffer_bytes",
                    axis_label="prefill seconds saved per second",
                    mappings=SIZE_MAPPINGS,
                    description=(
                        "Prefill seconds per second each simulated buffer size would save: its "
                        "simulated hit tokens per second times the difference between "
                        "recomputing and reloading a token. Negative bars: reloading is slower "
                        "than recomputing here, so no buffer size helps. Needs the prefill fit, "
                        "so it shows the latest result in the time range; pick one engine."
                    ),
                    queries=(
                        Query(
                            f"last_over_time(kvoffload_whatif_ttft_saved_seconds_per_second{{{ENGINE}}}[$__range])",
                            instant=True,
                            table=True,
                        ),
                    ),
                    # Live, the tiny CPU model's per-token prefill cost is often below the
                    # noise (the fit then reports recompute as free and this is absent).
                    scenarios=GPU,
                ),
                Panel(
                    key="decision.kv_usage",
                    title="GPU KV cache usage",
                    kind="timeseries",
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=12,
                    description=(
                        "GPU KV cache in use by running requests (vllm:kv_cache_usage_perc). "
                        "Cached prefix blocks that can be evicted count as free, so this reads "
                        "0 on an idle server with a warm cache. Sustained values above "
                        f"{T.kv_usage_high:.0%} (orange) / {T.kv_usage_critical:.0%} (red) mean "
                        "prefixes get evicted: the case offload is for."
                    ),
                    queries=(Query(f"kvoffload_kv_cache_usage_ratio{{{ENGINE}}}", EL),),
                    steps=high_is_bad(T.kv_usage_high, T.kv_usage_critical),
                    threshold_lines=True,
                    runbooks=("KVCacheSaturated",),
                    scenarios=BOTH,
                ),
                Panel(
                    key="decision.whatif_configured",
                    title="What-if at the configured size vs measured",
                    width=12,
                    kind="timeseries",
                    unit="percentunit",
                    min=0,
                    max=1,
                    description=(
                        "The simulator's hit ratio at the configured buffer next to the measured "
                        "offload hit ratio. They should track each other; a large gap means "
                        "the simulation (or the events it reads) is off, so trust the advice "
                        "less."
                    ),
                    queries=(
                        Query(
                            f"kvoffload_whatif_configured_hit_ratio{{{ENGINE}}}", "what-if " + EL
                        ),
                        Query(f"kvoffload_offload_hit_ratio{{{ENGINE}}}", "measured " + EL),
                    ),
                    scenarios=GPU,
                ),
            ),
        ),
        Row(
            "Store threshold and buffer size (from KV events)",
            (
                Panel(
                    key="decision.wasted_store_share",
                    title="Dropped CPU chunks never loaded",
                    kind="timeseries",
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=12,
                    description=(
                        "Of the chunks the CPU tier dropped, the share no request loaded while "
                        "they were held (medium CPU KV events, since the exporter joined the "
                        "stream; vLLM does not export this). Above "
                        f"{T.wasted_store_share_high:.0%} (red line), once "
                        f"{T.min_dropped_chunks:g} chunks were dropped, the advisor recommends "
                        "a store_threshold ('"
                        f"{ACTION_INFO[Action.RAISE_STORE_THRESHOLD].title}', reason "
                        f"{Reason.STORES_NEVER_LOADED}) if "
                        "offload pays and its what-if with store_threshold 2 keeps the hit "
                        "ratio (transfers dashboard, eviction policy row): offloading only "
                        "prefixes seen again saves the PCIe traffic and pinned memory. Low: "
                        "most stored chunks serve a load before they go."
                    ),
                    queries=(Query(f"kvoffload_offload_wasted_store_ratio{{{ENGINE}}}", EL),),
                    steps=high_is_bad(T.wasted_store_share_high),
                    threshold_lines=True,
                    see_also=("kvoe-transfers",),
                    scenarios=GPU,
                ),
                Panel(
                    key="decision.wasted_store_bytes",
                    title="CPU stores dropped unused vs all stores",
                    kind="timeseries",
                    unit="Bps",
                    min=0,
                    width=12,
                    description=(
                        "Bytes per second of CPU-tier chunks dropped without ever being loaded "
                        "(KV events; counted when the chunk is dropped, so it trails the store "
                        "by the chunk's stay in the buffer), next to all bytes stored to the "
                        "CPU tier. This is the PCIe traffic and copy work a store_threshold "
                        "would save. Needs the KV bytes per token (--kv-bytes-per-token or "
                        "found by the exporter)."
                    ),
                    queries=(
                        Query(
                            "sum by (target, model_name, engine) ("
                            + rate("kvoffload_offload_wasted_store_bytes_total")
                            + ")",
                            "never loaded " + EL,
                        ),
                        Query(
                            "sum by (target, model_name, engine) ("
                            + rate("kvoffload_offload_store_bytes_total")
                            + ")",
                            "stored " + EL,
                        ),
                    ),
                    scenarios=GPU,
                ),
                Panel(
                    key="decision.reuse_gap_bytes",
                    title="Reuse gap vs CPU buffer",
                    kind="timeseries",
                    unit="bytes",
                    min=0,
                    width=16,
                    description=(
                        "How far back the blocks that return after a GPU eviction were "
                        "computed, in KV bytes computed since (KV events): half and 90% of "
                        "returns came back within these. A CPU tier that offloads every "
                        "computed block needs about that much to still hold them (an upper "
                        "bound, power-of-two steps). Next to the configured buffer and the "
                        "advisor's recommendation (absent unless its advice is about the "
                        "size): a buffer below the half line misses most returning prefixes; "
                        "one above the 90% line holds nearly all of them."
                    ),
                    queries=(
                        Query(
                            f'kvoffload_reuse_gap_bytes{{{ENGINE}, share="0.5"}}',
                            "half of returns within " + EL,
                        ),
                        Query(
                            f'kvoffload_reuse_gap_bytes{{{ENGINE}, share="0.9"}}',
                            "90% of returns within " + EL,
                        ),
                        Query(f"kvoffload_offload_buffer_bytes{{{ENGINE}}}", "configured " + EL),
                        Query(
                            f"kvoffload_advice_recommended_buffer_bytes{{{ENGINE}}}",
                            "recommended " + EL,
                        ),
                    ),
                    see_also=("kvoe-memory",),
                    scenarios=GPU,
                ),
                Panel(
                    key="decision.reuse_gap_seconds",
                    title="Reuse gap in time",
                    kind="timeseries",
                    unit="s",
                    min=0,
                    width=8,
                    description=(
                        "Seconds from a block's GPU eviction to its return, for half and 90% "
                        "of the returns since the exporter joined the KV event stream (upper "
                        "bound, power-of-two steps from 0.1 s). A CPU tier keeps a stored "
                        "chunk for about its size over the store rate ('stored' above): "
                        "prefixes that return later than that find it gone."
                    ),
                    queries=(
                        Query(
                            f'kvoffload_reuse_gap_seconds{{{ENGINE}, share="0.5"}}',
                            "half of returns within " + EL,
                        ),
                        Query(
                            f'kvoffload_reuse_gap_seconds{{{ENGINE}, share="0.9"}}',
                            "90% of returns within " + EL,
                        ),
                    ),
                    scenarios=GPU,
                ),
            ),
        ),
        Row(
            "Is it dangerous?",
            (
                Panel(
                    key="decision.pinned_vs_limit",
                    title="Pinned memory vs container limit",
                    width=16,
                    kind="timeseries",
                    unit="bytes",
                    min=0,
                    description=(
                        "Pinned (page-locked) host memory of the vLLM processes, which holds the "
                        "offload pool, against the container's memory usage and limit. Pinned "
                        "memory is never swapped or reclaimed: when usage reaches the limit the "
                        "OOM killer ends vLLM."
                    ),
                    queries=(
                        Query(
                            f"sum by (target) (kvoffload_process_pinned_bytes{{{TARGET}}})",
                            "pinned {{target}}",
                        ),
                        Query(
                            f"kvoffload_container_memory_usage_bytes{{{TARGET}}}",
                            "container usage {{target}}",
                        ),
                        Query(
                            f"kvoffload_container_memory_limit_bytes{{{TARGET}}}",
                            "container limit {{target}}",
                        ),
                    ),
                    runbooks=("PinnedMemoryNearLimit",),
                    see_also=("kvoe-memory",),
                    scenarios=LIVE | GPU,
                ),
                Panel(
                    key="decision.memory_usage_ratio",
                    title="Container memory used / limit",
                    kind="timeseries",
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=8,
                    description=(
                        "Container memory usage over its limit. Above "
                        f"{T.memory_usage_high:.0%} (red) a growing offload pool risks the OOM "
                        "killer; the advisor then says 'reduce buffer (OOM risk)'."
                    ),
                    queries=(
                        Query(
                            f"kvoffload_container_memory_usage_bytes{{{TARGET}}} / "
                            f"kvoffload_container_memory_limit_bytes{{{TARGET}}}",
                            "{{target}}",
                        ),
                    ),
                    steps=high_is_bad(T.memory_usage_high),
                    threshold_lines=True,
                    runbooks=("PinnedMemoryNearLimit",),
                    see_also=("kvoe-memory",),
                    scenarios=GPU,
                ),
            ),
        ),
    ),
)

# ---------------------------------------------------------------------------------------
# 2b. KV transfer backends (rows of the transfers dashboard, docs/backends.md)
# ---------------------------------------------------------------------------------------

# Grafana's v1 dashboard schema has no conditional rows: each backend's row is always there
# and its queries only return series while that backend runs, so an unused row stays empty.
UNUSED = " Empty unless an engine runs it."

BACKEND_ROWS: tuple[Row, ...] = (
    Row(
        "Backends: KV connector and policy",
        (
            Panel(
                key="transfers.backend_config",
                title="KV connector, spec, policy and tiers per engine",
                kind="table",
                unit="none",
                width=24,
                height=6,
                description=(
                    "What each engine runs: the KV connector (OffloadingConnector, "
                    "SimpleCPUOffloadConnector, LMCache, NixlConnector, none), the offloading "
                    "spec, eviction policy, store_threshold and tiers, read from vLLM's command "
                    "line (or inferred from its series; 'unknown' where they cannot tell)."
                ),
                queries=(
                    Query(
                        "max by (target, model_name, engine, connector, spec, eviction_policy, "
                        f"store_threshold, tiers) (kvoffload_offload_config_info{{{ENGINE}}})",
                        instant=True,
                        table=True,
                    ),
                ),
                hidden_columns=("Time", "Value"),
                see_also=("kvoe-decision",),
                scenarios=BACKENDS,
            ),
            Panel(
                key="transfers.whatif_policy",
                title="What-if: eviction policy and store_threshold",
                kind="barchart",
                unit="percentunit",
                min=0,
                max=1,
                width=24,
                x_field="setting",
                x_numeric=False,
                axis_label="simulated offload hit ratio",
                description=(
                    "The offload hit ratio the CPU tier would reach with each eviction policy "
                    "(lru, arc) and store_threshold (0, 2), replayed from the engine's KV events "
                    "at the configured buffer (with offload off: at the advisor's recommended "
                    "size). The advisor names a setting that serves materially more." + UNUSED
                ),
                queries=(
                    Query(
                        "label_join(last_over_time(kvoffload_whatif_policy_hit_ratio{"
                        + ENGINE
                        + '}[$__range]), "setting", ", store_threshold ", "policy", '
                        '"store_threshold")',
                        instant=True,
                        table=True,
                    ),
                ),
                scenarios=GPU,
            ),
        ),
    ),
    Row(
        "Tiering (TieringOffloadingSpec)",
        (
            Panel(
                key="transfers.tier_hit_ratio",
                title="Tier hit ratio",
                kind="timeseries",
                unit="percentunit",
                min=0,
                max=1,
                width=8,
                description=(
                    "Share of chunk lookups each tier answered (vLLM 0.32+ per-tier counters). "
                    "A secondary tier only sees what the CPU primary (0:primary) missed; near 0 "
                    "while chunks are written to it, it does not earn its keep." + UNUSED
                ),
                queries=(Query(f"kvoffload_tier_hit_ratio{{{ENGINE}}}", "{{tier}} " + EL),),
                steps=low_is_bad(T.offload_hit_ratio_material),
                runbooks=("SecondaryTierNotEarningKeep",),
                scenarios=BACKENDS,
            ),
            Panel(
                key="transfers.tier_bandwidth",
                title="Tier read and write bandwidth",
                kind="timeseries",
                unit="Bps",
                min=0,
                width=8,
                description=(
                    "Bytes per second of transfer time: reads are promotions from a secondary "
                    "tier into the CPU primary (a hit being served), writes are cascades of "
                    "evicted CPU chunks into the tier. Slow reads delay the requests that wait "
                    "for the promotion." + UNUSED
                ),
                queries=(
                    Query(
                        f"kvoffload_tier_read_bandwidth_bytes_per_second{{{ENGINE}}}",
                        "read {{tier}} " + EL,
                    ),
                    Query(
                        f"kvoffload_tier_write_bandwidth_bytes_per_second{{{ENGINE}}}",
                        "write {{tier}} " + EL,
                    ),
                ),
                scenarios=BACKENDS,
            ),
            Panel(
                key="transfers.tier_lookup_latency",
                title="Tier lookup latency (p99)",
                kind="timeseries",
                unit="s",
                log_scale=True,
                width=8,
                description=(
                    "Time the scheduler blocks in tier lookups "
                    "(vllm:kv_offload_tiering_lookup_sync_delay_seconds, p99; per tier from vLLM "
                    "0.32, one series per engine in 0.26). On the scheduling path of every "
                    "request that missed the GPU and CPU caches." + UNUSED
                ),
                queries=(
                    Query(
                        "histogram_quantile(0.99, sum by (le, instance, model_name, engine, "
                        "tier) ("
                        + rate("vllm:kv_offload_tiering_lookup_sync_delay_seconds_bucket", VLLM)
                        + "))",
                        "p99 {{tier}} " + VL,
                    ),
                ),
                scenarios=BACKENDS,
            ),
        ),
    ),
    Row(
        "Simple CPU offload (SimpleCPUOffloadConnector)",
        (
            Panel(
                key="transfers.simple_outcomes",
                title="Simple offload store decisions",
                kind="timeseries",
                unit="ops",
                min=0,
                width=12,
                stack=True,
                description=(
                    "Store decisions per second by outcome "
                    "(vllm:simple_kv_offload_save_outcomes_total, vLLM 0.32+): stored, dropped "
                    "(cpu_full, request_gone, null_block, not_hashed) or skipped (already "
                    "cached, in flight). dropped_cpu_full growing means the pool is too small."
                    + UNUSED
                ),
                queries=(
                    Query(
                        "sum by (instance, model_name, engine, outcome) ("
                        + rate("vllm:simple_kv_offload_save_outcomes_total", VLLM)
                        + ")",
                        "{{outcome}} " + VL,
                    ),
                ),
                scenarios=BACKENDS,
            ),
            Panel(
                key="transfers.simple_ratios",
                title="Simple offload: stored and dropped share",
                kind="timeseries",
                unit="percentunit",
                min=0,
                max=1,
                width=12,
                description=(
                    "Share of classified store decisions that stored the block and that "
                    "dropped it, over the exporter's window. More than half dropped for 15 "
                    "minutes fires SimpleOffloadDroppingStores." + UNUSED
                ),
                queries=(
                    Query(f"kvoffload_simple_offload_stored_ratio{{{ENGINE}}}", "stored " + EL),
                    Query(f"kvoffload_simple_offload_dropped_ratio{{{ENGINE}}}", "dropped " + EL),
                ),
                runbooks=("SimpleOffloadDroppingStores",),
                scenarios=BACKENDS,
            ),
        ),
    ),
    Row(
        "LMCache",
        (
            Panel(
                key="transfers.lmcache_throughput",
                title="LMCache retrieve and store throughput",
                kind="timeseries",
                unit="si:tok/s",
                min=0,
                width=12,
                description=(
                    "Tokens per second of LMCache's own retrieve and store time "
                    "(lmcache:num_hit_tokens_total / time_to_retrieve, num_stored_tokens_total / "
                    "time_to_store; TP workers count the same tokens, so one worker's view). The "
                    "retrieve rate is the transfer rate the advisor weighs against recompute."
                    + UNUSED
                ),
                queries=(
                    Query(
                        f"kvoffload_lmcache_retrieve_tokens_per_second{{{ENGINE}}}",
                        "retrieve " + EL,
                    ),
                    Query(f"kvoffload_lmcache_store_tokens_per_second{{{ENGINE}}}", "store " + EL),
                ),
                scenarios=BACKENDS,
            ),
            Panel(
                key="transfers.lmcache_hit_ratio",
                title="LMCache: prompt tokens served and lookup hit ratio",
                kind="timeseries",
                unit="percentunit",
                min=0,
                max=1,
                width=12,
                description=(
                    "For engines whose connector is LMCache: the share of all prompt tokens "
                    "vLLM loaded through it (external_kv_transfer, the offload hit ratio of the "
                    "other backends) and the share of the tokens LMCache was asked for that it "
                    "had." + UNUSED
                ),
                queries=(
                    Query(
                        f"kvoffload_offload_hit_ratio{{{ENGINE}}} and on (target, model_name, "
                        "engine) kvoffload_offload_config_info"
                        f'{{{ENGINE}, connector=~"LMCache.*"}}',
                        "prompt tokens " + EL,
                    ),
                    Query(
                        f"kvoffload_offload_lookup_hit_ratio{{{ENGINE}}} and on (target, "
                        "model_name, engine) kvoffload_offload_config_info"
                        f'{{{ENGINE}, connector=~"LMCache.*"}}',
                        "lookups " + EL,
                    ),
                ),
                scenarios=BACKENDS,
            ),
        ),
    ),
    Row(
        "Disaggregated prefill (NixlConnector)",
        (
            Panel(
                key="transfers.nixl_bandwidth",
                title="NIXL KV transfer bandwidth",
                kind="timeseries",
                unit="Bps",
                min=0,
                width=6,
                description=(
                    "KV bytes between prefill and decode engines per second of transfer time "
                    "(vllm:nixl_bytes_transferred / vllm:nixl_xfer_time_seconds), per worker. "
                    "NVLink and RDMA reach tens of GB/s; TCP a few GB/s at best." + UNUSED
                ),
                queries=(
                    Query(f"kvoffload_nixl_transfer_bandwidth_bytes_per_second{{{ENGINE}}}", EL),
                ),
                scenarios=BACKENDS,
            ),
            Panel(
                key="transfers.nixl_speedup",
                title="NIXL transfer vs recompute",
                kind="timeseries",
                unit="suffix:×",
                min=0,
                width=6,
                description=(
                    "KV transfer tokens/s over the model's marginal recompute tokens/s (a "
                    "decode engine takes the rate of a prefill engine of the same model). "
                    "Below 1 (red) moving the KV costs more than computing it again: "
                    "disaggregation is slower than one engine." + UNUSED
                ),
                queries=(Query(f"kvoffload_nixl_transfer_speedup_ratio{{{ENGINE}}}", EL),),
                steps=low_is_bad(LOCAL_STEPS["up"]),
                threshold_lines=True,
                runbooks=("DisaggregationSlowerThanRecompute",),
                scenarios=BACKENDS,
            ),
            Panel(
                key="transfers.nixl_failures",
                title="NIXL failed transfers",
                kind="timeseries",
                unit="ops",
                min=0,
                width=6,
                description=(
                    "Failed NIXL transfers per second, handshake and notification failures "
                    "included (vLLM counts them together). The affected requests recompute "
                    "their prompt or fail." + UNUSED
                ),
                queries=(
                    Query(
                        "sum by (target, model_name, engine) ("
                        + rate("kvoffload_nixl_failed_transfers_total")
                        + ")",
                        EL,
                    ),
                ),
                runbooks=("NixlTransfersFailing",),
                scenarios=BACKENDS,
            ),
            Panel(
                key="transfers.nixl_link",
                title="NIXL KV path",
                kind="table",
                unit="none",
                width=6,
                description=(
                    "The KV path between prefill and decode where it can be known: nvlink, "
                    "rdma (UCX_TLS names verbs transports), cuda_ipc, tcp, or unknown "
                    "(docs/backends.md says how it is determined)." + UNUSED
                ),
                queries=(
                    Query(
                        "max by (target, model_name, engine, link) "
                        f"(kvoffload_nixl_link_info{{{ENGINE}}})",
                        instant=True,
                        table=True,
                    ),
                ),
                hidden_columns=("Time", "Value"),
                scenarios=BACKENDS,
            ),
        ),
    ),
)

# ---------------------------------------------------------------------------------------
# 2. Transfers
# ---------------------------------------------------------------------------------------

TRANSFERS = Dashboard(
    uid="kvoe-transfers",
    title="KV offload: transfers",
    file="kv-offload-transfers.json",
    description=(
        "What moves between GPU and CPU: offload bytes and copy bandwidth, PCIe traffic "
        "against the link, where prompt tokens come from, lookups, allocation failures and "
        "the CPU tier as seen through KV cache events."
    ),
    rows=(
        Row(
            "Offload traffic",
            (
                Panel(
                    key="transfers.throughput",
                    title="Offload throughput (vLLM)",
                    kind="timeseries",
                    unit="Bps",
                    min=0,
                    description=(
                        "Bytes per second stored GPU -> CPU and loaded CPU -> GPU, from vLLM's "
                        "vllm:kv_offload_{store,load}_bytes_total. Stores follow prefill of new "
                        "prefixes; loads follow offload hits. Stores without loads are wasted "
                        "PCIe bandwidth (see the reuse ratio on the decision dashboard)."
                    ),
                    queries=(
                        Query(
                            "sum by (instance, model_name, engine) "
                            f"({rate('vllm:kv_offload_store_bytes_total', VLLM)})",
                            "store " + VL,
                        ),
                        Query(
                            "sum by (instance, model_name, engine) "
                            f"({rate('vllm:kv_offload_load_bytes_total', VLLM)})",
                            "load " + VL,
                        ),
                    ),
                    scenarios=OFFLOAD,
                ),
                Panel(
                    key="transfers.bandwidth",
                    title="Offload copy bandwidth",
                    kind="timeseries",
                    unit="Bps",
                    min=0,
                    description=(
                        "Bytes per second of GPU copy time (bytes / summed CUDA-event time of "
                        "the copies, over the exporter's window). This is the speed of a copy "
                        "once it runs, not wall-clock throughput: fixed per-transfer costs are "
                        "not in it. Compare it with the PCIe link below."
                    ),
                    queries=(
                        Query(
                            f"kvoffload_offload_load_bandwidth_bytes_per_second{{{ENGINE}}}",
                            "load " + EL,
                        ),
                        Query(
                            f"kvoffload_offload_store_bandwidth_bytes_per_second{{{ENGINE}}}",
                            "store " + EL,
                        ),
                    ),
                    see_also=("kvoe-memory",),
                    scenarios=OFFLOAD,
                ),
                Panel(
                    key="transfers.totals",
                    title="Moved in the time range",
                    kind="stat",
                    unit="bytes",
                    width=8,
                    description=(
                        "Bytes stored to and loaded from the CPU tier over the dashboard's time "
                        "range (reset-safe totals re-exported by the exporter)."
                    ),
                    queries=(
                        Query(
                            "sum by (target, model_name, engine) "
                            f"(increase(kvoffload_offload_store_bytes_total{{{ENGINE}}}[$__range]))",
                            "stored " + EL,
                            instant=True,
                        ),
                        Query(
                            "sum by (target, model_name, engine) "
                            f"(increase(kvoffload_offload_load_bytes_total{{{ENGINE}}}[$__range]))",
                            "loaded " + EL,
                            instant=True,
                        ),
                    ),
                    scenarios=OFFLOAD,
                ),
                Panel(
                    key="transfers.transfer_size",
                    title="Mean transfer size",
                    kind="timeseries",
                    unit="bytes",
                    min=0,
                    width=8,
                    description=(
                        "Average bytes per store and per load operation. Small transfers "
                        "(a few blocks) pay the fixed per-copy cost many times; large ones "
                        "approach link bandwidth."
                    ),
                    queries=(
                        Query(
                            "sum by (instance, model_name, engine) "
                            f"({rate('vllm:kv_offload_store_size_sum', VLLM)}) / "
                            "sum by (instance, model_name, engine) "
                            f"({rate('vllm:kv_offload_store_size_count', VLLM)})",
                            "store " + VL,
                        ),
                        Query(
                            "sum by (instance, model_name, engine) "
                            f"({rate('vllm:kv_offload_load_size_sum', VLLM)}) / "
                            "sum by (instance, model_name, engine) "
                            f"({rate('vllm:kv_offload_load_size_count', VLLM)})",
                            "load " + VL,
                        ),
                    ),
                    scenarios=OFFLOAD,
                ),
                Panel(
                    key="transfers.prompt_sources",
                    title="Prompt tokens by source",
                    kind="timeseries",
                    unit="si:tok/s",
                    min=0,
                    width=8,
                    stack=True,
                    description=(
                        "Where prompt tokens' KV came from, stacked: recomputed on the GPU "
                        "(local_compute), found in the GPU prefix cache (local_cache_hit), or "
                        "loaded from the offload tier (external_kv_transfer). Offload is "
                        "working when external_kv_transfer takes a visible share from "
                        "local_compute."
                    ),
                    queries=(
                        Query(
                            f"sum by (source) ({rate('kvoffload_prompt_tokens_total')})",
                            "{{source}}",
                        ),
                    ),
                    see_also=("kvoe-decision",),
                    preview=Scenario.OFFLOAD,
                    scenarios=BOTH,
                ),
            ),
        ),
        Row(
            "PCIe",
            (
                Panel(
                    key="transfers.pcie_throughput",
                    title="PCIe TX/RX vs link bandwidth",
                    kind="timeseries",
                    unit="Bps",
                    min=0,
                    description=(
                        "Host link traffic per GPU from NVML's PCIe byte counters, accumulated "
                        "wrap-safe by the exporter (TX = device to host, i.e. offload stores; "
                        "RX = host to device, i.e. loads and everything else), against the "
                        "link's theoretical bandwidth for its current generation and width. "
                        "NVML counts protocol overhead, so expect ~8% more than vLLM's bytes."
                    ),
                    queries=(
                        Query(
                            on_exporter(
                                'rate(kvoffload_gpu_pcie_tx_bytes_total{job=~"$job"}'
                                "[$__rate_interval])"
                            ),
                            "TX gpu {{gpu}} {{instance}}",
                        ),
                        Query(
                            on_exporter(
                                'rate(kvoffload_gpu_pcie_rx_bytes_total{job=~"$job"}'
                                "[$__rate_interval])"
                            ),
                            "RX gpu {{gpu}} {{instance}}",
                        ),
                        Query(
                            on_exporter(
                                'kvoffload_gpu_pcie_link_bandwidth_bytes_per_second{job=~"$job"}'
                            ),
                            "link gpu {{gpu}} {{instance}}",
                        ),
                    ),
                    see_also=("kvoe-memory",),
                    scenarios=GPU,
                ),
                Panel(
                    key="transfers.pcie_utilization",
                    title="PCIe utilisation",
                    kind="timeseries",
                    unit="percentunit",
                    min=0,
                    max=1,
                    description=(
                        "Share of the link's theoretical bandwidth in use per direction (PCIe "
                        "bytes per second over the link bandwidth, as the PCIeSaturated alert "
                        "computes it). Above "
                        f"{T.pcie_utilization_high:.0%} (red) offload transfers compete with "
                        "other host traffic and slow each other down."
                    ),
                    queries=(
                        Query(
                            on_exporter(
                                'rate(kvoffload_gpu_pcie_tx_bytes_total{job=~"$job"}'
                                "[$__rate_interval]) / "
                                'kvoffload_gpu_pcie_link_bandwidth_bytes_per_second{job=~"$job"}'
                            ),
                            "TX gpu {{gpu}} {{instance}}",
                        ),
                        Query(
                            on_exporter(
                                'rate(kvoffload_gpu_pcie_rx_bytes_total{job=~"$job"}'
                                "[$__rate_interval]) / "
                                'kvoffload_gpu_pcie_link_bandwidth_bytes_per_second{job=~"$job"}'
                            ),
                            "RX gpu {{gpu}} {{instance}}",
                        ),
                    ),
                    steps=high_is_bad(T.pcie_utilization_high),
                    threshold_lines=True,
                    runbooks=("PCIeSaturated",),
                    scenarios=GPU,
                ),
            ),
        ),
        Row(
            "Lookups and the CPU tier",
            (
                Panel(
                    key="transfers.lookup_latency",
                    title="Offload lookup latency",
                    kind="timeseries",
                    unit="s",
                    log_scale=True,
                    width=8,
                    description=(
                        "Time the scheduler spends in one offload-tier lookup "
                        "(vllm:kv_offload_lookup_sync_delay_seconds, p50 and p99). It is on the "
                        "scheduling path of every request with a GPU miss, so it should stay "
                        "far below a millisecond."
                    ),
                    queries=quantiles(
                        "vllm:kv_offload_lookup_sync_delay_seconds_bucket", (0.5, 0.99)
                    ),
                    scenarios=OFFLOAD,
                ),
                Panel(
                    key="transfers.failures",
                    title="Store allocation failures and skipped stores",
                    kind="timeseries",
                    unit="ops",
                    min=0,
                    width=8,
                    description=(
                        "Stores per second that found no evictable CPU chunk (the buffer is too "
                        "small or pinned by in-flight transfers) and stores skipped because the "
                        "block had not been offered store_threshold times. vLLM creates these "
                        "counters on their first event, so an engine with offload on and no "
                        "failure shows 0 here; no line at all means offload is off."
                    ),
                    queries=(
                        Query(
                            "sum by (instance, model_name, engine) "
                            f"({rate('vllm:kv_offload_allocation_failure_total', VLLM)})"
                            " or sum by (instance, model_name, engine) "
                            f"(0 * {rate('vllm:kv_offload_store_bytes_total', VLLM)})",
                            "allocation failures " + VL,
                        ),
                        Query(
                            "sum by (instance, model_name, engine) "
                            f"({rate('vllm:kv_offload_stores_skipped_total', VLLM)})",
                            "skipped (threshold) " + VL,
                        ),
                    ),
                    runbooks=("OffloadBufferTooSmall",),
                    scenarios=OFFLOAD,
                ),
                Panel(
                    key="transfers.cpu_pinned_by_transfers",
                    title="CPU buffer held by in-flight transfers",
                    kind="timeseries",
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=8,
                    description=(
                        "Share of the CPU buffer pinned by transfers that have not completed "
                        "(stores and loads), from vLLM. This is not occupancy: a full but idle "
                        "buffer reads 0. Sustained high values mean stores get dropped."
                    ),
                    queries=(
                        Query(
                            f"vllm:kv_offload_cpu_cache_write_usage_perc{{{VLLM}}}", "stores " + VL
                        ),
                        Query(
                            f"vllm:kv_offload_cpu_cache_read_usage_perc{{{VLLM}}}", "loads " + VL
                        ),
                    ),
                    scenarios=OFFLOAD,
                ),
                Panel(
                    key="transfers.resident_blocks",
                    title="Resident KV blocks by medium (from KV events)",
                    kind="timeseries",
                    unit="short",
                    min=0,
                    description=(
                        "Blocks held per medium, counted from vLLM's KV cache events (stored "
                        "minus removed). GPU is the prefix cache including evictable blocks "
                        "(which vllm:kv_cache_usage_perc counts as free); CPU is the offload "
                        "tier's real occupancy, which vLLM does not export."
                    ),
                    queries=(
                        Query(
                            "sum by (target, model_name, engine, medium) "
                            f"(kvoffload_kv_resident_blocks{{{ENGINE}}})",
                            "{{medium}} " + EL,
                        ),
                    ),
                    scenarios=LIVE,
                ),
                Panel(
                    key="transfers.kv_events",
                    title="KV cache events",
                    kind="timeseries",
                    unit="ops",
                    min=0,
                    width=6,
                    description=(
                        "KV cache events per second by type and medium (BlockStored, "
                        "BlockRemoved, AllBlocksCleared; GPU or CPU). GPU removals are "
                        "evictions: a steady stream under load is what offload can catch."
                    ),
                    queries=(
                        Query(
                            f"sum by (target, type, medium) ({rate('kvoffload_kv_events_total')})",
                            "{{type}} {{medium}} {{target}}",
                        ),
                    ),
                    scenarios=LIVE,
                ),
                Panel(
                    key="transfers.kv_event_health",
                    title="KV event gaps and drops",
                    kind="timeseries",
                    unit="ops",
                    min=0,
                    width=6,
                    description=(
                        "Event batches per second: sequence gaps in vLLM's event stream, "
                        "batches lost after a gap (not recovered through the replay endpoint) "
                        "and batches the exporter dropped because its queue was full. Lost and "
                        "dropped batches make the resident-block counts and the what-if curve "
                        "drift; all should be 0."
                    ),
                    queries=(
                        Query(
                            "sum by (target) "
                            f"({rate('kvoffload_kv_event_gaps_total', TARGET_ENGINE)})",
                            "gaps {{target}}",
                        ),
                        Query(
                            "sum by (target) "
                            f"({rate('kvoffload_kv_events_lost_total', TARGET_ENGINE)})",
                            "lost {{target}}",
                        ),
                        Query(
                            "sum by (target) "
                            f"({rate('kvoffload_kv_events_dropped_total', TARGET)})",
                            "dropped {{target}}",
                        ),
                    ),
                    runbooks=("KVEventGaps",),
                    scenarios=LIVE,
                ),
            ),
        ),
        *BACKEND_ROWS,
    ),
)

# ---------------------------------------------------------------------------------------
# 3. Memory and GPU
# ---------------------------------------------------------------------------------------

MEMORY = Dashboard(
    uid="kvoe-memory",
    title="KV offload: memory and GPU",
    file="kv-offload-memory.json",
    description=(
        "Where the offload buffer lives and what it costs: per-process resident, shared and "
        "pinned memory, /dev/shm, the container's headroom, GPU memory and the PCIe link."
    ),
    rows=(
        Row(
            "vLLM processes",
            (
                Panel(
                    key="memory.process_rss",
                    title="Resident memory per vLLM process",
                    kind="timeseries",
                    unit="bytes",
                    min=0,
                    stack=True,
                    description=(
                        "Resident memory of each vLLM process split into anonymous and shared "
                        "pages. The offload pool is shared memory (mappings of /dev/zero or "
                        "/dev/shm), so it shows up as shmem of the engine core, not anon."
                    ),
                    queries=(
                        Query(
                            f"kvoffload_process_resident_anon_bytes{{{TARGET}}}",
                            "anon {{role}} {{pid}}",
                        ),
                        Query(
                            f"kvoffload_process_resident_shmem_bytes{{{TARGET}}}",
                            "shmem {{role}} {{pid}}",
                        ),
                    ),
                    scenarios=LIVE,
                ),
                Panel(
                    key="memory.process_pinned",
                    title="Pinned and locked memory per process",
                    kind="timeseries",
                    unit="bytes",
                    min=0,
                    description=(
                        "Host memory pinned for GPU transfers (cudaHostAlloc, identified from "
                        "the process's mappings) and memory locked with mlock (VmLck). CUDA "
                        "pinning does not show in VmLck, which is why both are here."
                    ),
                    queries=(
                        Query(
                            f"kvoffload_process_pinned_bytes{{{TARGET}}}",
                            "pinned {{role}} {{pid}}",
                        ),
                        Query(
                            f"kvoffload_process_locked_bytes{{{TARGET}}}",
                            "locked {{role}} {{pid}}",
                        ),
                    ),
                    scenarios=GPU,
                ),
                Panel(
                    key="memory.pool_vs_buffer",
                    title="Offload pool vs configured buffer",
                    kind="timeseries",
                    unit="bytes",
                    min=0,
                    description=(
                        "The memory the offload pool really takes against --kv-offloading-size. "
                        "vLLM rounds each layer's share up to a power of two, so the pool can be "
                        "much larger than configured (0.5 GiB became 896 MiB on an H200): size "
                        "container limits from the pool, not the flag."
                    ),
                    queries=(
                        Query(f"kvoffload_offload_pool_bytes{{{TARGET}}}", "pool {{target}}"),
                        Query(
                            f"kvoffload_offload_buffer_bytes{{{ENGINE}}}",
                            "configured " + EL,
                        ),
                    ),
                    see_also=("kvoe-decision",),
                    scenarios=GPU,
                ),
                Panel(
                    key="memory.pool_ratio",
                    title="Offload pool / configured buffer",
                    kind="stat",
                    unit="suffix:×",
                    width=4,
                    decimals=2,
                    description=(
                        "What --kv-offloading-size really costs in host memory. Above 1 the "
                        "pool is bigger than asked for (per-layer tensors rounded up to a power "
                        "of two: 1.75× for 0.5 GiB on a 28-layer model with vLLM 0.26)."
                    ),
                    queries=(
                        Query(
                            f"kvoffload_offload_pool_to_buffer_ratio{{{ENGINE}}}", EL, instant=True
                        ),
                    ),
                    steps=(Step(None, Color.OK), Step(LOCAL_STEPS["pool_rounding"], Color.WARN)),
                    scenarios=GPU,
                ),
                Panel(
                    key="memory.dev_shm",
                    title="/dev/shm used vs size",
                    kind="timeseries",
                    width=8,
                    unit="bytes",
                    min=0,
                    description=(
                        "Newer vLLM releases place the offload region in /dev/shm. Its size is "
                        "the container's shm limit (Docker default 64 MiB): a region larger "
                        "than that fails at start-up or with SIGBUS."
                    ),
                    queries=(
                        Query(f"kvoffload_dev_shm_used_bytes{{{TARGET}}}", "used {{target}}"),
                        Query(f"kvoffload_dev_shm_size_bytes{{{TARGET}}}", "size {{target}}"),
                    ),
                    scenarios=LIVE,
                ),
            ),
        ),
        Row(
            "Container",
            (
                Panel(
                    key="memory.container",
                    title="Container memory: usage, limit, headroom",
                    kind="timeseries",
                    unit="bytes",
                    min=0,
                    width=24,
                    description=(
                        "The cgroup's memory limit, usage (anon + shmem + page cache), and "
                        "headroom (limit - usage). Pinned memory cannot be reclaimed, so "
                        "headroom is what is left before the OOM killer; keep it above the "
                        "growth the advisor recommends."
                    ),
                    queries=tuple(
                        Query(
                            f"kvoffload_container_memory_{part}_bytes{{{TARGET}}}",
                            f"{part} {{{{target}}}}",
                        )
                        for part in ("limit", "usage", "anon", "shmem", "headroom")
                    ),
                    runbooks=("PinnedMemoryNearLimit",),
                    see_also=("kvoe-decision",),
                    scenarios=LIVE | GPU,
                ),
            ),
        ),
        Row(
            "GPU",
            (
                Panel(
                    key="memory.gpu_memory",
                    title="GPU memory",
                    kind="timeseries",
                    unit="bytes",
                    min=0,
                    description=(
                        "Used, reserved (driver) and total memory per GPU from NVML. vLLM "
                        "reserves its KV cache up front, so used memory is flat; the offload "
                        "buffer is host memory and does not appear here."
                    ),
                    queries=tuple(
                        Query(
                            on_exporter(f'kvoffload_gpu_memory_{part}_bytes{{job=~"$job"}}'),
                            f"{part} gpu {{{{gpu}}}} {{{{instance}}}}",
                        )
                        for part in ("used", "reserved", "total")
                    ),
                    scenarios=GPU,
                ),
                Panel(
                    key="memory.gpu_process_memory",
                    title="GPU memory per process",
                    kind="timeseries",
                    unit="bytes",
                    min=0,
                    description=(
                        "GPU memory each process holds, from NVML's process list: the vLLM "
                        "engine core holds its weights and the KV cache it reserved at start-up."
                    ),
                    queries=(
                        Query(
                            on_exporter('kvoffload_gpu_process_memory_bytes{job=~"$job"}'),
                            "pid {{pid}} gpu {{gpu}}",
                        ),
                    ),
                    scenarios=GPU,
                ),
                Panel(
                    key="memory.pcie_link",
                    title="PCIe link: current vs maximum",
                    kind="timeseries",
                    unit="none",
                    min=0,
                    description=(
                        "Link generation and width now and at most. A link running below its "
                        "maximum (a x16 card at x8, Gen5 at Gen3) halves or quarters offload "
                        "bandwidth; idle GPUs drop the generation to save power, so read it "
                        "under load."
                    ),
                    queries=(
                        Query(
                            on_exporter('kvoffload_gpu_pcie_link_generation{job=~"$job"}'),
                            "gen gpu {{gpu}}",
                        ),
                        Query(
                            on_exporter('kvoffload_gpu_pcie_link_generation_max{job=~"$job"}'),
                            "max gen gpu {{gpu}}",
                        ),
                        Query(
                            on_exporter('kvoffload_gpu_pcie_link_width{job=~"$job"}'),
                            "width gpu {{gpu}}",
                        ),
                        Query(
                            on_exporter('kvoffload_gpu_pcie_link_width_max{job=~"$job"}'),
                            "max width gpu {{gpu}}",
                        ),
                    ),
                    scenarios=GPU,
                ),
                Panel(
                    key="memory.pcie_replays",
                    title="PCIe replay errors",
                    kind="timeseries",
                    unit="ops",
                    min=0,
                    description=(
                        "Link-level retransmissions per second (NVML replay counter). Any "
                        "sustained rate points at a bad riser, slot or cable and costs "
                        "bandwidth on every transfer."
                    ),
                    queries=(
                        Query(
                            on_exporter(
                                'rate(kvoffload_gpu_pcie_replays_total{job=~"$job"}'
                                "[$__rate_interval])"
                            ),
                            "gpu {{gpu}} {{instance}}",
                        ),
                    ),
                    steps=high_is_bad(LOCAL_STEPS["any_replays"]),
                    threshold_lines=True,
                    scenarios=GPU,
                ),
            ),
        ),
        Row(
            "Exporter health",
            (
                Panel(
                    key="memory.targets_up",
                    title="vLLM targets up",
                    kind="stat",
                    unit="none",
                    width=8,
                    height=6,
                    description=(
                        "Whether the exporter's last scrape of each vLLM target succeeded. "
                        "While a target is down its derived series are absent, never 0."
                    ),
                    queries=(
                        Query(f"kvoffload_target_up{{{TARGET}}}", "{{target}}", instant=True),
                    ),
                    mappings=UP_DOWN,
                    steps=(Step(None, Color.BAD), Step(LOCAL_STEPS["up"], Color.OK)),
                    runbooks=("ExporterTargetDown",),
                    scenarios=BOTH,
                ),
                Panel(
                    key="memory.window_coverage",
                    title="Evidence window covered",
                    kind="timeseries",
                    unit="s",
                    min=0,
                    width=8,
                    height=6,
                    description=(
                        "How much of the exporter's sliding window good scrapes cover, against "
                        "the window. Ratios and the advice are computed over the covered part; "
                        f"below {T.min_window_seconds:g} s the advisor reports insufficient data."
                    ),
                    queries=(
                        Query(
                            f"kvoffload_target_window_covered_seconds{{{TARGET}}}",
                            "covered {{target}}",
                        ),
                        Query(
                            on_exporter('kvoffload_window_seconds{job=~"$job"}'),
                            "window {{instance}}",
                        ),
                    ),
                    steps=low_is_bad(T.min_window_seconds),
                    threshold_lines=True,
                    scenarios=BOTH,
                ),
                Panel(
                    key="memory.scrape_failures",
                    title="Scrape failures and collector errors",
                    kind="timeseries",
                    unit="ops",
                    min=0,
                    width=8,
                    height=6,
                    description=(
                        "Failed scrapes of each vLLM target and collection errors of each "
                        "other collector (NVML, /proc, cgroup, KV events), per second. Anything "
                        "but 0 means some panels are missing data; the reason or error kind is "
                        "a label of kvoffload_target_scrape_failures_total and "
                        "kvoffload_collector_errors_total, and the exporter's / page shows the "
                        "last error."
                    ),
                    queries=(
                        Query(
                            "sum by (target) "
                            f"({rate('kvoffload_target_scrape_failures_total', TARGET)})",
                            "vLLM scrape {{target}}",
                        ),
                        Query(
                            on_exporter(
                                "sum by (instance, collector) "
                                '(rate(kvoffload_collector_errors_total{job=~"$job"}'
                                "[$__rate_interval]))"
                            ),
                            "{{collector}}",
                        ),
                    ),
                    runbooks=("CollectorDown",),
                    scenarios=BOTH,
                ),
            ),
        ),
    ),
)

DASHBOARDS: tuple[Dashboard, ...] = (DECISION, TRANSFERS, MEMORY)
