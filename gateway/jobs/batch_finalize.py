"""Finalization of a batch: its output and error files, its final status and its token usage.

:func:`finalize_batch` runs when all lines are final, from whichever gateway sees it first (after a line finishes,
or in the runner's upkeep loop — so a batch whose gateway was killed still finishes): it writes the output file
(succeeded lines) and the error file (failed, cancelled, expired lines) in input order, one line per ``custom_id``,
with ids fixed per batch, so finalizing twice rewrites the same files. Output lines are OpenAI's::

    {"id": "batch_req_…", "custom_id": "r1", "response": {"status_code": 200, "request_id": "…", "body": {…}},
     "error": null}

The batch's ``usage`` (OpenAI's ``BatchUsage``) sums the ``usage`` of the succeeded lines' responses.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import msgspec

from gateway.jobs.api import JobsService
from gateway.jobs.models import (
    BATCH_CANCELLED,
    BATCH_EXPIRED,
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FINALIZING,
    IN_PROGRESS,
    SUCCEEDED,
    VALIDATING,
    FileRecord,
    Job,
    error_file_id,
    output_file_id,
)

PURPOSE_BATCH_OUTPUT = "batch_output"


def _output_line(job: Job) -> bytes:
    request_id = f"batch_req_{job.id.removeprefix('job_')}"
    if job.status == SUCCEEDED:
        response = {"status_code": job.status_code or 200, "request_id": job.request_id,
                    "body": msgspec.json.decode(job.result)}
        return msgspec.json.encode({"id": request_id, "custom_id": job.custom_id, "response": response,
                                    "error": None})
    if job.status in (CANCELLED, EXPIRED):
        code = "batch_cancelled" if job.status == CANCELLED else "batch_expired"
        message = (job.error or {}).get("message", job.status)
        return msgspec.json.encode({"id": request_id, "custom_id": job.custom_id, "response": None,
                                    "error": {"code": code, "message": message}})
    response = {"status_code": job.status_code or 500, "request_id": job.request_id, "body": {"error": job.error}}
    return msgspec.json.encode({"id": request_id, "custom_id": job.custom_id, "response": response, "error": None})


async def finalize_batch(service: JobsService, batch_id: str) -> None:
    """Finish a batch whose lines are all final: write its output and error files, set its final status.

    Idempotent and safe to run from several gateways at once (compare-and-set on the status; fixed file ids).
    Does nothing while a line is unfinished or when the batch is already final.
    """
    store = service.store
    batch = await store.get_batch(batch_id)
    if batch is None or batch.is_final or batch.status == VALIDATING:
        return
    if batch.num_completed + batch.num_failed < batch.num_total:
        return
    now_s = time.time()
    if batch.status == IN_PROGRESS:
        batch = await store.update_batch(batch_id, frozenset({IN_PROGRESS}), service.retention_s,
                                         status=FINALIZING, finalizing_at=now_s)
        if batch is None:
            return
    jobs = await store.batch_jobs(batch_id)
    output = [_output_line(job) for job in jobs if job.status == SUCCEEDED]
    errors = [_output_line(job) for job in jobs if job.status != SUCCEEDED]
    lifetime_s = batch.output_expires_after_s or service.retention_s
    file_ids: dict[str, str] = {"output_file_id": "", "error_file_id": ""}
    for field, lines, make_id, suffix in (("output_file_id", output, output_file_id, "output"),
                                          ("error_file_id", errors, error_file_id, "error")):
        if not lines:
            continue
        content = b"\n".join(lines) + b"\n"
        record = FileRecord(id=make_id(batch_id), owner=batch.owner, filename=f"{batch_id}_{suffix}.jsonl",
                            purpose=PURPOSE_BATCH_OUTPUT, bytes=len(content), created_at=now_s,
                            expires_at=now_s + lifetime_s)
        await store.put_file(record, content)
        file_ids[field] = record.id
    if batch.status == CANCELLING:
        final = {"status": BATCH_CANCELLED, "cancelled_at": now_s}
    elif any(job.status == EXPIRED for job in jobs):
        final = {"status": BATCH_EXPIRED, "expired_at": now_s}
    else:
        final = {"status": COMPLETED, "completed_at": now_s}
    await store.update_batch(batch_id, frozenset({FINALIZING, CANCELLING}), service.retention_s, **final, **file_ids,
                             **_usage_totals(job for job in jobs if job.status == SUCCEEDED))


def _usage_totals(jobs: Iterable[Job]) -> dict[str, int]:
    """Sum the ``usage`` of the results of ``jobs`` into :class:`Batch`'s ``input_tokens``, ``cached_tokens`` and
    ``output_tokens``."""
    totals = {"input_tokens": 0, "cached_tokens": 0, "output_tokens": 0}
    for job in jobs:
        usage = msgspec.json.decode(job.result).get("usage") or {}
        totals["input_tokens"] += usage.get("prompt_tokens", 0)
        totals["cached_tokens"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        totals["output_tokens"] += usage.get("completion_tokens", 0)
    return totals
