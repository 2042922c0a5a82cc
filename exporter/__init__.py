"""kv-offload-exporter: tells vLLM operators whether CPU KV-cache offloading pays off."""

__version__ = "0.1.0"
