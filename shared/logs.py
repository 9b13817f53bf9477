"""Log output of every Sluice process: human-readable lines on a terminal, JSON lines otherwise.

structlog key-value events either way (never prompt text). ``SLUICE_LOG_FORMAT=console`` or ``json`` chooses
explicitly (e.g. JSON on a terminal for piping into jq, or console lines under a process supervisor).
``SLUICE_LOG_LEVEL`` (``debug``, ``info`` — the default —, ``warning``, ``error``) drops events below it: health
and metrics polls and expected connect retries log at debug.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Literal, TextIO

import msgspec
import structlog

LOG_FORMATS = ("console", "json")
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
LEVEL_NAMES = {number: name for name, number in LOG_LEVELS.items()}


def choose_log_level(environ: dict[str, str] | None = None) -> int:
    """Return the stdlib level ``$SLUICE_LOG_LEVEL`` names (default ``info``).

    Raises:
        ValueError: ``SLUICE_LOG_LEVEL`` is not one of :data:`LOG_LEVELS`.
    """
    chosen = (os.environ if environ is None else environ).get("SLUICE_LOG_LEVEL", "").strip().lower() or "info"
    if chosen not in LOG_LEVELS:
        raise ValueError(f"SLUICE_LOG_LEVEL={chosen!r}: expected one of {', '.join(LOG_LEVELS)}")
    return LOG_LEVELS[chosen]


_LOG_ENCODER = msgspec.json.Encoder(enc_hook=repr)


def log_line_json(event_dict: dict, **_: object) -> str:
    """Return a log event as one compact JSON object (msgspec; about 10x faster than ``json.dumps`` on a request
    line); a value JSON cannot hold is written as its ``repr``."""
    try:
        return _LOG_ENCODER.encode(event_dict).decode()
    except (TypeError, msgspec.EncodeError):  # e.g. a dict with keys that are not strings
        return json.dumps(event_dict, default=repr)


def choose_log_format(stream: TextIO, environ: dict[str, str] | None = None) -> Literal["console", "json"]:
    """Return ``$SLUICE_LOG_FORMAT`` when set, else ``console`` when ``stream`` is a terminal, else ``json``.

    Raises:
        ValueError: ``SLUICE_LOG_FORMAT`` is neither ``console`` nor ``json``.
    """
    chosen = (os.environ if environ is None else environ).get("SLUICE_LOG_FORMAT", "").strip().lower()
    if chosen:
        if chosen not in LOG_FORMATS:
            raise ValueError(f"SLUICE_LOG_FORMAT={chosen!r}: expected one of {', '.join(LOG_FORMATS)}")
        return chosen  # type: ignore[return-value]
    isatty = getattr(stream, "isatty", None)
    return "console" if isatty is not None and isatty() else "json"


def configure_logging(stream: TextIO | None = None, environ: dict[str, str] | None = None) -> str:
    """Send stdlib logging and structlog to ``stream`` (default stderr) in the format :func:`choose_log_format`
    picks, dropping events below :func:`choose_log_level`; return that format.

    Raises:
        ValueError: ``SLUICE_LOG_FORMAT`` is neither ``console`` nor ``json``, or ``SLUICE_LOG_LEVEL`` is unknown.
    """
    stream = sys.stderr if stream is None else stream
    log_format = choose_log_format(stream, environ)
    level = choose_log_level(environ)
    logging.basicConfig(level=level, stream=stream, format="%(message)s")
    processors: list = [structlog.processors.TimeStamper(fmt="iso"), structlog.processors.add_log_level]
    if log_format == "console":
        isatty = getattr(stream, "isatty", None)
        processors.append(structlog.dev.ConsoleRenderer(colors=isatty is not None and isatty()))
    else:
        processors += [structlog.processors.format_exc_info,
                       structlog.processors.JSONRenderer(serializer=log_line_json)]
    logger_factory = structlog.PrintLoggerFactory(stream)
    structlog.configure(processors=processors, logger_factory=logger_factory,
                        wrapper_class=structlog.make_filtering_bound_logger(level), cache_logger_on_first_use=True)
    global _json_lines
    _json_lines = JsonLines(stream, level, logger_factory) if log_format == "json" else None
    return log_format


class JsonLines:
    """The JSON lines :func:`configure_logging` sets up, written without structlog's per-call work: the same object
    its processors render (the fields, ``event``, ``timestamp`` in ISO 8601 UTC with microseconds, ``level``), for
    events logged once per request (:func:`log_fields`).

    Measured with ``valgrind --tool=callgrind`` on a 22-field request line: about 103,000 instructions through
    structlog's bound logger (keyword arguments copied three times, the ``datetime`` timestamp, ``print``), about
    32,000 here.

    Args:
        stream: where lines go (flushed after each, like structlog's ``PrintLogger``).
        level: the lowest stdlib level written.
        logger_factory: the factory structlog was configured with; once structlog is configured otherwise
            (:meth:`active`), :func:`log_fields` goes through structlog again.
    """

    def __init__(self, stream: TextIO, level: int, logger_factory: object) -> None:
        self.stream = stream
        self.level = level
        self.logger_factory = logger_factory
        self._second = -1
        self._second_iso = ""  # "YYYY-MM-DDTHH:MM:SS" of ``_second``, formatted once per second

    def active(self) -> bool:
        """Return whether structlog still runs the configuration this writer mirrors."""
        return structlog.get_config()["logger_factory"] is self.logger_factory

    def write(self, level: int, event: str, fields: dict[str, Any]) -> None:
        """Write ``fields`` (taken over: ``event``, ``timestamp`` and ``level`` are added to it) as one line when
        ``level`` is at least the configured level."""
        if level < self.level:
            return
        now_s = time.time()
        second = int(now_s)
        if second != self._second:
            self._second, self._second_iso = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        fields["event"] = event
        fields["timestamp"] = f"{self._second_iso}.{int((now_s - second) * 1_000_000):06d}Z"
        fields["level"] = LEVEL_NAMES.get(level) or logging.getLevelName(level).lower()
        self.stream.write(log_line_json(fields) + "\n")
        self.stream.flush()


_json_lines: JsonLines | None = None


def log_fields(logger: Any, level: int, event: str, fields: dict[str, Any]) -> None:
    """Log ``event`` with ``fields`` (a dict this call takes over) at stdlib ``level``: as ``logger.log(level,
    event, **fields)`` does, through :class:`JsonLines` while :func:`configure_logging`'s JSON output is active
    (one line per request is worth the shortcut), else through structlog."""
    lines = _json_lines
    if lines is not None and lines.active():
        lines.write(level, event, fields)
    else:
        logger.log(level, event, **fields)
