"""The aiohttp application: every resource as a ``cleanup_ctx``, the routes and the error middleware.

Resources start in this order and stop in reverse (aiohttp runs ``cleanup_ctx`` backwards on shutdown): metrics →
tokenizer (thread pool) → the fleet (``gateway.fleet.fleet``: pools of workers — local processes under the
autoscaler, ``--worker-address`` and Redis-registry workers — each pool with the admission controller that reads its
capacity) → the tier counters shared with other gateways through Redis (``gateway.admission.tier_counters``; their
queued requests count against each tier's ``queue_capacity``). The tier resolver and the output capper are built
with the app (they only read the config), so a bad tiers / keys config fails at start.

Routes and the error ladder are in ``gateway.http``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import AsyncIterator

import structlog
from aiohttp import web

from gateway.http.body_deadline import BodyDeadline
from gateway.http.middleware import add_response_headers, error_middleware
from gateway.http.routes import add_routes, setup_cors
from gateway.pipeline.request import RequestPipeline
from gateway.admission.caps import OutputCapper
from gateway.fleet.deep_ready import PROBE_TIMEOUT_S, DeepReadiness
from gateway.fleet.fleet import Fleet
from gateway.jobs import setup_jobs
from gateway.metrics import Metrics
from gateway.admission.pressure import PressureMonitor
from gateway.state import (
    ADMISSION,
    CAPPER,
    CONFIG,
    DEEP_READY,
    FLEET,
    GATEWAY_ID,
    RESOLVER,
    METRICS,
    OPTIONS,
    PIPELINE,
    POOL,
    STARTED_AT,
    TIER_COUNTERS,
    TOKENIZER,
    GatewayOptions,
)
from gateway.admission.tier_counters import TierCounters, TierCountersCollector, tier_counts_from_stats
from gateway.pipeline.classify import TierResolver
from gateway.pipeline.tokenize import Tokenizer
from shared.config import effective_tiers, tokenizer_model_path

log = structlog.get_logger("sluice.gateway")

DEEP_READY_PROMPT = "Hello"  # what /readyz?deep=1 asks every worker to continue by one token


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
            None, Tokenizer.for_model, config.model, config.gateway.tokenizer_threads,
            "" if config.model.synthetic else tokenizer_model_path(config))
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
    app[PIPELINE] = RequestPipeline(config, fleet, app[TOKENIZER], metrics)
    metrics.attach_state(fleet.admission_stats, fleet.worker_status)
    top_tier = max(effective_tiers(config), key=lambda tier: tier.priority)
    app[DEEP_READY] = DeepReadiness(
        lambda: [client for runtime in fleet.runtimes.values() for client in runtime.pool.ready_clients()],
        app[TOKENIZER].encode_text_sync(DEEP_READY_PROMPT), top_tier.name, top_tier.priority,
        min(PROBE_TIMEOUT_S, config.gateway.first_token_timeout_s))
    fleet.start()
    yield
    await app[DEEP_READY].close()
    await fleet.close()  # sheds what is still queued (503 server_draining), stops workers, closes connections


async def _tier_counters_ctx(app: web.Application) -> AsyncIterator[None]:
    """Per-tier counts shared with the other gateways through Redis (``gateway.admission.tier_counters``): published
    every interval, and the other gateways' queued requests count against each pool's tier ``queue_capacity``."""
    fleet, metrics = app[FLEET], app[METRICS]
    counters = TierCounters.from_config(app[CONFIG], app[GATEWAY_ID],
                                        lambda: tier_counts_from_stats(fleet.admission_stats()))
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
    body_deadline = BodyDeadline(config.gateway.body_read_timeout_s, config.gateway.max_unfinished_bodies)
    app = web.Application(middlewares=[error_middleware, body_deadline.middleware],
                          client_max_size=config.gateway.max_body_bytes)
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
    app.on_response_prepare.append(add_response_headers)
    add_routes(app)
    setup_jobs(app)  # /v1/jobs, /v1/files, /v1/batches and the jobs resource (store + runner), last: stops first
    if config.gateway.cors_allow_origins:
        setup_cors(app, config.gateway.cors_allow_origins)
    return app


