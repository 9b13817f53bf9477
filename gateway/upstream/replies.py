"""Reading an upstream engine's replies other than its stream: error bodies (the message and the request field they
name, in OpenAI's, FastAPI's and ``transformers serve``'s shapes), ``Retry-After``, and ``/v1/models``."""

from __future__ import annotations

import re

import msgspec

DEFAULT_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


def retry_after_s_of(header: str | None) -> float:
    """Return the upstream's ``Retry-After`` in seconds (delta-seconds form), within [0.1, 60]; 1 s when absent."""
    try:
        value = float(header) if header else DEFAULT_RETRY_AFTER_S
    except ValueError:
        value = DEFAULT_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(0.1, value))


def model_ids(body: bytes) -> list[str]:
    """Return the model ids of an OpenAI ``/v1/models`` answer (``{"data": [{"id"}]}``); [] when it lists none."""
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return []
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return []
    return [str(entry["id"]) for entry in data if isinstance(entry, dict) and entry.get("id")]


UNEXPECTED_FIELDS_RE = re.compile(r"Unexpected fields in the request: \{'([^']+)'")


def error_param(body: str) -> str | None:
    """Return the request field an upstream's error body names, or None: OpenAI's ``error.param`` (or a top-level
    ``param``), the body field of FastAPI's first validation error (``{"detail": [{"loc": ["body", "top_k"]}]}``),
    or the first of ``transformers serve``'s "Unexpected fields in the request: {'top_k'}"."""
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(payload, dict):
        return None
    error = payload.get("error")
    for source in (error, payload):
        if isinstance(source, dict) and isinstance(source.get("param"), str) and source["param"]:
            return source["param"]
    detail = payload.get("detail")
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        loc = detail[0].get("loc")
        if isinstance(loc, list) and len(loc) >= 2 and loc[0] == "body" and isinstance(loc[1], str):
            return loc[1]
    for text in (detail, error, (error or {}).get("message") if isinstance(error, dict) else None):
        if isinstance(text, str) and (match := UNEXPECTED_FIELDS_RE.search(text)):
            return match.group(1)
    return None


def error_message(body: str) -> str:
    """Return the ``error.message`` of an OpenAI error body (or of ``{"message"}`` / ``{"detail"}``), else the text."""
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.strip()[:500] or "(empty body)"
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        for key in ("message", "detail", "error"):
            if payload.get(key):
                return str(payload[key])[:500]
    return body.strip()[:500]
