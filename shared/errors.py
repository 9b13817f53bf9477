"""Error codes of Sluice, their HTTP status and the OpenAI error envelope.

The envelope is OpenAI's: ``{"error": {"message", "type", "param", "code"}}`` with ``code`` a string and
``param`` the offending request field (or null).
"""

from __future__ import annotations

import enum
from typing import Any


class ErrorCode(str, enum.Enum):
    """Every error Sluice returns, by its OpenAI-style string code."""

    INVALID_JSON = "invalid_json"
    INVALID_REQUEST = "invalid_request_error"
    INVALID_VALUE = "invalid_value"
    MISSING_FIELD = "missing_required_parameter"
    INVALID_TYPE = "invalid_type"
    MODEL_NOT_FOUND = "model_not_found"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    BODY_TOO_LARGE = "request_too_large"
    REQUEST_TIMEOUT = "request_timeout"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    INVALID_API_KEY = "invalid_api_key"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    SERVER_OVERLOADED = "server_overloaded"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    PREDICTED_QUEUE_TIMEOUT = "predicted_queue_timeout"
    NO_WORKER = "no_worker_available"
    WORKER_FAILED = "worker_failed"
    WORKER_TIMEOUT = "worker_timeout"
    WORKER_NOT_GENERATING = "worker_not_generating"
    DRAINING = "server_draining"
    PREEMPTED = "preempted"  # internal: a higher tier took the request's slot; it resumes (gateway.pipeline.choice)
    STORE_UNAVAILABLE = "store_unavailable"
    INTERNAL = "internal_error"


# code -> (HTTP status, OpenAI error type)
_CODE_TO_STATUS_AND_TYPE: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_JSON: (400, "invalid_request_error"),
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.INVALID_VALUE: (400, "invalid_request_error"),
    ErrorCode.MISSING_FIELD: (400, "invalid_request_error"),
    ErrorCode.INVALID_TYPE: (400, "invalid_request_error"),
    ErrorCode.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error"),
    ErrorCode.BODY_TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.REQUEST_TIMEOUT: (408, "invalid_request_error"),
    ErrorCode.NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    ErrorCode.INVALID_API_KEY: (401, "authentication_error"),
    ErrorCode.RATE_LIMIT_EXCEEDED: (429, "rate_limit_error"),
    ErrorCode.SERVER_OVERLOADED: (503, "server_error"),
    ErrorCode.QUEUE_FULL: (503, "server_error"),
    ErrorCode.QUEUE_TIMEOUT: (503, "server_error"),
    ErrorCode.PREDICTED_QUEUE_TIMEOUT: (503, "server_error"),
    ErrorCode.NO_WORKER: (503, "server_error"),
    ErrorCode.WORKER_FAILED: (502, "server_error"),
    ErrorCode.WORKER_TIMEOUT: (504, "server_error"),
    ErrorCode.WORKER_NOT_GENERATING: (503, "server_error"),
    ErrorCode.DRAINING: (503, "server_error"),
    ErrorCode.PREEMPTED: (503, "server_error"),
    ErrorCode.STORE_UNAVAILABLE: (503, "server_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
}


def http_status(code: ErrorCode) -> int:
    """Return the HTTP status for an error code."""
    return _CODE_TO_STATUS_AND_TYPE[code][0]


def error_type(code: ErrorCode) -> str:
    """Return the OpenAI error ``type`` for an error code."""
    return _CODE_TO_STATUS_AND_TYPE[code][1]


class SluiceError(Exception):
    """An expected failure with a code, a message for the client and the request field at fault.

    Args:
        code: the error code; decides the HTTP status.
        message: human-readable, safe to show the client (never prompt text).
        param: the request field at fault, e.g. ``"messages[0].content"``, or None.
        retry_after_s: seconds for the ``Retry-After`` header (429/503), or None.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        return http_status(self.code)

    def envelope(self) -> dict[str, Any]:
        """Return the OpenAI error envelope as a dict ready for JSON."""
        return error_envelope(self.code, self.message, self.param)


def model_not_found(model: str, served: list[str]) -> SluiceError:
    """Return the 404 ``model_not_found`` for ``model``, naming the ``served`` model ids (``param``: ``model``)."""
    names = ", ".join(f"'{name}'" for name in served)
    return SluiceError(ErrorCode.MODEL_NOT_FOUND, f"The model '{model}' does not exist; this server serves {names} "
                       "(see /v1/models)", param="model")


def error_envelope(code: ErrorCode, message: str, param: str | None = None) -> dict[str, Any]:
    """Build ``{"error": {"message", "type", "param", "code"}}`` for a code."""
    return {"error": {"message": message, "type": error_type(code), "param": param, "code": code.value}}
