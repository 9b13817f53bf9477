"""The job store interface: files, jobs (a durable queue with leases) and batches, behind one small API.

Two implementations: :class:`~gateway.jobs.sqlite_store.SqliteJobStore` (a file, the embedded default) and
:class:`~gateway.jobs.redis_store.RedisJobStore` (streams with a consumer group for the queue, hashes for state;
several gateways share one queue). ``tests/gateway/test_jobs_store.py`` runs one suite against both.

Guarantees every implementation keeps:

- **At-least-once execution.** :meth:`JobStore.claim` hands a queued job to one runner with a lease of
  ``lease_s`` seconds; the runner renews it (:meth:`JobStore.renew`) while the job runs. A job whose lease ran out
  (its runner died) is handed out again by a later ``claim`` — to any gateway sharing the store.
- **One result per job.** :meth:`JobStore.finish` writes a final state only when the job has none yet: the first
  writer wins and later writers get ``False`` (a runner that lost its lease, a cancel racing a result).
- **Exact batch counts.** The batch's completed / failed counters change in the same atomic step as the job's final
  state, so they count every line exactly once.
- **Limits.** :meth:`JobStore.add_jobs` checks the owner's unfinished jobs against the limit in the same atomic
  step as it adds them (SQLite) or reserves them first (Redis).
"""

from __future__ import annotations

import abc
from typing import Any

import redis.exceptions

from gateway.jobs.models import Batch, FileRecord, Job, JobsSummary

# A store that cannot be reached for now (Redis stopped, restarting or unreachable): 503, not a bug.
STORE_UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (redis.exceptions.ConnectionError,
                                                             redis.exceptions.TimeoutError)


class TooManyJobsError(Exception):
    """Adding the jobs would take the owner past ``max_jobs_per_key`` unfinished jobs.

    Attributes:
        num_active: the owner's unfinished (queued or running) jobs now.
        limit: the limit.
    """

    def __init__(self, num_active: int, limit: int) -> None:
        super().__init__(f"{num_active} unfinished jobs, limit {limit}")
        self.num_active = num_active
        self.limit = limit


class JobStore(abc.ABC):
    """Durable storage of files, jobs and batches, and the job queue. Every method is a coroutine."""

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect and create what is missing (tables, consumer groups)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections and threads."""

    # ----------------------------------------------------------------------------------------------- files

    @abc.abstractmethod
    async def put_file(self, record: FileRecord, content: bytes) -> None:
        """Store a file and its content; an existing file with the same id is replaced (idempotent re-writes)."""

    @abc.abstractmethod
    async def get_file(self, file_id: str) -> FileRecord | None:
        """Return a file's record, or None."""

    @abc.abstractmethod
    async def get_file_content(self, file_id: str) -> bytes | None:
        """Return a file's content, or None."""

    @abc.abstractmethod
    async def list_files(self, owner: str, limit: int, after: str | None,
                         purpose: str | None = None, oldest_first: bool = False) -> tuple[list[FileRecord], bool]:
        """Return one page of the owner's files, newest first (or oldest first), and whether more follow.

        Args:
            owner: the owner.
            limit: most records to return, ≥ 1.
            after: the id of the last record of the previous page (cursor), or None for the first page.
            purpose: only files with this purpose, or None for all.
            oldest_first: ascending creation order (OpenAI's ``order=asc``).
        """

    @abc.abstractmethod
    async def delete_file(self, file_id: str) -> bool:
        """Delete a file; return whether it existed."""

    # ----------------------------------------------------------------------------------------------- jobs

    @abc.abstractmethod
    async def add_jobs(self, jobs: list[Job], max_active_per_owner: int, batch: Batch | None = None) -> None:
        """Add queued jobs (all of one owner), and their batch if given, atomically.

        Raises:
            TooManyJobsError: the owner would have more than ``max_active_per_owner`` unfinished jobs; nothing
                was added.
        """

    @abc.abstractmethod
    async def get_job(self, job_id: str) -> Job | None:
        """Return a job, or None."""

    @abc.abstractmethod
    async def list_jobs(self, owner: str, limit: int, after: str | None) -> tuple[list[Job], bool]:
        """Return one page of the owner's native jobs (not batch lines), newest first, and whether more follow."""

    @abc.abstractmethod
    async def count_active_jobs(self, owner: str) -> int:
        """Return the owner's unfinished (queued or running) jobs, batch lines included."""

    @abc.abstractmethod
    async def claim(self, runner_id: str, lease_s: float, now_s: float) -> Job | None:
        """Hand the next job to ``runner_id`` and mark it running with a lease until ``now_s + lease_s``.

        Order: a running job whose lease expired (its runner died) first, then queued jobs by priority (larger
        first), then age. Increments ``attempts``; sets ``started_at`` on the first start.

        Returns:
            The claimed job (as stored after the claim), or None when nothing is ready.
        """

    @abc.abstractmethod
    async def renew(self, job_id: str, runner_id: str, lease_s: float, now_s: float) -> bool:
        """Extend the lease of a running job held by ``runner_id``.

        Returns:
            False when the runner no longer holds it: it reached a final state (cancelled, expired) or its lease
            expired and another runner claimed it. The runner must stop working on it.
        """

    @abc.abstractmethod
    async def requeue(self, job_id: str, runner_id: str, refund_attempt: bool = False) -> bool:
        """Put a running job held by ``runner_id`` back in the queue (a transient failure); return whether it was.

        Args:
            refund_attempt: the run never reached a worker (shed by admission, shutdown): take back the attempt
                :meth:`claim` counted.
        """

    @abc.abstractmethod
    async def finish(self, job_id: str, status: str, now_s: float, *, result: bytes = b"",
                     error: dict[str, Any] | None = None, status_code: int = 0, request_id: str = "",
                     retention_s: float) -> bool:
        """Write a job's final state (``succeeded``, ``failed``, ``cancelled`` or ``expired``) once.

        Also counts the line in its batch (``succeeded`` → completed, any other → failed) and takes the job out of
        the queue.

        Args:
            retention_s: seconds after ``now_s`` the finished job is deleted.

        Returns:
            True when this call wrote the final state; False when the job already had one (first writer wins) or
            does not exist.
        """

    @abc.abstractmethod
    async def delete_job(self, job_id: str) -> bool:
        """Delete a finished job now (before its retention ends); return whether a finished job went.

        An unfinished job is left alone (cancel it first): the call returns False.
        """

    @abc.abstractmethod
    async def summary(self, now_s: float) -> JobsSummary:
        """Return the counts of jobs by status and of batches in progress, over the whole store.

        Args:
            now_s: Unix seconds, for ``oldest_queued_age_s``.
        """

    @abc.abstractmethod
    async def batch_jobs(self, batch_id: str) -> list[Job]:
        """Return the jobs of a batch in line order."""

    @abc.abstractmethod
    async def due_jobs(self, now_s: float, limit: int) -> list[str]:
        """Return ids of up to ``limit`` unfinished jobs whose ``expires_at`` is before ``now_s``."""

    # ----------------------------------------------------------------------------------------------- batches

    @abc.abstractmethod
    async def get_batch(self, batch_id: str) -> Batch | None:
        """Return a batch (with its current counts), or None."""

    @abc.abstractmethod
    async def list_batches(self, owner: str, limit: int, after: str | None) -> tuple[list[Batch], bool]:
        """Return one page of the owner's batches, newest first, and whether more follow."""

    @abc.abstractmethod
    async def update_batch(self, batch_id: str, expected_statuses: frozenset[str], retention_s: float,
                           **fields: Any) -> Batch | None:
        """Set fields of a batch if its status is one of ``expected_statuses`` (compare-and-set).

        Args:
            retention_s: when the new status is final, the batch is deleted this many seconds later.
            fields: :class:`~gateway.jobs.models.Batch` attributes to set (not the counters).

        Returns:
            The updated batch, or None when it does not exist or its status was not expected.
        """

    @abc.abstractmethod
    async def open_batch_ids(self) -> list[str]:
        """Return ids of batches not in a final status (to finalize when all their lines are done)."""

    @abc.abstractmethod
    async def purge(self, now_s: float) -> int:
        """Delete finished jobs, final batches and files whose retention ended; return how many records went."""
