"""A job store whose Redis goes away: ``/metrics`` and ``/status``'s job summary keep answering (trial 4: both were
500 ``internal_error`` for the whole outage, the time an operator most needs them)."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.http import operations
from gateway.http.middleware import error_middleware
from gateway.jobs.api import JOBS, JobsService
from gateway.jobs.redis_store import RedisJobStore
from gateway.metrics import Metrics
from gateway.state import METRICS
from tests.support.server import free_port

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server (make redis)")


def _start_redis(port: int) -> subprocess.Popen:
    process = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return process
        except redis.RedisError:
            if time.monotonic() > deadline:
                process.kill()
                raise
            time.sleep(0.05)


async def test_metrics_and_the_status_job_summary_answer_while_the_store_redis_is_down():
    port = free_port()
    redis_process = _start_redis(port)
    store = RedisJobStore(f"redis://127.0.0.1:{port}/0", "sluice-test-outage")
    try:
        await store.open()
        app = web.Application(middlewares=[error_middleware])
        app[METRICS] = Metrics()
        app[JOBS] = JobsService(store=store, runner=None, config=None)  # the endpoints below read only the store
        app.router.add_get("/metrics", operations.metrics)
        async with TestClient(TestServer(app)) as client:
            response = await client.get("/metrics")
            assert response.status == 200 and "sluice_batches_in_progress 0.0" in await response.text()
            redis_process.kill()
            redis_process.wait()
            response = await client.get("/metrics")
            text = await response.text()
            assert response.status == 200, text
            assert "sluice_active_requests 0.0" in text and "sluice_batches_in_progress 0.0" in text  # last known
            summary = await operations._jobs_summary(app)
            assert isinstance(summary, dict) and "ConnectionError" in summary["store_unavailable"]
    finally:
        redis_process.kill()
        redis_process.wait()
        await store.close()
