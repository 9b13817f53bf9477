"""The SQLite job store's schema and its row codec (``gateway.jobs.sqlite_store``).

Tables ``files``, ``jobs`` and ``batches``; a job row has one column per :class:`~gateway.jobs.models.Job` field
(``metadata`` and ``error`` as JSON text, ``deferred`` as 0/1); a batch row keeps the whole record as JSON with its
counters in columns of their own, so that one ``UPDATE`` counts a finished line.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import msgspec

from gateway.jobs.models import QUEUED, RUNNING, Batch, Job

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    kind TEXT NOT NULL,
    body BLOB NOT NULL,
    priority INTEGER NOT NULL,
    metadata TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL NOT NULL,
    finished_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    attempts INTEGER NOT NULL,
    result BLOB NOT NULL,
    error TEXT,
    status_code INTEGER NOT NULL,
    request_id TEXT NOT NULL,
    batch_id TEXT NOT NULL,
    custom_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    lease_owner TEXT NOT NULL,
    lease_expires_at REAL NOT NULL,
    deferred INTEGER NOT NULL,
    purge_at REAL NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_ready ON jobs (status, priority DESC, seq);
CREATE INDEX IF NOT EXISTS jobs_lease ON jobs (status, lease_expires_at);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs (owner, batch_id, seq);
CREATE INDEX IF NOT EXISTS jobs_batch ON jobs (batch_id, line);
CREATE INDEX IF NOT EXISTS jobs_expiry ON jobs (status, expires_at);
CREATE INDEX IF NOT EXISTS jobs_purge ON jobs (purge_at);
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    purpose TEXT NOT NULL,
    expires_at REAL NOT NULL,
    record BLOB NOT NULL,
    content BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS files_owner ON files (owner, seq);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    status TEXT NOT NULL,
    num_completed INTEGER NOT NULL DEFAULT 0,
    num_failed INTEGER NOT NULL DEFAULT 0,
    purge_at REAL NOT NULL DEFAULT 0,
    record BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, seq);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
"""

JOB_COLUMNS = [name for name in Job.__struct_fields__]
ACTIVE_STATUSES = (QUEUED, RUNNING)


def job_params(job: Job) -> dict[str, Any]:
    params = msgspec.structs.asdict(job)
    params["metadata"] = json.dumps(job.metadata)
    params["error"] = None if job.error is None else json.dumps(job.error)
    params["deferred"] = int(job.deferred)
    return params


def job_from_row(row: sqlite3.Row) -> Job:
    values = {name: row[name] for name in JOB_COLUMNS}
    values["metadata"] = json.loads(values["metadata"])
    values["error"] = None if values["error"] is None else json.loads(values["error"])
    values["deferred"] = bool(values["deferred"])
    values["body"] = bytes(values["body"])
    values["result"] = bytes(values["result"])
    return Job(**values)


def batch_from_row(row: sqlite3.Row) -> Batch:
    batch = msgspec.json.decode(row["record"], type=Batch)
    return msgspec.structs.replace(batch, status=row["status"], num_completed=row["num_completed"],
                                   num_failed=row["num_failed"])
