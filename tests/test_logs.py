"""exporter/logs.py: one line per event, JSON or key=value text, fields kept apart."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from exporter.logs import JsonFormatter, TextFormatter, log_event, setup_logging


def _record(event: str = "source_down", level: int = logging.WARNING, **fields: object):
    captured: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            captured.append(record)

    logger = logging.getLogger("kvoe.test_logs")
    logger.handlers[:] = [Keep()]
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    log_event(logger, level, event, **fields)
    (record,) = captured
    record.created = 1_700_000_000.1234  # 2023-11-14T22:13:20.1234Z
    return record


def test_json_formatter_writes_one_object_with_event_and_fields() -> None:
    line = JsonFormatter().format(_record(source="nvml", kind="timeout", errors=3))
    assert "\n" not in line
    assert json.loads(line) == {
        "ts": 1_700_000_000.123,
        "level": "warning",
        "logger": "kvoe.test_logs",
        "event": "source_down",
        "source": "nvml",
        "kind": "timeout",
        "errors": 3,
    }


def test_json_formatter_stringifies_what_json_cannot_hold() -> None:
    doc = json.loads(JsonFormatter().format(_record(path=sys.version_info[:0], obj=object())))
    assert doc["path"] == [] and doc["obj"].startswith("<object object at")


def test_text_formatter_quotes_only_values_with_spaces_or_empty() -> None:
    line = TextFormatter().format(
        _record("counter_reset", logging.INFO, target="a:1", error="HTTP 500 from x", note="")
    )
    assert line == (
        '2023-11-14T22:13:20 info counter_reset target=a:1 error="HTTP 500 from x" note=""'
    )


@pytest.mark.parametrize("formatter", [JsonFormatter(), TextFormatter()])
def test_formatters_append_the_traceback(formatter: logging.Formatter) -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record()
        record.exc_info = sys.exc_info()
    out = formatter.format(record)
    assert "ValueError: boom" in out and "Traceback" in out


def test_a_plain_log_call_has_no_fields() -> None:
    record = logging.LogRecord("kvoe.x", logging.ERROR, __file__, 1, "plain %s", ("msg",), None)
    record.created = 1_700_000_000.0
    assert json.loads(JsonFormatter().format(record))["event"] == "plain msg"
    assert TextFormatter().format(record) == "2023-11-14T22:13:20 error plain msg"


def test_setup_logging_sets_one_handler_on_kvoe_with_the_format_and_level() -> None:
    root = logging.getLogger("kvoe")
    saved = (root.handlers[:], root.level, root.propagate)
    try:
        setup_logging("json", "debug")
        setup_logging("json", "warning")  # again: replaces, never stacks
        (handler,) = root.handlers
        assert isinstance(handler.formatter, JsonFormatter)
        assert root.level == logging.WARNING and root.propagate is False
        setup_logging("text", "info")
        assert isinstance(root.handlers[0].formatter, TextFormatter)
        assert root.level == logging.INFO
    finally:
        root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]
