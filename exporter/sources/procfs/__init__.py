"""The procfs collector: pure parsers, vLLM process discovery, source; registered here."""

from __future__ import annotations

from exporter.options import Option, Registration

REGISTRATION = Registration(
    "procfs",
    True,
    "read vLLM process memory (pinned, shmem) from /proc",
    (Option("path.shm", "str", "/dev/shm", "the /dev/shm vLLM uses, as mounted here", "PATH"),),
)
