"""The SQLite job store: one database file in WAL mode, the embedded default (works with nothing else installed).

Every call runs on one dedicated thread that owns the connection (``sqlite3`` is blocking; the event loop never
waits on it). Multi-statement changes run inside ``BEGIN IMMEDIATE`` transactions, so several processes may share
the file (SQLite's own locking; ``busy_timeout`` waits for the lock).

The queue is the ``jobs`` table itself: :meth:`claim` picks, in one transaction, the oldest expired lease or else
the best queued job (index ``jobs_ready``: status, priority, seq) and marks it running with a lease.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import sqlite3
from pathlib import Path
from typing import Any, Callable, TypeVar

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
from gateway.jobs.sqlite_schema import (
    ACTIVE_STATUSES,
    JOB_COLUMNS,
    SCHEMA,
    batch_from_row,
    job_from_row,
    job_params,
)
from gateway.jobs.store import JobStore, TooManyJobsError

T = TypeVar("T")

BUSY_TIMEOUT_MS = 10000

class SqliteJobStore(JobStore):
    """The job store in one SQLite file.

    Args:
        path: the database file (created with its tables when missing).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None

    # ----------------------------------------------------------------------------------------------- plumbing

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._executor is None or self._conn is None:
            raise RuntimeError("the SQLite job store is not open")
        conn = self._conn
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, conn)

    @staticmethod
    def _transaction(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn(conn)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return result

    async def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await self._run(lambda conn: self._transaction(conn, fn))

    async def open(self) -> None:
        """See :meth:`JobStore.open`: open the file in WAL mode and create the tables."""
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-jobs-db")

        def connect() -> sqlite3.Connection:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable across process crashes
            conn.executescript(SCHEMA)
            return conn

        self._conn = await asyncio.get_running_loop().run_in_executor(self._executor, connect)

    async def close(self) -> None:
        """See :meth:`JobStore.close`."""
        if self._executor is None:
            return
        conn, self._conn = self._conn, None
        if conn is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, conn.close)
        self._executor.shutdown(wait=True)
        self._executor = None

    # ----------------------------------------------------------------------------------------------- files

    async def put_file(self, record: FileRecord, content: bytes) -> None:
        """See :meth:`JobStore.put_file`."""
        encoded = msgspec.json.encode(record)

        def put(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO files (id, owner, purpose, expires_at, record, content) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET record = excluded.record, content = excluded.content, "
                "expires_at = excluded.expires_at",
                (record.id, record.owner, record.purpose, record.expires_at, encoded, content))

        await self._run(put)

    async def get_file(self, file_id: str) -> FileRecord | None:
        """See :meth:`JobStore.get_file`."""
        row = await self._run(lambda c: c.execute("SELECT record FROM files WHERE id = ?", (file_id,)).fetchone())
        return None if row is None else msgspec.json.decode(row["record"], type=FileRecord)

    async def get_file_content(self, file_id: str) -> bytes | None:
        """See :meth:`JobStore.get_file_content`."""
        row = await self._run(lambda c: c.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone())
        return None if row is None else bytes(row["content"])

    async def list_files(self, owner: str, limit: int, after: str | None,
                         purpose: str | None = None, oldest_first: bool = False) -> tuple[list[FileRecord], bool]:
        """See :meth:`JobStore.list_files`."""

        def page(conn: sqlite3.Connection) -> list[sqlite3.Row]:
            sql, params = "SELECT record FROM files WHERE owner = ?", [owner]
            if purpose is not None:
                sql += " AND purpose = ?"
                params.append(purpose)
            if after is not None:
                # an unknown cursor matches nothing, in either order
                sql += (" AND seq > COALESCE((SELECT seq FROM files WHERE id = ? AND owner = ?), 1e18)" if oldest_first
                        else " AND seq < COALESCE((SELECT seq FROM files WHERE id = ? AND owner = ?), -1)")
                params += [after, owner]
            sql += " ORDER BY seq ASC LIMIT ?" if oldest_first else " ORDER BY seq DESC LIMIT ?"
            params.append(limit + 1)
            return conn.execute(sql, params).fetchall()

        rows = await self._run(page)
        records = [msgspec.json.decode(row["record"], type=FileRecord) for row in rows[:limit]]
        return records, len(rows) > limit

    async def delete_file(self, file_id: str) -> bool:
        """See :meth:`JobStore.delete_file`."""
        cursor = await self._run(lambda c: c.execute("DELETE FROM files WHERE id = ?", (file_id,)))
        return cursor.rowcount > 0

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
                num_active = conn.execute(
                    "SELECT COUNT(*) FROM jobs WHERE owner = ? AND status IN (?, ?)", (owner, *ACTIVE_STATUSES)).fetchone()[0]
                if num_active + len(jobs) > max_active_per_owner:
                    raise TooManyJobsError(num_active, max_active_per_owner)
                conn.executemany(f"INSERT INTO jobs ({columns}) VALUES ({placeholders})", params)
            if batch is not None:
                conn.execute("INSERT INTO batches (id, owner, status, record) VALUES (?, ?, ?, ?)",
                             (batch.id, batch.owner, batch.status, msgspec.json.encode(batch)))

        await self._tx(add)

    async def get_job(self, job_id: str) -> Job | None:
        """See :meth:`JobStore.get_job`."""
        row = await self._run(lambda c: c.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())
        return None if row is None else job_from_row(row)

    async def list_jobs(self, owner: str, limit: int, after: str | None) -> tuple[list[Job], bool]:
        """See :meth:`JobStore.list_jobs`."""

        def page(conn: sqlite3.Connection) -> list[sqlite3.Row]:
            sql, params = "SELECT * FROM jobs WHERE owner = ? AND batch_id = ''", [owner]
            if after is not None:
                sql += " AND seq < COALESCE((SELECT seq FROM jobs WHERE id = ? AND owner = ?), -1)"
                params += [after, owner]
            sql += " ORDER BY seq DESC LIMIT ?"
            params.append(limit + 1)
            return conn.execute(sql, params).fetchall()

        rows = await self._run(page)
        return [job_from_row(row) for row in rows[:limit]], len(rows) > limit

    async def count_active_jobs(self, owner: str) -> int:
        """See :meth:`JobStore.count_active_jobs`."""
        row = await self._run(lambda c: c.execute(
            "SELECT COUNT(*) FROM jobs WHERE owner = ? AND status IN (?, ?)", (owner, *ACTIVE_STATUSES)).fetchone())
        return int(row[0])

    async def claim(self, runner_id: str, lease_s: float, now_s: float) -> Job | None:
        """See :meth:`JobStore.claim`."""

        def claim(conn: sqlite3.Connection) -> sqlite3.Row | None:
            row = conn.execute(
                "SELECT seq FROM jobs WHERE status = ? AND lease_expires_at < ? ORDER BY lease_expires_at LIMIT 1",
                (RUNNING, now_s)).fetchone()
            if row is None:
                row = conn.execute("SELECT seq FROM jobs WHERE status = ? ORDER BY priority DESC, seq LIMIT 1",
                                   (QUEUED,)).fetchone()
            if row is None:
                return None
            return conn.execute(
                "UPDATE jobs SET status = ?, lease_owner = ?, lease_expires_at = ?, attempts = attempts + 1, "
                "started_at = CASE WHEN started_at = 0 THEN ? ELSE started_at END WHERE seq = ? RETURNING *",
                (RUNNING, runner_id, now_s + lease_s, now_s, row["seq"])).fetchone()

        row = await self._tx(claim)
        return None if row is None else job_from_row(row)

    async def renew(self, job_id: str, runner_id: str, lease_s: float, now_s: float) -> bool:
        """See :meth:`JobStore.renew`."""
        cursor = await self._run(lambda c: c.execute(
            "UPDATE jobs SET lease_expires_at = ? WHERE id = ? AND status = ? AND lease_owner = ?",
            (now_s + lease_s, job_id, RUNNING, runner_id)))
        return cursor.rowcount > 0

    async def requeue(self, job_id: str, runner_id: str, refund_attempt: bool = False) -> bool:
        """See :meth:`JobStore.requeue`."""
        cursor = await self._run(lambda c: c.execute(
            "UPDATE jobs SET status = ?, lease_owner = '', lease_expires_at = 0, attempts = attempts - ? "
            "WHERE id = ? AND status = ? AND lease_owner = ?",
            (QUEUED, int(refund_attempt), job_id, RUNNING, runner_id)))
        return cursor.rowcount > 0

    async def finish(self, job_id: str, status: str, now_s: float, *, result: bytes = b"",
                     error: dict[str, Any] | None = None, status_code: int = 0, request_id: str = "",
                     retention_s: float) -> bool:
        """See :meth:`JobStore.finish`."""
        error_json = None if error is None else json.dumps(error)

        def finish(conn: sqlite3.Connection) -> bool:
            row = conn.execute(
                "UPDATE jobs SET status = ?, finished_at = ?, result = ?, error = ?, status_code = ?, "
                "request_id = ?, lease_owner = '', lease_expires_at = 0, purge_at = ? "
                "WHERE id = ? AND status IN (?, ?) RETURNING batch_id",
                (status, now_s, result, error_json, status_code, request_id, now_s + retention_s, job_id,
                 *ACTIVE_STATUSES)).fetchone()
            if row is None:
                return False
            if row["batch_id"]:
                counter = "num_completed" if status == SUCCEEDED else "num_failed"
                conn.execute(f"UPDATE batches SET {counter} = {counter} + 1 WHERE id = ?", (row["batch_id"],))
            return True

        return await self._tx(finish)

    async def delete_job(self, job_id: str) -> bool:
        """See :meth:`JobStore.delete_job`."""
        final = sorted(JOB_FINAL_STATUSES)
        cursor = await self._run(lambda c: c.execute(
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

        num_by_status, oldest_created_at, num_batches = await self._run(count)
        oldest_age_s = 0.0 if oldest_created_at is None else max(0.0, now_s - oldest_created_at)
        return JobsSummary(queued=num_by_status.get(QUEUED, 0), running=num_by_status.get(RUNNING, 0),
                           succeeded=num_by_status.get(SUCCEEDED, 0), failed=num_by_status.get(FAILED, 0),
                           cancelled=num_by_status.get(CANCELLED, 0), expired=num_by_status.get(EXPIRED, 0),
                           oldest_queued_age_s=round(oldest_age_s, 3), batches_in_progress=num_batches)

    async def batch_jobs(self, batch_id: str) -> list[Job]:
        """See :meth:`JobStore.batch_jobs`."""
        rows = await self._run(lambda c: c.execute(
            "SELECT * FROM jobs WHERE batch_id = ? ORDER BY line", (batch_id,)).fetchall())
        return [job_from_row(row) for row in rows]

    async def due_jobs(self, now_s: float, limit: int) -> list[str]:
        """See :meth:`JobStore.due_jobs`."""
        rows = await self._run(lambda c: c.execute(
            "SELECT id FROM jobs WHERE status IN (?, ?) AND expires_at > 0 AND expires_at < ? LIMIT ?",
            (*ACTIVE_STATUSES, now_s, limit)).fetchall())
        return [row["id"] for row in rows]

    # ----------------------------------------------------------------------------------------------- batches

    async def get_batch(self, batch_id: str) -> Batch | None:
        """See :meth:`JobStore.get_batch`."""
        row = await self._run(lambda c: c.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone())
        return None if row is None else batch_from_row(row)

    async def list_batches(self, owner: str, limit: int, after: str | None) -> tuple[list[Batch], bool]:
        """See :meth:`JobStore.list_batches`."""

        def page(conn: sqlite3.Connection) -> list[sqlite3.Row]:
            sql, params = "SELECT * FROM batches WHERE owner = ?", [owner]
            if after is not None:
                sql += " AND seq < COALESCE((SELECT seq FROM batches WHERE id = ? AND owner = ?), -1)"
                params += [after, owner]
            sql += " ORDER BY seq DESC LIMIT ?"
            params.append(limit + 1)
            return conn.execute(sql, params).fetchall()

        rows = await self._run(page)
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

        return await self._tx(update)

    async def open_batch_ids(self) -> list[str]:
        """See :meth:`JobStore.open_batch_ids`."""
        final = sorted(BATCH_FINAL_STATUSES)
        rows = await self._run(lambda c: c.execute(
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

        return await self._tx(purge)
