"""The KV-event collector: publisher discovery, ZMQ receiver, source; registered here."""

from __future__ import annotations

from exporter.options import Option, Registration

REGISTRATION = Registration(
    "kv_events",
    True,
    "consume vLLM's KV cache events (endpoints below, or discovered from the target) "
    "and run the what-if simulator",
    (
        Option(
            "kv-events-endpoint",
            "list",
            [],
            "vLLM KV-event publisher to connect to when vLLM binds (its endpoint tcp://*:5557 -> "
            "tcp://VLLM_HOST:5557), one per DP rank in rank order; single target (else "
            "targets[].kv_events_endpoint); default: ask GET /kv_event_sources",
            "ENDPOINT",
        ),
        Option(
            "kv-events-bind",
            "list",
            [],
            "address to bind for a vLLM that connects to the exporter (its endpoint "
            "tcp://EXPORTER:5557), one per DP rank (vLLM adds the rank to the port)",
            "ENDPOINT",
        ),
        Option(
            "kv-events-replay-endpoint",
            "list",
            [],
            "vLLM's KV-event replay endpoint (its replay_endpoint), one per DP rank, "
            "to recover batches lost in a sequence gap",
            "ENDPOINT",
        ),
        Option(
            "kv-events-replay-timeout",
            "float",
            2.0,
            "seconds to wait for vLLM's replay endpoint to answer a sequence gap; the receiver "
            "waits meanwhile (new batches queue in its socket), and what has not come back by "
            "then is counted lost (kvoffload_kv_events_lost_total)",
            "SECONDS",
        ),
        Option(
            "kv-events-queue",
            "int",
            10000,
            "KV-event batches buffered between the receiver and the next collection cycle; "
            "beyond it batches are dropped and counted (kvoffload_kv_events_dropped_total), "
            "never blocking vLLM",
            "N",
        ),
        Option(
            "record-events",
            "str",
            "",
            "append every KV-event message received to FILE as JSON lines "
            "(input of `kv-offload-exporter whatif --events`)",
            "FILE",
        ),
    ),
)
