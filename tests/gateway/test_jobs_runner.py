"""Crash safety and sharing of the job runner, with real gateways killed with SIGKILL and restarted.

- BC34: kill -9 the gateway in the middle of a 64-request batch; the restarted gateway (same SQLite file, or the
  same Redis) finishes it with 64 results and no duplicate ``custom_id``; a batch created and cancelled after the
  restart ends ``cancelled``.
- Two gateways on one Redis: jobs submitted to either run exactly once and are visible through both.

Workers are the **sim** backend (the roofline simulator; ``sim.time_scale`` 10 makes one 8-token request last about
half a second) so that the batch is reliably mid-way when the gateway is killed; what is under test is the
gateway's job store and runner.
"""

from __future__ import annotations

import io
import json
import shutil
import time
import uuid

import openai
import pytest

from tests.gateway.jobs_support import (
    Server,
    batch_lines,
    chat_body,
    delete_redis_prefix,
    redis_available,
    redis_jobs,
    sim_config,
    sqlite_jobs,
)

pytestmark = pytest.mark.slow

NUM_LINES = 64
BATCH_STATUSES = {"validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                  "cancelled"}
FINAL_BATCH_STATUSES = {"completed", "failed", "expired", "cancelled"}
LEASE_TIMEOUT_S = 2.0


@pytest.fixture(params=["sqlite", "redis"])
def store_config(request, tmp_path):
    if request.param == "sqlite":
        yield sqlite_jobs(tmp_path / "jobs.sqlite3", LEASE_TIMEOUT_S)
        return
    if not redis_available():
        pytest.skip("no Redis server at 127.0.0.1:6379 (make redis)")
    prefix = f"sluice-test:{uuid.uuid4().hex}"
    yield redis_jobs(prefix, LEASE_TIMEOUT_S)
    delete_redis_prefix(prefix)


def _client(server: Server, key: str = "key-bc34") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=30)


def _poll(client: openai.OpenAI, batch_id: str, until, timeout_s: float, seen_statuses: set[str]):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        seen_statuses.add(batch.status)
        if until(batch):
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} stuck: {batch}"
        time.sleep(0.1)


def test_bc34_gateway_killed_mid_batch_resumes_with_all_results_no_duplicates(store_config, tmp_path):
    config = sim_config(store_config, max_num_seqs=4, time_scale=10.0)
    server = Server(tmp_path / "gw", config).start()
    seen: set[str] = set()
    try:
        client = _client(server)
        uploaded = client.files.create(file=("bc34.jsonl", io.BytesIO(batch_lines(NUM_LINES))), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        mid = _poll(client, batch.id, lambda b: b.request_counts.completed >= 20, 60, seen)
        assert mid.request_counts.completed < NUM_LINES, "the batch finished before the kill; slow the sim down"
        server.kill9()
        killed_at_completed = mid.request_counts.completed

        server.start()  # same config: same SQLite file or Redis prefix, same port
        client = _client(server)
        after = client.batches.retrieve(batch.id)  # retrievable after the restart, results so far kept
        assert after.request_counts.completed >= killed_at_completed
        second = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
        assert client.batches.cancel(second.id).status in ("cancelling", "cancelled")

        done = _poll(client, batch.id, lambda b: b.status in FINAL_BATCH_STATUSES, 90, seen)
        cancelled = _poll(client, second.id, lambda b: b.status in FINAL_BATCH_STATUSES, 30, seen)
        assert seen <= BATCH_STATUSES
        assert done.status == "completed", done
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (NUM_LINES, NUM_LINES, 0)
        output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
        custom_ids = [row["custom_id"] for row in output]
        assert len(output) == NUM_LINES and len(set(custom_ids)) == NUM_LINES
        assert set(custom_ids) == {f"r{i}" for i in range(1, NUM_LINES + 1)}
        assert all(row["response"]["status_code"] == 200 and row["response"]["body"]["choices"] for row in output)
        assert cancelled.status == "cancelled"
        assert cancelled.request_counts.completed + cancelled.request_counts.failed == NUM_LINES
        runs = server.log_events("job_started")
        assert any(run["attempt"] == 2 for run in runs), "no job was re-claimed after the lease expired"
    finally:
        server.stop()


def test_two_gateways_on_one_redis_run_each_job_once_and_both_see_it(tmp_path):
    if not redis_available():
        pytest.skip("no Redis server at 127.0.0.1:6379 (make redis)")
    prefix = f"sluice-test:{uuid.uuid4().hex}"
    config = sim_config(redis_jobs(prefix, LEASE_TIMEOUT_S), max_num_seqs=4, time_scale=5.0)
    gateways = [Server(tmp_path / "a", config), Server(tmp_path / "b", config)]
    try:
        for gateway in gateways:
            gateway.start(wait=False)
        for gateway in gateways:
            gateway.wait_ready()
        key = "key-shared"
        submitted: list[str] = []
        for i in range(24):
            status, _, job = gateways[i % 2].post("/v1/jobs", chat_body(f"Count to {i}.", 8), key)
            assert status == 202
            submitted.append(job["id"])
        for i, job_id in enumerate(submitted):
            other = gateways[(i + 1) % 2]  # read through the gateway it was not submitted to
            done = other.wait_job(job_id, key, {"succeeded", "failed"}, timeout_s=60)
            assert done["status"] == "succeeded" and done["attempts"] == 1
        for gateway in gateways:
            listed: list[str] = []
            after = None
            while True:
                status, page = gateway.get("/v1/jobs?limit=100" + (f"&after={after}" if after else ""), key)
                listed += [job["id"] for job in page["data"]]
                if not page["has_more"]:
                    break
                after = page["last_id"]
            assert sorted(listed) == sorted(submitted)
        starts = [event["job_id"] for gateway in gateways for event in gateway.log_events("job_started")]
        assert sorted(starts) == sorted(submitted)  # each job ran exactly once, on one of the two
        assert all(any(event["job_id"] in submitted for event in g.log_events("job_started")) for g in gateways)
    finally:
        for gateway in gateways:
            gateway.stop()
        delete_redis_prefix(prefix)
        shutil.rmtree(tmp_path, ignore_errors=True)
