"""The request pipeline: parse → classify → tokenize → cap → admit → generate → respond, one implementation that
the HTTP handlers (``gateway.http.completions``) and the async job runner (``gateway.jobs``) both call.

::

    parse(kind, body bytes)            OpenAI schema (400), served model (404), unsupported fields (400)
    classify                           HTTP: API key, tier header, service_tier → Principal; jobs: the lowest tier
    tokenize(kind, body)               chat template or prompts, off the event loop; a prompt whose byte length
                                       alone proves it past the context is a 400 before any encoding
    plan(kind, body, principal, …)     n, stop strings, route to a pool, cap max_tokens → a Generation
    admit(plan)                        cold-start check, tiered queues (429/503 with Retry-After)
    plan.generation.start()            Generate to the reserved workers; TextEvent / FinishEvent out
    respond: collect(plan)             the chat.completion / text_completion object (HTTP streams it as SSE instead)
    close(plan)                        abort what still runs on a worker, give every reservation back

Validation and admission finish before any byte of a response is sent, so bad input or a shed request is a JSON
error, never an SSE stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.admission.caps import CapDecision
from gateway.fleet.fleet import Fleet
from gateway.fleet.pools import PoolRuntime, Route
from gateway.metrics import Metrics
from gateway.pipeline import openai_api
from gateway.pipeline.openai_api import OpenAIRequest
from gateway.pipeline.choice_state import FinishEvent
from gateway.pipeline.classify import Principal
from gateway.pipeline.generate import Generation
from gateway.pipeline.logprobs import LogprobFormatter, TokenLogprob
from gateway.pipeline.responses import chat_completion, text_completion
from gateway.pipeline.tokenize import PromptTooLong, Tokenizer
from gateway.pipeline.upstream_fit import check_servable, unservable_field, upstream_prompts
from shared.config import Config
from shared.errors import ErrorCode, SluiceError
from shared.protocol import SamplingParams

MAX_PROMPTS_PER_REQUEST = 64

Kind = Literal["chat", "completion"]


@dataclass
class Plan:
    """One request after validation, tokenization, routing and capping: ready to admit.

    Attributes:
        kind: ``chat`` or ``completion``.
        request_id: the id the request carries to the workers and into the response id.
        body: the parsed request.
        principal: who asks, in which tier.
        route: the pool that serves it (its tier's degrade pool under pressure).
        prompt_ids: ``[num_prompts][prompt tokens]`` token ids.
        caps: the output cap of each prompt (``gateway.admission.caps``).
        generation: its choices' runs on workers.
        arrival_s: ``time.perf_counter()`` when the request arrived.
        logprob_formatter: names the tokens of the answer's log-probabilities; None when not asked for.
        prompt_chars: characters of each prompt's text (completions ``text_offset`` counts from there).
    """

    kind: Kind
    request_id: str
    body: OpenAIRequest
    principal: Principal
    route: Route
    prompt_ids: list[list[int]]
    caps: list[CapDecision]
    generation: Generation
    arrival_s: float
    logprob_formatter: LogprobFormatter | None = None
    prompt_chars: list[int] = field(default_factory=list)

    def logprobs_object(self, index: int, entries: list[TokenLogprob]) -> dict | None:
        """Return choice ``index``'s ``logprobs`` object for ``entries`` (a whole answer or one chunk's tokens);
        None when the request did not ask for log-probabilities."""
        if self.logprob_formatter is None:
            return None
        if self.kind == "chat":
            return self.logprob_formatter.chat(entries)
        return self.logprob_formatter.completion(entries, self.prompt_chars[index // self.generation.n])

    @property
    def model_name(self) -> str:
        """Return the model that answers (the degrade pool's when the request was degraded)."""
        return self.route.runtime.config.model_name

    @property
    def response_id(self) -> str:
        """Return the OpenAI response id: ``chatcmpl-<request id>`` or ``cmpl-<request id>``."""
        return f"chatcmpl-{self.request_id}" if self.kind == "chat" else f"cmpl-{self.request_id}"


class RequestPipeline:
    """The steps of one completion request, shared by HTTP and async jobs.

    Args:
        config: the whole config (gateway limits, model context).
        fleet: the pools (routing, cold starts, admission per pool).
        tokenizer: the served model's tokenizer.
        metrics: the gateway's metrics (token counts, timings of every generation).
    """

    def __init__(self, config: Config, fleet: Fleet, tokenizer: Tokenizer, metrics: Metrics) -> None:
        self.config = config
        self.fleet = fleet
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.logprob_formatter = LogprobFormatter(tokenizer)

    def parse(self, kind: Kind, raw_body: bytes) -> OpenAIRequest:
        """Decode and validate a request body against its OpenAI schema; check that its model is served.

        Raises:
            SluiceError: 400 for a malformed or unsupported request, 404 ``model_not_found``.
        """
        schema = openai_api.ChatCompletionRequest if kind == "chat" else openai_api.CompletionRequest
        body = openai_api.decode_body(raw_body, schema)
        self.fleet.runtime_for_model(body.model)  # 404 model_not_found naming the served models
        openai_api.check_unsupported(body)
        return body

    async def tokenize(self, kind: Kind, body: OpenAIRequest, context_tokens: int | None = None) -> list[list[int]]:
        """Return the prompts' token ids: the chat template applied to the messages, or the completion prompts
        (strings tokenized, token ids checked).

        A text prompt past the context costs little: one of B bytes has at least B ÷
        ``tokenizer.max_token_bytes`` tokens, so one that long is refused before encoding; the others are encoded
        under the bound of the context (``Tokenizer``'s probe stops early on a dense text past it).

        Args:
            context_tokens: the context to check against; None = what the model's pool gives now (its ready
                workers' context and KV, else ``model.max_model_len_tokens``).

        Raises:
            SluiceError: 400 for too many, empty or out-of-vocabulary prompts; 400 ``context_length_exceeded`` for
                a text prompt that leaves no room for output (the exact check of token prompts is the cap step's).
        """
        if context_tokens is None:  # the context the pool's ready workers give now
            context_tokens = self.fleet.runtime_for_model(body.model).pool.max_model_len_tokens(
                self.config.model.max_model_len_tokens)
        if isinstance(body, openai_api.ChatCompletionRequest):
            messages = openai_api.chat_messages(body)
            num_bytes = sum(len(m["content"].encode()) for m in messages)
            self._check_prompt_bytes(num_bytes, context_tokens, "messages")
            try:
                return [await self.tokenizer.encode_chat(messages, max_tokens=context_tokens - 1)]
            except PromptTooLong as exc:
                raise _too_long(context_tokens, exc.num_tokens_at_least, "messages") from None
        return await self._completion_prompt_ids(body, context_tokens)

    def _check_prompt_bytes(self, num_bytes: int, context_tokens: int, param: str) -> None:
        """Raise 400 ``context_length_exceeded`` when ``num_bytes`` of prompt text cannot be fewer tokens than
        ``context_tokens`` (each token stands for at most ``tokenizer.max_token_bytes`` bytes)."""
        min_tokens = -(-num_bytes // self.tokenizer.max_token_bytes)
        if min_tokens >= context_tokens:
            raise _too_long(context_tokens, min_tokens, param, f" ({num_bytes} bytes of text)")

    async def _completion_prompt_ids(self, body: openai_api.CompletionRequest,
                                     context_tokens: int) -> list[list[int]]:
        prompts = openai_api.completion_prompts(body)
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise SluiceError(ErrorCode.INVALID_VALUE, f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request",
                              param="prompt")
        vocab_size = self.tokenizer.vocab_size
        prompt_ids: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                self._check_prompt_bytes(len(prompt.encode()), context_tokens, param)
                try:
                    ids = await self.tokenizer.encode_text(prompt, max_tokens=context_tokens - 1)
                except PromptTooLong as exc:
                    raise _too_long(context_tokens, exc.num_tokens_at_least, param) from None
            else:
                ids = prompt
            if not ids:
                raise SluiceError(ErrorCode.INVALID_VALUE, "the prompt must not be empty", param=param)
            if any(t < 0 or t >= vocab_size for t in ids):
                raise SluiceError(ErrorCode.INVALID_VALUE, f"token ids must be in [0, {vocab_size - 1}]",
                                  param=param)
            prompt_ids.append(ids)
        return prompt_ids

    def plan(self, kind: Kind, body: OpenAIRequest, principal: Principal, prompt_ids: list[list[int]],
             request_id: str, arrival_s: float) -> Plan:
        """Check ``n`` and the stop strings, route to a pool, cap each prompt's output; return the plan.

        Raises:
            SluiceError: 400 for ``n`` over ``gateway.max_n``, bad stop strings, or a prompt past the context.
        """
        config = self.config
        n = body.n or 1
        _check_max_n(n, config.gateway.max_n)
        stop_strings = openai_api.stop_strings(body.stop, config.gateway.max_stop_sequences)
        route = self.fleet.route(body.model, principal.tier,
                                 lambda pool: unservable_field(body, pool.config) is None)
        runtime = route.runtime
        check_servable(body, runtime)
        caps = self._caps(kind, body, runtime, principal.tier.name, prompt_ids)
        generation = Generation(
            request_id=request_id, prompts=prompt_ids, max_tokens=[cap.max_tokens for cap in caps], n=n,
            sampling=_sampling(body), stop_strings=stop_strings, principal=principal, admission=runtime.admission,
            pool=runtime.pool, tokenizer=self.tokenizer, metrics=self.metrics,
            first_token_timeout_s=config.gateway.first_token_timeout_s,
            stall_timeout_s=config.gateway.stall_timeout_s, arrival_s=arrival_s,
            cache_key=body.prompt_cache_key or "", ignore_eos=body.ignore_eos,
            upstream_prompts=(upstream_prompts(body, runtime.config.engine, self.tokenizer)
                              if runtime.config.backend == "openai" else None),
        )
        plan = Plan(kind, request_id, body, principal, route, prompt_ids, caps, generation, arrival_s)
        if generation.sampling.logprobs:
            plan.logprob_formatter = self.logprob_formatter
            if isinstance(body, openai_api.CompletionRequest):
                plan.prompt_chars = [len(p) if isinstance(p, str) else len(self.tokenizer.decode(p))
                                     for p in openai_api.completion_prompts(body)]
        return plan

    async def admit(self, plan: Plan) -> None:
        """Start a worker for a pool that has none ready (or reject when its cold start is too late), then wait in
        the tier queues until every choice has room on a worker.

        Raises:
            SluiceError: 400 when the request needs more sequences at once than its pool can ever run for its tier
                (:meth:`_check_sequences_fit`); 429/503 with ``Retry-After`` when shed.
        """
        generation = plan.generation
        self._check_sequences_fit(plan.route.runtime, plan.principal.tier.name, len(generation.prompts), generation.n)
        try:
            self.fleet.check_cold_start(plan.route.runtime, plan.principal.tier.name, generation.counts_sheds)
        except SluiceError as exc:
            generation.note_shed(exc.code)
            raise
        await generation.admit()

    def _check_sequences_fit(self, runtime: PoolRuntime, tier: str, num_prompts: int, n: int) -> None:
        """Refuse a request whose choices (``num_prompts`` × ``n``) outnumber the sequence slots ``runtime``'s pool
        can ever give ``tier`` at once (:meth:`Fleet.max_sequence_slots` less the slots the tiers above reserve): its
        choices are admitted together, so it would hold the slots it got while waiting out its queue deadline for
        the rest, and then get a 503 that no retry can change. Nothing is refused before a worker of the pool said
        Hello (the slots are not known yet).

        Raises:
            SluiceError: 400 ``invalid_value`` naming ``n`` (``prompt`` for several prompts with ``n`` 1).
        """
        needed = num_prompts * n
        if needed <= 1:
            return
        total_slots = self.fleet.max_sequence_slots(runtime)
        if total_slots is None:
            return
        usable_slots = runtime.admission.usable_sequence_slots(tier, total_slots)
        if needed > usable_slots:
            shape = f"{num_prompts} prompts × n={n}" if num_prompts > 1 else f"n={n}"
            raise SluiceError(ErrorCode.INVALID_VALUE,
                              f"This request needs {needed} sequences at once ({shape}), but pool '{runtime.name}' "
                              f"runs at most {usable_slots} at once for the '{tier}' tier. Lower n, or send fewer "
                              f"prompts per request.", param="n" if n > 1 else "prompt")

    async def collect(self, plan: Plan) -> dict[str, Any]:
        """Run the started generation to its end; return the chat.completion / text_completion object.

        Raises:
            SluiceError: 502/504 when a worker fails or times out.
        """
        generation = plan.generation
        finish_reasons = ["stop"] * len(generation.choices)
        while (event := await generation.next_event()) is not None:
            if isinstance(event, FinishEvent):
                finish_reasons[event.index] = event.finish_reason
        texts = [generation.text(i) for i in range(len(generation.choices))]
        logprobs = [plan.logprobs_object(i, generation.logprobs(i)) for i in range(len(generation.choices))]
        build = chat_completion if plan.kind == "chat" else text_completion
        return build(plan.response_id, int(time.time()), plan.model_name, texts, finish_reasons,
                     generation.usage().to_dict(), logprobs)

    def _caps(self, kind: Kind, body: OpenAIRequest, runtime: PoolRuntime, tier: str, prompt_ids: list[list[int]],
              context_tokens: int | None = None) -> list[CapDecision]:
        """Return each prompt's output cap on ``runtime``'s pool in ``tier``.

        Args:
            context_tokens: the context; None = the longest sequence the pool's KV can give the tier now.

        Raises:
            SluiceError: 400 ``context_length_exceeded`` for a prompt past the context (a 400 now, not a wait),
                ``invalid_value`` for ``max_tokens`` below 1.
        """
        if context_tokens is None:
            context_tokens = runtime.pool.max_model_len_tokens(
                self.config.model.max_model_len_tokens, runtime.capper.reserved_kv_fraction_above(tier))
        requested = openai_api.requested_max_tokens(body)
        prompt_param = "messages" if kind == "chat" else "prompt"
        return [runtime.capper.cap(tier, requested, len(ids), param=_max_tokens_param(body),
                                   prompt_param=prompt_param, max_model_len_tokens=context_tokens)
                for ids in prompt_ids]

    async def check(self, kind: Kind, raw_body: bytes, tier: str) -> None:
        """Run the steps before admission that need no client against the configured context
        (``model.max_model_len_tokens``): parse, ``n`` (``gateway.max_n``, and the sequence slots the pool can ever
        give ``tier`` once a worker of it said Hello), stop strings, tokenize, cap in ``tier``. The job endpoint's
        check at submission: a request that can never run is a 400 then, not a job that fails when it runs. Not the
        context the ready workers give now: a job waits out a time when fewer or smaller workers are up.

        Raises:
            SluiceError: as :meth:`parse`, :meth:`tokenize` and :meth:`plan` (4xx naming the field).
        """
        body = self.parse(kind, raw_body)
        n = body.n or 1
        _check_max_n(n, self.config.gateway.max_n)
        openai_api.stop_strings(body.stop, self.config.gateway.max_stop_sequences)
        runtime = self.fleet.runtime_for_model(body.model)
        check_servable(body, runtime)
        context_tokens = self.config.model.max_model_len_tokens
        prompt_ids = await self.tokenize(kind, body, context_tokens)
        self._check_sequences_fit(runtime, tier, len(prompt_ids), n)
        if runtime.config.backend == "openai":
            upstream_prompts(body, runtime.config.engine, self.tokenizer)  # token ids an engine cannot take
        self._caps(kind, body, runtime, tier, prompt_ids, context_tokens)

    async def run_completion(self, kind: Kind, raw_body: bytes, *, principal: Principal, request_id: str,
                             on_admitted: Callable[[], None] | None = None) -> dict[str, Any]:
        """Run one non-streamed completion request without a client connection (the job runner's path).

        Args:
            kind: ``chat`` or ``completion``.
            raw_body: the request body (JSON).
            principal: whose request and in which tier (the job runner passes the lowest tier).
            request_id: the id the request carries to the worker and into the response id.
            on_admitted: called once admission has reserved room on a worker.

        Returns:
            The chat.completion (or text_completion) object.

        Raises:
            SluiceError: as the HTTP handlers (4xx bad input, 429/503 shed, 502/504 worker failure). A 503 shed
                is not counted in the tier's rejections (``/status``, ``sluice_rejected_total``: the 503s answered):
                the job runner puts the job back in its queue.
        """
        arrival_s = time.perf_counter()
        body = self.parse(kind, raw_body)
        prompt_ids = await self.tokenize(kind, body)
        plan = self.plan(kind, body, principal, prompt_ids, request_id, arrival_s)
        plan.generation.counts_sheds = False
        try:
            try:
                await self.admit(plan)
            except SluiceError as exc:  # shed: a 503 goes back to the job queue (no client gets it), a 429 counts
                if exc.status < 500:
                    plan.generation.count_sheds()
                raise
            if on_admitted is not None:
                on_admitted()
            plan.generation.start()
            return await self.collect(plan)
        finally:
            plan.generation.close()


def _check_max_n(n: int, max_n: int) -> None:
    """Refuse ``n`` over ``gateway.max_n``.

    Raises:
        SluiceError: 400 ``invalid_value`` naming ``n``.
    """
    if n > max_n:
        raise SluiceError(ErrorCode.INVALID_VALUE, f"n must be at most {max_n}", param="n")


def _too_long(context_tokens: int, num_tokens_at_least: int, param: str, detail: str = "") -> SluiceError:
    return SluiceError(
        ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        f"This model's maximum context length is {context_tokens} tokens, but the prompt has at least "
        f"{num_tokens_at_least} tokens{detail}, leaving no room for output. Shorten the messages or the prompt.",
        param=param)


def _sampling(body: OpenAIRequest) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    logprobs, top_logprobs = openai_api.logprobs_wanted(body)
    return SamplingParams(
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=top_k,
        seed=body.seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def _max_tokens_param(body: OpenAIRequest) -> str:
    if isinstance(body, openai_api.ChatCompletionRequest) and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"
