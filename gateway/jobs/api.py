"""Native job API (``/v1/jobs``), ownership, limits, and the deferral of shed requests to jobs.

- ``POST /v1/jobs``: body = one chat completions request, plus optional ``priority`` (0–9 inside the batch tier,
  larger first; default 0) and ``metadata`` (≤ 16 string pairs). → 202, the job object, ``Location``; 400 as the
  sync endpoint for bad input, a prompt past the context (``context_length_exceeded``) included.
- ``GET /v1/jobs/{id}``: the job; ``result`` is the full chat.completion once ``succeeded``.
- ``GET /v1/jobs?limit=&after=``: the caller's jobs, newest first, OpenAI list pagination.
- ``DELETE /v1/jobs/{id}``: cancel or delete. Queued → ``cancelled``; running → ``cancelled`` and aborted on its
  worker (at once in this gateway, at the next heartbeat in another one); already final → deleted (``job.deleted``;
  a later GET answers 404).

**Ownership.** A job, file or batch belongs to the API key that created it (stored as a SHA-256 digest; no key →
``anonymous``); any other key gets 404, never 403, so ids cannot be probed. With ``admission.require_api_key`` an
unknown key gets 401 as on the completion endpoints.

**Deferral.** :func:`defer_shed_request` is called by the completion handlers when admission sheds a request with
503: if the request's tier has ``defer_on_overload`` or the client sent ``x-sluice-defer: allow``, the request is
stored as a job (``deferred: true``) and the client gets 202 with the job object and ``Location`` instead.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from gateway.pipeline import openai_api
from gateway.pipeline.classify import check_tier_hint
from gateway.jobs.models import (
    COMPLETION_WINDOW_S,
    KIND_CHAT,
    KIND_COMPLETION,
    MAX_PRIORITY,
    MIN_PRIORITY,
    Job,
    job_view,
    list_view,
    new_job_id,
    owner_of_key,
)
from gateway.jobs.runner import JobRunner
from gateway.jobs.store import JobStore, TooManyJobsError
from gateway.jobs.stores import STORE_UNAVAILABLE_ERRORS
from gateway.state import CONFIG, FLEET, PIPELINE, REQUEST_LOG, RESOLVER
from shared.config import Config, TierConfig, effective_tiers, lowest_tier
from shared.errors import ErrorCode, SluiceError, model_not_found

DEFER_HEADER = "x-sluice-defer"
DEFER_ALLOW = "allow"
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MIN_PAGE_LIMIT = 1
DEFAULT_PAGE_LIMIT = 20
MAX_PAGE_LIMIT = 100
# Codes of admission's 503 sheds that deferral turns into a job.
DEFERRABLE_CODES = frozenset({ErrorCode.SERVER_OVERLOADED, ErrorCode.QUEUE_FULL, ErrorCode.QUEUE_TIMEOUT,
                              ErrorCode.PREDICTED_QUEUE_TIMEOUT, ErrorCode.NO_WORKER})


@dataclass
class JobsService:
    """What the job endpoints need: the store, the runner and the config (``app[JOBS]``)."""

    store: JobStore
    runner: JobRunner
    config: Config

    @property
    def retention_s(self) -> float:
        return self.runner.retention_s


JOBS = web.AppKey("jobs", JobsService)


# ---------------------------------------------------------------------------------------------- helpers


def owner_of(request: web.Request) -> str:
    """Return the owner id of the request's API key (``anonymous`` without one).

    Raises:
        SluiceError: 401 ``invalid_api_key`` when ``admission.require_api_key`` is set and the key is unknown.
    """
    authorization = request.headers.get("Authorization")
    if request.app[CONFIG].admission.require_api_key:
        request.app[RESOLVER].resolve(authorization)
    scheme, _, token = (authorization or "").strip().partition(" ")
    return owner_of_key(token.strip() if scheme.lower() == "bearer" else None)


def not_found(kind: str, object_id: str, param: str | None = None) -> SluiceError:
    """Return the 404 for an object that does not exist or belongs to another key (the same answer)."""
    return SluiceError(ErrorCode.NOT_FOUND, f"No {kind} found with id '{object_id}'.", param=param)


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(payload), status=status, headers=headers,
                        content_type="application/json")


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """Return the request body as a JSON object.

    Raises:
        SluiceError: 400 when it is not JSON or not an object.
    """
    value = openai_api.decode_json(await request.read())
    if not isinstance(value, dict):
        raise SluiceError(ErrorCode.INVALID_TYPE, "the request body must be a JSON object")
    return value


def page_params(request: web.Request) -> tuple[int, str | None]:
    """Return (limit, after) of a list request.

    Raises:
        SluiceError: 400 when ``limit`` is not an integer in [1, 100].
    """
    raw = request.query.get("limit")
    limit = DEFAULT_PAGE_LIMIT
    if raw is not None:
        try:
            limit = int(raw)
        except ValueError:
            limit = 0
        if not MIN_PAGE_LIMIT <= limit <= MAX_PAGE_LIMIT:
            raise SluiceError(ErrorCode.INVALID_VALUE, f"limit must be an integer in [1, {MAX_PAGE_LIMIT}]",
                              param="limit")
    return limit, request.query.get("after") or None



def check_metadata(value: Any, param: str = "metadata") -> dict[str, str]:
    """Return validated metadata: at most 16 pairs of strings (keys ≤ 64, values ≤ 512 characters), like OpenAI.

    Raises:
        SluiceError: 400 naming the offending key.
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SluiceError(ErrorCode.INVALID_TYPE, f"'{param}' must be an object of string values", param=param)
    if len(value) > MAX_METADATA_PAIRS:
        raise SluiceError(ErrorCode.INVALID_VALUE, f"'{param}' has more than {MAX_METADATA_PAIRS} keys", param=param)
    for key, item in value.items():
        if not isinstance(item, str) or len(key) > MAX_METADATA_KEY_CHARS or len(item) > MAX_METADATA_VALUE_CHARS:
            raise SluiceError(ErrorCode.INVALID_VALUE, f"'{param}.{key}' must be a string of at most "
                              f"{MAX_METADATA_VALUE_CHARS} characters under a key of at most "
                              f"{MAX_METADATA_KEY_CHARS}", param=f"{param}.{key}")
    return dict(value)


def validate_request_body(config: Config, kind: str, body: dict[str, Any], served_models: Sequence[str]) -> bytes:
    """Validate a completion request body as the sync endpoint would, and return it as stored (no streaming).

    Checks what needs no worker: the schema, the model name (any of ``served_models``, ``Fleet.model_names``: the
    job runs on the pool it names, as a request would), unsupported features, ``service_tier``, the messages /
    prompt shape and ``n``. Length caps and the context limit are applied when the job runs (they depend on the
    workers).

    Raises:
        SluiceError: 400 (404 for an unknown model) with the field in ``param``.
    """
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    encoded = msgspec.json.encode(body)
    schema = openai_api.ChatCompletionRequest if kind == KIND_CHAT else openai_api.CompletionRequest
    request = openai_api.decode_body(encoded, schema)
    if request.model not in served_models:
        raise model_not_found(request.model, list(served_models))
    openai_api.check_unsupported(request)
    check_tier_hint(request.service_tier, "service_tier", (tier.name for tier in effective_tiers(config)))
    if kind == KIND_CHAT:
        openai_api.chat_messages(request)
    elif kind == KIND_COMPLETION and not openai_api.completion_prompts(request):
        raise SluiceError(ErrorCode.INVALID_VALUE, "the prompt must not be empty", param="prompt")
    if (request.n or 1) > config.gateway.max_n:
        raise SluiceError(ErrorCode.INVALID_VALUE, f"n must be at most {config.gateway.max_n}", param="n")
    return encoded


def too_many_jobs(exc: TooManyJobsError, adding: int, retry_after_s: float) -> SluiceError:
    """The error of a key at ``jobs.max_jobs_per_key``: 429 with ``Retry-After`` (about one job's run time, see
    :meth:`JobRunner.retry_after_s`) while waiting for some to finish helps; 400 ``invalid_value`` for a batch larger
    than the limit itself, which can never fit (a 429 would have clients retry it for nothing)."""
    if adding > exc.limit:
        return SluiceError(ErrorCode.INVALID_VALUE,
                           f"A batch of {adding} lines can never fit: an API key may have at most {exc.limit} "
                           f"unfinished jobs (jobs.max_jobs_per_key). Split it, or raise jobs.max_jobs_per_key.",
                           param="input_file_id")
    return SluiceError(ErrorCode.RATE_LIMIT_EXCEEDED,
                       f"This API key has {exc.num_active} unfinished jobs; adding {adding} would pass the limit of "
                       f"{exc.limit} (jobs.max_jobs_per_key). Wait for some to finish.", retry_after_s=retry_after_s)


async def _owned_job(request: web.Request) -> Job:
    service = request.app[JOBS]
    job_id = request.match_info["job_id"]
    job = await service.store.get_job(job_id)
    if job is None or job.owner != owner_of(request) or job.batch_id:
        raise not_found("job", job_id)
    return job


def _job_response(job: Job, status: int = 200) -> web.Response:
    headers = {"Location": f"/v1/jobs/{job.id}"} if status == 202 else None
    return json_response(job_view(job), status, headers)


async def submit_job(service: JobsService, owner: str, kind: str, body: bytes, *, priority: int = 0,
                     metadata: dict[str, str] | None = None, deferred: bool = False) -> Job:
    """Store a new queued job and wake the runner.

    Raises:
        SluiceError: 429 with ``Retry-After`` when the owner has ``jobs.max_jobs_per_key`` unfinished jobs.
    """
    now_s = time.time()
    job = Job(id=new_job_id(), owner=owner, kind=kind, body=body, priority=priority, metadata=metadata or {},
              created_at=now_s, expires_at=now_s + COMPLETION_WINDOW_S, deferred=deferred)
    try:
        await service.store.add_jobs([job], service.config.jobs.max_jobs_per_key)
    except TooManyJobsError as exc:
        raise too_many_jobs(exc, 1, service.runner.retry_after_s(service.config.admission.max_retry_after_s)) from None
    service.runner.notify()
    return job


# ---------------------------------------------------------------------------------------------- handlers


async def create_job(request: web.Request) -> web.Response:
    """``POST /v1/jobs``: queue one chat completion request; 202 with the job and ``Location``."""
    service = request.app[JOBS]
    owner = owner_of(request)
    body = await read_json_object(request)
    priority = body.pop("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise SluiceError(ErrorCode.INVALID_VALUE, f"priority must be an integer in [{MIN_PRIORITY}, "
                          f"{MAX_PRIORITY}] (larger runs first, inside the batch tier)", param="priority")
    metadata = check_metadata(body.pop("metadata", None))
    encoded = validate_request_body(service.config, KIND_CHAT, body, request.app[FLEET].model_names())
    await request.app[PIPELINE].check(KIND_CHAT, encoded, lowest_tier(service.config).name)
    job = await submit_job(service, owner, KIND_CHAT, encoded, priority=priority, metadata=metadata)
    request[REQUEST_LOG].update(job_id=job.id, outcome="queued")
    return _job_response(job, 202)


async def get_job(request: web.Request) -> web.Response:
    """``GET /v1/jobs/{job_id}``."""
    return _job_response(await _owned_job(request))


async def list_jobs(request: web.Request) -> web.Response:
    """``GET /v1/jobs``: the caller's jobs, newest first (``limit`` 1–100, default 20; ``after`` = a job id)."""
    limit, after = page_params(request)
    jobs, has_more = await request.app[JOBS].store.list_jobs(owner_of(request), limit, after)
    return json_response(list_view([job_view(job) for job in jobs], has_more))


async def delete_job(request: web.Request) -> web.Response:
    """``DELETE /v1/jobs/{job_id}``: cancel an unfinished job (200, the job, now ``cancelled``); delete a finished
    one (200, ``{"id", "object": "job.deleted", "deleted": true}``; a later GET answers 404)."""
    service = request.app[JOBS]
    job = await _owned_job(request)
    if not job.is_final:
        await service.runner.cancel(job)
        return _job_response(await service.store.get_job(job.id) or job)
    deleted = await service.store.delete_job(job.id)
    return json_response({"id": job.id, "object": "job.deleted", "deleted": deleted})


# ---------------------------------------------------------------------------------------------- deferral


async def defer_shed_request(request: web.Request, kind: str, tier: TierConfig, error: SluiceError,
                             stream: bool = False) -> web.Response | None:
    """Turn a request admission shed with 503 into a job, when the tier or the client allows it.

    Args:
        request: the sync completion request (its body was already read and validated by the handler).
        kind: ``chat`` or ``completion``.
        tier: the tier the request was served in.
        error: the shed error.
        stream: the request asked for a stream: deferred only when its client asks (``x-sluice-defer: allow``),
            not by the tier's ``defer_on_overload`` alone — an SSE client reads a 202 job object as an empty
            stream (the OpenAI SDK yields no chunk and raises nothing), where a 503 with ``Retry-After`` is retried.

    Returns:
        202 with the job object and ``Location``; or None when deferral does not apply (not a deferrable 503,
        neither ``defer_on_overload`` (for a request that does not stream) nor ``x-sluice-defer: allow``, jobs not
        set up, or the key's job limit is reached) and the caller raises ``error`` as usual.
    """
    if error.code not in DEFERRABLE_CODES or JOBS not in request.app:
        return None
    asked = request.headers.get(DEFER_HEADER, "").strip().lower() == DEFER_ALLOW
    if not (asked or (tier.defer_on_overload and not stream)):
        return None
    service = request.app[JOBS]
    body = openai_api.decode_json(await request.read())
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    try:
        job = await submit_job(service, owner_of(request), kind, msgspec.json.encode(body), deferred=True)
    except (SluiceError, *STORE_UNAVAILABLE_ERRORS):
        return None
    request[REQUEST_LOG].update(outcome="deferred", job_id=job.id, shed_code=error.code.value)
    return _job_response(job, 202)


STORE_RETRY_AFTER_S = 5


def store_unavailable_as_503(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                             ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Wrap a jobs / files / batches handler: a store that cannot be reached answers 503 ``store_unavailable``
    with ``Retry-After`` instead of a 500."""

    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except STORE_UNAVAILABLE_ERRORS as exc:
            raise SluiceError(ErrorCode.STORE_UNAVAILABLE, f"the job store is unavailable ({type(exc).__name__}); "
                              "retry later", retry_after_s=STORE_RETRY_AFTER_S) from None

    return guarded


def setup_job_routes(app: web.Application) -> None:
    app.router.add_post("/v1/jobs", store_unavailable_as_503(create_job))
    app.router.add_get("/v1/jobs", store_unavailable_as_503(list_jobs))
    app.router.add_get("/v1/jobs/{job_id}", store_unavailable_as_503(get_job))
    app.router.add_delete("/v1/jobs/{job_id}", store_unavailable_as_503(delete_job))
