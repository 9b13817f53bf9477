"""One request's generation: admission of its choices, their runs on workers, turned into text events.

Per choice: admission ticket → reservation on a worker → ``Generate`` → worker token ids →
:class:`IncrementalDetokenizer` → :class:`StopStringMatcher` → text pieces. A stop string match aborts the choice on
its worker at once (finish_reason ``stop``). :meth:`Generation.close` aborts every choice still running and gives
back every reservation; handlers call it in ``finally`` so a client that disconnects (at any point: queued,
prefill or decode, stream or not) leaves its queue or makes the gateway send ``Abort``.

::

    prompt p, sample j  ──▶ choice index p * n + j ──▶ Generate(request_id = "<rid>-<index>", seed + index)

**n > 1 and several prompts**: one admission ticket per choice (each is one sequence on a worker, with its own KV
demand), all queued at the same moment, so they sit side by side in their tier's queue and start together when
capacity allows; the request waits until every choice is admitted, and if any is shed the request fails with that
error and the others leave the queue. The API key's rate limit counts the request once (on the first ticket).

**Worker health** (DESIGN.md, step 6): each choice has one first-token deadline, ``gateway.first_token_timeout_s``
from the moment its first ``Generate`` is sent, shared by all its attempts, and an inter-token stall deadline
(``gateway.stall_timeout_s``). A timeout or a worker failure counts against the worker's circuit breaker; the first
token (or a clean end) counts as a success. A choice that fails before its first token — so before any byte of it
reached the client — is retried once while its first-token deadline has time left, with a fresh ticket (no
rate-limit charge) that avoids the failed worker when another can serve; the retry's wait for admission and for
its first token both count against what is left. A first-token timeout leaves nothing, so the client waits at most
``first_token_timeout_s`` for a first token whatever the number of attempts. After its first token, a failure ends
the request: in-band for a stream that has started.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec
import structlog

from gateway.admission.controller import AdmissionController
from gateway.admission.tickets import Ticket
from gateway.pipeline.detokenize import IncrementalDetokenizer
from gateway.pipeline.logprobs import LogprobLedger, TokenLogprob
from gateway.metrics import Metrics
from gateway.pipeline.stop import StopStringMatcher
from gateway.pipeline.classify import Principal
from gateway.pipeline.tokenize import Tokenizer
from gateway.upstream.request_body import UpstreamPrompt
from gateway.workers.client import WorkerClient
from gateway.workers.pool import WorkerPool
from gateway.workers.reservation import Reservation
from gateway.workers.stream import RequestStream, StreamUpdate
from shared.errors import ErrorCode, SluiceError
from shared.protocol import Generate, SamplingParams

log = structlog.get_logger("sluice.gateway")

SEED_MODULUS = 2**63
MAX_ATTEMPTS_PER_CHOICE = 2  # the first try and one retry before the first byte
# Failures that may be retried on another worker when no token of the choice exists yet.
# server_overloaded: an upstream answered 429/503 (gateway.upstream); the retry waits in the tier queue.
RETRYABLE_CODES = frozenset({ErrorCode.WORKER_FAILED, ErrorCode.WORKER_TIMEOUT, ErrorCode.DRAINING,
                             ErrorCode.SERVER_OVERLOADED})
# Failures that say the worker is unhealthy (its breaker counts them); others (bad input) are the request's fault.
HEALTH_FAILURE_CODES = frozenset({ErrorCode.WORKER_FAILED, ErrorCode.WORKER_TIMEOUT, ErrorCode.INTERNAL})


@dataclass
class TextEvent:
    """New text of one choice (never empty), with the log-probabilities of the tokens whose text starts in it
    (when the request asked for them; else empty)."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class FinishEvent:
    """The end of one choice."""

    index: int
    finish_reason: str  # "stop" | "length"


@dataclass
class ChoiceState:
    """Bookkeeping of one choice."""

    index: int
    prompt_index: int
    request_id: str
    prompt_tokens: int
    ticket: Ticket[Reservation] | None = None
    attempt: int = 0
    stream: RequestStream | None = None
    dispatched_at_s: float = 0.0
    first_token_deadline_s: float | None = None  # time.perf_counter() of the first Generate + first_token_timeout_s
    detokenizer: IncrementalDetokenizer | None = None
    matcher: StopStringMatcher | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    text_parts: list[str] = field(default_factory=list)
    last_token_at_s: float = 0.0
    logprobs: LogprobLedger = field(default_factory=LogprobLedger)

    @property
    def reservation(self) -> Reservation | None:
        return self.ticket.reservation if self.ticket is not None else None

    @property
    def worker(self) -> WorkerClient | None:
        reservation = self.reservation
        return reservation.worker if reservation is not None else None


@dataclass
class Usage:
    """Token accounting of a request (OpenAI ``usage``)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Generation:
    """Admit and run ``n`` choices for each prompt of one request and yield their text as events.

    Args:
        request_id: the request's id (choice ids derive from it).
        prompts: prompt token ids, one list per prompt.
        max_tokens: effective output cap per prompt, in tokens.
        n: choices per prompt.
        sampling: the request's sampling parameters (``seed`` is offset by the choice index).
        stop_strings: stop strings, applied by the gateway.
        principal: who sent it and its tier (rate limits, queue).
        admission, pool, tokenizer, metrics: the app's resources.
        first_token_timeout_s, stall_timeout_s: limits on waiting for the worker, per attempt.
        arrival_s: ``time.perf_counter()`` when the request arrived (for TTFT).
        cache_key: carried to the worker.
        ignore_eos: forwarded (benchmarks).
        upstream_prompts: the client's messages or prompt, one per prompt, for an upstream worker
            (``gateway.upstream``); None = token ids only.
    """

    def __init__(self, *, request_id: str, prompts: list[list[int]], max_tokens: list[int], n: int,
                 sampling: SamplingParams, stop_strings: list[str], principal: Principal,
                 admission: AdmissionController, pool: WorkerPool, tokenizer: Tokenizer, metrics: Metrics,
                 first_token_timeout_s: float, stall_timeout_s: float, arrival_s: float, cache_key: str = "",
                 ignore_eos: bool = False, upstream_prompts: list[UpstreamPrompt] | None = None) -> None:
        self.request_id = request_id
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.n = n
        self.sampling = sampling
        self.stop_strings = stop_strings
        self.principal = principal
        self.tier = principal.tier.name
        self.admission = admission
        self.pool = pool
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.first_token_timeout_s = first_token_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.arrival_s = arrival_s
        self.cache_key = cache_key
        self.ignore_eos = ignore_eos
        self.upstream_prompts = upstream_prompts
        self.choices: list[ChoiceState] = []
        self.ttft_s: float | None = None
        self.worker_ttft_ms: float | None = None
        self.num_retries = 0
        self._events: asyncio.Queue = asyncio.Queue(maxsize=256)
        self._tasks: list[asyncio.Task] = []
        self._num_finished = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def queue_wait_s(self) -> float:
        """Seconds from arrival at admission until the last choice was admitted (``x-sluice-queue-ms``)."""
        return max((c.ticket.queue_wait_s for c in self.choices if c.ticket is not None), default=0.0)

    async def admit(self) -> None:
        """Queue every choice in its tier and wait until all are admitted (see the module docstring).

        Raises:
            SluiceError: a choice was shed (429/503 with ``retry_after_s``); nothing stays queued or reserved.
        """
        for prompt_index, prompt_ids in enumerate(self.prompts):
            for j in range(self.n):
                index = prompt_index * self.n + j
                choice = ChoiceState(index, prompt_index, f"{self.request_id}-{index}", len(prompt_ids))
                max_tokens = self.max_tokens[prompt_index]
                if index == 0:
                    choice.ticket = self.admission.make_ticket_for(self.principal, prompt_ids, max_tokens)
                else:
                    choice.ticket = self.admission.make_ticket(self.tier, prompt_ids, max_tokens)
                self.choices.append(choice)
        if len(self.choices) == 1:
            await self.admission.admit(self.choices[0].ticket)
        else:
            await self._admit_together([c.ticket for c in self.choices])
        for choice in self.choices:
            self.metrics.queue_time.labels(self.tier).observe(choice.ticket.queue_wait_s)

    async def _admit_together(self, tickets: list[Ticket[Reservation]]) -> None:
        tasks = [asyncio.create_task(self.admission.admit(t), name=f"admit-{self.request_id}") for t in tickets]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()  # each leaves its queue or gives its reservation back
            await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled():
                    task.exception()  # retrieved: the first error is the one raised
            raise

    def start(self) -> None:
        """Start one task per admitted choice: send ``Generate`` to its worker and pump the replies."""
        for choice in self.choices:
            choice.detokenizer = IncrementalDetokenizer(self.tokenizer, self.prompts[choice.prompt_index])
            choice.matcher = StopStringMatcher(self.stop_strings)
            self._tasks.append(asyncio.create_task(self._pump(choice), name=f"pump-{choice.request_id}"))

    def close(self) -> None:
        """Abort every choice still running, give back every reservation and cancel the pumps (synchronous)."""
        for choice in self.choices:
            if choice.stream is not None and not choice.stream.done:
                choice.stream.worker.abort(choice.stream.request_id)
            if choice.ticket is not None:
                self.admission.release(choice.ticket)
        for task in self._tasks:
            task.cancel()

    def has_event(self) -> bool:
        """Return whether :meth:`next_event` would return without waiting (an event is queued, or all finished)."""
        return self._num_finished == len(self.choices) or not self._events.empty()

    async def next_event(self) -> TextEvent | FinishEvent | None:
        """Return the next :class:`TextEvent` / :class:`FinishEvent`, or None once every choice finished.

        Raises:
            SluiceError: a choice failed (worker error, worker lost, timeout, shed on retry); :meth:`close` aborts
                the others.
        """
        if self._num_finished == len(self.choices):
            return None
        event = await self._events.get()
        if isinstance(event, SluiceError):
            raise event
        if isinstance(event, FinishEvent):
            self._num_finished += 1
        return event

    # ------------------------------------------------------------------ per choice

    async def _pump(self, choice: ChoiceState) -> None:
        try:
            await self._run_choice(choice)
        except SluiceError as exc:
            await self._events.put(exc)

    async def _run_choice(self, choice: ChoiceState) -> None:
        """Run the choice to its end, retrying once on another worker when it fails before its first token."""
        while True:
            try:
                self._send(choice)
                await self._stream_choice(choice)
            except SluiceError as exc:
                failed_worker = choice.worker
                # the worker dropped it unstarted at its start deadline: a queue timeout, not a worker fault
                dropped = exc.code is ErrorCode.QUEUE_TIMEOUT and choice.completion_tokens == 0
                self._end_attempt(choice, failed=exc.code in HEALTH_FAILURE_CODES, answered=not dropped)
                if dropped:
                    raise self.admission.shed_at_worker(choice.ticket, exc.message) from None
                retryable = (exc.code in RETRYABLE_CODES and choice.completion_tokens == 0
                             and choice.attempt + 1 < MAX_ATTEMPTS_PER_CHOICE
                             and self._first_token_time_left_s(choice) > 0)
                if not retryable:
                    raise
                choice.attempt += 1
                self.num_retries += 1
                log.warning("retry_before_first_byte", request_id=self.request_id, choice=choice.index,
                            failed_worker=failed_worker.name if failed_worker else None, error_code=exc.code.value)
                await self._admit_retry(choice, failed_worker)
                continue
            self._end_attempt(choice, failed=False)
            return

    def _first_token_time_left_s(self, choice: ChoiceState) -> float:
        """Seconds left of the choice's first-token deadline (the whole timeout before its first ``Generate``)."""
        if choice.first_token_deadline_s is None:
            return self.first_token_timeout_s
        return max(0.0, choice.first_token_deadline_s - time.perf_counter())

    async def _admit_retry(self, choice: ChoiceState, failed_worker: WorkerClient | None) -> None:
        """Admit the choice's retry on a fresh ticket that avoids ``failed_worker`` when another worker can serve.

        Raises:
            SluiceError: shed, or ``worker_timeout`` when the first-token deadline passes before admission (the
                ticket then leaves its queue).
        """
        prompt_ids = self.prompts[choice.prompt_index]
        choice.ticket = self.admission.make_ticket(self.tier, prompt_ids, self.max_tokens[choice.prompt_index],
                                                   avoid=failed_worker)
        try:
            await asyncio.wait_for(self.admission.admit(choice.ticket), self._first_token_time_left_s(choice))
        except TimeoutError:
            raise SluiceError(ErrorCode.WORKER_TIMEOUT, f"no worker sent a first token within "
                              f"{self.first_token_timeout_s:g} s") from None
        self.metrics.queue_time.labels(self.tier).observe(choice.ticket.queue_wait_s)

    def _send(self, choice: ChoiceState) -> None:
        reservation = choice.reservation
        if reservation is None:  # a bug: choices run only once admitted
            raise RuntimeError(f"choice {choice.request_id} started without a reservation")
        seed = self.sampling.seed
        sampling = self.sampling if seed is None else msgspec.structs.replace(
            self.sampling, seed=(seed + choice.index) % SEED_MODULUS)
        suffix = "" if choice.attempt == 0 else f"-r{choice.attempt}"
        message = Generate(
            request_id=choice.request_id + suffix,
            prompt_token_ids=self.prompts[choice.prompt_index],
            sampling=sampling,
            max_tokens=self.max_tokens[choice.prompt_index],
            stop_token_ids=self.tokenizer.eos_token_ids,
            tier=self.tier,
            cache_key=self.cache_key,
            deadline_s=self.admission.worker_start_deadline_s(
                choice.ticket, self.pool.prefill_queue_s or choice.ticket.tier.queue_timeout_s),
            ignore_eos=self.ignore_eos,
            priority=reservation.priority,
        )
        choice.stream = None
        prompt = self.upstream_prompts[choice.prompt_index] if self.upstream_prompts else None
        choice.stream = reservation.worker.start_request(message, reservation, prompt)
        choice.dispatched_at_s = time.perf_counter()
        if choice.first_token_deadline_s is None:
            choice.first_token_deadline_s = choice.dispatched_at_s + self.first_token_timeout_s
        self.pool.dispatched(reservation)

    def _end_attempt(self, choice: ChoiceState, failed: bool, answered: bool = True) -> None:
        """Abort the attempt's worker request if it still runs, tell the breaker, give the reservation back
        (with the answer's length unless it failed or was never ``answered``: dropped unstarted)."""
        stream = choice.stream
        if stream is not None and not stream.done:
            stream.worker.abort(stream.request_id)
        reservation = choice.reservation
        if reservation is not None:
            if failed:
                self.pool.record_failure(reservation)
            else:
                self.pool.record_success(reservation)
        if choice.ticket is not None:
            self.admission.release(choice.ticket, choice.completion_tokens if answered and not failed else None)

    async def _next_update(self, choice: ChoiceState):
        stream = choice.stream
        if choice.completion_tokens == 0:
            limit_s = self.first_token_timeout_s
            timeout_s = self._first_token_time_left_s(choice)
            what = "first token"
        else:
            limit_s = timeout_s = self.stall_timeout_s
            what = "next token"
        try:
            return await stream.next_update(timeout_s)
        except SluiceError as exc:
            if exc.code is not ErrorCode.WORKER_TIMEOUT:
                raise
            raise SluiceError(ErrorCode.WORKER_TIMEOUT, f"worker {stream.worker.name} sent no {what} within "
                              f"{limit_s:g} s") from None

    async def _stream_choice(self, choice: ChoiceState) -> None:
        stream = choice.stream
        while True:
            update = await self._next_update(choice)
            if update.token_ids or update.text:
                if choice.completion_tokens == 0:
                    self.pool.record_success(choice.reservation)
                self._observe_tokens(choice, update.num_tokens, update.first_token_latency_ms)
                piece = self._detokenize(choice, update) if update.token_ids else update.text
                text = choice.matcher.push(piece)
                if text:
                    await self._emit(choice, text)
                if choice.matcher.matched is not None:
                    stream.worker.abort(stream.request_id)
                    await self._finish(choice, "stop")
                    return
            if update.finished is not None:
                finished = update.finished
                choice.cached_tokens = finished.cached_tokens
                choice.completion_tokens = max(choice.completion_tokens, finished.completion_tokens)
                text = choice.matcher.push(choice.detokenizer.flush())
                if choice.matcher.matched is None:
                    text += choice.matcher.flush()
                if text:
                    await self._emit(choice, text)
                reason = "stop" if choice.matcher.matched is not None else finished.finish_reason
                await self._finish(choice, "length" if reason == "length" else "stop")
                return

    def _detokenize(self, choice: ChoiceState, update: StreamUpdate) -> str:
        """Return the text of the update's tokens; with logprobs, note where each token's text starts."""
        if not self.sampling.logprobs or len(update.logprobs) != len(update.token_ids):
            return choice.detokenizer.push(update.token_ids)
        pieces = []
        for token_id, logprob, top_ids, top_logprobs in zip(update.token_ids, update.logprobs,
                                                             update.top_token_ids, update.top_logprobs):
            pieces.append(choice.detokenizer.push([token_id]))
            choice.logprobs.add(token_id, logprob, top_ids, top_logprobs, pieces[-1])
        return "".join(pieces)

    def _observe_tokens(self, choice: ChoiceState, num_tokens: int, worker_ttft_ms: float | None) -> None:
        now_s = time.perf_counter()
        if choice.completion_tokens == 0:
            if self.ttft_s is None:
                self.ttft_s = now_s - self.arrival_s
                self.metrics.ttft.observe(self.ttft_s)
                if worker_ttft_ms is not None:
                    self.worker_ttft_ms = worker_ttft_ms
                    self.metrics.gateway_overhead.observe(max(0.0, self.ttft_s - worker_ttft_ms / 1000.0))
        else:
            self.metrics.inter_token_latency.observe((now_s - choice.last_token_at_s) / num_tokens)
        choice.last_token_at_s = now_s
        choice.completion_tokens += num_tokens

    async def _emit(self, choice: ChoiceState, text: str) -> None:
        choice.text_parts.append(text)
        await self._events.put(TextEvent(choice.index, text, choice.logprobs.emit(text)))

    async def _finish(self, choice: ChoiceState, reason: str) -> None:
        choice.finish_reason = reason
        await self._events.put(FinishEvent(choice.index, reason))

    # ------------------------------------------------------------------ results

    def usage(self) -> Usage:
        """Return the request's usage: each prompt counted once, completions summed over choices."""
        prompt_tokens = sum(len(p) for p in self.prompts)
        cached = [0] * len(self.prompts)
        for choice in self.choices:
            cached[choice.prompt_index] = max(cached[choice.prompt_index], choice.cached_tokens)
        completion_tokens = sum(c.completion_tokens for c in self.choices)
        return Usage(prompt_tokens, completion_tokens, sum(cached))

    def text(self, index: int) -> str:
        return "".join(self.choices[index].text_parts)

    def logprobs(self, index: int) -> list[TokenLogprob]:
        """Return the log-probabilities of the tokens of choice ``index``'s text (empty unless asked for)."""
        return self.choices[index].logprobs.released
