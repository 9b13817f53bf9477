"""The OpenAI Files and Batch APIs, so the ``openai`` SDK's batch workflow works unchanged.

Files: ``POST /v1/files`` (multipart ``file`` + ``purpose=batch``; JSONL), ``GET /v1/files``,
``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``.
Batches: ``POST /v1/batches`` (``endpoint`` ``/v1/chat/completions`` or ``/v1/completions``,
``completion_window`` ``24h``), ``GET /v1/batches``, ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``.

Input line (OpenAI's)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {<a chat completions request>}}

Upload checks the file's shape (JSON objects, ``custom_id`` present and unique, ``method``, ``url``, ``body``; at
most ``jobs.max_batch_lines`` lines and ``jobs.max_file_bytes`` bytes) and answers 400 / 413 naming the first bad
line. Creating a batch checks every line's ``url`` against the endpoint and its ``body.model`` against the served
model: a batch with such lines is created ``failed`` with ``errors`` naming each line (as OpenAI's ``validating`` →
``failed``). Otherwise it becomes ``in_progress`` with one job per line, atomically; a line whose body is not a
valid request (a bad field, empty messages) does not fail the batch: it fails on its own when it runs, as OpenAI's
do, and lands in the error file with ``response.status_code`` 400 and ``response.body.error`` naming the field.

Finalization (output and error files, final status, usage): :mod:`gateway.jobs.batch_finalize`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from aiohttp import web

from gateway.jobs.api import (
    JOBS,
    check_metadata,
    json_response,
    not_found,
    owner_of,
    page_params,
    read_json_object,
    store_unavailable_as_503,
    too_many_jobs,
    validate_request_body,
)
from gateway.jobs.models import (
    BATCH_FAILED,
    CANCELLING,
    COMPLETION_WINDOW,
    COMPLETION_WINDOW_S,
    ENDPOINT_TO_KIND,
    FINALIZING,
    IN_PROGRESS,
    VALIDATING,
    Batch,
    FileRecord,
    Job,
    batch_view,
    file_view,
    list_view,
    new_batch_id,
    new_file_id,
)
from gateway.jobs.batch_finalize import finalize_batch
from gateway.jobs.store import TooManyJobsError
from gateway.state import FLEET, REQUEST_LOG
from shared.config import Config
from shared.errors import ErrorCode, SluiceError

PURPOSE_BATCH = "batch"
READ_CHUNK_BYTES = 1 << 16
MAX_REPORTED_ERRORS = 100
MIN_EXPIRES_AFTER_S = 3600  # OpenAI's lower bound for expires_after.seconds


class _InputLine(msgspec.Struct, forbid_unknown_fields=False):
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


def _bad_file(line_number: int, message: str) -> SluiceError:
    return SluiceError(ErrorCode.INVALID_VALUE, f"Invalid batch input file, line {line_number}: {message}",
                       param="file")


def parse_input_lines(content: bytes, max_lines: int) -> list[tuple[int, _InputLine]]:
    """Parse and check a batch input file; return (line number from 1, line) for every non-empty line.

    Raises:
        SluiceError: 400 naming the first bad line: not UTF-8 JSON, not an object, a missing or repeated
            ``custom_id``, a ``method`` other than POST, an unsupported ``url``, a ``body`` that is not an object;
            more than ``max_lines`` requests; or no request at all.
    """
    lines: list[tuple[int, _InputLine]] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(lines) == max_lines:
            raise _bad_file(number, f"the file has more than {max_lines} requests (jobs.max_batch_lines)")
        try:
            line = msgspec.json.decode(raw, type=_InputLine)
        except msgspec.ValidationError as exc:
            raise _bad_file(number, str(exc)) from None
        except msgspec.DecodeError as exc:
            raise _bad_file(number, f"not valid JSON ({exc})") from None
        except RecursionError:
            raise _bad_file(number, "the JSON is nested too deeply to decode") from None
        if not line.custom_id:
            raise _bad_file(number, "`custom_id` must be a non-empty string")
        if line.custom_id in seen:
            raise _bad_file(number, f"`custom_id` {line.custom_id!r} is already used on line {seen[line.custom_id]}")
        if line.method.upper() != "POST":
            raise _bad_file(number, f"`method` must be POST, got {line.method!r}")
        if line.url not in ENDPOINT_TO_KIND:
            raise _bad_file(number, f"`url` must be one of {sorted(ENDPOINT_TO_KIND)}, got {line.url!r}")
        seen[line.custom_id] = number
        lines.append((number, line))
    if not lines:
        raise SluiceError(ErrorCode.INVALID_VALUE, "Invalid batch input file: it contains no request", param="file")
    return lines


def _expires_after_s(value: Any, param: str, retention_s: float) -> float:
    """Validate an OpenAI ``expires_after`` ({"anchor": "created_at", "seconds": N}); return N (0 = absent)."""
    if value is None:
        return 0.0
    if not isinstance(value, dict) or value.get("anchor", "created_at") != "created_at":
        raise SluiceError(ErrorCode.INVALID_VALUE, f"'{param}' must be {{\"anchor\": \"created_at\", \"seconds\": "
                          "N}", param=param)
    try:
        seconds = int(value.get("seconds"))
    except (TypeError, ValueError):
        seconds = -1
    if not MIN_EXPIRES_AFTER_S <= seconds <= retention_s:
        raise SluiceError(ErrorCode.INVALID_VALUE, f"'{param}.seconds' must be between {MIN_EXPIRES_AFTER_S} and "
                          f"{int(retention_s)} (jobs.result_retention_days)", param=f"{param}.seconds")
    return float(seconds)


async def _owned_file(request: web.Request) -> FileRecord:
    file_id = request.match_info["file_id"]
    record = await request.app[JOBS].store.get_file(file_id)
    if record is None or record.owner != owner_of(request):
        raise not_found("file", file_id)
    return record


async def _owned_batch(request: web.Request) -> Batch:
    batch_id = request.match_info["batch_id"]
    batch = await request.app[JOBS].store.get_batch(batch_id)
    if batch is None or batch.owner != owner_of(request):
        raise not_found("batch", batch_id)
    return batch


# ---------------------------------------------------------------------------------------------- files


async def _read_upload(request: web.Request, max_file_bytes: int) -> tuple[dict[str, str], bytes | None, str]:
    """Read a multipart upload: ``(text fields, the 'file' part's bytes or None, its filename)``.

    Raises:
        SluiceError: ``request_too_large`` when the file exceeds ``max_file_bytes``.
        ValueError: the multipart body is malformed (aiohttp's reader).
    """
    reader = await request.multipart()
    fields: dict[str, str] = {}
    content: bytes | None = None
    filename = "upload.jsonl"
    while (part := await reader.next()) is not None:
        if part.name == "file":
            filename = part.filename or filename
            chunks: list[bytes] = []
            size = 0
            while chunk := await part.read_chunk(READ_CHUNK_BYTES):
                size += len(chunk)
                if size > max_file_bytes:
                    raise SluiceError(ErrorCode.BODY_TOO_LARGE, f"The file exceeds the limit of "
                                      f"{max_file_bytes} bytes (jobs.max_file_bytes).", param="file")
                chunks.append(chunk)
            content = b"".join(chunks)
        elif part.name:
            fields[part.name] = (await part.read(decode=True)).decode("utf-8", errors="replace")
    return fields, content, filename


async def upload_file(request: web.Request) -> web.Response:
    """``POST /v1/files``: store a batch input file (multipart ``file``, ``purpose=batch``)."""
    service = request.app[JOBS]
    owner = owner_of(request)
    limits = service.config.jobs
    if not request.content_type.startswith("multipart/"):
        raise SluiceError(ErrorCode.INVALID_REQUEST, "upload the file as multipart/form-data with the fields "
                          "'file' and 'purpose'")
    try:
        fields, content, filename = await _read_upload(request, limits.max_file_bytes)
    except ValueError as exc:  # aiohttp's multipart reader: no boundary, or not where the header says
        raise SluiceError(ErrorCode.INVALID_REQUEST, f"The multipart/form-data body is malformed: {exc}") from exc
    if content is None:
        raise SluiceError(ErrorCode.MISSING_FIELD, "Missing required parameter: 'file'", param="file")
    purpose = fields.get("purpose")
    if purpose != PURPOSE_BATCH:
        raise SluiceError(ErrorCode.INVALID_VALUE, f"'purpose' must be 'batch' on this server, got {purpose!r}",
                          param="purpose")
    expires_after = None
    if "expires_after[seconds]" in fields:
        expires_after = {"anchor": fields.get("expires_after[anchor]", "created_at"),
                         "seconds": fields["expires_after[seconds]"]}
    lifetime_s = _expires_after_s(expires_after, "expires_after", service.retention_s) or service.retention_s
    lines = await asyncio.to_thread(parse_input_lines, content, limits.max_batch_lines)  # big files: off the loop
    now_s = time.time()
    record = FileRecord(id=new_file_id(), owner=owner, filename=filename, purpose=PURPOSE_BATCH, bytes=len(content),
                        created_at=now_s, expires_at=now_s + lifetime_s, num_lines=len(lines))
    await service.store.put_file(record, content)
    request[REQUEST_LOG].update(file_id=record.id, bytes=len(content), lines=len(lines))
    return json_response(file_view(record))


async def get_file(request: web.Request) -> web.Response:
    """``GET /v1/files/{file_id}``."""
    return json_response(file_view(await _owned_file(request)))


async def get_file_content(request: web.Request) -> web.Response:
    """``GET /v1/files/{file_id}/content``: the file's bytes (JSONL)."""
    record = await _owned_file(request)
    content = await request.app[JOBS].store.get_file_content(record.id)
    if content is None:
        raise not_found("file", record.id)
    return web.Response(body=content, content_type="application/jsonl")


async def list_files(request: web.Request) -> web.Response:
    """``GET /v1/files``: the caller's files, newest first (``order=desc``, the default) or oldest first
    (``order=asc``); ``purpose``, ``limit``, ``after``.

    Raises:
        SluiceError: 400 naming ``order`` when it is neither ``asc`` nor ``desc``.
    """
    limit, after = page_params(request)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise SluiceError(ErrorCode.INVALID_VALUE, f"'order' must be 'asc' or 'desc', got {order!r}", param="order")
    records, has_more = await request.app[JOBS].store.list_files(owner_of(request), limit, after,
                                                                  request.query.get("purpose") or None,
                                                                  oldest_first=order == "asc")
    return json_response(list_view([file_view(r) for r in records], has_more))


async def delete_file(request: web.Request) -> web.Response:
    """``DELETE /v1/files/{file_id}``."""
    record = await _owned_file(request)
    await request.app[JOBS].store.delete_file(record.id)
    return json_response({"id": record.id, "object": "file", "deleted": True})


# ---------------------------------------------------------------------------------------------- batches


async def create_batch(request: web.Request) -> web.Response:
    """``POST /v1/batches``: one job per input line; ``in_progress`` (or ``failed`` with per-line errors)."""
    service = request.app[JOBS]
    owner = owner_of(request)
    body = await read_json_object(request)
    for name in ("input_file_id", "endpoint", "completion_window"):
        if body.get(name) is None:
            raise SluiceError(ErrorCode.MISSING_FIELD, f"Missing required parameter: '{name}'", param=name)
        if not isinstance(body[name], str):
            raise SluiceError(ErrorCode.INVALID_TYPE, f"'{name}' must be a string, got "
                              f"{type(body[name]).__name__}", param=name)
    endpoint = body["endpoint"]
    if endpoint not in ENDPOINT_TO_KIND:
        raise SluiceError(ErrorCode.INVALID_VALUE, f"'endpoint' must be one of {sorted(ENDPOINT_TO_KIND)} on this "
                          f"server, got {endpoint!r}", param="endpoint")
    if body["completion_window"] != COMPLETION_WINDOW:
        raise SluiceError(ErrorCode.INVALID_VALUE, f"'completion_window' must be '{COMPLETION_WINDOW}'",
                          param="completion_window")
    metadata = check_metadata(body.get("metadata"))
    output_expires_after_s = _expires_after_s(body.get("output_expires_after"), "output_expires_after",
                                              service.retention_s)
    file_id = body["input_file_id"]
    record = await service.store.get_file(file_id)
    if record is None or record.owner != owner:
        raise not_found("file", file_id, param="input_file_id")
    if record.purpose != PURPOSE_BATCH:
        raise SluiceError(ErrorCode.INVALID_VALUE, f"file '{file_id}' has purpose '{record.purpose}', not 'batch'",
                          param="input_file_id")
    content = await service.store.get_file_content(file_id)
    if content is None:
        raise not_found("file", file_id, param="input_file_id")
    now_s = time.time()
    batch = Batch(id=new_batch_id(), owner=owner, endpoint=endpoint, input_file_id=file_id, status=VALIDATING,
                  created_at=now_s, expires_at=now_s + COMPLETION_WINDOW_S, metadata=metadata,
                  output_expires_after_s=output_expires_after_s)
    jobs, errors = await asyncio.to_thread(_jobs_of_batch, service.config, batch, content,
                                           request.app[FLEET].model_names())
    if errors:
        batch = msgspec.structs.replace(batch, status=BATCH_FAILED, failed_at=now_s, num_total=len(jobs) + len(errors),
                                        errors=errors[:MAX_REPORTED_ERRORS])
        await service.store.add_jobs([], service.config.jobs.max_jobs_per_key, batch=batch)
    else:
        batch = msgspec.structs.replace(batch, status=IN_PROGRESS, in_progress_at=now_s, num_total=len(jobs))
        try:
            await service.store.add_jobs(jobs, service.config.jobs.max_jobs_per_key, batch=batch)
        except TooManyJobsError as exc:
            retry_after_s = service.runner.retry_after_s(service.config.admission.max_retry_after_s)
            raise too_many_jobs(exc, len(jobs), retry_after_s) from None
        service.runner.notify()
    request[REQUEST_LOG].update(batch_id=batch.id, lines=batch.num_total, outcome=batch.status)
    return json_response(batch_view(batch))


def _jobs_of_batch(config: Config, batch: Batch, content: bytes,
                   served_models: list[str]) -> tuple[list[Job], list[dict[str, Any]]]:
    """Return one queued job per input line, and the errors of the lines that fail the whole batch (a wrong ``url``
    or a model not in ``served_models``; OpenAI ``BatchError``: code, line, param, message). A line whose body is
    otherwise invalid is queued as it is: it fails when it runs (a 400 in the error file). Synchronous (it runs in
    a thread)."""
    kind = ENDPOINT_TO_KIND[batch.endpoint]
    jobs: list[Job] = []
    errors: list[dict[str, Any]] = []
    for number, line in parse_input_lines(content, config.jobs.max_batch_lines):
        if line.url != batch.endpoint:
            errors.append({"code": "invalid_url", "line": number, "param": "url", "message":
                           f"the line's url {line.url!r} differs from the batch endpoint {batch.endpoint!r}"})
            continue
        try:
            encoded = validate_request_body(config, kind, line.body, served_models)
        except SluiceError as exc:
            if exc.code is ErrorCode.MODEL_NOT_FOUND:
                errors.append({"code": exc.code.value, "line": number, "param": exc.param and f"body.{exc.param}",
                               "message": exc.message})
                continue
            encoded = msgspec.json.encode({k: v for k, v in line.body.items() if k not in ("stream", "stream_options")})
        jobs.append(Job(id=f"job_{batch.id.removeprefix('batch_')}_{number}", owner=batch.owner, kind=kind,
                        body=encoded, created_at=batch.created_at, expires_at=batch.expires_at, batch_id=batch.id,
                        custom_id=line.custom_id, line=number))
    return jobs, errors


async def get_batch(request: web.Request) -> web.Response:
    """``GET /v1/batches/{batch_id}``."""
    return json_response(batch_view(await _owned_batch(request)))


async def list_batches(request: web.Request) -> web.Response:
    """``GET /v1/batches``: the caller's batches, newest first (``limit``, ``after``)."""
    limit, after = page_params(request)
    batches, has_more = await request.app[JOBS].store.list_batches(owner_of(request), limit, after)
    return json_response(list_view([batch_view(b) for b in batches], has_more))


async def cancel_batch(request: web.Request) -> web.Response:
    """``POST /v1/batches/{batch_id}/cancel``: ``cancelling``, every unfinished line cancelled (running ones
    aborted), then ``cancelled`` with the lines finished so far in the output file. A final batch is returned
    unchanged."""
    service = request.app[JOBS]
    batch = await _owned_batch(request)
    if not batch.is_final:
        await service.store.update_batch(batch.id, frozenset({VALIDATING, IN_PROGRESS, FINALIZING}),
                                         service.retention_s, status=CANCELLING, cancelling_at=time.time())
        for job in await service.store.batch_jobs(batch.id):
            if not job.is_final:
                await service.runner.cancel(job, "the batch was cancelled")
        await finalize_batch(service, batch.id)
    return json_response(batch_view(await service.store.get_batch(batch.id) or batch))


def setup_batch_routes(app: web.Application) -> None:
    routes = [("POST", "/v1/files", upload_file), ("GET", "/v1/files", list_files),
              ("GET", "/v1/files/{file_id}", get_file), ("DELETE", "/v1/files/{file_id}", delete_file),
              ("GET", "/v1/files/{file_id}/content", get_file_content), ("POST", "/v1/batches", create_batch),
              ("GET", "/v1/batches", list_batches), ("GET", "/v1/batches/{batch_id}", get_batch),
              ("POST", "/v1/batches/{batch_id}/cancel", cancel_batch)]
    for method, path, handler in routes:
        app.router.add_route(method, path, store_unavailable_as_503(handler))
