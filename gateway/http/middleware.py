"""The error ladder, one middleware:

- :class:`SluiceError` → its status with the OpenAI envelope (``Retry-After`` when it has one; on a 429 or 503 also
  ``x-sluice-reject-reason``: the body's ``code``, so proxies and dashboards count reasons without parsing bodies);
- aiohttp's HTTP errors (404, 405, 413 body too large …) → the same envelope;
- ``CancelledError`` (the client went away; ``handler_cancellation`` is on) → counted as 499 and re-raised;
- anything else → 500 ``internal_error``, logged with the request id (a bug: bad input never gets here).

Every response carries ``x-sluice-gateway: <gateway id>`` (set when it is prepared, streams included), so a client
behind several gateways sharing a port (``gateway.reuse_port``) or a load balancer sees who answered, and
``x-request-id``: the client's own ``X-Request-Id`` when it sent a usable one (1-128 printable ASCII characters, no
space; vLLM's and nginx's practice, so a caller's trace id comes back to it), else the gateway's request id. The
gateway's id stays the request's key everywhere else (worker requests, response ids, the log line, which also
carries ``client_request_id``): two clients may send the same id.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from typing import Awaitable, Callable

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.state import CLIENT_REQUEST_ID, CONFIG, GATEWAY_ID, METRICS, REQUEST_ID, REQUEST_LOG
from shared.errors import ErrorCode, SluiceError, error_envelope
from shared.logs import log_fields

log = structlog.get_logger("sluice.gateway")

CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request", for metrics and logs only

_HTTP_STATUS_TO_CODE = {
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.BODY_TOO_LARGE,
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


CLIENT_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")  # an X-Request-Id the response echoes
REJECT_STATUSES = frozenset({429, 503})
REJECT_REASON_HEADER = "x-sluice-reject-reason"  # llm-d's practice: proxies count reasons without reading bodies


def _json_error(error: SluiceError) -> web.Response:
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(int(error.retry_after_s))
    if error.status in REJECT_STATUSES:
        headers[REJECT_REASON_HEADER] = error.code.value
    return web.json_response(error.envelope(), status=error.status, headers=headers)


def _http_error(exc: web.HTTPException, request: web.Request) -> web.Response:
    if isinstance(exc, web.HTTPRedirection):  # not an error: the answer is its Location (none for a 304)
        headers = {}
        if "Location" in exc.headers:
            headers["Location"] = exc.headers["Location"]
        return web.Response(status=exc.status, headers=headers)
    code = _HTTP_STATUS_TO_CODE.get(exc.status)
    if code is ErrorCode.BODY_TOO_LARGE:
        limit = request.app[CONFIG].gateway.max_body_bytes
        message = f"the request body exceeds the limit of {limit} bytes"
    elif code is ErrorCode.NOT_FOUND:
        message = f"no route for {request.method} {request.path}"
    elif code is ErrorCode.METHOD_NOT_ALLOWED:
        message = f"method {request.method} is not allowed on {request.path}"
    else:
        code = ErrorCode.INVALID_REQUEST if exc.status < 500 else ErrorCode.INTERNAL
        message = exc.reason
    envelope = error_envelope(code, message)
    headers = {}
    if exc.status == 405 and "Allow" in exc.headers:
        headers["Allow"] = exc.headers["Allow"]
    return web.json_response(envelope, status=exc.status, headers=headers)


def _unreadable_body(request: web.Request, exc: Exception) -> SluiceError:
    """Return the 400 of a body aiohttp could not read: one that does not decode as its ``Content-Encoding`` says
    (gzip, deflate, br and zstd are read), else the parser's own words (a multipart header line too long …)."""
    encoding = request.headers.get("Content-Encoding")
    if encoding:
        return SluiceError(ErrorCode.INVALID_REQUEST, f"The request body could not be decoded as its Content-Encoding "
                           f"({encoding!r}) says; send it uncompressed, or compressed as that header says (gzip, "
                           "deflate, br and zstd are read)")
    cause = exc.__cause__ if isinstance(exc, web.RequestPayloadError) and exc.__cause__ is not None else exc
    reason = cause.message if isinstance(cause, HttpProcessingError) else str(cause)
    return SluiceError(ErrorCode.INVALID_REQUEST, f"The request body could not be read: {reason.strip()}")


def _endpoint(request: web.Request) -> str:
    """Return the route's canonical path (a bounded label set), or "unmatched"."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Assign the request id, map every failure to the OpenAI envelope, count and log the request."""
    request_id = new_request_id()
    request[REQUEST_ID] = request_id
    request[REQUEST_LOG] = {}
    client_request_id = request.headers.get("X-Request-Id")
    if client_request_id is not None and CLIENT_REQUEST_ID_RE.fullmatch(client_request_id):
        request[CLIENT_REQUEST_ID] = client_request_id
        request[REQUEST_LOG]["client_request_id"] = client_request_id
    started_s = time.perf_counter()
    status = 500
    try:
        try:
            response = await handler(request)
        except SluiceError as exc:
            request[REQUEST_LOG].setdefault("error_code", exc.code.value)
            request[REQUEST_LOG].setdefault("error_message", exc.message)  # never prompt text (SluiceError)
            response = _json_error(exc)
        except web.HTTPException as exc:
            response = _http_error(exc, request)
        except (web.RequestPayloadError, HttpProcessingError) as exc:  # a body its Content-Encoding cannot decode
            error = _unreadable_body(request, exc)
            request[REQUEST_LOG].setdefault("error_code", error.code.value)
            response = _json_error(error)
        except asyncio.CancelledError:
            status = CLIENT_CLOSED_STATUS
            request[REQUEST_LOG]["outcome"] = "client_disconnected"
            raise
        except ConnectionError:
            status = CLIENT_CLOSED_STATUS
            request[REQUEST_LOG]["outcome"] = "client_disconnected"
            raise
        except Exception:
            log.exception("internal_error", request_id=request_id, method=request.method, path=request.path)
            response = _json_error(SluiceError(ErrorCode.INTERNAL, f"internal error (request id {request_id})"))
        status = response.status
        return response
    finally:
        endpoint = _endpoint(request)
        request.app[METRICS].requests.labels(endpoint, str(status)).inc()
        level = request_log_level(request.path, endpoint, status)
        if level is not None:
            duration_ms = round((time.perf_counter() - started_s) * 1000, 2)
            log_fields(log, level, "request", {"request_id": request_id, "method": request.method,
                                               "path": request.path, "status": status, "duration_ms": duration_ms,
                                               **request[REQUEST_LOG]})


POLL_PATHS = frozenset({"/healthz", "/health", "/readyz", "/metrics", "/status"})  # balancers, Prometheus, the page
UNLOGGED_PATHS = frozenset({"/favicon.ico"})  # browsers ask for it on every page; it says nothing about the gateway


def request_log_level(path: str, endpoint: str, status: int) -> int | None:
    """Return the level of a request's log line, or None for no line.

    Polls (:data:`POLL_PATHS`) log at debug whatever their status (a readiness probe answers 503 while workers
    start); the favicon never; the API (``/v1/…``) and any other 4xx / 5xx at info; everything else not at all.

    Args:
        path: the request path.
        endpoint: the route's canonical path, or "unmatched".
        status: the response status (499 when the client went away).
    """
    if path in UNLOGGED_PATHS:
        return None
    if path in POLL_PATHS:
        return logging.DEBUG
    if endpoint.startswith("/v1/") or status >= 400:
        return logging.INFO
    return None


async def add_response_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` (every response, streams included): say which gateway answers, and the request id
    (the client's ``X-Request-Id`` when usable, else the gateway's; see the module docstring)."""
    headers = response.headers
    headers["x-sluice-gateway"] = request.app[GATEWAY_ID]
    request_id = request.get(CLIENT_REQUEST_ID) or request.get(REQUEST_ID)
    if request_id is not None:
        headers["x-request-id"] = request_id


def new_request_id() -> str:
    """Return a new request id: 32 hex digits, 128 random bits (``os.urandom``; a tenth of ``uuid4().hex``'s cost,
    which builds a ``UUID`` object first)."""
    return os.urandom(16).hex()
