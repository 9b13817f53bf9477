"""The job runner's exact decisions, pinned with a real SQLite store, a scripted executor and a scripted gate.

Which failures are retried and which fail the job, what counts as an attempt, when a job may start (idle grace),
expiry, and cancellation of a running job. The end-to-end behaviour (real gateways, kill -9) is in
test_jobs_runner.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.jobs.idle_capacity import Room
from gateway.jobs.models import CANCELLED, EXPIRED, FAILED, QUEUED, SUCCEEDED, Job, new_job_id
from gateway.jobs.runner import JobRunner
from gateway.jobs.sqlite_store import SqliteJobStore
from shared.config import JobsConfig
from shared.errors import ErrorCode, SluiceError

CONFIG = JobsConfig(lease_timeout_s=5.0, poll_interval_s=0.01, idle_grace_s=0.0, max_attempts=3)


class ScriptedGate:
    """The idle-capacity gate, set by the test."""

    def __init__(self, room: Room = Room(4, False)) -> None:
        self.room = room

    def room_for_jobs(self) -> Room:
        return self.room


class ScriptedExecutor:
    """Runs each call by the next outcome of a script: an exception to raise, "block", or a response dict."""

    def __init__(self, *outcomes, admit: bool = True) -> None:
        self.outcomes = list(outcomes)
        self.admit = admit
        self.calls = 0

    async def __call__(self, kind, body, request_id, on_admitted):
        self.calls += 1
        outcome = self.outcomes.pop(0) if self.outcomes else {"object": "chat.completion"}
        if self.admit:
            on_admitted()
        if outcome == "block":
            await asyncio.Event().wait()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


@pytest.fixture
async def store(tmp_path):
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    await store.open()
    yield store
    await store.close()


async def _finalize(batch_id: str) -> None:
    return None


async def _run_until(runner: JobRunner, predicate, timeout_s: float = 5.0) -> None:
    runner.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not await predicate():
            assert time.monotonic() < deadline, "condition not reached"
            await asyncio.sleep(0.01)
    finally:
        await runner.close()


async def _add(store, **fields) -> Job:
    now_s = time.time()
    job = Job(id=new_job_id(), owner="alice", kind="chat", body=b"{}", created_at=now_s,
              expires_at=now_s + 3600, **fields)
    await store.add_jobs([job], 100)
    return job


def _status_is(store, job_id: str, *statuses: str):
    async def check() -> bool:
        return (await store.get_job(job_id)).status in statuses
    return check


async def test_client_error_fails_at_once_with_its_status(store):
    job = await _add(store)
    error = SluiceError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long", param="messages")
    executor = ScriptedExecutor(error)
    await _run_until(JobRunner(store, CONFIG, executor, ScriptedGate(), _finalize),
                     _status_is(store, job.id, FAILED))
    stored = await store.get_job(job.id)
    assert stored.status_code == 400 and stored.error["code"] == "context_length_exceeded"
    assert stored.error["param"] == "messages" and executor.calls == 1


async def test_worker_failures_are_retried_until_max_attempts(store, monkeypatch):
    monkeypatch.setattr("gateway.jobs.runner.TRANSIENT_BACKOFF_S", 0.0)
    job = await _add(store)
    lost = SluiceError(ErrorCode.WORKER_FAILED, "worker lost")
    executor = ScriptedExecutor(lost, lost, lost, lost)
    await _run_until(JobRunner(store, CONFIG, executor, ScriptedGate(), _finalize),
                     _status_is(store, job.id, FAILED))
    stored = await store.get_job(job.id)
    assert stored.attempts == CONFIG.max_attempts == executor.calls and stored.status_code == 502


async def test_shed_before_any_worker_does_not_use_up_attempts(store, monkeypatch):
    monkeypatch.setattr("gateway.jobs.runner.TRANSIENT_BACKOFF_S", 0.0)
    job = await _add(store)
    shed = SluiceError(ErrorCode.QUEUE_FULL, "full", retry_after_s=1)
    executor = ScriptedExecutor(*([shed] * 5), {"object": "chat.completion"}, admit=False)
    await _run_until(JobRunner(store, CONFIG, executor, ScriptedGate(), _finalize),
                     _status_is(store, job.id, SUCCEEDED))
    stored = await store.get_job(job.id)
    assert executor.calls == 6 > CONFIG.max_attempts and stored.attempts == 1


async def test_a_job_ended_by_the_gateway_shutting_down_does_not_use_up_an_attempt(store, monkeypatch):
    """A drain that times out ends the requests still running with server_draining (503): a job on its worker
    goes back to the queue as a shutdown's cancellation puts it, even on what would be its last attempt."""
    monkeypatch.setattr("gateway.jobs.runner.TRANSIENT_BACKOFF_S", 0.0)
    job = await _add(store)
    draining = SluiceError(ErrorCode.DRAINING, "the server is shutting down")
    executor = ScriptedExecutor(*([draining] * 4), {"object": "chat.completion"})  # admitted each time
    await _run_until(JobRunner(store, CONFIG, executor, ScriptedGate(), _finalize),
                     _status_is(store, job.id, SUCCEEDED))
    stored = await store.get_job(job.id)
    assert executor.calls == 5 > CONFIG.max_attempts and stored.attempts == 1


async def test_no_job_starts_while_requests_wait_and_only_after_the_idle_grace(store):
    job = await _add(store)
    gate = ScriptedGate(Room(4, True))
    config = JobsConfig(poll_interval_s=0.01, idle_grace_s=0.3)
    runner = JobRunner(store, config, ScriptedExecutor(), gate, _finalize)
    runner.start()
    try:
        await asyncio.sleep(0.3)
        assert (await store.get_job(job.id)).status == QUEUED
        gate.room = Room(4, False)
        cleared_s = time.monotonic()
        while (await store.get_job(job.id)).status != SUCCEEDED:
            await asyncio.sleep(0.01)
        assert time.monotonic() - cleared_s >= config.idle_grace_s
    finally:
        await runner.close()


async def test_cancel_aborts_a_job_running_here(store):
    job = await _add(store)
    runner = JobRunner(store, CONFIG, ScriptedExecutor("block"), ScriptedGate(), _finalize)
    runner.start()
    try:
        while runner.num_running == 0:
            await asyncio.sleep(0.01)
        assert await runner.cancel(await store.get_job(job.id))
        while runner.num_running:
            await asyncio.sleep(0.01)
        stored = await store.get_job(job.id)
        assert stored.status == CANCELLED and not stored.result
        assert not await runner.cancel(stored)  # already final: nothing written
    finally:
        await runner.close()


async def test_jobs_past_their_window_expire(store):
    now_s = time.time()
    late = Job(id=new_job_id(), owner="alice", kind="chat", body=b"{}", created_at=now_s - 10, expires_at=now_s - 1)
    await store.add_jobs([late], 100)
    runner = JobRunner(store, CONFIG, ScriptedExecutor(), ScriptedGate(Room(0, True)), _finalize)
    assert await runner.expire_due() == 1
    stored = await store.get_job(late.id)
    assert stored.status == EXPIRED and stored.error["code"] == "batch_expired"


async def test_retry_after_of_a_full_key_is_the_median_run_time_of_the_jobs_that_succeeded_here(store):
    now = [time.time()]

    class SlowExecutor(ScriptedExecutor):
        async def __call__(self, kind, body, request_id, on_admitted):
            now[0] += 2.0 + self.calls  # runs of 2, 3, 4 s on the runner's clock
            return await super().__call__(kind, body, request_id, on_admitted)

    jobs = [await _add(store) for _ in range(3)]
    runner = JobRunner(store, CONFIG, SlowExecutor(), ScriptedGate(), _finalize, clock=lambda: now[0])
    assert runner.retry_after_s(120) == 5  # nothing measured yet

    async def all_succeeded() -> bool:
        return [(await store.get_job(job.id)).status for job in jobs] == [SUCCEEDED] * 3

    await _run_until(runner, all_succeeded)
    assert runner.retry_after_s(120) == 3
    assert runner.retry_after_s(2) == 2  # within admission.max_retry_after_s
