"""The operational endpoints: models, health, readiness, ``/status`` and Prometheus ``/metrics``."""

from __future__ import annotations

import time

import msgspec
import structlog
from aiohttp import web

from gateway.jobs.api import JOBS
from gateway.jobs.models import JobsSummary
from gateway.jobs.stores import STORE_UNAVAILABLE_ERRORS
from gateway.fleet.deep_ready import CACHE_S
from gateway.state import CONFIG, DEEP_READY, FLEET, GATEWAY_ID, METRICS, POOL, STARTED_AT, TIER_COUNTERS
from shared.errors import ErrorCode, SluiceError

log = structlog.get_logger("sluice.gateway")


def _dumps(payload: object) -> str:
    return msgspec.json.encode(payload).decode()


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the served models, one per pool (the first pool's first)."""
    names = request.app[FLEET].model_names()
    return web.json_response({"object": "list", "data": [_model_card(request.app, name) for name in names]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``."""
    name = request.match_info["model"]
    request.app[FLEET].runtime_for_model(name)  # 404 model_not_found naming the served models
    return web.json_response(_model_card(request.app, name))


def _model_card(app: web.Application, name: str) -> dict:
    config = app[CONFIG]
    pool = app[FLEET].runtime_for_model(name).pool
    return {"id": name, "object": "model", "created": int(app[STARTED_AT]), "owned_by": "sluice",
            "max_model_len": pool.max_model_len_tokens(config.model.max_model_len_tokens)}


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz`` (and ``GET /health``, the path vLLM and TGI serve): the process is up."""
    return web.json_response({"status": "ok"})


async def favicon(request: web.Request) -> web.Response:
    """``GET /favicon.ico``: 204 (browsers ask for it with every page; the gateway has no icon)."""
    return web.Response(status=204)


async def readyz(request: web.Request) -> web.Response:
    """``GET /readyz``: 200 once a worker said Hello — or when a pool scales from zero and can start one (requests
    wait through its cold start) — else 503 (also while draining, so balancers stop sending).

    A pool whose local workers stopped on a configuration error is named with the error: in the 503's message,
    or in the 200's ``pool_config_errors`` while other pools serve. While other pools serve, the 200's
    ``pools_not_serving`` names each other pool that can serve no request now (no serving worker, none it can
    start) and why: its workers' or upstreams' ``not_ready_reason`` (an upstream down, or not serving the
    configured model).

    ``GET /readyz?deep=1`` also has every ready worker generate one token (``gateway.fleet.deep_ready``, cached
    for a few seconds): 503 ``worker_not_generating`` naming each connected worker that cannot, and why; the 200
    lists the workers that generated (``generated``).
    """
    fleet = request.app[FLEET]
    if fleet.draining:
        raise SluiceError(ErrorCode.DRAINING, "the gateway is shutting down", retry_after_s=1)
    clients = [client for runtime in fleet.runtimes.values() for client in runtime.pool.clients]
    ready = sum(1 for client in clients if client.ready)
    if not fleet.is_ready():
        reasons = [reason for client in clients if (reason := client.not_ready_reason()) is not None]
        reasons += [f"pool {runtime.name}: {runtime.last_start_failure}" for runtime in fleet.runtimes.values()
                    if runtime.last_start_failure is not None]
        # spawned local workers that do not listen yet (loading the model): not in the pool's clients until then
        reasons += [f"local worker {lw.client.name} starting (loading the model, not listening yet)"
                    for runtime in fleet.runtimes.values() for lw in runtime.local.values()
                    if lw.client not in runtime.pool.clients]
        why = "; ".join(reasons) if reasons else fleet.default.no_worker_words()
        raise SluiceError(ErrorCode.NO_WORKER, f"no worker is ready: {why}", retry_after_s=1)
    body = {"status": "ready", "ready_workers": ready, "workers": len(clients)}
    config_errors = fleet.config_errors()
    if config_errors:  # other pools serve; these never will in this run
        body["pool_config_errors"] = config_errors
    not_serving = {runtime.name: runtime.not_serving_reason() for runtime in fleet.runtimes.values()
                   if not fleet.can_serve(runtime) and runtime.name not in config_errors}
    if not_serving:  # other pools serve; these do not now (a request for their model is a 503 naming why)
        body["pools_not_serving"] = not_serving
    if request.query.get("deep", "").lower() in ("1", "true", "yes"):
        probes = await request.app[DEEP_READY].check()
        failed = [probe.reason for probe in probes if not probe.ok]
        if failed:
            raise SluiceError(ErrorCode.WORKER_NOT_GENERATING, "; ".join(failed), retry_after_s=int(CACHE_S))
        body["generated"] = [probe.worker for probe in probes]
    return web.json_response(body)


async def status(request: web.Request) -> web.Response:
    """``GET /status``: JSON snapshot of the model, pressure, admission queues per tier, and the workers with
    their breaker state and last capacity (``backend: "sim"``, ``simulator: true`` for the roofline simulator);
    ``jobs``, the job store's counts by status (:class:`~gateway.jobs.models.JobsSummary`; null without a job
    store); ``gateway_id`` and ``fleet_tiers``, the tier counts of every gateway sharing Redis
    (``gateway.admission.tier_counters``)."""
    app = request.app
    config = app[CONFIG]
    fleet = app[FLEET]
    admission = fleet.admission_stats()  # Structs: serialized by msgspec with the rest
    return web.json_response({
        "model": fleet.default.config.model_name,  # the first pool's, as max_model_len_tokens below
        "pressure": admission.pressure,
        "admission": admission,
        "max_model_len_tokens": app[POOL].max_model_len_tokens(config.model.max_model_len_tokens),
        "active_requests": app[METRICS].num_active_requests,
        "uptime_s": round(time.time() - app[STARTED_AT], 3),
        "workers": fleet.worker_status(),
        "local_workers": fleet.local_worker_status(),
        "fleet": fleet.snapshot(),
        "gateway_id": app[GATEWAY_ID],
        "fleet_tiers": app[TIER_COUNTERS].snapshot(),  # per tier summed over the gateways sharing Redis
        "jobs": await _jobs_summary(app),
    }, dumps=_dumps)


async def _jobs_summary(app: web.Application) -> JobsSummary | dict[str, str] | None:
    """Return the job store's summary (None when the app has no job store), and set the job gauges from it.

    A store that cannot be reached (its Redis down) gives ``{"store_unavailable": "<error>"}`` and leaves the job
    gauges as they were: ``/status`` and ``/metrics`` keep answering through the outage they should show.
    """
    if JOBS not in app:
        return None
    try:
        summary = await app[JOBS].store.summary(time.time())
    except STORE_UNAVAILABLE_ERRORS as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.warning("jobs_summary_unavailable", error=error)
        return {"store_unavailable": error}
    app[METRICS].observe_jobs(summary)
    return summary


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format (the job gauges read the job store first)."""
    await _jobs_summary(request.app)
    return web.Response(body=request.app[METRICS].render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
