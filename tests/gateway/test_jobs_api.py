"""``/v1/jobs``, ownership, limits, delete / cancel in every state, the jobs in ``/status`` and ``/metrics``,
deferral of shed requests, and a worker killed mid-job.

One real gateway with one local **sim** worker (the roofline simulator, slowed down with ``sim.time_scale`` so a
token takes about 0.34 s and 2 sequences fill it): the behaviour under test is the gateway's, and the simulator
makes "the worker is full" and "this job is running" last long enough to act on. Tiers are small so that a
request is shed at will: ``standard`` and ``vip`` queue at most one request; ``vip`` has ``defer_on_overload``.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
import urllib.request
import uuid

import pytest

from tests.gateway.jobs_support import Server, chat_body, sim_config, sqlite_jobs

pytestmark = pytest.mark.slow

MAX_JOBS_PER_KEY = 12
VIP_KEY = "key-vip"

TIERS = f"""
max_jobs_per_key = {MAX_JOBS_PER_KEY}

[[tiers]]
name = "vip"
priority = 3
queue_capacity = 1
queue_timeout_s = 120.0
defer_on_overload = true

[[tiers]]
name = "standard"
priority = 2
queue_capacity = 1
queue_timeout_s = 120.0

[[tiers]]
name = "batch"
priority = 0
queue_capacity = 64
queue_timeout_s = 300.0

[admission]
early_rejection = false

[[api_keys]]
key = "{VIP_KEY}"
tenant = "acme"
tier = "vip"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    workdir = tmp_path_factory.mktemp("jobs_api")
    config = sim_config(sqlite_jobs(workdir / "jobs.sqlite3", lease_timeout_s=3.0) + TIERS, max_num_seqs=2,
                        time_scale=50.0)
    config = config.replace('default_tier = "standard"', "")
    server = Server(workdir, config).start()
    yield server
    server.stop()


def _submit(server: Server, key: str | None, max_tokens: int = 4, **extra) -> dict:
    status, headers, job = server.post("/v1/jobs", chat_body("Tell me about tea.", max_tokens, **extra), key)
    assert status == 202, job
    assert headers["location"] == f"/v1/jobs/{job['id']}"
    return job


def _first_token_sent(server: Server) -> bool:
    """One request on the worker, and its prompt has started (its first token came back)."""
    worker = server.status()["workers"][0]
    return worker["in_flight"] == 1 and worker["pending_prefill"] == 0


def _worker_running(server: Server) -> int:
    capacity = server.status()["workers"][0]["capacity"]
    return capacity["num_running"] + capacity["num_waiting"] if capacity else 0


def _wait(predicate, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def test_job_returns_full_chat_completion(server):
    key = f"key-{uuid.uuid4().hex}"
    job = _submit(server, key, metadata={"purpose": "test"}, priority=7)
    assert job["status"] == "queued" and job["object"] == "job" and job["priority"] == 7
    done = server.wait_job(job["id"], key, {"succeeded", "failed"}, timeout_s=30)
    assert done["status"] == "succeeded" and done["attempts"] == 1 and done["metadata"] == {"purpose": "test"}
    result = done["result"]
    assert result["object"] == "chat.completion" and result["choices"][0]["message"]["content"]
    assert result["usage"]["completion_tokens"] == 4 and done["started_at"] and done["finished_at"]


def test_another_key_gets_404_never_403(server):
    alice = f"key-{uuid.uuid4().hex}"
    job = _submit(server, alice)
    for other in (f"key-{uuid.uuid4().hex}", None):
        assert server.get(f"/v1/jobs/{job['id']}", other)[0] == 404
        assert server.delete(f"/v1/jobs/{job['id']}", other)[0] == 404
        assert all(j["id"] != job["id"] for j in server.get("/v1/jobs", other)[1]["data"])
    status, body = server.get(f"/v1/jobs/{job['id']}", alice)
    assert status == 200 and body["id"] == job["id"]
    server.wait_job(job["id"], alice, {"succeeded"}, timeout_s=30)


def test_list_is_paginated_newest_first(server):
    key = f"key-{uuid.uuid4().hex}"
    ids = [_submit(server, key)["id"] for _ in range(5)]
    seen: list[str] = []
    after = None
    while True:
        status, page = server.get("/v1/jobs?limit=2" + (f"&after={after}" if after else ""), key)
        assert status == 200 and len(page["data"]) <= 2
        seen += [job["id"] for job in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == list(reversed(ids))
    assert server.get("/v1/jobs?limit=0", key)[0] == 400
    for job_id in ids:
        server.wait_job(job_id, key, {"succeeded"}, timeout_s=30)


def test_invalid_jobs_are_4xx_naming_the_field(server):
    cases = [
        ({"model": "SmolLM2-135M-Instruct"}, 400, "messages"),
        (chat_body("hi", priority=10), 400, "priority"),
        (chat_body("hi", metadata={"k": 1}), 400, "metadata.k"),
        (chat_body("hi", temperature=9), 400, "temperature"),
        ({**chat_body("hi"), "model": "gpt-9"}, 404, "model"),
        (chat_body("hi", stop=[f"s{i}" for i in range(9)]), 400, "stop"),  # past gateway.max_stop_sequences
        (chat_body("hi", service_tier="nope"), 400, "service_tier"),  # a job runs in the batch tier, but
        # what the sync endpoint refuses is refused here too
        (chat_body("hi", n=9), 400, "n"),  # past gateway.max_n
        (chat_body("hi", n=3), 400, "n"),  # more choices than the worker's 2 sequence slots: it could never run
        (chat_body("word " * 3000), 400, "messages"),  # past the 2048-token context: refused now, not failed later
    ]
    _, before = server.get("/v1/jobs?limit=100")
    for body, status, param in cases:
        got, _, error = server.post("/v1/jobs", body)
        assert got == status and error["error"]["param"] == param, error
    assert error["error"]["code"] == "context_length_exceeded", error
    _, after = server.get("/v1/jobs?limit=100")
    assert [j["id"] for j in after["data"]] == [j["id"] for j in before["data"]]  # none of them was stored


def test_delete_deletes_a_finished_job_and_cancels_an_unfinished_one(server):
    key = f"key-{uuid.uuid4().hex}"
    # succeeded → deleted: a later GET and DELETE answer 404
    done = _submit(server, key)
    server.wait_job(done["id"], key, {"succeeded"}, timeout_s=30)
    status, deleted = server.delete(f"/v1/jobs/{done['id']}", key)
    assert status == 200 and deleted == {"id": done["id"], "object": "job.deleted", "deleted": True}
    assert server.get(f"/v1/jobs/{done['id']}", key)[0] == 404
    assert server.delete(f"/v1/jobs/{done['id']}", key)[0] == 404
    assert all(j["id"] != done["id"] for j in server.get("/v1/jobs", key)[1]["data"])
    # running (2 fill the worker) and queued (the third finds no room) → cancelled, still readable
    running = [_submit(server, key, max_tokens=200) for _ in range(2)]
    for job in running:
        server.wait_job(job["id"], key, {"running"}, timeout_s=30)
    _wait(lambda: _worker_running(server) == 2, 10, "the two jobs never reached the worker")
    queued = _submit(server, key, max_tokens=200)
    time.sleep(0.5)
    assert server.get(f"/v1/jobs/{queued['id']}", key)[1]["status"] == "queued"
    status, job = server.delete(f"/v1/jobs/{queued['id']}", key)
    assert status == 200 and job["status"] == "cancelled" and job["attempts"] == 0
    for job in running:
        status, cancelled = server.delete(f"/v1/jobs/{job['id']}", key)
        assert status == 200 and cancelled["status"] == "cancelled" and cancelled["error"]["code"] == "cancelled"
    _wait(lambda: _worker_running(server) == 0, 5, "cancelled running jobs were not aborted on the worker")
    # cancelled: never run afterwards; a second DELETE deletes it
    time.sleep(0.5)
    status, still = server.get(f"/v1/jobs/{queued['id']}", key)
    assert status == 200 and still["status"] == "cancelled" and still["attempts"] == 0
    assert server.delete(f"/v1/jobs/{queued['id']}", key)[1]["deleted"] is True
    assert server.get(f"/v1/jobs/{queued['id']}", key)[0] == 404


def _metric_value(text: str, sample: str) -> float | None:
    """Return the value of the exposition line that starts with ``sample`` (name and labels), or None."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_status_and_metrics_count_jobs_by_status(server):
    key = f"key-{uuid.uuid4().hex}"
    before = server.status()["jobs"]
    jobs = [_submit(server, key) for _ in range(2)]
    for job in jobs:
        server.wait_job(job["id"], key, {"succeeded"}, timeout_s=30)
    summary = server.status()["jobs"]
    assert set(summary) == {"queued", "running", "succeeded", "failed", "cancelled", "expired",
                            "oldest_queued_age_s", "batches_in_progress"}
    assert summary["succeeded"] >= before["succeeded"] + 2
    assert summary["queued"] >= 0 and summary["running"] >= 0 and summary["oldest_queued_age_s"] >= 0.0
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    assert _metric_value(text, 'sluice_jobs{status="succeeded"}') >= summary["succeeded"]
    assert _metric_value(text, 'sluice_jobs{status="queued"}') is not None
    assert _metric_value(text, "sluice_batches_in_progress") is not None
    assert _metric_value(text, "sluice_jobs_oldest_queued_age_seconds") is not None
    assert _metric_value(text, 'sluice_jobs_finished_total{status="succeeded"}') >= 2


def test_unfinished_jobs_per_key_are_limited(server):
    key = f"key-{uuid.uuid4().hex}"
    jobs = [_submit(server, key, max_tokens=200) for _ in range(MAX_JOBS_PER_KEY)]
    status, headers, error = server.post("/v1/jobs", chat_body("one more", 4), key)
    assert status == 429 and "jobs.max_jobs_per_key" in error["error"]["message"]
    assert int(headers["retry-after"]) >= 1  # every 429 says when to retry
    other_key = f"key-{uuid.uuid4().hex}"
    status, _, other = server.post("/v1/jobs", chat_body("another key", 4), other_key)
    assert status == 202
    for job in jobs:
        assert server.delete(f"/v1/jobs/{job['id']}", key)[1]["status"] == "cancelled"
    status, _, again = server.post("/v1/jobs", chat_body("room again", 4), key)
    assert status == 202
    # let both finish here: a job still running would take the sequence slots the next test fills
    for job_id, job_key in ((other["id"], other_key), (again["id"], key)):
        assert server.wait_job(job_id, job_key, {"succeeded"}, timeout_s=30)["status"] == "succeeded"


def _sync(server: Server, key: str | None, max_tokens: int, headers: dict[str, str] | None = None):
    return server.post("/v1/chat/completions", chat_body("Describe the sea.", max_tokens), key, headers)


def _shed_counts(server: Server) -> dict[str, tuple[int, int]]:
    """Tier → (rejected, deferred) requests so far, every code together (``/status``)."""
    tiers = server.status()["admission"]["tiers"]
    return {name: (sum(t["rejected"].values()), sum(t["deferred"].values())) for name, t in tiers.items()}


def test_deferral_returns_202_where_a_503_would_have_been(server):
    _wait(lambda: _worker_running(server) == 0, 30, "worker busy before the test")
    before = _shed_counts(server)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # fill the worker (2 sequences), then the one-slot standard and vip queues
        fillers = [pool.submit(_sync, server, None, 24) for _ in range(2)]
        _wait(lambda: _worker_running(server) == 2, 10, "fillers did not start")
        queued_standard = pool.submit(_sync, server, None, 4)
        queued_vip = pool.submit(_sync, server, VIP_KEY, 4)
        time.sleep(0.5)
        status, _, shed = _sync(server, None, 4)
        assert status == 503 and shed["error"]["code"] in ("queue_full", "predicted_queue_timeout")
        status, headers, deferred = _sync(server, None, 4, {"x-sluice-defer": "allow"})  # the client asks
        assert status == 202 and deferred["deferred"] is True and deferred["status"] == "queued"
        assert headers["location"] == f"/v1/jobs/{deferred['id']}"
        status, headers, vip_deferred = _sync(server, VIP_KEY, 4)  # the tier defers on overload
        assert status == 202 and vip_deferred["deferred"] is True
        # ... but not a stream its client did not ask to defer: an SSE client reads a 202 job as an empty stream
        streamed = {**chat_body("Describe the sea.", 4), "stream": True}
        status, _, shed_stream = server.post("/v1/chat/completions", streamed, VIP_KEY)
        assert status == 503 and shed_stream["error"]["code"] in ("queue_full", "predicted_queue_timeout")
        assert server.get(f"/v1/jobs/{vip_deferred['id']}", "key-other")[0] == 404
        assert server.get(f"/v1/jobs/{vip_deferred['id']}", None)[0] == 404
        assert server.get(f"/v1/jobs/{deferred['id']}", None)[1]["status"] == "queued"  # no room while loaded
        for future in fillers:
            assert future.result()[0] == 200
        late_503s = {}
        for tier, future in (("standard", queued_standard), ("vip", queued_vip)):  # queued behind the fillers:
            status, _, body = future.result()  # served, or shed by its deadline
            assert status == 200 or (status == 503 and body["error"]["code"] in ("queue_timeout",
                                                                                  "predicted_queue_timeout"))
            late_503s[tier] = int(status == 503)
    # a deferred request is counted as deferred, not as rejected: rejected counts the 503s answered (trial 4)
    after = _shed_counts(server)
    assert after["standard"] == (before["standard"][0] + 1 + late_503s["standard"], before["standard"][1] + 1)
    assert after["vip"] == (before["vip"][0] + 1 + late_503s["vip"], before["vip"][1] + 1)
    answer = server.wait_job(deferred["id"], None, {"succeeded", "failed"}, timeout_s=60)
    assert answer["status"] == "succeeded" and answer["result"]["object"] == "chat.completion"
    assert server.wait_job(vip_deferred["id"], VIP_KEY, {"succeeded"}, timeout_s=60)["result"]["choices"]


def test_job_survives_a_worker_killed_mid_job(server):
    key = f"key-{uuid.uuid4().hex}"
    _wait(lambda: _worker_running(server) == 0, 30, "worker busy before the test")
    job = _submit(server, key, max_tokens=16)
    server.wait_job(job["id"], key, {"running"}, timeout_s=30)
    # kill it mid-decode: after its first token (a kill before that is retried inside the gateway, and the job's
    # runner never sees it fail) and long before its last (16 tokens take about 5 s)
    _wait(lambda: _first_token_sent(server), 10, "the job never started decoding on the worker")
    worker_pid = server.status()["local_workers"][0]["pid"]
    assert server.get(f"/v1/jobs/{job['id']}", key)[1]["status"] == "running"
    os.kill(worker_pid, signal.SIGKILL)
    done = server.wait_job(job["id"], key, {"succeeded", "failed"}, timeout_s=90)
    assert done["status"] == "succeeded" and done["attempts"] == 2, done
    assert done["result"]["usage"]["completion_tokens"] == 16
    assert server.status()["local_workers"][0]["pid"] != worker_pid


async def test_an_unreachable_store_is_503_store_unavailable_with_retry_after():
    import redis.exceptions
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from gateway.http.middleware import error_middleware
    from gateway.jobs.api import store_unavailable_as_503
    from gateway.metrics import Metrics
    from gateway.state import METRICS

    async def handler(request: web.Request) -> web.Response:
        raise redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

    app = web.Application(middlewares=[error_middleware])
    app[METRICS] = Metrics()
    app.router.add_post("/v1/jobs", store_unavailable_as_503(handler))
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/v1/jobs", json={})
        body = await response.json()
    assert response.status == 503 and response.headers["Retry-After"] == "5"
    assert body["error"]["code"] == "store_unavailable" and body["error"]["type"] == "server_error"
