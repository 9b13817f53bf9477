"""Records of the job store (msgspec Structs) and their OpenAI-shaped JSON views.

Three kinds of record, each owned by the API key that created it (``owner``: a digest of the key, never the key):

- :class:`Job`: one chat or text completion request run asynchronously. A native job (``POST /v1/jobs``) or one
  line of a batch (``batch_id`` and ``custom_id`` set).
- :class:`FileRecord`: an uploaded batch input file, or a batch's output / error file (OpenAI ``FileObject``).
- :class:`Batch`: an OpenAI batch: its lines are jobs; ``num_completed`` / ``num_failed`` count the lines that
  reached a final state (OpenAI ``request_counts``).

Job life cycle (a final state is written exactly once: the first writer wins)::

    queued ──claim──▶ running ──▶ succeeded | failed
      │  ◀──transient failure / lease expiry──┘
      └──────────────▶ cancelled | expired   (also from running)

Times are Unix seconds (float in the records, int in the JSON views, as OpenAI).
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import msgspec

# Job statuses.
QUEUED = "queued"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
EXPIRED = "expired"
JOB_FINAL_STATUSES = frozenset({SUCCEEDED, FAILED, CANCELLED, EXPIRED})
JOB_ACTIVE_STATUSES = frozenset({QUEUED, RUNNING})

# Batch statuses (OpenAI's).
VALIDATING = "validating"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
BATCH_FAILED = "failed"
BATCH_EXPIRED = "expired"
CANCELLING = "cancelling"
BATCH_CANCELLED = "cancelled"
BATCH_FINAL_STATUSES = frozenset({COMPLETED, BATCH_FAILED, BATCH_EXPIRED, BATCH_CANCELLED})

KIND_CHAT = "chat"
KIND_COMPLETION = "completion"
ENDPOINT_TO_KIND = {"/v1/chat/completions": KIND_CHAT, "/v1/completions": KIND_COMPLETION}
KIND_TO_ENDPOINT = {kind: endpoint for endpoint, kind in ENDPOINT_TO_KIND.items()}

MIN_PRIORITY = 0
MAX_PRIORITY = 9  # priorities inside the batch tier: larger runs first

ANONYMOUS_OWNER = "anonymous"
COMPLETION_WINDOW = "24h"
COMPLETION_WINDOW_S = 24 * 3600.0


class Job(msgspec.Struct, kw_only=True):
    """One asynchronous completion request.

    Attributes:
        id: ``job_<hex>``.
        owner: digest of the creating API key (see :func:`owner_of_key`), or ``anonymous``.
        kind: ``chat`` or ``completion`` (the endpoint the body is for).
        body: the request body as JSON bytes (``stream`` is ignored: the result is one whole response).
        priority: 0–9 inside the batch tier; larger runs first.
        metadata: caller's string key-value pairs, returned as given.
        status: see the module docstring.
        created_at, started_at, finished_at, expires_at: Unix seconds; 0.0 until it happens. A job not finished by
            ``expires_at`` becomes ``expired``.
        attempts: how many times a runner started it.
        result: the response body (chat.completion / text_completion) as JSON bytes, once succeeded.
        error: ``{"code", "message"}`` (plus ``param``) once failed, cancelled or expired.
        status_code: the HTTP status the request got (200 on success, the error's status when it failed); 0 before.
        request_id: the gateway request id of the run that wrote the result.
        batch_id, custom_id, line: set for a batch line (``line`` counts from 1).
        lease_owner: the runner holding the job while it runs ("" when none).
        lease_expires_at: Unix seconds after which another runner may claim it.
        deferred: the job was created from a sync request shed under overload (``x-sluice-defer``).
    """

    id: str
    owner: str
    kind: str
    body: bytes
    priority: int = 0
    metadata: dict[str, str] = {}
    status: str = QUEUED
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    expires_at: float = 0.0
    attempts: int = 0
    result: bytes = b""
    error: dict[str, Any] | None = None
    status_code: int = 0
    request_id: str = ""
    batch_id: str = ""
    custom_id: str = ""
    line: int = 0
    lease_owner: str = ""
    lease_expires_at: float = 0.0
    deferred: bool = False

    @property
    def is_final(self) -> bool:
        return self.status in JOB_FINAL_STATUSES


class JobsSummary(msgspec.Struct, kw_only=True):
    """What the job store holds now, by job status (``/status`` → ``jobs``, the ``sluice_jobs`` gauges).

    Counts cover every owner and every gateway sharing the store; finished jobs count until their retention ends.
    A field is None when the store cannot answer it without a scan (the Redis store counts only unfinished jobs).

    Attributes:
        queued, running: unfinished jobs (batch lines included).
        succeeded, failed, cancelled, expired: finished jobs still retained, or None.
        oldest_queued_age_s: seconds the oldest queued job has waited since it was created (0.0 when none are
            queued), or None.
        batches_in_progress: batches not in a final status.
    """

    queued: int
    running: int
    succeeded: int | None = None
    failed: int | None = None
    cancelled: int | None = None
    expired: int | None = None
    oldest_queued_age_s: float | None = None
    batches_in_progress: int = 0


class FileRecord(msgspec.Struct, kw_only=True):
    """An uploaded or generated file (OpenAI ``FileObject``); the content is stored next to it.

    Attributes:
        id: ``file-<hex>``.
        owner: as :attr:`Job.owner`.
        filename: as uploaded (generated files: ``batch_<id>_output.jsonl`` / ``..._error.jsonl``).
        purpose: ``batch`` (input) or ``batch_output``.
        bytes: content size in bytes.
        created_at: Unix seconds.
        expires_at: Unix seconds when the file is deleted.
        num_lines: non-empty lines (requests) of a batch input file.
    """

    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: float
    expires_at: float
    num_lines: int = 0


class Batch(msgspec.Struct, kw_only=True):
    """An OpenAI batch: one job per line of its input file.

    Attributes:
        id: ``batch_<hex>``.
        owner: as :attr:`Job.owner`.
        endpoint: ``/v1/chat/completions`` or ``/v1/completions``.
        input_file_id: the uploaded input file.
        completion_window: ``24h``.
        status: OpenAI's batch status.
        num_total, num_completed, num_failed: lines in total / succeeded / failed, cancelled or expired.
        created_at, in_progress_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at,
            cancelled_at, expires_at: Unix seconds, 0.0 until it happens.
        output_file_id, error_file_id: generated at finalization ("" when there is nothing to put in them).
        errors: validation errors ``{"code", "line", "message", "param"}`` of a failed batch.
        metadata: caller's string key-value pairs.
        output_expires_after_s: retention of the output and error files in seconds (0 = the store's retention).
        input_tokens, cached_tokens, output_tokens: the ``usage`` of the lines that succeeded, summed at
            finalization (prompt tokens, those of them served from the prefix cache, completion tokens).
    """

    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str = COMPLETION_WINDOW
    status: str = VALIDATING
    num_total: int = 0
    num_completed: int = 0
    num_failed: int = 0
    created_at: float = 0.0
    in_progress_at: float = 0.0
    finalizing_at: float = 0.0
    completed_at: float = 0.0
    failed_at: float = 0.0
    expired_at: float = 0.0
    cancelling_at: float = 0.0
    cancelled_at: float = 0.0
    expires_at: float = 0.0
    output_file_id: str = ""
    error_file_id: str = ""
    errors: list[dict[str, Any]] = []
    metadata: dict[str, str] = {}
    output_expires_after_s: float = 0.0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def is_final(self) -> bool:
        return self.status in BATCH_FINAL_STATUSES


# ---------------------------------------------------------------------------------------------------------- ids


def new_job_id() -> str:
    return f"job_{uuid.uuid4().hex}"


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def output_file_id(batch_id: str) -> str:
    """Return the id of a batch's output file: fixed per batch, so finalizing twice writes the same file."""
    return f"file-{batch_id.removeprefix('batch_')}-output"


def error_file_id(batch_id: str) -> str:
    """Return the id of a batch's error file (fixed per batch, like :func:`output_file_id`)."""
    return f"file-{batch_id.removeprefix('batch_')}-error"


def owner_of_key(api_key: str | None) -> str:
    """Return the owner id of an API key: a SHA-256 digest (the store never holds keys), or ``anonymous``."""
    if not api_key:
        return ANONYMOUS_OWNER
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------------------- views


def _ts(seconds: float) -> int | None:
    return int(seconds) if seconds else None


def job_view(job: Job) -> dict[str, Any]:
    """Return the JSON object of a job (``GET /v1/jobs/{id}``).

    ``result`` is the full chat.completion (or text_completion) object once the job succeeded, else null.
    """
    body = msgspec.json.decode(job.body) if job.body else {}
    view: dict[str, Any] = {
        "id": job.id,
        "object": "job",
        "endpoint": KIND_TO_ENDPOINT.get(job.kind, ""),
        "model": body.get("model") if isinstance(body, dict) else None,
        "status": job.status,
        "priority": job.priority,
        "metadata": job.metadata,
        "created_at": _ts(job.created_at),
        "started_at": _ts(job.started_at),
        "finished_at": _ts(job.finished_at),
        "expires_at": _ts(job.expires_at),
        "attempts": job.attempts,
        "deferred": job.deferred,
        "result": msgspec.json.decode(job.result) if job.result else None,
        "error": job.error,
    }
    if job.batch_id:
        view["batch_id"] = job.batch_id
        view["custom_id"] = job.custom_id
    return view


def file_view(record: FileRecord) -> dict[str, Any]:
    """Return the OpenAI ``FileObject`` of a file."""
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": int(record.created_at),
        "expires_at": _ts(record.expires_at),
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_view(batch: Batch) -> dict[str, Any]:
    """Return the OpenAI ``Batch`` object of a batch; its ``usage`` is null until the batch is final."""
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id or None,
        "error_file_id": batch.error_file_id or None,
        "created_at": int(batch.created_at),
        "in_progress_at": _ts(batch.in_progress_at),
        "expires_at": _ts(batch.expires_at),
        "finalizing_at": _ts(batch.finalizing_at),
        "completed_at": _ts(batch.completed_at),
        "failed_at": _ts(batch.failed_at),
        "expired_at": _ts(batch.expired_at),
        "cancelling_at": _ts(batch.cancelling_at),
        "cancelled_at": _ts(batch.cancelled_at),
        "request_counts": {"total": batch.num_total, "completed": batch.num_completed, "failed": batch.num_failed},
        "metadata": batch.metadata or None,
        "usage": _batch_usage(batch) if batch.is_final else None,
    }


def _batch_usage(batch: Batch) -> dict[str, Any]:
    """OpenAI's ``BatchUsage`` object (no reasoning models here: ``reasoning_tokens`` is 0)."""
    return {"input_tokens": batch.input_tokens, "input_tokens_details": {"cached_tokens": batch.cached_tokens},
            "output_tokens": batch.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": batch.input_tokens + batch.output_tokens}


def list_view(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """Return an OpenAI list page (``first_id`` / ``last_id`` / ``has_more`` cursor pagination)."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
