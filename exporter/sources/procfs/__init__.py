"""The procfs collector: pure parsers, vLLM process discovery, source."""
