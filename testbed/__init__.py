"""Real servers for tests, the demo and benchmarks: vLLM CPU, Prometheus, Alertmanager.

Everything binds 127.0.0.1 and every process is stopped by its owner; nothing here
is part of the exporter package.
"""
