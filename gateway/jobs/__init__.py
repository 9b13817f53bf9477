"""Async jobs: the native job API, the OpenAI Files + Batch APIs, a durable store and the idle-capacity runner.

DESIGN.md, Gateway → Async jobs. The app calls :func:`setup_jobs` once, at the end of ``build_app``:
it adds the routes and one ``cleanup_ctx`` (opened after the workers, so closed before them) that opens the store
(``[jobs] store``: SQLite file or Redis), starts the runner, and on shutdown puts running jobs back in the queue.

Modules, in call order: ``models`` (records and their JSON views) → ``store`` (the interface) →
``sqlite_store`` / ``redis_store`` (each over its connection, ``*_files`` and ``*_queue``: leases) →
``idle_capacity`` (the fleet-wide gate) → ``runner`` (claim, lease, execute, expire, finalize) → ``api``
(``/v1/jobs``, ownership, deferral of shed requests) → ``batches`` (``/v1/files``, ``/v1/batches``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from gateway.jobs.api import JOBS, JobsService, setup_job_routes
from gateway.jobs.batch_finalize import finalize_batch
from gateway.jobs.batches import setup_batch_routes
from gateway.jobs.idle_capacity import FleetIdleCapacity
from gateway.jobs.runner import JobRunner
from gateway.jobs.stores import make_store
from gateway.state import CONFIG, FLEET, METRICS, PIPELINE
from gateway.pipeline.classify import Principal
from shared.config import lowest_tier

__all__ = ["JOBS", "setup_jobs"]

JOBS_TENANT = "jobs"


def _lowest_tier_principal(app: web.Application) -> Principal:
    """Return the principal jobs run as: the lowest-priority tier (``batch`` by default), no per-minute limits."""
    tier = lowest_tier(app[CONFIG])
    return Principal(tenant=JOBS_TENANT, tier=tier, key_tier=tier, rate_limit_key=JOBS_TENANT, rpm_limit=0,
                     tpm_limit=0)


async def _jobs_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    store = make_store(config.jobs)
    await store.open()
    principal = _lowest_tier_principal(app)

    async def execute(kind: str, body: bytes, request_id: str, on_admitted: Callable[[], None]) -> dict[str, Any]:
        return await app[PIPELINE].run_completion(kind, body, principal=principal, request_id=request_id,
                                                  on_admitted=on_admitted)

    service: JobsService | None = None

    async def finalize(batch_id: str) -> None:
        await finalize_batch(service, batch_id)

    capacity = FleetIdleCapacity(lambda: app[FLEET].runtimes.values(), principal.tier.name,
                                 lambda runtime: app[FLEET].can_cold_start(runtime))
    runner = JobRunner(store, config.jobs, execute, capacity, finalize, on_finished=app[METRICS].job_finished)
    service = JobsService(store=store, runner=runner, config=config)
    app[JOBS] = service
    runner.start()
    try:
        yield
    finally:
        await runner.close()
        await store.close()


def setup_jobs(app: web.Application) -> None:
    """Add the job, file and batch routes and the jobs resource (store + runner) to the app."""
    setup_job_routes(app)
    setup_batch_routes(app)
    app.cleanup_ctx.append(_jobs_ctx)
