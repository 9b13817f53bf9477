"""The aiohttp application: routes, the error ladder, and every resource as a ``cleanup_ctx``.

Resources start in this order and stop in reverse (aiohttp runs ``cleanup_ctx`` backwards on shutdown):
metrics → tokenizer (thread pool) → the fleet (``gateway.fleet.fleet``: pools of workers — local processes under the
autoscaler, ``--worker-address`` and Redis-registry workers — each pool with the admission controller that reads
its capacity) → the tier counters shared with other gateways through Redis (``gateway.admission.tier_counters``; their queued
requests count against each tier's ``queue_capacity``). The tier resolver and the output capper are built with the
app (they only read the config), so a bad tiers / keys config fails at start.

The error ladder (one middleware):

- :class:`SluiceError` → its status with the OpenAI envelope (``Retry-After`` when it has one);
- aiohttp's HTTP errors (404, 405, 413 body too large …) → the same envelope;
- ``CancelledError`` (the client went away; ``handler_cancellation`` is on) → counted as 499 and re-raised;
- anything else → 500 ``internal_error``, logged with the request id (a bug: bad input never gets here).

Every response carries ``x-sluice-gateway: <gateway id>`` (set when it is prepared, streams included), so a client
behind several gateways sharing a port (``gateway.reuse_port``) or a load balancer sees who answered.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import AsyncIterator, Awaitable, Callable

import structlog
from aiohttp import web

from gateway.http import dashboard, handlers
from gateway.admission.caps import OutputCapper
from gateway.fleet.fleet import Fleet
from gateway.jobs import setup_jobs
from gateway.metrics import Metrics
from gateway.admission.pressure import PressureMonitor
from gateway.http.state import (
    ADMISSION,
    CAPPER,
    CONFIG,
    FLEET,
    GATEWAY_ID,
    RESOLVER,
    METRICS,
    OPTIONS,
    REQUEST_ID,
    REQUEST_LOG,
    POOL,
    STARTED_AT,
    TIER_COUNTERS,
    TOKENIZER,
    GatewayOptions,
)
from gateway.admission.tier_counters import TierCounters, TierCountersCollector, tier_counts_from_snapshot
from gateway.pipeline.classify import TierResolver
from gateway.pipeline.tokenize import Tokenizer
from shared.config import resolve_model_path
from shared.errors import ErrorCode, SluiceError, error_envelope

log = structlog.get_logger("sluice.gateway")

CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request", for metrics and logs only

_HTTP_STATUS_TO_CODE = {
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.BODY_TOO_LARGE,
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json_error(error: SluiceError, request_id: str) -> web.Response:
    headers = {"x-request-id": request_id}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(int(error.retry_after_s))
    return web.json_response(error.envelope(), status=error.status, headers=headers)


def _http_error(exc: web.HTTPException, request: web.Request, request_id: str) -> web.Response:
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
    headers = {"x-request-id": request_id}
    if exc.status == 405 and "Allow" in exc.headers:
        headers["Allow"] = exc.headers["Allow"]
    return web.json_response(envelope, status=exc.status, headers=headers)


def _endpoint(request: web.Request) -> str:
    """Return the route's canonical path (a bounded label set), or "unmatched"."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Assign the request id, map every failure to the OpenAI envelope, count and log the request."""
    request_id = handlers.new_request_id()
    request[REQUEST_ID] = request_id
    request[REQUEST_LOG] = {}
    started_s = time.perf_counter()
    status = 500
    try:
        try:
            response = await handler(request)
        except SluiceError as exc:
            request[REQUEST_LOG].setdefault("error_code", exc.code.value)
            response = _json_error(exc, request_id)
        except web.HTTPException as exc:
            response = _http_error(exc, request, request_id)
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
            response = _json_error(SluiceError(ErrorCode.INTERNAL, f"internal error (request id {request_id})"),
                                   request_id)
        if not response.prepared:
            response.headers.setdefault("x-request-id", request_id)
        status = response.status
        return response
    finally:
        endpoint = _endpoint(request)
        request.app[METRICS].requests.labels(endpoint, str(status)).inc()
        if endpoint.startswith("/v1/") or status >= 400:
            duration_ms = round((time.perf_counter() - started_s) * 1000, 2)
            log.info("request", request_id=request_id, method=request.method, path=request.path, status=status,
                     duration_ms=duration_ms, **request[REQUEST_LOG])


async def _add_gateway_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: say which gateway answers (every response, streams included)."""
    response.headers["x-sluice-gateway"] = request.app[GATEWAY_ID]


# ---------------------------------------------------------------------- resources (cleanup_ctx)


async def _metrics_ctx(app: web.Application) -> AsyncIterator[None]:
    if METRICS not in app:
        app[METRICS] = Metrics()
    yield


async def _tokenizer_ctx(app: web.Application) -> AsyncIterator[None]:
    owned = TOKENIZER not in app
    if owned:
        config = app[CONFIG]
        loop = asyncio.get_running_loop()
        app[TOKENIZER] = await loop.run_in_executor(
            None, Tokenizer.from_model_path, resolve_model_path(config.model), config.gateway.tokenizer_threads)
    yield
    if owned:
        app[TOKENIZER].close()


async def _workers_ctx(app: web.Application) -> AsyncIterator[None]:
    """The fleet (``gateway.fleet.fleet``): pools with their admission, local workers under the autoscaler, workers from
    ``--worker-address`` and from the Redis registry. ``POOL`` / ``ADMISSION`` name the first pool's."""
    options, config, metrics = app[OPTIONS], app[CONFIG], app[METRICS]
    fleet = Fleet(config, metrics, options.config_path,
                  spawn_local=options.spawn_local_workers and not options.worker_addresses,
                  worker_addresses=options.worker_addresses, default_capper=app[CAPPER])
    app[FLEET] = fleet
    app[POOL] = fleet.default.pool
    app[ADMISSION] = fleet.default.admission
    metrics.attach_state(fleet.admission_snapshot, fleet.worker_status)
    fleet.start()
    yield
    await fleet.close()  # sheds what is still queued (503 server_draining), stops workers, closes connections


async def _tier_counters_ctx(app: web.Application) -> AsyncIterator[None]:
    """Per-tier counts shared with the other gateways through Redis (``gateway.admission.tier_counters``): published every
    interval, and the other gateways' queued requests count against each pool's tier ``queue_capacity``."""
    fleet, metrics = app[FLEET], app[METRICS]
    counters = TierCounters.from_config(app[CONFIG], app[GATEWAY_ID],
                                        lambda: tier_counts_from_snapshot(fleet.admission_snapshot()))
    app[TIER_COUNTERS] = counters
    for runtime in fleet.runtimes.values():
        runtime.admission.queued_elsewhere = counters.queued_elsewhere
    collector = TierCountersCollector(counters)
    metrics.registry.register(collector)
    counters.start()
    log.info("tier_counters", gateway_id=counters.gateway_id, shared=counters.shared)
    yield
    metrics.registry.unregister(collector)
    await counters.close()  # removes this gateway's counts from Redis at once


def build_app(options: GatewayOptions, tokenizer: Tokenizer | None = None,
              metrics: Metrics | None = None) -> web.Application:
    """Build the gateway application.

    Args:
        options: config and how to reach workers.
        tokenizer: an already loaded tokenizer to share (tests); None loads the model's at startup.
        metrics: a metrics registry to use; None makes a fresh one.
    """
    config = options.config
    app = web.Application(middlewares=[error_middleware], client_max_size=config.gateway.max_body_bytes)
    app[OPTIONS] = options
    app[CONFIG] = config
    app[STARTED_AT] = time.time()
    app[GATEWAY_ID] = options.gateway_id or f"{socket.gethostname()}-{os.getpid()}"
    app[RESOLVER] = TierResolver(config)
    app[CAPPER] = OutputCapper(config, PressureMonitor(config.pressure))
    if tokenizer is not None:
        app[TOKENIZER] = tokenizer
    if metrics is not None:
        app[METRICS] = metrics
    app.cleanup_ctx.extend([_metrics_ctx, _tokenizer_ctx, _workers_ctx, _tier_counters_ctx])
    app.on_response_prepare.append(_add_gateway_header)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/v1/models/{model}", handlers.model)
    app.router.add_get("/healthz", handlers.healthz)
    app.router.add_get("/health", handlers.healthz)  # vLLM's and TGI's path: a drop-in for their health checks
    app.router.add_get("/readyz", handlers.readyz)
    app.router.add_get("/status", handlers.status)
    app.router.add_get("/metrics", handlers.metrics)
    dashboard.add_routes(app.router)  # GET / and /dashboard: the status page
    setup_jobs(app)  # /v1/jobs, /v1/files, /v1/batches and the jobs resource (store + runner), last: stops first
    if config.gateway.cors_allow_origins:
        _setup_cors(app, config.gateway.cors_allow_origins)
    return app


def _setup_cors(app: web.Application, origins: tuple[str, ...]) -> None:
    """Answer CORS preflights and add CORS headers on every route for ``origins`` (``aiohttp_cors``): any method
    and request header, every response header exposed (``Retry-After``, ``x-sluice-*``), no credentials."""
    import aiohttp_cors

    options = aiohttp_cors.ResourceOptions(allow_credentials=False, expose_headers="*", allow_headers="*",
                                           allow_methods="*")
    cors = aiohttp_cors.setup(app, defaults={origin: options for origin in origins})
    for route in list(app.router.routes()):
        if route.method != "HEAD":  # aiohttp adds HEAD beside GET; the GET route's preflight covers the resource
            cors.add(route)
