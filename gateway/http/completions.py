"""``POST /v1/chat/completions`` and ``POST /v1/completions``: the HTTP side of the request pipeline.

The steps themselves are :class:`~gateway.pipeline.request.RequestPipeline`'s; this module reads the body,
classifies the caller from its headers, offers a shed request deferral to an async job, writes the answer as JSON or
as an SSE stream, and fills the request's log line. A stream's headers are sent once its first event exists, so a
worker that fails before the first token is a plain 502/504 too; later failures go in-band. Successful responses
carry ``x-sluice-queue-ms`` and ``x-sluice-tier`` (the tier that served them).
"""

from __future__ import annotations

import functools
import time

import msgspec
from aiohttp import web

from gateway.jobs.api import defer_shed_request
from gateway.pipeline.choice_state import TextEvent
from gateway.pipeline.classify import Principal
from gateway.pipeline.openai_api import OpenAIRequest
from gateway.pipeline.request import Kind, Plan
from gateway.pipeline.responses import DONE_EVENT, ChunkFactory, sse_error_event
from gateway.state import METRICS, PIPELINE, REQUEST_ID, REQUEST_LOG, RESOLVER
from shared.errors import SluiceError

QUEUE_MS_HEADER = "x-sluice-queue-ms"
TIER_HEADER = "x-sluice-tier"  # the tier that served the request (the request header of that name can only lower it)
DEGRADED_HEADER = "x-sluice-degraded"  # "1" when the tier's degrade pool answered instead of the model's


def _principal(request: web.Request, body: OpenAIRequest) -> Principal:
    """Authenticate the request and pick its tier (a client may only lower it: header or ``service_tier``)."""
    resolver = request.app[RESOLVER]
    return resolver.resolve(request.headers.get("Authorization"), request.headers.get(resolver.tier_header),
                            body.service_tier)


async def serve_completion(request: web.Request, kind: Kind) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (``kind`` "chat") and ``POST /v1/completions`` ("completion"), bound to their
    kind by :data:`chat_completions` and :data:`completions` (a wrapper coroutine would be one more frame resumed on
    every token)."""
    arrival_s = time.perf_counter()
    pipeline, metrics = request.app[PIPELINE], request.app[METRICS]
    body = pipeline.parse(kind, await request.read())  # over client_max_size: HTTPRequestEntityTooLarge → 413
    principal = _principal(request, body)
    prompt_ids = await pipeline.tokenize(kind, body)
    plan = pipeline.plan(kind, body, principal, prompt_ids, request[REQUEST_ID], arrival_s)
    generation = plan.generation
    log_fields = request[REQUEST_LOG]
    log_fields.update(kind=kind, stream=bool(body.stream), n=generation.n,
                      prompt_tokens=sum(map(len, prompt_ids)), max_tokens=plan.caps[0].max_tokens,
                      max_tokens_limited_by=plan.caps[0].limited_by, tier=principal.tier.name,
                      tenant=principal.tenant, pool=plan.route.runtime.name)
    if plan.route.degraded:
        log_fields.update(degraded=True, requested_pool=plan.route.requested.name)
    metrics.request_started()
    generation.counts_sheds = False  # a shed is a rejection only once no job was made of it (below)
    try:
        try:
            await pipeline.admit(plan)
        except SluiceError as exc:  # shed: an async job instead, where the tier or the client allows
            deferred = await defer_shed_request(request, kind, principal.tier, exc, stream=bool(body.stream))
            generation.count_sheds(deferred=deferred is not None)
            if deferred is None:
                raise
            return deferred
        log_fields["queue_ms"] = round(generation.queue_wait_s * 1000, 2)
        generation.start()
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return await _stream(request, plan, include_usage)
        payload = await pipeline.collect(plan)
        log_fields["outcome"] = "ok"
        return web.json_response(payload, dumps=_dumps, headers=_queue_header(plan))
    finally:
        generation.close()
        metrics.request_ended()
        usage = generation.usage()
        metrics.prompt_tokens.inc(usage.prompt_tokens)
        metrics.completion_tokens.inc(usage.completion_tokens)
        metrics.e2e_latency.observe(time.perf_counter() - arrival_s)
        log_fields.update(completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens,
                          ttft_ms=None if generation.ttft_s is None else round(generation.ttft_s * 1000, 2),
                          worker_ttft_ms=generation.worker_ttft_ms, retries=generation.num_retries)


chat_completions = functools.partial(serve_completion, kind="chat")
completions = functools.partial(serve_completion, kind="completion")


def _queue_header(plan: Plan) -> dict[str, str]:
    headers = {QUEUE_MS_HEADER: f"{plan.generation.queue_wait_s * 1000:.1f}", TIER_HEADER: plan.generation.tier}
    if plan.route.degraded:
        headers[DEGRADED_HEADER] = "1"
    return headers


def _dumps(payload: object) -> str:
    return msgspec.json.encode(payload).decode()


async def _stream(request: web.Request, plan: Plan, include_usage: bool) -> web.StreamResponse:
    generation = plan.generation
    first_event = await generation.next_event()  # errors before the first byte are plain JSON errors
    chunks = ChunkFactory(plan.kind, plan.response_id, int(time.time()), plan.model_name, include_usage)
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
        **_queue_header(plan),
    })
    response._send_headers_immediately = False  # aiohttp: the headers leave with the first chunk, in one send
    await response.prepare(request)
    request[REQUEST_LOG]["outcome"] = "client_disconnected"
    # Events that are ready together leave in one write (one send): the role chunks with the first text, the last
    # text with its finish chunk, the usage chunk, [DONE] and the end of the chunked body.
    pending: list[bytes] = [chunks.role(c.index) for c in generation.choices] if plan.kind == "chat" else []
    event = first_event
    try:
        while event is not None:
            if isinstance(event, TextEvent):
                pending.append(chunks.text(event.index, event.text, plan.logprobs_object(event.index, event.logprobs)))
            else:
                pending.append(chunks.finish(event.index, event.finish_reason))
            if not generation.has_event():
                await response.write(b"".join(pending))
                pending.clear()
            event = await generation.next_event()
        if include_usage:
            pending.append(chunks.usage(generation.usage().to_dict()))
        request[REQUEST_LOG]["outcome"] = "ok"
    except SluiceError as exc:
        request[REQUEST_LOG].update(outcome="error_in_band", error_code=exc.code.value)
        pending.append(sse_error_event(exc))
    pending.append(DONE_EVENT)
    await response.write_eof(b"".join(pending))
    return response
