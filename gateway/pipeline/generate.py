"""One request's generation: admission of its choices, their runs on workers, their events merged into one stream.

::

    prompt p, sample j  ──▶ choice index p * n + j ──▶ Generate(request_id = "<rid>-<index>", seed + index)

:class:`~gateway.pipeline.choice.ChoiceRunner` runs each choice (attempts, retries before the first token,
deadlines, token ids → text) as its :class:`TextEvent` / :class:`FinishEvent` are read by
:meth:`Generation.next_event`: a request of one choice (the common case) in the reader's own task; several on one
task each, which put their events into the request's bounded event queue, read in arrival order.
:meth:`Generation.close` aborts every choice still running and gives back every reservation; handlers call it in
``finally`` so a client that disconnects (at any point: queued, prefill or decode, stream or not) leaves its queue or
makes the gateway send ``Abort``.

**n > 1 and several prompts**: one admission ticket per choice (each is one sequence on a worker, with its own KV
demand), all queued at the same moment, so they sit side by side in their tier's queue and start together when
capacity allows; the request waits until every choice is admitted, and if any is shed the request fails with that
error and the others leave the queue. The API key's rate limit counts the request once (on the first ticket).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass

from gateway.admission.controller import AdmissionController
from gateway.admission.tickets import Ticket
from gateway.metrics import Metrics
from gateway.pipeline.choice import ChoiceRunner
from gateway.pipeline.choice_state import ChoiceState, FinishEvent, TextEvent
from gateway.pipeline.classify import Principal
from gateway.pipeline.logprobs import TokenLogprob
from gateway.pipeline.tokenize import Tokenizer
from gateway.upstream.request_body import UpstreamPrompt
from gateway.workers.pool import WorkerPool
from gateway.workers.reservation import Reservation
from shared.errors import ErrorCode, SluiceError
from shared.protocol import SamplingParams

# What a choice's task puts into its request's event queue (n > 1): text, its end, or the failure that ends it.
ChoiceEvent = TextEvent | FinishEvent | SluiceError


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
        first_token_timeout_s: seconds from a choice's first ``Generate`` to its first token, all attempts together.
        stall_timeout_s: seconds between two replies of a choice once it has a token.
        arrival_s: ``time.perf_counter()`` when the request arrived (for TTFT).
        cache_key: carried to the worker.
        ignore_eos: forwarded (benchmarks).
        upstream_prompts: the client's messages or prompt, one per prompt, for an upstream worker
            (``gateway.upstream``); None = token ids only.

    Attributes:
        counts_sheds: admission counts a shed of this request's first admission in its tier's rejections at once
            (the default); False: the request's owner counts it with :meth:`count_sheds` once it knows whether a
            client got the 429/503 (an HTTP request that may be deferred to a job instead; a job's own request,
            which its runner puts back in the job queue), so ``sluice_rejected_total`` never goes back down.
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
        self.principal = principal
        self.tier = principal.tier.name
        self.admission = admission
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.arrival_s = arrival_s
        self.choices: list[ChoiceState] = []
        self.ttft_s: float | None = None
        self.worker_ttft_ms: float | None = None
        self._events: asyncio.Queue[ChoiceEvent] | None = None  # several choices only (start)
        self._tasks: list[asyncio.Task] = []
        self._num_finished = 0
        self.counts_sheds = True
        self._uncounted_sheds: list[ErrorCode] = []  # codes of sheds left to the owner (counts_sheds False)
        self._runner = ChoiceRunner(
            request_id=request_id, prompts=prompts, max_tokens=max_tokens, sampling=sampling,
            stop_strings=stop_strings, tier=self.tier, admission=admission, pool=pool, tokenizer=tokenizer,
            metrics=metrics, first_token_timeout_s=first_token_timeout_s, stall_timeout_s=stall_timeout_s,
            cache_key=cache_key, ignore_eos=ignore_eos, upstream_prompts=upstream_prompts,
            on_first_token=self._first_token)

    # ------------------------------------------------------------------ lifecycle

    @property
    def queue_wait_s(self) -> float:
        """Seconds from arrival at admission until the last choice was admitted (``x-sluice-queue-ms``)."""
        return max((c.ticket.queue_wait_s for c in self.choices if c.ticket is not None), default=0.0)

    @property
    def num_retries(self) -> int:
        """Attempts sent again on another worker before their choice's first token, over all choices."""
        return sum(c.attempt for c in self.choices)

    async def admit(self) -> None:
        """Queue every choice in its tier and wait until all are admitted (see the module docstring).

        Raises:
            SluiceError: a choice was shed (429/503 with ``retry_after_s``); nothing stays queued or reserved.
        """
        try:
            await self._admit_choices()
        except SluiceError:
            self._uncounted_sheds += [c.ticket.shed_code for c in self.choices
                                      if not c.ticket.counts_shed and c.ticket.shed_code is not None]
            raise
        for choice in self.choices:
            self.metrics.queue_time.labels(self.tier).observe(choice.ticket.queue_wait_s)

    def note_shed(self, code: ErrorCode) -> None:
        """Note a rejection of this request before admission (the fleet's cold-start check) that its owner counts
        (:attr:`counts_sheds` False; with it True the check counted it)."""
        if not self.counts_sheds:
            self._uncounted_sheds.append(code)

    def count_sheds(self, deferred: bool = False) -> None:
        """Count the sheds of this request that admission left to its owner (:attr:`counts_sheds` False): in its
        tier's rejections when its client got the 429/503, or once as deferred (``sluice_deferred_total``) when it
        got an async job instead. A job's own request that its runner puts back in the job queue is not counted:
        its owner does not call this."""
        codes, self._uncounted_sheds = self._uncounted_sheds, []
        shedder = self.admission.shedder
        if deferred and codes:
            shedder.count_deferred(self.tier, codes[0])
            return
        for code in codes:
            shedder.count_rejected(self.tier, code)

    async def _admit_choices(self) -> None:
        group = self.request_id if len(self.prompts) * self.n > 1 else None  # choices reserved together
        for prompt_index, prompt_ids in enumerate(self.prompts):
            for j in range(self.n):
                index = prompt_index * self.n + j
                choice = ChoiceState(index, prompt_index, f"{self.request_id}-{index}", len(prompt_ids))
                max_tokens = self.max_tokens[prompt_index]
                if index == 0:
                    choice.ticket = self.admission.make_ticket_for(self.principal, prompt_ids, max_tokens, group)
                else:
                    choice.ticket = self.admission.make_ticket(self.tier, prompt_ids, max_tokens, group=group)
                choice.ticket.counts_shed = self.counts_sheds
                self.choices.append(choice)
        if len(self.choices) == 1:
            await self.admission.admit(self.choices[0].ticket)
        else:
            await self._admit_together([c.ticket for c in self.choices])

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
        """Make the admitted choices ready to run: one alone runs as :meth:`next_event` reads it; several start one
        task each now, which sends its ``Generate`` and pumps its events into the event queue."""
        for choice in self.choices:
            self._runner.start(choice)
        if len(self.choices) > 1:
            self._events = asyncio.Queue(maxsize=256)
            self._tasks = [asyncio.create_task(self._pump(choice), name=f"pump-{choice.request_id}")
                           for choice in self.choices]

    async def _pump(self, choice: ChoiceState) -> None:
        events = self._events
        try:
            while (event := await self._runner.next_event(choice)) is not None:
                await events.put(event)
        except SluiceError as exc:
            await events.put(exc)

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
        """Return whether :meth:`next_event` would return without waiting (an event is ready, or all finished)."""
        if self._events is None:
            return self._runner.ready(self.choices[0])
        return self._num_finished == len(self.choices) or not self._events.empty()

    def next_event(self) -> Awaitable[TextEvent | FinishEvent | None]:
        """Return an awaitable of the next :class:`TextEvent` / :class:`FinishEvent`, or of None once every choice
        finished: for one choice, its runner's own coroutine (no coroutine of this class between the handler and
        the worker's stream, resumed once per token); for several, the next event of the request's queue.

        Raises (when awaited):
            SluiceError: a choice failed (worker error, worker lost, timeout, shed on retry); :meth:`close` aborts
                the others.
        """
        if self._events is None:
            return self._runner.next_event(self.choices[0])
        return self._next_queued_event()

    async def _next_queued_event(self) -> TextEvent | FinishEvent | None:
        if self._num_finished == len(self.choices):
            return None
        event = await self._events.get()
        if isinstance(event, SluiceError):
            raise event
        if isinstance(event, FinishEvent):
            self._num_finished += 1
        return event

    def _first_token(self, now_s: float, worker_ttft_ms: float | None) -> None:
        """Note the request's TTFT on the first token of its first choice to have one (``now_s``: perf_counter)."""
        if self.ttft_s is None:
            self.ttft_s = now_s - self.arrival_s
            self.metrics.ttft.observe(self.ttft_s)
            if worker_ttft_ms is not None:
                self.worker_ttft_ms = worker_ttft_ms
                self.metrics.gateway_overhead.observe(max(0.0, self.ttft_s - worker_ttft_ms / 1000.0))

    # ------------------------------------------------------------------ results

    def usage(self) -> Usage:
        """Return the request's usage: each prompt counted once — as the engine counted it where a choice of it
        finished (an upstream engine applies its own chat template), else as the gateway tokenized it —, completions
        summed over choices."""
        prompt_tokens = [len(p) for p in self.prompts]
        cached = [0] * len(self.prompts)
        for choice in self.choices:
            cached[choice.prompt_index] = max(cached[choice.prompt_index], choice.cached_tokens)
            if choice.engine_prompt_tokens is not None:
                prompt_tokens[choice.prompt_index] = choice.engine_prompt_tokens
        completion_tokens = sum(c.completion_tokens for c in self.choices)
        return Usage(sum(prompt_tokens), completion_tokens, sum(cached))

    def text(self, index: int) -> str:
        return "".join(self.choices[index].text_parts)

    def logprobs(self, index: int) -> list[TokenLogprob]:
        """Return the log-probabilities of the tokens of choice ``index``'s text (empty unless asked for)."""
        return self.choices[index].logprobs.released
