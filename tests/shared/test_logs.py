"""Log output: console lines on a terminal, JSON lines otherwise (shared/logs.py)."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest
import structlog

from shared.logs import choose_log_format, configure_logging, log_fields


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def reset_structlog():
    yield
    structlog.reset_defaults()


def test_a_pipe_gets_json_lines():
    stream = io.StringIO()
    assert configure_logging(stream, environ={}) == "json"
    structlog.get_logger("t").info("worker_ready", port=9100)
    record = json.loads(stream.getvalue())
    assert record["event"] == "worker_ready" and record["port"] == 9100 and record["level"] == "info"


def test_a_terminal_gets_readable_lines():
    stream = Terminal()
    assert configure_logging(stream, environ={}) == "console"
    structlog.get_logger("t").info("worker_ready", port=9100)
    line = stream.getvalue()
    assert "worker_ready" in line and "port" in line and "9100" in line and not line.lstrip().startswith("{")


def test_the_environment_chooses_explicitly():
    assert choose_log_format(Terminal(), {"SLUICE_LOG_FORMAT": "json"}) == "json"
    assert choose_log_format(io.StringIO(), {"SLUICE_LOG_FORMAT": "Console"}) == "console"
    with pytest.raises(ValueError, match="SLUICE_LOG_FORMAT='xml'"):
        choose_log_format(io.StringIO(), {"SLUICE_LOG_FORMAT": "xml"})


def test_events_below_the_level_are_dropped():
    stream = io.StringIO()
    configure_logging(stream, environ={})
    logger = structlog.get_logger("t")
    logger.debug("poll", path="/healthz")
    logger.info("worker_ready", port=9100)
    assert [json.loads(line)["event"] for line in stream.getvalue().splitlines()] == ["worker_ready"]
    stream = io.StringIO()
    configure_logging(stream, environ={"SLUICE_LOG_LEVEL": "debug"})
    structlog.get_logger("t").debug("poll", path="/healthz")
    assert json.loads(stream.getvalue())["event"] == "poll"
    with pytest.raises(ValueError, match="SLUICE_LOG_LEVEL"):
        configure_logging(io.StringIO(), environ={"SLUICE_LOG_LEVEL": "loud"})


def _without_timestamp(line: str) -> list:
    record = json.loads(line)
    assert record.pop("timestamp").endswith("Z")
    return list(record.items())


def test_log_fields_writes_the_line_structlog_writes():
    stream = io.StringIO()
    configure_logging(stream, environ={})
    logger = structlog.get_logger("t")
    fields = {"request_id": "ab12", "status": 200, "ttft_ms": 1.5, "tenant": "ünï", "stream": True, "n": None}
    logger.log(logging.INFO, "request", **fields)
    log_fields(logger, logging.INFO, "request", dict(fields))
    structlog_line, fast_line = stream.getvalue().splitlines()
    assert _without_timestamp(fast_line) == _without_timestamp(structlog_line)  # same keys, values and order
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", json.loads(fast_line)["timestamp"])


def test_log_fields_drops_lines_below_the_level_and_follows_a_new_configuration():
    stream = io.StringIO()
    configure_logging(stream, environ={})
    logger = structlog.get_logger("t")
    log_fields(logger, logging.DEBUG, "request", {"path": "/healthz"})
    assert stream.getvalue() == ""
    terminal = Terminal()
    configure_logging(terminal, environ={})  # console lines: structlog renders them
    log_fields(structlog.get_logger("t"), logging.INFO, "request", {"path": "/v1/models"})
    assert "/v1/models" in terminal.getvalue() and not terminal.getvalue().lstrip().startswith("{")
    configure_logging(stream, environ={})
    structlog.reset_defaults()  # configured otherwise: the JSON shortcut must not write to the old stream
    log_fields(structlog.get_logger("t"), logging.INFO, "request", {"path": "/v1/models"})
    assert stream.getvalue() == ""
