"""The job store contract, one suite run against both stores: SQLite (a temp file) and Redis (a real server at
127.0.0.1:6379, each test under its own key prefix, deleted afterwards)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from gateway.jobs.models import (
    CANCELLED,
    COMPLETED,
    EXPIRED,
    FAILED,
    IN_PROGRESS,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    Batch,
    FileRecord,
    Job,
    new_batch_id,
    new_file_id,
    new_job_id,
)
from gateway.jobs.redis_store import RedisJobStore
from gateway.jobs.sqlite_store import SqliteJobStore
from gateway.jobs.store import JobStore, TooManyJobsError

REDIS_URL = "redis://127.0.0.1:6379/0"
RETENTION_S = 3600.0


def _redis_available() -> bool:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError:
        return False
    return True


@pytest.fixture(params=["sqlite", "redis"])
async def store(request, tmp_path) -> JobStore:
    if request.param == "sqlite":
        store: JobStore = SqliteJobStore(tmp_path / "jobs.sqlite3")
    else:
        if not _redis_available():
            pytest.skip("no Redis server at 127.0.0.1:6379 (make redis)")
        store = RedisJobStore(REDIS_URL, f"sluice-test:{uuid.uuid4().hex}")
    await store.open()
    yield store
    if isinstance(store, RedisJobStore):
        await store.delete_all()
    await store.close()


def _job(owner: str = "alice", priority: int = 0, **fields) -> Job:
    now_s = time.time()
    return Job(id=new_job_id(), owner=owner, kind="chat", body=b'{"model": "m", "messages": []}',
               priority=priority, created_at=now_s, expires_at=now_s + 3600, **fields)


async def test_claim_runs_priority_first_then_fifo(store):
    low_old, high, low_new = _job(priority=0), _job(priority=5), _job(priority=0)
    for job in (low_old, high, low_new):
        await store.add_jobs([job], 100)
    now_s = time.time()
    claimed = [await store.claim("r1", 30, now_s) for _ in range(3)]
    assert [job.id for job in claimed] == [high.id, low_old.id, low_new.id]
    assert all(job.status == RUNNING and job.attempts == 1 and job.lease_owner == "r1" for job in claimed)
    assert await store.claim("r1", 30, now_s) is None


async def test_first_writer_wins_and_one_claim_per_job(store):
    job = _job()
    await store.add_jobs([job], 100)
    now_s = time.time()
    claims = await asyncio.gather(*(store.claim(f"r{i}", 30, now_s) for i in range(4)))
    assert sum(c is not None for c in claims) == 1
    assert await store.finish(job.id, SUCCEEDED, now_s, result=b'{"ok": 1}', status_code=200,
                              retention_s=RETENTION_S)
    assert not await store.finish(job.id, FAILED, now_s, error={"code": "x", "message": "y"},
                                  retention_s=RETENTION_S)
    assert not await store.finish(job.id, CANCELLED, now_s, retention_s=RETENTION_S)
    stored = await store.get_job(job.id)
    assert stored.status == SUCCEEDED and stored.result == b'{"ok": 1}' and stored.error is None
    assert await store.count_active_jobs("alice") == 0


async def test_expired_lease_is_claimed_again_and_old_runner_loses(store):
    job = _job()
    await store.add_jobs([job], 100)
    lease_s = 0.3
    first = await store.claim("dead-runner", lease_s, time.time())
    assert first.id == job.id
    assert await store.claim("r2", lease_s, time.time()) is None  # still leased
    await asyncio.sleep(lease_s + 0.2)
    second = await store.claim("r2", lease_s, time.time())
    assert second is not None and second.id == job.id and second.attempts == 2 and second.lease_owner == "r2"
    assert not await store.renew(job.id, "dead-runner", lease_s, time.time())
    assert await store.renew(job.id, "r2", lease_s, time.time())
    assert await store.finish(job.id, SUCCEEDED, time.time(), result=b"{}", retention_s=RETENTION_S)
    assert not await store.renew(job.id, "r2", lease_s, time.time())


async def test_a_finished_job_past_its_retention_is_gone_before_the_purge_runs(store):
    """README trial 5: with a 17 s retention, a finished job was still readable 24 s later (the SQLite purge runs
    every 5 minutes)."""
    job = _job()
    await store.add_jobs([job], 100)
    claimed = await store.claim("r1", 30.0, time.time())
    assert claimed.id == job.id
    assert await store.finish(job.id, SUCCEEDED, time.time(), result=b"{}", retention_s=1.0)
    assert (await store.get_job(job.id)).status == SUCCEEDED
    assert [j.id for j in (await store.list_jobs("alice", 10, None))[0]] == [job.id]
    await asyncio.sleep(1.3)
    assert await store.get_job(job.id) is None
    assert (await store.list_jobs("alice", 10, None))[0] == []


async def test_renewed_lease_is_not_taken(store):
    job = _job()
    await store.add_jobs([job], 100)
    lease_s = 0.4
    await store.claim("r1", lease_s, time.time())
    for _ in range(4):
        await asyncio.sleep(lease_s / 3)
        assert await store.renew(job.id, "r1", lease_s, time.time())
    assert await store.claim("r2", lease_s, time.time()) is None


async def test_requeue_puts_a_job_back(store):
    job = _job()
    await store.add_jobs([job], 100)
    await store.claim("r1", 30, time.time())
    assert not await store.requeue(job.id, "someone-else")
    assert await store.requeue(job.id, "r1")
    assert (await store.get_job(job.id)).status == QUEUED
    again = await store.claim("r2", 30, time.time())
    assert again.id == job.id and again.attempts == 2
    assert await store.requeue(job.id, "r2", refund_attempt=True)  # never reached a worker: not an attempt
    assert (await store.claim("r3", 30, time.time())).attempts == 2


async def test_cancelled_queued_job_is_never_claimed(store):
    job = _job()
    await store.add_jobs([job], 100)
    assert await store.finish(job.id, CANCELLED, time.time(), error={"code": "cancelled", "message": "m"},
                              retention_s=RETENTION_S)
    assert await store.claim("r1", 30, time.time()) is None


async def test_limit_of_unfinished_jobs_per_owner(store):
    await store.add_jobs([_job(), _job()], 3)
    with pytest.raises(TooManyJobsError) as info:
        await store.add_jobs([_job(), _job()], 3)
    assert info.value.num_active == 2 and info.value.limit == 3
    await store.add_jobs([_job(owner="bob")], 3)  # per owner
    assert await store.count_active_jobs("alice") == 2


async def test_list_jobs_pages_newest_first_and_only_own(store):
    jobs = [_job() for _ in range(5)]
    for job in jobs:
        await store.add_jobs([job], 100)
    await store.add_jobs([_job(owner="bob")], 100)
    page1, more1 = await store.list_jobs("alice", 2, None)
    page2, more2 = await store.list_jobs("alice", 2, page1[-1].id)
    page3, more3 = await store.list_jobs("alice", 2, page2[-1].id)
    ids = [job.id for job in page1 + page2 + page3]
    assert ids == [job.id for job in reversed(jobs)]
    assert (more1, more2, more3) == (True, True, False)


async def test_batch_counts_every_line_once_and_keeps_line_order(store):
    batch = Batch(id=new_batch_id(), owner="alice", endpoint="/v1/chat/completions", input_file_id="file-x",
                  status=IN_PROGRESS, num_total=3, created_at=time.time())
    lines = [_job(batch_id=batch.id, custom_id=f"r{i}", line=i) for i in (1, 2, 3)]
    await store.add_jobs(lines, 100, batch=batch)
    assert await store.open_batch_ids() == [batch.id]
    now_s = time.time()
    await store.finish(lines[0].id, SUCCEEDED, now_s, result=b"{}", retention_s=RETENTION_S)
    await store.finish(lines[0].id, SUCCEEDED, now_s, result=b"{}", retention_s=RETENTION_S)  # loses
    await store.finish(lines[1].id, FAILED, now_s, error={"code": "e", "message": "m"}, retention_s=RETENTION_S)
    await store.finish(lines[2].id, EXPIRED, now_s, error={"code": "batch_expired", "message": "m"},
                       retention_s=RETENTION_S)
    stored = await store.get_batch(batch.id)
    assert (stored.num_total, stored.num_completed, stored.num_failed) == (3, 1, 2)
    assert [job.custom_id for job in await store.batch_jobs(batch.id)] == ["r1", "r2", "r3"]
    assert await store.list_jobs("alice", 10, None) == ([], False)  # batch lines are not native jobs
    updated = await store.update_batch(batch.id, frozenset({IN_PROGRESS}), RETENTION_S, status=COMPLETED,
                                       completed_at=now_s, output_file_id="file-out", input_tokens=120,
                                       cached_tokens=64, output_tokens=16)
    assert updated.status == COMPLETED and updated.output_file_id == "file-out" and updated.num_completed == 1
    stored = await store.get_batch(batch.id)
    assert (stored.input_tokens, stored.cached_tokens, stored.output_tokens) == (120, 64, 16)
    assert await store.update_batch(batch.id, frozenset({IN_PROGRESS}), RETENTION_S, status=CANCELLED) is None
    assert await store.open_batch_ids() == []


async def test_files_round_trip_and_list(store):
    records = []
    for i in range(3):
        record = FileRecord(id=new_file_id(), owner="alice", filename=f"f{i}.jsonl", purpose="batch",
                            bytes=3, created_at=time.time(), expires_at=time.time() + 3600, num_lines=1)
        await store.put_file(record, b"abc")
        records.append(record)
    assert await store.get_file_content(records[1].id) == b"abc"
    assert (await store.get_file(records[1].id)).filename == "f1.jsonl"
    page, more = await store.list_files("alice", 2, None)
    assert [r.id for r in page] == [records[2].id, records[1].id] and more
    output = FileRecord(id=new_file_id(), owner="alice", filename="out.jsonl", purpose="batch_output", bytes=1,
                        created_at=time.time(), expires_at=time.time() + 3600)
    await store.put_file(output, b"x")
    await store.put_file(output, b"y")  # finalizing twice rewrites the same file
    assert await store.get_file_content(output.id) == b"y"
    assert [r.id for r in (await store.list_files("alice", 10, None, purpose="batch_output"))[0]] == [output.id]
    batch_files, more = await store.list_files("alice", 2, None, purpose="batch")
    assert [r.id for r in batch_files] == [records[2].id, records[1].id] and more
    # oldest first (order=asc), paged with the same cursor
    page, more = await store.list_files("alice", 2, None, oldest_first=True)
    assert [r.id for r in page] == [records[0].id, records[1].id] and more
    page, more = await store.list_files("alice", 2, records[1].id, oldest_first=True)
    assert [r.id for r in page] == [records[2].id, output.id] and not more
    assert (await store.list_files("alice", 2, "file-unknown", oldest_first=True)) == ([], False)
    assert await store.delete_file(records[0].id)
    assert await store.get_file(records[0].id) is None
    assert (await store.list_files("bob", 10, None)) == ([], False)


async def test_due_jobs_lists_unfinished_jobs_past_their_window(store):
    now_s = time.time()
    late = Job(id=new_job_id(), owner="alice", kind="chat", body=b"{}", created_at=now_s, expires_at=now_s - 1)
    await store.add_jobs([late, _job()], 100)
    assert await store.due_jobs(now_s, 10) == [late.id]


async def test_summary_counts_jobs_by_status_and_open_batches(store):
    queued, running, done, cancelled = _job(), _job(), _job(), _job()
    batch = Batch(id=new_batch_id(), owner="alice", input_file_id="file-x", endpoint="/v1/chat/completions",
                  status=IN_PROGRESS, created_at=time.time(), num_total=0)
    await store.add_jobs([queued, running, done, cancelled], 100, batch=batch)
    now_s = time.time()
    first = await store.claim("r1", 60.0, now_s)
    second = await store.claim("r1", 60.0, now_s)
    await store.finish(first.id, SUCCEEDED, now_s, retention_s=RETENTION_S)
    third = await store.claim("r1", 60.0, now_s)
    await store.finish(third.id, CANCELLED, now_s, retention_s=RETENTION_S)
    summary = await store.summary(now_s + 5.0)
    assert (summary.queued, summary.running, summary.batches_in_progress) == (1, 1, 1)
    assert second is not None
    if isinstance(store, SqliteJobStore):
        assert (summary.succeeded, summary.failed, summary.cancelled, summary.expired) == (1, 0, 1, 0)
        assert summary.oldest_queued_age_s >= 5.0
    else:
        assert summary.succeeded is None and summary.oldest_queued_age_s is None


async def test_delete_job_deletes_only_finished_jobs(store):
    unfinished, finished = _job(), _job()
    await store.add_jobs([unfinished, finished], 100)
    await store.finish(finished.id, SUCCEEDED, time.time(), retention_s=RETENTION_S)
    assert await store.delete_job(unfinished.id) is False
    assert await store.get_job(unfinished.id) is not None
    assert await store.delete_job(finished.id) is True
    assert await store.get_job(finished.id) is None
    assert await store.delete_job(finished.id) is False
    jobs, _ = await store.list_jobs("alice", 10, None)
    assert [job.id for job in jobs] == [unfinished.id]


async def test_redis_store_claims_again_after_redis_lost_its_keys(store):
    """A Redis restarted without persistence (``make redis`` runs it so) or flushed has no consumer groups: the
    store creates them again at the next claim instead of failing every claim with ``NOGROUP`` until the gateway
    restarts (trial 4: a job queued forever)."""
    if not isinstance(store, RedisJobStore):
        pytest.skip("the Redis store's consumer groups")
    await store.delete_all()  # what the restart leaves: no stream, no group
    job = _job()
    await store.add_jobs([job], 100)
    claimed = await store.claim("r1", 30, time.time())
    assert claimed is not None and claimed.id == job.id and claimed.status == RUNNING
