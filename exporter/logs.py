"""Structured logs: one line per event, JSON or key=value text."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_FIELDS = "kvoe_fields"


def log_event(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    logger.log(level, event, extra={_FIELDS: fields})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        out.update(getattr(record, _FIELDS, {}))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [stamp, record.levelname.lower(), record.getMessage()]
        for key, value in getattr(record, _FIELDS, {}).items():
            text = str(value)
            parts.append(f"{key}={json.dumps(text) if ' ' in text or not text else text}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(fmt: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("kvoe")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
