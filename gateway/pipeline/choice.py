"""One choice's run on workers: its attempts, their deadlines, and its worker replies turned into text events.

Per choice: reservation on a worker → ``Generate`` → worker token ids → :class:`IncrementalDetokenizer` →
:class:`StopStringMatcher` → :class:`TextEvent` pieces, then one :class:`FinishEvent`. A stop string match aborts
the choice on its worker at once (finish_reason ``stop``). Attempt ``a`` of choice ``index`` is sent as
``Generate(request_id = "<rid>-<index>" for a = 0, "<rid>-<index>-r<a>" after, seed + index)``.

The request's :class:`~gateway.pipeline.generate.Generation` owns the choices (their first admission, the order
their events are read in, usage); a :class:`ChoiceRunner` advances an admitted choice only when its next event is
asked for (:meth:`ChoiceRunner.next_event`), in the asking task: a request with one choice runs in its HTTP
handler's task, with no task or queue of its own between the worker's reply and the client's chunk. It talks back
through ``on_first_token`` (the request's TTFT).

**Worker health** (DESIGN.md, step 6): each choice has one first-token deadline, ``gateway.first_token_timeout_s``
from the moment its first ``Generate`` is sent, shared by all its attempts, and an inter-token stall deadline
(``gateway.stall_timeout_s``). A timeout or a worker failure counts against the worker's circuit breaker; the first
token (or a clean end) counts as a success. A choice that fails before its first token — so before any byte of it
reached the client — is retried once while its first-token deadline has time left, with a fresh ticket (no
rate-limit charge) that avoids the failed worker when another can serve; the retry's wait for admission and for
its first token both count against what is left. A first-token timeout leaves nothing, so the client waits at most
``first_token_timeout_s`` for a first token whatever the number of attempts. After its first token, a failure ends
the request: in-band for a stream that has started.

**Preemption** (:mod:`gateway.admission.preemption`): on an upstream engine a choice may be stopped for a higher
tier's request. It is then queued again in its tier, keeping its place: before its first token, as it was (its
first-token deadline starts again when it is sent); after it, as the continuation of its answer — the prompt's
token ids and those of the text streamed so far, sent to the engine's ``/v1/completions``, with the output budget
left — queued for at most ``gateway.stall_timeout_s``. Its stream goes on where it stopped (same stop matcher,
same token count); usage counts the prompt once and every output token. Attempt suffix ``-p<k>`` for the k-th
resumption.

**An engine's own 429/503** (``server_overloaded`` from :mod:`gateway.upstream`) before the first token is no
failure: the choice is queued again in its place in its tier until what is left of its queue deadline, and sent once
an upstream takes it; the client never sees the engine's refusal, only an answer or Sluice's own 503 at its tier's
deadline. Attempt suffix ``-q<k>`` for the k-th requeue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import structlog

from gateway.admission.controller import AdmissionController
from gateway.metrics import Metrics
from gateway.pipeline.choice_state import ChoiceState, FinishEvent, TextEvent
from gateway.pipeline.detokenize import IncrementalDetokenizer
from gateway.pipeline.stop import StopStringMatcher
from gateway.pipeline.tokenize import Tokenizer
from gateway.upstream.request_body import UpstreamPrompt
from gateway.workers.breaker import BreakerState
from gateway.workers.client import WorkerClient
from gateway.workers.pool import WorkerPool
from gateway.workers.stream import StreamUpdate
from shared.errors import ErrorCode, SluiceError
from shared.protocol import Generate, SamplingParams

log = structlog.get_logger("sluice.gateway")

SEED_MODULUS = 2**63
MAX_ATTEMPTS_PER_CHOICE = 2  # the first try and one retry before the first byte
MAX_PREEMPTIONS_PER_CHOICE = 2  # then it runs to its end: a low tier is not stopped over and over
# A request this close to its output budget's end frees its slot within a few decode steps (an engine notices a stop
# only at the next one); stopping it would throw away its prompt's and answer's KV, recomputed when it resumes.
MIN_TOKENS_LEFT_TO_PREEMPT = 4
# Failures that may be retried on another worker when no token of the choice exists yet. (An engine's own 429/503,
# server_overloaded, is no failure: the choice waits in its tier queue again, ChoiceRunner._requeue.)
RETRYABLE_CODES = frozenset({ErrorCode.WORKER_FAILED, ErrorCode.WORKER_TIMEOUT, ErrorCode.DRAINING})
# Failures that say the worker is unhealthy (its breaker counts them); others (bad input) are the request's fault.
HEALTH_FAILURE_CODES = frozenset({ErrorCode.WORKER_FAILED, ErrorCode.WORKER_TIMEOUT, ErrorCode.INTERNAL})


class ChoiceRunner:
    """Run the admitted choices of one request on their workers, one event at a time: their text, then their end.

    Args:
        request_id: the request's id (logs; each choice carries its own id).
        prompts: prompt token ids, one list per prompt.
        max_tokens: effective output cap per prompt, in tokens.
        sampling: the request's sampling parameters (``seed`` is offset by the choice index).
        stop_strings: stop strings, applied here rather than by the worker.
        tier: the request's tier name (its queue on a retry, its priority on the worker).
        admission, pool, tokenizer, metrics: the app's resources.
        first_token_timeout_s: seconds from a choice's first ``Generate`` to its first token, all attempts together.
        stall_timeout_s: seconds between two replies of a choice once it has a token.
        cache_key: carried to the worker.
        ignore_eos: forwarded (benchmarks).
        upstream_prompts: the client's messages or prompt, one per prompt, for an upstream worker; None = token ids.
        on_first_token: called on each choice's first token with ``time.perf_counter()`` then and the worker's TTFT
            in ms (None when the worker does not report it).
    """

    def __init__(self, *, request_id: str, prompts: list[list[int]], max_tokens: list[int], sampling: SamplingParams,
                 stop_strings: list[str], tier: str, admission: AdmissionController, pool: WorkerPool,
                 tokenizer: Tokenizer, metrics: Metrics, first_token_timeout_s: float, stall_timeout_s: float,
                 cache_key: str, ignore_eos: bool, upstream_prompts: list[UpstreamPrompt] | None,
                 on_first_token: Callable[[float, float | None], None]) -> None:
        self.request_id = request_id
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop_strings = stop_strings
        self.tier = tier
        self.admission = admission
        self.pool = pool
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.first_token_timeout_s = first_token_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.cache_key = cache_key
        self.ignore_eos = ignore_eos
        self.upstream_prompts = upstream_prompts
        self._on_first_token = on_first_token

    def start(self, choice: ChoiceState) -> None:
        """Give the admitted choice its detokenizer and stop matcher; its ``Generate`` leaves on the first
        :meth:`next_event`."""
        choice.detokenizer = IncrementalDetokenizer(self.tokenizer, self.prompts[choice.prompt_index])
        choice.matcher = StopStringMatcher(self.stop_strings)

    def ready(self, choice: ChoiceState) -> bool:
        """Return whether :meth:`next_event` returns an event or None without waiting: one is pending, or the choice
        has ended. A worker reply that is in is taken now, since it may make no event (a token held back as the
        start of a possible stop string, a character not complete yet): then the answer is False, not a wait on the
        next reply. False also while a failure is in (:meth:`next_event` may retry or resume: a wait)."""
        while not choice.pending and choice.finish_reason is None:
            stream = choice.stream
            if stream is None or not stream.has_unread or stream.failed:
                return False
            self._apply_update(choice, stream.take_update())
        return True

    async def next_event(self, choice: ChoiceState) -> TextEvent | FinishEvent | None:
        """Return the choice's next :class:`TextEvent` or its :class:`FinishEvent`, then None.

        The choice advances only here, in the caller's task: each call sends its attempt when none runs, reads its
        worker's replies and retries or resumes it as the module docstring says.

        Raises:
            SluiceError: the choice failed (worker error, worker lost, timeout, shed on retry); it is over.
        """
        while not choice.pending:
            if choice.finish_reason is not None:
                return None
            try:
                if choice.stream is None:
                    self._send(choice)
                self._apply_update(choice, await self._next_update(choice))
            except SluiceError as exc:
                await self._recover(choice, exc)
        return choice.pending.popleft()

    async def _recover(self, choice: ChoiceState, exc: SluiceError) -> None:
        """End the failed or preempted attempt; queue the choice again when it may go on (a preemption, a
        retryable failure before its first token), else raise."""
        if exc.code is ErrorCode.PREEMPTED:
            self._end_attempt(choice, failed=False, answered=False)
            choice.stream = None
            await self._resume(choice)
            return
        if exc.code is ErrorCode.SERVER_OVERLOADED and choice.completion_tokens == 0:
            self._end_attempt(choice, failed=False, answered=False)
            choice.stream = None
            await self._requeue(choice)
            return
        failed_worker = choice.worker
        # the worker dropped it unstarted at its start deadline: a queue timeout, not a worker fault
        dropped = exc.code is ErrorCode.QUEUE_TIMEOUT and choice.completion_tokens == 0
        self._end_attempt(choice, failed=exc.code in HEALTH_FAILURE_CODES, answered=not dropped)
        choice.stream = None
        if dropped:
            raise self.admission.shed_at_worker(choice.ticket, exc.message) from None
        retryable = (exc.code in RETRYABLE_CODES and choice.completion_tokens == 0
                     and choice.attempt + 1 < MAX_ATTEMPTS_PER_CHOICE
                     and self._first_token_time_left_s(choice) > 0)
        if not retryable:
            raise exc
        choice.attempt += 1
        log.warning("retry_before_first_byte", request_id=self.request_id, choice=choice.index,
                    failed_worker=failed_worker.name if failed_worker else None, error_code=exc.code.value)
        await self._admit_retry(choice, failed_worker)

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

    def _can_preempt(self, choice: ChoiceState) -> bool:
        """Return whether the choice's running request may be stopped for a higher tier's now
        (``Ticket.can_preempt``): not when it is not running, already preempted :data:`MAX_PREEMPTIONS_PER_CHOICE`
        times, decoding fewer than :data:`MIN_TOKENS_LEFT_TO_PREEMPT` tokens from its output budget's end (a short
        answer's long prompt still counts: its slot frees only after it), with output on an engine that cannot
        continue from token ids, with output not yet read (the counts below would be stale), or
        on a worker the gateway does not use now (stopping it frees no usable slot)."""
        stream, worker = choice.stream, choice.worker
        return not (stream is None or stream.done or stream.has_unread or worker is None
                    or not worker.preemptible_by_gateway or not worker.ready
                    or worker.breaker.state is BreakerState.OPEN
                    or choice.finish_reason is not None or choice.num_preemptions >= MAX_PREEMPTIONS_PER_CHOICE
                    or (choice.completion_tokens > 0 and self.max_tokens[choice.prompt_index]
                        - choice.completion_tokens < MIN_TOKENS_LEFT_TO_PREEMPT)
                    or (choice.completion_tokens > 0 and not worker.resumes_from_token_ids))

    def _preempt(self, choice: ChoiceState) -> bool:
        """Stop the choice's running request for a higher tier's (``Ticket.on_preempt``, called by the dispatcher):
        close its upstream request, end its stream with ``preempted`` (the reader resumes it: :meth:`_resume`) and
        release its ticket now. Return False, doing nothing, when :meth:`_can_preempt` says no."""
        if not self._can_preempt(choice):
            return False
        stream, worker = choice.stream, choice.worker
        choice.num_preemptions += 1
        worker.abort(stream.request_id)
        stream._fail(SluiceError(ErrorCode.PREEMPTED, f"preempted on {worker.name} for a higher tier"))
        self.admission.release(choice.ticket)
        log.info("preempted", request_id=self.request_id, choice=choice.index, worker=worker.name, tier=self.tier,
                 completion_tokens=choice.completion_tokens)
        return True

    async def _resume(self, choice: ChoiceState) -> None:
        """Queue a preempted choice again, keeping its place in its tier (module docstring).

        Raises:
            SluiceError: shed while it waits (``queue_timeout``): before the first token the client gets a 503,
                after it an in-band error.
        """
        index = choice.prompt_index
        if choice.completion_tokens == 0:
            timeout_s = choice.ticket.tier.queue_timeout_s
            choice.first_token_deadline_s = None
        else:
            # the answer so far: what was released to the client and what the stop matcher still holds back
            output_ids = self.tokenizer.encode_text_sync("".join(choice.text_parts) + choice.matcher.held)
            choice.resume_prompt = [*self.prompts[index], *output_ids]
            choice.resume_base_tokens = choice.completion_tokens
            timeout_s = self.stall_timeout_s
        choice.ticket = self.admission.make_resume_ticket(
            choice.ticket, self._prompt_ids(choice), self.max_tokens[index] - choice.resume_base_tokens, timeout_s)
        await self.admission.admit(choice.ticket)

    async def _requeue(self, choice: ChoiceState) -> None:
        """Queue a choice again that an engine turned away with its own 429/503 before its first token (that
        upstream takes nothing for its ``Retry-After``): in its place in its tier, until what is left of its queue
        deadline (:meth:`AdmissionController.make_requeue_ticket`); its first-token deadline starts again when it is
        sent. However often the engine refuses, the client gets an answer or Sluice's own 503 at its tier's
        deadline.

        Raises:
            SluiceError: ``queue_timeout`` when its deadline passes while it waits.
        """
        choice.num_requeues += 1
        choice.first_token_deadline_s = None
        log.info("requeued_after_engine_refusal", request_id=self.request_id, choice=choice.index,
                 times=choice.num_requeues)
        choice.ticket = self.admission.make_requeue_ticket(choice.ticket)
        await self.admission.admit(choice.ticket)

    def _prompt_ids(self, choice: ChoiceState) -> list[int]:
        """The prompt token ids of the choice's current attempt: its prompt, or prompt + output when it resumes."""
        return choice.resume_prompt if choice.resume_prompt is not None else self.prompts[choice.prompt_index]

    def _send(self, choice: ChoiceState) -> None:
        reservation = choice.reservation
        if reservation is None:  # a bug: choices run only once admitted
            raise RuntimeError(f"choice {choice.request_id} started without a reservation")
        seed = self.sampling.seed
        sampling = self.sampling if seed is None else msgspec.structs.replace(
            self.sampling, seed=(seed + choice.index) % SEED_MODULUS)
        suffix = "" if choice.attempt == 0 else f"-r{choice.attempt}"
        if choice.num_preemptions:
            suffix += f"-p{choice.num_preemptions}"
        if choice.num_requeues:
            suffix += f"-q{choice.num_requeues}"
        index = choice.prompt_index
        message = Generate(
            request_id=choice.request_id + suffix,
            prompt_token_ids=self._prompt_ids(choice),
            sampling=sampling,
            max_tokens=self.max_tokens[index] - choice.resume_base_tokens,
            stop_token_ids=self.tokenizer.eos_token_ids,
            tier=self.tier,
            cache_key=self.cache_key,
            deadline_s=self.admission.worker_start_deadline_s(
                choice.ticket, self.pool.prefill_queue_s or choice.ticket.tier.queue_timeout_s),
            ignore_eos=self.ignore_eos,
            priority=reservation.priority,
        )
        choice.stream = None
        if choice.resume_prompt is not None:
            prompt = UpstreamPrompt(prompt=choice.resume_prompt)  # the answer so far continues as a completion
        else:
            prompt = self.upstream_prompts[index] if self.upstream_prompts else None
        choice.stream = reservation.worker.start_request(message, reservation, prompt)
        if reservation.worker.preemptible_by_gateway:
            choice.ticket.on_preempt = lambda: self._preempt(choice)
            choice.ticket.can_preempt = lambda: self._can_preempt(choice)
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
            self.admission.release(choice.ticket, choice.completion_tokens - choice.resume_base_tokens
                                   if answered and not failed else None)

    async def _next_update(self, choice: ChoiceState) -> StreamUpdate:
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
            if choice.completion_tokens == 0:
                # the loop's timer may fire a fraction of a millisecond before the perf_counter deadline: the
                # deadline is spent now, whatever the clocks say, so no retry starts with nothing left
                choice.first_token_deadline_s = time.perf_counter()
            raise SluiceError(ErrorCode.WORKER_TIMEOUT, f"worker {stream.worker.name} sent no {what} within "
                              f"{limit_s:g} s") from None

    def _apply_update(self, choice: ChoiceState, update: StreamUpdate) -> None:
        """Turn one reply of the attempt's worker into the choice's pending events (text, then its end)."""
        if update.token_ids or update.text:
            if choice.completion_tokens == 0:
                self.pool.record_success(choice.reservation)
            self._observe_tokens(choice, update.num_tokens, update.first_token_latency_ms)
            piece = self._detokenize(choice, update) if update.token_ids else update.text
            text = choice.matcher.push(piece)
            if text:
                self._emit(choice, text)
            if choice.matcher.matched is not None:
                self._finish(choice, "stop")  # aborts the request on its worker
                return
        if update.finished is not None:
            finished = update.finished
            choice.cached_tokens = min(finished.cached_tokens, choice.prompt_tokens)  # a resumption's prompt
            # holds the answer so far, which the engine may have cached too
            if choice.resume_prompt is None:
                choice.engine_prompt_tokens = finished.prompt_tokens
            choice.completion_tokens = max(choice.completion_tokens,
                                           choice.resume_base_tokens + finished.completion_tokens)
            text = choice.matcher.push(choice.detokenizer.flush())
            if choice.matcher.matched is None:
                text += choice.matcher.flush()
            if text:
                self._emit(choice, text)
            reason = "stop" if choice.matcher.matched is not None else finished.finish_reason
            self._finish(choice, "length" if reason == "length" else "stop")

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
        ticket = choice.ticket
        ticket.decoding = True
        ticket.decoded_tokens += num_tokens
        if choice.completion_tokens == 0:
            self._on_first_token(now_s, worker_ttft_ms)
        else:
            self.metrics.inter_token_latency.observe((now_s - choice.last_token_at_s) / num_tokens)
        choice.last_token_at_s = now_s
        choice.completion_tokens += num_tokens

    def _emit(self, choice: ChoiceState, text: str) -> None:
        choice.text_parts.append(text)
        choice.pending.append(TextEvent(choice.index, text, choice.logprobs.emit(text)))

    def _finish(self, choice: ChoiceState, reason: str) -> None:
        """End the choice: its :class:`FinishEvent`, its attempt ended on its worker, its reservation given back."""
        choice.finish_reason = reason
        choice.pending.append(FinishEvent(choice.index, reason))
        self._end_attempt(choice, failed=False)
