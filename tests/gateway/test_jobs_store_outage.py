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
from tests.gateway.jobs_support import chat_body, sim_config
from tests.support.server import SluiceProcess, free_port, get_json, post_json, wait_for

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


def test_a_gateway_whose_job_store_redis_is_away_at_start_serves_and_says_so_once(tmp_path):
    """README trial 13: a Redis job store unreachable at start ended ``sluice serve`` with a traceback (chat down too,
    though it needs no job store), and an outage logged two full tracebacks a second (with console logs the event
    loop spent its time formatting them). Now: the gateway serves, its job endpoints answer 503 until Redis is
    there, the outage is one warning, and once Redis comes jobs run (the consumer groups are created then)."""
    port = free_port()
    config = sim_config(f'store = "redis"\nredis_url = "redis://127.0.0.1:{port}/0"\n'
                        f'redis_key_prefix = "sluice-test-start-{port}"\nidle_grace_s = 0.0\n', time_scale=50.0)
    with SluiceProcess(config, tmp_path, min_ready_workers=1) as gateway:
        assert post_json(gateway.base_url + "/v1/chat/completions", chat_body("Say hi.", 4))[0] == 200
        status, body, headers = post_json(gateway.base_url + "/v1/jobs", chat_body("Say hi.", 4))
        assert status == 503 and body["error"]["code"] == "store_unavailable" and headers["Retry-After"] == "5"
        time.sleep(4.0)  # the runner's upkeep tries the store every second (backing off)
        assert len(gateway.log_events("job_store_unreachable_at_start")) == 1
        assert len(gateway.log_events("job_store_unreachable")) == 1
        assert "Traceback" not in gateway.log_text()
        redis_process = _start_redis(port)
        try:
            wait_for(lambda: gateway.log_events("job_store_reachable_again"), 30.0, "the runner to find Redis")
            status, job, _ = post_json(gateway.base_url + "/v1/jobs", chat_body("Say hi.", 4))
            assert status == 202, job

            def finished():
                done = get_json(gateway.base_url + f"/v1/jobs/{job['id']}")[1]
                return done if done["status"] in ("succeeded", "failed") else None

            assert wait_for(finished, 30.0, "the job to run")["status"] == "succeeded"
        finally:
            redis_process.kill()
            redis_process.wait()
