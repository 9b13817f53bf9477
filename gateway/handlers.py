"""HTTP handlers of the OpenAI endpoints and the operational ones (models, health, readiness, status, metrics).

Request life cycle (DESIGN.md): parse and validate → authenticate and classify (tier) → tokenize (off the loop) →
cap output length (tier, pressure, context) → admit (tiered queues; 429/503 with Retry-After) → route (the
admission reservation names the worker) → generate → stream back or collect. Validation and admission finish
before any byte of the response is sent, so bad input or a shed request is a JSON error, never an SSE stream
(BC06, BC25). A stream's headers are sent once its first event exists, so a worker that fails before the first
token is a plain 502/504 too; later failures go in-band. Successful responses carry ``x-sluice-queue-ms`` and
``x-sluice-tier`` (the tier that served them).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import msgspec
from aiohttp import web

from gateway import openai_api
from gateway.fleet import Route
from gateway.generation import FinishEvent, Generation, TextEvent
from gateway.jobs.api import defer_shed_request
from gateway.state import (
    CONFIG,
    FLEET,
    GATEWAY_ID,
    METRICS,
    POOL,
    REQUEST_ID,
    REQUEST_LOG,
    RESOLVER,
    STARTED_AT,
    TIER_COUNTERS,
    TOKENIZER,
)
from gateway.tiers import Principal
from gateway.streaming import DONE_EVENT, ChunkFactory, chat_completion, sse_error_event, text_completion
from shared.errors import ErrorCode, SluiceError
from shared.protocol import SamplingParams

MAX_PROMPTS_PER_REQUEST = 64
QUEUE_MS_HEADER = "x-sluice-queue-ms"
TIER_HEADER = "x-sluice-tier"  # the tier that served the request (the request header of that name can only lower it)
DEGRADED_HEADER = "x-sluice-degraded"  # "1" when the tier's degrade pool answered instead of the model's (issue 7)


def _check_model(app: web.Application, model: str) -> None:
    app[FLEET].runtime_for_model(model)  # 404 model_not_found naming the served models


def _route(app: web.Application, model: str, principal: Principal) -> Route:
    """Pick the pool of the request's model (or its tier's degrade pool under pressure); start a worker there when
    none is ready, or reject at once when its cold start cannot make the tier's deadline (503, Retry-After)."""
    fleet = app[FLEET]
    route = fleet.route(model, principal.tier)
    fleet.check_cold_start(route.runtime, principal.tier.name)
    return route


async def _read_body(request: web.Request) -> bytes:
    return await request.read()  # raises HTTPRequestEntityTooLarge over client_max_size (→ 413 envelope)


def _principal(request: web.Request, body) -> Principal:
    """Authenticate the request and pick its tier (a client may only lower it: header or ``service_tier``)."""
    resolver = request.app[RESOLVER]
    return resolver.resolve(request.headers.get("Authorization"), request.headers.get(resolver.tier_header),
                            body.service_tier)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    arrival_s = time.perf_counter()
    body = openai_api.decode_body(await _read_body(request), openai_api.ChatCompletionRequest)
    _check_model(request.app, body.model)
    openai_api.check_unsupported(body)
    principal = _principal(request, body)
    messages = openai_api.chat_messages(body)
    prompt_ids = await request.app[TOKENIZER].encode_chat(messages)
    return await _serve(request, "chat", body, principal, [prompt_ids], arrival_s, prompt_param="messages")


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    arrival_s = time.perf_counter()
    body = openai_api.decode_body(await _read_body(request), openai_api.CompletionRequest)
    _check_model(request.app, body.model)
    openai_api.check_unsupported(body)
    principal = _principal(request, body)
    prompt_ids = await _completion_prompt_ids(request.app[TOKENIZER], body)
    return await _serve(request, "completion", body, principal, prompt_ids, arrival_s, prompt_param="prompt")


async def _completion_prompt_ids(tokenizer, body: openai_api.CompletionRequest) -> list[list[int]]:
    """Tokenize a completions request's prompts (strings or token ids), checking count, emptiness and ids."""
    prompts = openai_api.completion_prompts(body)
    if len(prompts) > MAX_PROMPTS_PER_REQUEST:
        raise SluiceError(ErrorCode.INVALID_VALUE, f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request",
                          param="prompt")
    prompt_ids: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        ids = await tokenizer.encode_text(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise SluiceError(ErrorCode.INVALID_VALUE, "the prompt must not be empty", param=param)
        if any(t < 0 or t >= tokenizer.vocab_size for t in ids):
            raise SluiceError(ErrorCode.INVALID_VALUE,
                              f"token ids must be in [0, {tokenizer.vocab_size - 1}]", param=param)
        prompt_ids.append(ids)
    return prompt_ids


def _sampling(body: openai_api.ChatCompletionRequest | openai_api.CompletionRequest) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    return SamplingParams(
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=top_k,
        seed=body.seed,
    )


def _max_tokens_param(body) -> str:
    if isinstance(body, openai_api.ChatCompletionRequest) and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


async def _serve(request: web.Request, kind: str, body, principal: Principal, prompt_ids: list[list[int]],
                 arrival_s: float, prompt_param: str) -> web.StreamResponse:
    app = request.app
    config, metrics = app[CONFIG], app[METRICS]
    n = body.n or 1
    if n > config.gateway.max_n:
        raise SluiceError(ErrorCode.INVALID_VALUE, f"n must be at most {config.gateway.max_n}", param="n")
    stop_strings = openai_api.stop_strings(body.stop, config.gateway.max_stop_sequences)
    route = app[FLEET].route(body.model, principal.tier)
    runtime = route.runtime
    pool = runtime.pool
    context_tokens = pool.max_model_len_tokens(config.model.max_model_len_tokens)
    requested = openai_api.requested_max_tokens(body)
    decisions = [
        runtime.capper.cap(principal.tier.name, requested, len(ids), param=_max_tokens_param(body),
                           prompt_param=prompt_param, max_model_len_tokens=context_tokens)
        for ids in prompt_ids
    ]
    max_tokens = [decision.max_tokens for decision in decisions]
    request_id: str = request[REQUEST_ID]
    generation = Generation(
        request_id=request_id, prompts=prompt_ids, max_tokens=max_tokens, n=n, sampling=_sampling(body),
        stop_strings=stop_strings, principal=principal, admission=runtime.admission, pool=pool,
        tokenizer=app[TOKENIZER], metrics=metrics, first_token_timeout_s=config.gateway.first_token_timeout_s,
        stall_timeout_s=config.gateway.stall_timeout_s, arrival_s=arrival_s,
        cache_key=body.prompt_cache_key or "", ignore_eos=body.ignore_eos,
    )
    log_fields = request[REQUEST_LOG]
    log_fields.update(kind=kind, stream=bool(body.stream), n=n, prompt_tokens=sum(map(len, prompt_ids)),
                      max_tokens=max_tokens[0], max_tokens_limited_by=decisions[0].limited_by,
                      tier=principal.tier.name, tenant=principal.tenant, pool=runtime.name)
    if route.degraded:
        log_fields.update(degraded=True, requested_pool=route.requested.name)
    metrics.request_started()
    try:
        try:
            app[FLEET].check_cold_start(runtime, principal.tier.name)
            await generation.admit()
        except SluiceError as exc:  # shed: an async job instead, where the tier or the client allows (issue 6)
            deferred = await defer_shed_request(request, kind, principal.tier, exc)
            if deferred is None:
                raise
            return deferred
        log_fields["queue_ms"] = round(generation.queue_wait_s * 1000, 2)
        generation.start()
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return await _stream(request, kind, generation, include_usage, route)
        return await _collect(request, kind, generation, route)
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


def _response_id(kind: str, request_id: str) -> str:
    return f"chatcmpl-{request_id}" if kind == "chat" else f"cmpl-{request_id}"


async def _collect(request: web.Request, kind: str, generation: Generation, route: Route) -> web.Response:
    finish_reasons = ["stop"] * len(generation.choices)
    while (event := await generation.next_event()) is not None:
        if isinstance(event, FinishEvent):
            finish_reasons[event.index] = event.finish_reason
    texts = [generation.text(i) for i in range(len(generation.choices))]
    build = chat_completion if kind == "chat" else text_completion
    payload = build(_response_id(kind, request[REQUEST_ID]), int(time.time()), route.runtime.config.model_name,
                    texts, finish_reasons, generation.usage().to_dict())
    request[REQUEST_LOG]["outcome"] = "ok"
    return web.json_response(payload, dumps=_dumps, headers=_queue_header(generation, route))


def _queue_header(generation: Generation, route: Route) -> dict[str, str]:
    headers = {QUEUE_MS_HEADER: f"{generation.queue_wait_s * 1000:.1f}", TIER_HEADER: generation.tier}
    if route.degraded:
        headers[DEGRADED_HEADER] = "1"
    return headers


def _dumps(payload) -> str:
    return msgspec.json.encode(payload).decode()


async def _stream(request: web.Request, kind: str, generation: Generation, include_usage: bool,
                  route: Route) -> web.StreamResponse:
    first_event = await generation.next_event()  # errors before the first byte are plain JSON errors
    chunks = ChunkFactory(kind, _response_id(kind, request[REQUEST_ID]), int(time.time()),
                          route.runtime.config.model_name)
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
        "x-request-id": request[REQUEST_ID],
        **_queue_header(generation, route),
    })
    response._send_headers_immediately = False  # aiohttp: the headers leave with the first chunk, in one send
    await response.prepare(request)
    request[REQUEST_LOG]["outcome"] = "client_disconnected"
    # Events that are ready together leave in one write (one send): the role chunks with the first text, the last
    # text with its finish chunk, the usage chunk, [DONE] and the end of the chunked body.
    pending: list[bytes] = [chunks.role(c.index) for c in generation.choices] if kind == "chat" else []
    event = first_event
    try:
        while event is not None:
            if isinstance(event, TextEvent):
                pending.append(chunks.text(event.index, event.text))
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


# ---------------------------------------------------------------------- operational endpoints


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the served models, one per pool (the first pool's first)."""
    names = request.app[FLEET].model_names()
    return web.json_response({"object": "list", "data": [_model_card(request.app, name) for name in names]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``."""
    name = request.match_info["model"]
    _check_model(request.app, name)
    return web.json_response(_model_card(request.app, name))


def _model_card(app: web.Application, name: str) -> dict:
    config = app[CONFIG]
    pool = app[FLEET].runtime_for_model(name).pool
    return {"id": name, "object": "model", "created": int(app[STARTED_AT]), "owned_by": "sluice",
            "max_model_len": pool.max_model_len_tokens(config.model.max_model_len_tokens)}


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz`` (and ``GET /health``, the path vLLM and TGI serve): the process is up."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """``GET /readyz``: 200 once a worker said Hello — or when a pool scales from zero and can start one (requests
    wait through its cold start) — else 503 (also while draining, so balancers stop sending)."""
    fleet = request.app[FLEET]
    if fleet.draining:
        raise SluiceError(ErrorCode.DRAINING, "the gateway is shutting down", retry_after_s=1)
    clients = [client for runtime in fleet.runtimes.values() for client in runtime.pool.clients]
    ready = sum(1 for client in clients if client.ready)
    if not fleet.is_ready():
        raise SluiceError(ErrorCode.NO_WORKER, "no worker is ready yet", retry_after_s=1)
    return web.json_response({"status": "ready", "ready_workers": ready, "workers": len(clients)})


async def status(request: web.Request) -> web.Response:
    """``GET /status``: JSON snapshot of the model, pressure, admission queues per tier, and the workers with
    their breaker state and last capacity (``backend: "sim"``, ``simulator: true`` for the roofline simulator);
    ``gateway_id`` and ``fleet_tiers``, the tier counts of every gateway sharing Redis (``gateway.tier_counters``)."""
    app = request.app
    config = app[CONFIG]
    fleet = app[FLEET]
    admission = fleet.admission_snapshot()
    return web.json_response({
        "model": config.model.name,
        "pressure": admission["pressure"],
        "admission": admission,
        "max_model_len_tokens": app[POOL].max_model_len_tokens(config.model.max_model_len_tokens),
        "active_requests": app[METRICS].num_active_requests,
        "uptime_s": round(time.time() - app[STARTED_AT], 3),
        "workers": fleet.worker_status(),
        "local_workers": fleet.local_worker_status(),
        "fleet": fleet.snapshot(),
        "gateway_id": app[GATEWAY_ID],
        "fleet_tiers": app[TIER_COUNTERS].snapshot(),  # per tier summed over the gateways sharing Redis (issue 7)
    }, dumps=_dumps)


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format."""
    return web.Response(body=request.app[METRICS].render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def new_request_id() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------- async jobs (issue 6): the job runner's path


async def run_completion(app: web.Application, kind: str, body_json: bytes, *, principal: Principal,
                         request_id: str, on_admitted: Callable[[], None] | None = None) -> dict:
    """Run one completion request like the HTTP handlers do, without a client connection; return the response.

    Same steps as ``POST /v1/chat/completions`` / ``/v1/completions`` with ``stream`` off: validate, tokenize, cap,
    admit in ``principal``'s tier (the job runner passes the lowest tier), generate on a worker, collect.
    Cancelling the caller aborts the request on its worker (``Generation.close``).

    Args:
        app: the gateway application.
        kind: ``chat`` or ``completion``.
        body_json: the request body (JSON).
        principal: whose request and in which tier.
        request_id: the id the request carries to the worker and into the response id.
        on_admitted: called once admission has reserved room on a worker.

    Returns:
        The chat.completion (or text_completion) object.

    Raises:
        SluiceError: as the handlers (4xx bad input, 429/503 shed, 502/504 worker failure).
    """
    arrival_s = time.perf_counter()
    schema = openai_api.ChatCompletionRequest if kind == "chat" else openai_api.CompletionRequest
    body = openai_api.decode_body(body_json, schema)
    _check_model(app, body.model)
    openai_api.check_unsupported(body)
    if kind == "chat":
        prompt_ids = [await app[TOKENIZER].encode_chat(openai_api.chat_messages(body))]
    else:
        prompt_ids = await _completion_prompt_ids(app[TOKENIZER], body)
    prompt_param = "messages" if kind == "chat" else "prompt"
    config = app[CONFIG]
    n = body.n or 1
    if n > config.gateway.max_n:
        raise SluiceError(ErrorCode.INVALID_VALUE, f"n must be at most {config.gateway.max_n}", param="n")
    route = _route(app, body.model, principal)
    pool = route.runtime.pool
    context_tokens = pool.max_model_len_tokens(config.model.max_model_len_tokens)
    requested = openai_api.requested_max_tokens(body)
    max_tokens = [
        route.runtime.capper.cap(principal.tier.name, requested, len(ids), param=_max_tokens_param(body),
                                 prompt_param=prompt_param, max_model_len_tokens=context_tokens).max_tokens
        for ids in prompt_ids
    ]
    generation = Generation(
        request_id=request_id, prompts=prompt_ids, max_tokens=max_tokens, n=n, sampling=_sampling(body),
        stop_strings=openai_api.stop_strings(body.stop, config.gateway.max_stop_sequences), principal=principal,
        admission=route.runtime.admission, pool=pool, tokenizer=app[TOKENIZER], metrics=app[METRICS],
        first_token_timeout_s=config.gateway.first_token_timeout_s, stall_timeout_s=config.gateway.stall_timeout_s,
        arrival_s=arrival_s, cache_key=body.prompt_cache_key or "", ignore_eos=body.ignore_eos,
    )
    try:
        await generation.admit()
        if on_admitted is not None:
            on_admitted()
        generation.start()
        finish_reasons = ["stop"] * len(generation.choices)
        while (event := await generation.next_event()) is not None:
            if isinstance(event, FinishEvent):
                finish_reasons[event.index] = event.finish_reason
    finally:
        generation.close()
    texts = [generation.text(i) for i in range(len(generation.choices))]
    build = chat_completion if kind == "chat" else text_completion
    return build(_response_id(kind, request_id), int(time.time()), route.runtime.config.model_name, texts,
                 finish_reasons, generation.usage().to_dict())
