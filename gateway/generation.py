"""One request's generation: its choices on workers, turned into text events.

Per choice: worker token ids → :class:`IncrementalDetokenizer` → :class:`StopStringMatcher` → text pieces. A stop
string match aborts the choice on its worker at once (finish_reason ``stop``). :meth:`Generation.close` aborts
every choice still running; handlers call it in ``finally`` so a client that disconnects (at any point: queued,
prefill or decode, stream or not) makes the gateway send ``Abort``.

::

    prompt p, sample j  ──▶ choice index p * n + j ──▶ Generate(request_id = "<rid>-<index>", seed + index)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec

from gateway.detokenize import IncrementalDetokenizer
from gateway.metrics import Metrics
from gateway.stop import StopStringMatcher
from gateway.tokenize import Tokenizer
from gateway.workers import RequestStream, WorkerPool
from shared.errors import SluiceError
from shared.protocol import Generate, SamplingParams

SEED_MODULUS = 2**63


@dataclass
class TextEvent:
    """New text of one choice (never empty)."""

    index: int
    text: str


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
    stream: RequestStream | None = None
    detokenizer: IncrementalDetokenizer | None = None
    matcher: StopStringMatcher | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    text_parts: list[str] = field(default_factory=list)
    last_token_at_s: float = 0.0


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
    """Run ``n`` choices for each prompt of one request and yield their text as events.

    Args:
        request_id: the request's id (choice ids derive from it).
        prompts: prompt token ids, one list per prompt.
        max_tokens: effective output cap per prompt, in tokens.
        n: choices per prompt.
        sampling: the request's sampling parameters (``seed`` is offset by the choice index).
        stop_strings: stop strings, applied by the gateway.
        pool, tokenizer, metrics: the app's resources.
        first_token_timeout_s, stall_timeout_s: limits on waiting for the worker.
        arrival_s: ``time.perf_counter()`` when the request arrived (for TTFT).
        tier, cache_key: carried to the worker.
        ignore_eos: forwarded (benchmarks).
    """

    def __init__(self, *, request_id: str, prompts: list[list[int]], max_tokens: list[int], n: int,
                 sampling: SamplingParams, stop_strings: list[str], pool: WorkerPool, tokenizer: Tokenizer,
                 metrics: Metrics, first_token_timeout_s: float, stall_timeout_s: float, arrival_s: float,
                 tier: str = "standard", cache_key: str = "", ignore_eos: bool = False) -> None:
        self.request_id = request_id
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.n = n
        self.sampling = sampling
        self.stop_strings = stop_strings
        self.pool = pool
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.first_token_timeout_s = first_token_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.arrival_s = arrival_s
        self.tier = tier
        self.cache_key = cache_key
        self.ignore_eos = ignore_eos
        self.choices: list[ChoiceState] = []
        self.ttft_s: float | None = None
        self.worker_ttft_ms: float | None = None
        self._events: asyncio.Queue = asyncio.Queue(maxsize=256)
        self._tasks: list[asyncio.Task] = []
        self._num_finished = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Send one ``Generate`` per choice to a chosen worker and start pumping its replies.

        Raises:
            SluiceError: no worker ready (503); nothing is left running in that case.
        """
        try:
            for prompt_index, prompt_ids in enumerate(self.prompts):
                demand_tokens = len(prompt_ids) + self.max_tokens[prompt_index]  # per choice
                worker = self.pool.choose(self.n * demand_tokens)
                for j in range(self.n):
                    index = prompt_index * self.n + j
                    choice = ChoiceState(index, prompt_index, f"{self.request_id}-{index}", len(prompt_ids))
                    seed = self.sampling.seed
                    sampling = self.sampling if seed is None else msgspec.structs.replace(
                        self.sampling, seed=(seed + index) % SEED_MODULUS)
                    message = Generate(
                        request_id=choice.request_id,
                        prompt_token_ids=prompt_ids,
                        sampling=sampling,
                        max_tokens=self.max_tokens[prompt_index],
                        stop_token_ids=self.tokenizer.eos_token_ids,
                        tier=self.tier,
                        cache_key=self.cache_key,
                        ignore_eos=self.ignore_eos,
                    )
                    choice.detokenizer = IncrementalDetokenizer(self.tokenizer)
                    choice.matcher = StopStringMatcher(self.stop_strings)
                    choice.stream = worker.start_request(message, demand_tokens)
                    self.choices.append(choice)
        except BaseException:
            self.close()
            raise
        for choice in self.choices:
            self._tasks.append(asyncio.create_task(self._pump(choice), name=f"pump-{choice.request_id}"))

    def close(self) -> None:
        """Abort every choice still running on its worker and cancel the pump tasks (synchronous)."""
        for choice in self.choices:
            if choice.stream is not None and not choice.stream.done:
                choice.stream.worker.abort(choice.request_id)
        for task in self._tasks:
            task.cancel()

    async def next_event(self) -> TextEvent | FinishEvent | None:
        """Return the next :class:`TextEvent` / :class:`FinishEvent`, or None once every choice finished.

        Raises:
            SluiceError: a choice failed (worker error, worker lost, timeout); :meth:`close` aborts the others.
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
            await self._pump_choice(choice)
        except SluiceError as exc:
            await self._events.put(exc)

    async def _pump_choice(self, choice: ChoiceState) -> None:
        stream = choice.stream
        timeout_s = self.first_token_timeout_s
        while True:
            update = await stream.next_update(timeout_s)
            timeout_s = self.stall_timeout_s
            if update.token_ids:
                self._observe_tokens(choice, update.token_ids, update.first_token_latency_ms)
                text = choice.matcher.push(choice.detokenizer.push(update.token_ids))
                if text:
                    await self._emit(choice, text)
                if choice.matcher.matched is not None:
                    stream.worker.abort(choice.request_id)
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

    def _observe_tokens(self, choice: ChoiceState, token_ids: list[int], worker_ttft_ms: float | None) -> None:
        now_s = time.perf_counter()
        if choice.completion_tokens == 0:
            if self.ttft_s is None:
                self.ttft_s = now_s - self.arrival_s
                self.metrics.ttft.observe(self.ttft_s)
                if worker_ttft_ms is not None:
                    self.worker_ttft_ms = worker_ttft_ms
                    self.metrics.gateway_overhead.observe(max(0.0, self.ttft_s - worker_ttft_ms / 1000.0))
        else:
            self.metrics.inter_token_latency.observe((now_s - choice.last_token_at_s) / len(token_ids))
        choice.last_token_at_s = now_s
        choice.completion_tokens += len(token_ids)

    async def _emit(self, choice: ChoiceState, text: str) -> None:
        choice.text_parts.append(text)
        await self._events.put(TextEvent(choice.index, text))

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
