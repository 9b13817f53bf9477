"""The SQLite job store's queue: the ``jobs`` table itself, and the lease of a running job.

:meth:`SqliteJobQueue.claim` picks, in one transaction, the oldest expired lease or else the best queued job (index
``jobs_ready``: status, priority, seq) and marks it running with a lease; renew, requeue and finish are single
``UPDATE``s guarded by the job's status and lease owner.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from gateway.jobs.models import QUEUED, RUNNING, SUCCEEDED, Job
from gateway.jobs.sqlite_connection import SqliteConnection
from gateway.jobs.sqlite_schema import ACTIVE_STATUSES, job_from_row


class SqliteJobQueue:
    """Hand queued jobs to runners with leases, and write their final state; the lease lifecycle of
    :class:`~gateway.jobs.store.JobStore` (claim, renew, requeue, finish).

    Args:
        db: the store's connection.
    """

    def __init__(self, db: SqliteConnection) -> None:
        self._db = db

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

        row = await self._db.tx(claim)
        return None if row is None else job_from_row(row)

    async def renew(self, job_id: str, runner_id: str, lease_s: float, now_s: float) -> bool:
        """See :meth:`JobStore.renew`."""
        cursor = await self._db.run(lambda c: c.execute(
            "UPDATE jobs SET lease_expires_at = ? WHERE id = ? AND status = ? AND lease_owner = ?",
            (now_s + lease_s, job_id, RUNNING, runner_id)))
        return cursor.rowcount > 0

    async def requeue(self, job_id: str, runner_id: str, refund_attempt: bool = False) -> bool:
        """See :meth:`JobStore.requeue`."""
        cursor = await self._db.run(lambda c: c.execute(
            "UPDATE jobs SET status = ?, lease_owner = '', lease_expires_at = 0, attempts = attempts - ? "
            "WHERE id = ? AND status = ? AND lease_owner = ?",
            (QUEUED, int(refund_attempt), job_id, RUNNING, runner_id)))
        return cursor.rowcount > 0

    async def finish(self, job_id: str, status: str, now_s: float, *, result: bytes = b"",
                     error: dict[str, Any] | None = None, status_code: int = 0, request_id: str = "",
                     retention_s: float) -> bool:
        """See :meth:`JobStore.finish`: the job's row and its batch's counter change in one transaction."""
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

        return await self._db.tx(finish)
