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
from typing import Literal, TextIO

import msgspec
import structlog

LOG_FORMATS = ("console", "json")
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


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
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer(serializer=log_line_json)]
    structlog.configure(processors=processors, logger_factory=structlog.PrintLoggerFactory(stream),
                        wrapper_class=structlog.make_filtering_bound_logger(level), cache_logger_on_first_use=True)
    return log_format
