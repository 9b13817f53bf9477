"""The job runner: claims jobs from the store and runs them on capacity the interactive tiers leave idle.

One runner per gateway. Its tasks (all owned by :class:`JobRunner`; :meth:`JobRunner.close` cancels them)::

    claim loop ── room? (IdleCapacity) ── claim ── run task per job ── execute (admission as the lowest tier)
    heartbeat  ── every lease/3: renew each running job's lease; lost → abort it on its worker
    upkeep     ── expire jobs past their window, finalize batches whose lines are all done, purge old records

**Work-conserving, interactive first** (peak shaving, valley filling). A job is claimed only when
:class:`IdleCapacity` finds room: no request of any tier waits in admission, no worker reports waiting sequences,
the pressure level does not shed the jobs' tier, and a ready worker has a free sequence slot and free KV — and no
request has been seen waiting for ``jobs.idle_grace_s`` (so a job does not grab the slot freed in the millisecond
between two interactive requests of a saturating load). The claimed job then goes through admission in the lowest
tier, so an interactive arrival still takes the next free slot before it. An idle GPU takes jobs at once (one claim
per free slot), and under an interactive load that keeps the workers full, no job starts.

**At-least-once, one result.** A job runs under a lease renewed by the heartbeat. A runner that dies (kill -9)
stops renewing and any gateway's runner claims the job again after ``jobs.lease_timeout_s``. A transient failure
(worker lost, shed by admission, timeout: a 5xx) puts the job back in the queue until it was started
``jobs.max_attempts`` times; a client error (4xx) fails it at once. The final state is written once by
:meth:`JobStore.finish` (first writer wins), so a cancel racing a result, or two runners racing after a lease
expiry, leave exactly one outcome. On a clean shutdown the runner puts its running jobs back in the queue.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
import structlog

from gateway.aio import wait_event
from gateway.jobs.idle_capacity import IdleCapacity
from gateway.jobs.models import (
    CANCELLED,
    EXPIRED,
    FAILED,
    SUCCEEDED,
    Job,
)
from gateway.jobs.store import STORE_UNAVAILABLE_ERRORS, JobStore
from shared.config import JobsConfig
from shared.errors import ErrorCode, SluiceError

log = structlog.get_logger("sluice.gateway.jobs")

SECONDS_PER_DAY = 86400.0
UPKEEP_INTERVAL_S = 1.0
PURGE_INTERVAL_S = 300.0
EXPIRE_BATCH_SIZE = 512
TRANSIENT_BACKOFF_S = 1.0
RUN_TIMES_KEPT = 32  # the run times of the jobs that finished last here, for Retry-After
RETRY_AFTER_UNMEASURED_S = 5.0  # Retry-After of a full key before any job finished here (as store_unavailable's)
STORE_ERROR_BACKOFF_S = 1.0  # the first wait after a store error; doubled on each one after, up to the next
MAX_STORE_ERROR_BACKOFF_S = 16.0

# (kind, body JSON bytes, request id, on_admitted) → the response body (chat.completion / text_completion)
Executor = Callable[[str, bytes, str, Callable[[], None]], Awaitable[dict[str, Any]]]


class StoreOutage:
    """The runner's view of a store that fails: one warning when an outage starts (the operation and the error, no
    traceback: a Redis that is away is not a bug) and one line when the store answers again, and the backoff before
    the next try, :data:`STORE_ERROR_BACKOFF_S` doubling to :data:`MAX_STORE_ERROR_BACKOFF_S`. Any other error is a
    bug: logged with its traceback each time, with the same backoff.

    Attributes:
        failing: the last store operation failed.
        num_errors: store errors since start.
    """

    def __init__(self) -> None:
        self.failing = False
        self.num_errors = 0
        self._backoff_s = STORE_ERROR_BACKOFF_S

    def failed(self, operation: str, exc: Exception) -> float:
        """Note that ``operation`` failed with ``exc``; return the seconds to wait before the next try."""
        self.num_errors += 1
        if not isinstance(exc, STORE_UNAVAILABLE_ERRORS):
            log.warning("job_store_error", operation=operation, exc_info=exc)
        elif not self.failing:
            log.warning("job_store_unreachable", operation=operation, error=f"{type(exc).__name__}: {exc}")
        if self.failing:
            self._backoff_s = min(MAX_STORE_ERROR_BACKOFF_S, 2 * self._backoff_s)
        self.failing = True
        return self._backoff_s

    def succeeded(self) -> None:
        """Note that a store operation succeeded: an outage, if any, is over."""
        if self.failing:
            log.info("job_store_reachable_again", errors=self.num_errors)
            self.failing = False
            self._backoff_s = STORE_ERROR_BACKOFF_S


class BatchFinalizer(Protocol):
    """Finalizes a batch whose lines are all done (see :mod:`gateway.jobs.batches`)."""

    async def __call__(self, batch_id: str) -> None: ...


class JobRunner:
    """Claim and run jobs on idle capacity; keep their leases; expire, finalize and purge.

    Args:
        store: the job store (opened).
        config: the ``[jobs]`` config.
        execute: runs one job's request through the gateway's own completion path (admission, caps, workers).
        capacity: the idle-capacity gate.
        finalize_batch: called after a batch line finishes and periodically for every open batch.
        clock: Unix time in seconds (records use wall-clock time: they are shared across processes).
        on_finished: called with ``succeeded`` or ``failed`` each time this runner writes a job's result
            (the ``sluice_jobs_finished_total`` counter).
    """

    def __init__(self, store: JobStore, config: JobsConfig, execute: Executor, capacity: IdleCapacity,
                 finalize_batch: BatchFinalizer, clock: Callable[[], float] = time.time,
                 on_finished: Callable[[str], None] = lambda status: None) -> None:
        self.store = store
        self.config = config
        self.runner_id = f"runner-{uuid.uuid4().hex[:12]}"
        self._execute = execute
        self._capacity = capacity
        self._finalize_batch = finalize_batch
        self._clock = clock
        self._on_finished = on_finished
        self._running: dict[str, asyncio.Task[None]] = {}  # job id → its run task
        self._unadmitted: set[str] = set()  # running here, not yet holding room on a worker
        self._cancelled_here: set[str] = set()  # jobs whose final state someone else wrote (cancel, lease lost)
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._paused_until_s = 0.0
        self._closing = False
        self.num_started = 0
        self.num_succeeded = 0
        self.num_failed = 0
        self.num_requeued = 0
        self._run_times_s: deque[float] = deque(maxlen=RUN_TIMES_KEPT)  # claim to success, seconds
        self.store_outage = StoreOutage()  # claims, lease renewals and upkeep that fail

    @property
    def retention_s(self) -> float:
        return self.config.result_retention_days * SECONDS_PER_DAY

    @property
    def num_running(self) -> int:
        return len(self._running)

    def retry_after_s(self, max_s: int) -> int:
        """``Retry-After`` for a key at ``jobs.max_jobs_per_key``: the median run time (claim to success) of the
        last :data:`RUN_TIMES_KEPT` jobs that succeeded here, rounded up, within [1, ``max_s``] (one of the key's
        jobs is running or queued, so about that long passes before the next can be added);
        :data:`RETRY_AFTER_UNMEASURED_S` before any did.

        Args:
            max_s: the ceiling (``admission.max_retry_after_s``).
        """
        measured_s = statistics.median(self._run_times_s) if self._run_times_s else RETRY_AFTER_UNMEASURED_S
        return min(max_s, max(1, math.ceil(measured_s)))

    def start(self) -> None:
        """Start the claim, heartbeat and upkeep tasks."""
        for coro, name in ((self._claim_loop(), "jobs-claim"), (self._heartbeat_loop(), "jobs-heartbeat"),
                           (self._upkeep_loop(), "jobs-upkeep")):
            self._tasks.append(asyncio.create_task(coro, name=name))

    async def close(self) -> None:
        """Stop claiming, put the jobs running here back in the queue, and stop every task."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        running = list(self._running.items())
        for _, task in running:
            task.cancel()
        await asyncio.gather(*(task for _, task in running), return_exceptions=True)
        for job_id, _ in running:
            try:
                if await self.store.requeue(job_id, self.runner_id, refund_attempt=True):
                    self.num_requeued += 1
            except Exception:  # the store is gone: the lease expires and another runner takes the job
                log.warning("job_requeue_failed", job_id=job_id, exc_info=True)

    def notify(self) -> None:
        """A job was submitted or capacity freed: look for work now instead of at the next poll."""
        self._wake.set()

    def abort_local(self, job_id: str) -> bool:
        """Stop a job running in this gateway whose final state was already written (cancel); return if it ran."""
        task = self._running.get(job_id)
        if task is None:
            return False
        self._cancelled_here.add(job_id)
        task.cancel()
        return True

    def snapshot(self) -> dict[str, Any]:
        """Return the runner's counters (for ``/status``)."""
        return {"runner_id": self.runner_id, "running": len(self._running), "started": self.num_started,
                "succeeded": self.num_succeeded, "failed": self.num_failed, "requeued": self.num_requeued}

    # ----------------------------------------------------------------------------------------------- claiming

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        await wait_event(self._wake, seconds)

    async def _claim_loop(self) -> None:
        poll_s = self.config.poll_interval_s
        idle_since_s: float | None = None  # since when no request has been seen waiting; None while one waits
        while True:
            now_s = self._clock()
            if now_s < self._paused_until_s:
                await asyncio.sleep(self._paused_until_s - now_s)
                continue
            seen = self._capacity.room_for_jobs()
            if seen.waiting:
                idle_since_s = None  # interactive demand: the grace period starts again once it is gone
                await self._sleep(poll_s)
                continue
            room = min(seen.num_slots - len(self._unadmitted), self.config.max_concurrent_jobs - len(self._running))
            if room <= 0:
                await self._sleep(poll_s)
                continue
            if idle_since_s is None:
                idle_since_s = now_s
            if now_s - idle_since_s < self.config.idle_grace_s:
                await asyncio.sleep(min(poll_s, self.config.idle_grace_s - (now_s - idle_since_s)))
                continue
            try:
                job = await self.store.claim(self.runner_id, self.config.lease_timeout_s, self._clock())
            except Exception as exc:
                await asyncio.sleep(self.store_outage.failed("claim", exc))
                continue
            self.store_outage.succeeded()
            if job is None:
                await self._sleep(poll_s)
                continue
            if job.attempts > self.config.max_attempts:
                await self._fail(job, 500, {"code": "max_attempts_exceeded", "message":
                                            f"the job was started {job.attempts - 1} times without finishing "
                                            f"(jobs.max_attempts = {self.config.max_attempts})"})
                continue
            self._start_job(job)
            await asyncio.sleep(0)  # let the job's task register with admission before the next look

    def _start_job(self, job: Job) -> None:
        self.num_started += 1
        task = asyncio.create_task(self._run(job), name=f"job-{job.id}")
        self._running[job.id] = task
        self._unadmitted.add(job.id)

    # ----------------------------------------------------------------------------------------------- running

    async def _run(self, job: Job) -> None:
        claimed_s = self._clock()
        request_id = uuid.uuid4().hex
        log.info("job_started", job_id=job.id, batch_id=job.batch_id or None, attempt=job.attempts,
                 request_id=request_id, runner=self.runner_id)
        try:
            try:
                response = await self._execute(job.kind, job.body, request_id,
                                               lambda: self._unadmitted.discard(job.id))
            except asyncio.CancelledError:
                if job.id in self._cancelled_here or self._closing:
                    return  # cancelled / lease lost (the final state is someone else's), or shutdown (requeued)
                raise
            except SluiceError as exc:
                await self._on_error(job, exc, request_id, admitted=job.id not in self._unadmitted)
                return
            except Exception:
                log.exception("job_internal_error", job_id=job.id, request_id=request_id)
                await self._on_error(job, SluiceError(ErrorCode.INTERNAL, f"internal error (request id "
                                                      f"{request_id})"), request_id, admitted=True)
                return
            written = await self.store.finish(job.id, SUCCEEDED, self._clock(),
                                              result=msgspec.json.encode(response), status_code=200,
                                              request_id=request_id, retention_s=self.retention_s)
            if written:
                self.num_succeeded += 1
                self._run_times_s.append(self._clock() - claimed_s)
                self._on_finished(SUCCEEDED)
            log.info("job_finished", job_id=job.id, status=SUCCEEDED if written else "lost_race",
                     request_id=request_id)
            if job.batch_id:
                await self._finalize_batch(job.batch_id)
        except Exception:
            log.exception("job_store_error", job_id=job.id)
        finally:
            self._running.pop(job.id, None)
            self._unadmitted.discard(job.id)
            self._cancelled_here.discard(job.id)
            self.notify()

    async def _on_error(self, job: Job, exc: SluiceError, request_id: str, admitted: bool) -> None:
        """A 5xx is transient: back to the queue (a shed before any worker was reached does not use up an
        attempt, nor does ``server_draining``: the gateway shutting down ended it, as a shutdown's cancellation
        does), and a short pause in claiming. A 4xx, or a 5xx on the last attempt, fails the job."""
        transient = exc.status >= 500 or exc.code is ErrorCode.RATE_LIMIT_EXCEEDED
        admitted = admitted and exc.code is not ErrorCode.DRAINING
        if transient and (not admitted or job.attempts < self.config.max_attempts):
            if await self.store.requeue(job.id, self.runner_id, refund_attempt=not admitted):
                self.num_requeued += 1
                self._paused_until_s = self._clock() + max(TRANSIENT_BACKOFF_S, self.config.poll_interval_s)
            log.info("job_requeued", job_id=job.id, code=exc.code.value, attempt=job.attempts, admitted=admitted,
                     request_id=request_id)
            return
        await self._fail(job, exc.status, dict(exc.envelope()["error"]), request_id)

    async def _fail(self, job: Job, status_code: int, error: dict[str, Any], request_id: str = "") -> None:
        written = await self.store.finish(job.id, FAILED, self._clock(), error=error, status_code=status_code,
                                          request_id=request_id, retention_s=self.retention_s)
        if written:
            self.num_failed += 1
            self._on_finished(FAILED)
        log.info("job_finished", job_id=job.id, status=FAILED if written else "lost_race", code=error.get("code"),
                 request_id=request_id or None)
        if job.batch_id:
            await self._finalize_batch(job.batch_id)

    # ----------------------------------------------------------------------------------------------- leases

    async def _heartbeat_loop(self) -> None:
        interval_s = max(0.05, self.config.lease_timeout_s / 3)
        while True:
            await asyncio.sleep(interval_s)
            for job_id in list(self._running):
                try:
                    held = await self.store.renew(job_id, self.runner_id, self.config.lease_timeout_s,
                                                  self._clock())
                except Exception as exc:
                    self.store_outage.failed("renew", exc)  # the next beat tries again: the lease outlasts two
                    continue
                if not held:  # cancelled, expired, or taken over after our lease ran out
                    log.info("job_lease_lost", job_id=job_id, runner=self.runner_id)
                    self.abort_local(job_id)

    # ----------------------------------------------------------------------------------------------- upkeep

    async def _upkeep_loop(self) -> None:
        next_purge_s = 0.0
        while True:
            wait_s = max(UPKEEP_INTERVAL_S, self.config.poll_interval_s)
            try:
                await self.expire_due()
                for batch_id in await self.store.open_batch_ids():
                    await self._finalize_batch(batch_id)
                now_s = self._clock()
                if now_s >= next_purge_s:
                    next_purge_s = now_s + PURGE_INTERVAL_S
                    removed = await self.store.purge(now_s)
                    if removed:
                        log.info("jobs_purged", records=removed)
            except Exception as exc:
                wait_s = max(wait_s, self.store_outage.failed("upkeep", exc))
            else:
                self.store_outage.succeeded()
            await asyncio.sleep(wait_s)

    async def expire_due(self) -> int:
        """Mark unfinished jobs past their completion window ``expired``; return how many this call marked."""
        num_expired = 0
        for job_id in await self.store.due_jobs(self._clock(), EXPIRE_BATCH_SIZE):
            written = await self.store.finish(
                job_id, EXPIRED, self._clock(), retention_s=self.retention_s,
                error={"code": "batch_expired", "message": "the job did not run within its completion window"})
            if written:
                num_expired += 1
                self.abort_local(job_id)
        return num_expired

    async def cancel(self, job: Job, message: str = "cancelled by the client") -> bool:
        """Cancel a job in any state: write ``cancelled`` unless it is final, and abort it if it runs here.

        A job running in another gateway stops at that gateway's next heartbeat (within ``lease_timeout_s / 3``).

        Returns:
            True when this call wrote the final state.
        """
        written = await self.store.finish(job.id, CANCELLED, self._clock(), retention_s=self.retention_s,
                                          error={"code": "cancelled", "message": message})
        if written:
            self.abort_local(job.id)
        return written
