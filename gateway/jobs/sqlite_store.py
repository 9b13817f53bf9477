"""The SQLite job store: one database file in WAL mode, the embedded default (works with nothing else installed).

:class:`SqliteJobStore` is the :class:`~gateway.jobs.store.JobStore` facade over three parts:

- :class:`~gateway.jobs.sqlite_connection.SqliteConnection`: the connection, its dedicated thread (the event loop
  never waits on ``sqlite3``) and ``BEGIN IMMEDIATE`` transactions, so several processes may share the file;
- :class:`~gateway.jobs.sqlite_files.SqliteFileStore`: the files;
- :class:`~gateway.jobs.sqlite_queue.SqliteJobQueue`: the queue, which is the ``jobs`` table itself, and the lease
  of a running job (claim, renew, requeue, finish).

The store itself keeps the job and batch records: adding jobs under the per-owner limit, reading and listing them,
updating batches, the summary and the purge of records whose retention ended. A record past its retention reads as
gone at once (:data:`RETAINED`), though the purge that deletes it runs only every few minutes.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import msgspec

from gateway.jobs.models import (
    BATCH_FINAL_STATUSES,
    CANCELLED,
    EXPIRED,
    FAILED,
    JOB_FINAL_STATUSES,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    Batch,
    FileRecord,
    Job,
    JobsSummary,
)
from gateway.jobs.sqlite_connection import SqliteConnection
from gateway.jobs.sqlite_files import SqliteFileStore
from gateway.jobs.sqlite_queue import SqliteJobQueue
from gateway.jobs.sqlite_schema import (
    ACTIVE_STATUSES,
    JOB_COLUMNS,
    batch_from_row,
    job_from_row,
    job_params,
)
from gateway.jobs.store import JobStore, TooManyJobsError

RETAINED = "(purge_at = 0 OR purge_at >= ?)"  # a job or batch record whose retention has not ended (param: now, s)


class SqliteJobStore(JobStore):
    """The job store in one SQLite file.

    Args:
        path: the database file (created with its tables when missing).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._db = SqliteConnection(self.path)
        self._files = SqliteFileStore(self._db)
        self._queue = SqliteJobQueue(self._db)

    async def open(self) -> None:
        """See :meth:`JobStore.open`: open the file in WAL mode and create the tables."""
        await self._db.open()

    async def close(self) -> None:
        """See :meth:`JobStore.close`."""
        await self._db.close()

    # ----------------------------------------------------------------------------------------------- files

    async def put_file(self, record: FileRecord, content: bytes) -> None:
        """See :meth:`JobStore.put_file`."""
        await self._files.put_file(record, content)

    async def get_file(self, file_id: str) -> FileRecord | None:
        """See :meth:`JobStore.get_file`."""
        return await self._files.get_file(file_id)

    async def get_file_content(self, file_id: str) -> bytes | None:
        """See :meth:`JobStore.get_file_content`."""
        return await self._files.get_file_content(file_id)

    async def list_files(self, owner: str, limit: int, after: str | None,
                         purpose: str | None = None, oldest_first: bool = False) -> tuple[list[FileRecord], bool]:
        """See :meth:`JobStore.list_files`."""
        return await self._files.list_files(owner, limit, after, purpose, oldest_first)

    async def delete_file(self, file_id: str) -> bool:
        """See :meth:`JobStore.delete_file`."""
        return await self._files.delete_file(file_id)

    # ----------------------------------------------------------------------------------------------- jobs

    async def add_jobs(self, jobs: list[Job], max_active_per_owner: int, batch: Batch | None = None) -> None:
        """See :meth:`JobStore.add_jobs`."""
        if not jobs and batch is None:
            return
        owner = jobs[0].owner if jobs else batch.owner
        params = [job_params(job) for job in jobs]
        columns = ", ".join(JOB_COLUMNS)
        placeholders = ", ".join(f":{name}" for name in JOB_COLUMNS)

        def add(conn: sqlite3.Connection) -> None:
            if jobs:
                num_active = conn.execute("SELECT COUNT(*) FROM jobs WHERE owner = ? AND status IN (?, ?)",
                                          (owner, *ACTIVE_STATUSES)).fetchone()[0]
                if num_active + len(jobs) > max_active_per_owner:
                    raise TooManyJobsError(num_active, max_active_per_owner)
                conn.executemany(f"INSERT INTO jobs ({columns}) VALUES ({placeholders})", params)
            if batch is not None:
                conn.execute("INSERT INTO batches (id, owner, status, record) VALUES (?, ?, ?, ?)",
                             (batch.id, batch.owner, batch.status, msgspec.json.encode(batch)))

        await self._db.tx(add)

    async def get_job(self, job_id: str) -> Job | None:
        """See :meth:`JobStore.get_job`."""
        now_s = time.time()
        row = await self._db.run(lambda c: c.execute(f"SELECT * FROM jobs WHERE id = ? AND {RETAINED}",
                                                     (job_id, now_s)).fetchone())
        return None if row is None else job_from_row(row)

    async def list_jobs(self, owner: str, limit: int, after: str | None) -> tuple[list[Job], bool]:
        """See :meth:`JobStore.list_jobs`."""

        def page(conn: sqlite3.Connection) -> list[sqlite3.Row]:
            sql, params = f"SELECT * FROM jobs WHERE owner = ? AND batch_id = '' AND {RETAINED}", [owner, time.time()]
            if after is not None:
                sql += " AND seq < COALESCE((SELECT seq FROM jobs WHERE id = ? AND owner = ?), -1)"
                params += [after, owner]
            sql += " ORDER BY seq DESC LIMIT ?"
            params.append(limit + 1)
            return conn.execute(sql, params).fetchall()

        rows = await self._db.run(page)
        return [job_from_row(row) for row in rows[:limit]], len(rows) > limit

    async def count_active_jobs(self, owner: str) -> int:
        """See :meth:`JobStore.count_active_jobs`."""
        row = await self._db.run(lambda c: c.execute(
            "SELECT COUNT(*) FROM jobs WHERE owner = ? AND status IN (?, ?)", (owner, *ACTIVE_STATUSES)).fetchone())
        return int(row[0])

    async def claim(self, runner_id: str, lease_s: float, now_s: float) -> Job | None:
        """See :meth:`JobStore.claim` and :meth:`SqliteJobQueue.claim`."""
        return await self._queue.claim(runner_id, lease_s, now_s)

    async def renew(self, job_id: str, runner_id: str, lease_s: float, now_s: float) -> bool:
        """See :meth:`JobStore.renew`."""
        return await self._queue.renew(job_id, runner_id, lease_s, now_s)

    async def requeue(self, job_id: str, runner_id: str, refund_attempt: bool = False) -> bool:
        """See :meth:`JobStore.requeue`."""
        return await self._queue.requeue(job_id, runner_id, refund_attempt)

    async def finish(self, job_id: str, status: str, now_s: float, *, result: bytes = b"",
                     error: dict[str, Any] | None = None, status_code: int = 0, request_id: str = "",
                     retention_s: float) -> bool:
        """See :meth:`JobStore.finish`."""
        return await self._queue.finish(job_id, status, now_s, result=result, error=error, status_code=status_code,
                                        request_id=request_id, retention_s=retention_s)

    async def delete_job(self, job_id: str) -> bool:
        """See :meth:`JobStore.delete_job`."""
        final = sorted(JOB_FINAL_STATUSES)
        cursor = await self._db.run(lambda c: c.execute(
            f"DELETE FROM jobs WHERE id = ? AND status IN ({', '.join('?' * len(final))})", (job_id, *final)))
        return cursor.rowcount > 0

    async def summary(self, now_s: float) -> JobsSummary:
        """See :meth:`JobStore.summary`: one ``GROUP BY status`` over the jobs (index ``jobs_ready``) and one count
        of the open batches."""
        final = sorted(BATCH_FINAL_STATUSES)

        def count(conn: sqlite3.Connection) -> tuple[dict[str, int], float | None, int]:
            num_by_status: dict[str, int] = {}
            oldest_created_at: float | None = None
            for row in conn.execute("SELECT status, COUNT(*) AS n, MIN(created_at) AS oldest FROM jobs "
                                    "GROUP BY status"):
                num_by_status[row["status"]] = int(row["n"])
                if row["status"] == QUEUED:
                    oldest_created_at = float(row["oldest"])
            num_batches = conn.execute(
                f"SELECT COUNT(*) FROM batches WHERE status NOT IN ({', '.join('?' * len(final))})",
                final).fetchone()[0]
            return num_by_status, oldest_created_at, int(num_batches)

        num_by_status, oldest_created_at, num_batches = await self._db.run(count)
        oldest_age_s = 0.0 if oldest_created_at is None else max(0.0, now_s - oldest_created_at)
        return JobsSummary(queued=num_by_status.get(QUEUED, 0), running=num_by_status.get(RUNNING, 0),
                           succeeded=num_by_status.get(SUCCEEDED, 0), failed=num_by_status.get(FAILED, 0),
                           cancelled=num_by_status.get(CANCELLED, 0), expired=num_by_status.get(EXPIRED, 0),
                           oldest_queued_age_s=round(oldest_age_s, 3), batches_in_progress=num_batches)

    async def batch_jobs(self, batch_id: str) -> list[Job]:
        """See :meth:`JobStore.batch_jobs`."""
        rows = await self._db.run(lambda c: c.execute(
            "SELECT * FROM jobs WHERE batch_id = ? ORDER BY line", (batch_id,)).fetchall())
        return [job_from_row(row) for row in rows]

    async def due_jobs(self, now_s: float, limit: int) -> list[str]:
        """See :meth:`JobStore.due_jobs`."""
        rows = await self._db.run(lambda c: c.execute(
            "SELECT id FROM jobs WHERE status IN (?, ?) AND expires_at > 0 AND expires_at < ? LIMIT ?",
            (*ACTIVE_STATUSES, now_s, limit)).fetchall())
        return [row["id"] for row in rows]

    # ----------------------------------------------------------------------------------------------- batches

    async def get_batch(self, batch_id: str) -> Batch | None:
        """See :meth:`JobStore.get_batch`."""
        now_s = time.time()
        row = await self._db.run(lambda c: c.execute(f"SELECT * FROM batches WHERE id = ? AND {RETAINED}",
                                                     (batch_id, now_s)).fetchone())
        return None if row is None else batch_from_row(row)

    async def list_batches(self, owner: str, limit: int, after: str | None) -> tuple[list[Batch], bool]:
        """See :meth:`JobStore.list_batches`."""

        def page(conn: sqlite3.Connection) -> list[sqlite3.Row]:
            sql, params = f"SELECT * FROM batches WHERE owner = ? AND {RETAINED}", [owner, time.time()]
            if after is not None:
                sql += " AND seq < COALESCE((SELECT seq FROM batches WHERE id = ? AND owner = ?), -1)"
                params += [after, owner]
            sql += " ORDER BY seq DESC LIMIT ?"
            params.append(limit + 1)
            return conn.execute(sql, params).fetchall()

        rows = await self._db.run(page)
        return [batch_from_row(row) for row in rows[:limit]], len(rows) > limit

    async def update_batch(self, batch_id: str, expected_statuses: frozenset[str], retention_s: float,
                           **fields: Any) -> Batch | None:
        """See :meth:`JobStore.update_batch`."""

        def update(conn: sqlite3.Connection) -> Batch | None:
            row = conn.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row["status"] not in expected_statuses:
                return None
            batch = msgspec.structs.replace(batch_from_row(row), **fields)
            purge_at = 0.0
            if batch.status in BATCH_FINAL_STATUSES:
                purge_at = max(batch.completed_at, batch.failed_at, batch.expired_at, batch.cancelled_at) + retention_s
            conn.execute("UPDATE batches SET status = ?, record = ?, purge_at = ? WHERE id = ?",
                         (batch.status, msgspec.json.encode(batch), purge_at, batch_id))
            return batch

        return await self._db.tx(update)

    async def open_batch_ids(self) -> list[str]:
        """See :meth:`JobStore.open_batch_ids`."""
        final = sorted(BATCH_FINAL_STATUSES)
        rows = await self._db.run(lambda c: c.execute(
            f"SELECT id FROM batches WHERE status NOT IN ({', '.join('?' * len(final))}) ORDER BY seq",
            final).fetchall())
        return [row["id"] for row in rows]

    async def purge(self, now_s: float) -> int:
        """See :meth:`JobStore.purge`."""

        def purge(conn: sqlite3.Connection) -> int:
            removed = conn.execute("DELETE FROM jobs WHERE purge_at > 0 AND purge_at < ?", (now_s,)).rowcount
            removed += conn.execute("DELETE FROM batches WHERE purge_at > 0 AND purge_at < ?", (now_s,)).rowcount
            removed += conn.execute("DELETE FROM files WHERE expires_at > 0 AND expires_at < ?", (now_s,)).rowcount
            return removed

        return await self._db.tx(purge)
