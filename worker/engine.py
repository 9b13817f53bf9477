"""The worker's engine loop: schedule → run the model → sample → report, one step at a time.

The engine is synchronous and single-threaded: :class:`worker.server.WorkerServer` calls :meth:`Engine.step` in a
dedicated thread and applies arrivals and aborts between steps, so an ``Abort`` takes effect within one step. The
server also marks an abort at once (:meth:`Engine.request_abort`, from its own thread): a step whose every sequence
is marked stops between two layers of the model (a long prompt's prefill chunk can take seconds on a CPU), and its
sequences are freed by the aborts that follow.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from shared.protocol import Generate
from worker.sampling import TokenLogprobs
from worker.scheduler import Scheduler, SchedulerOutput, SeqEvent
from worker.sequence import Sequence
from worker.step_rates import StepRates

KV_STATS_INTERVAL_S = 0.1  # how often the engine thread refreshes the KV stats snapshot that capacity reports read


class StepAbandoned(Exception):
    """A model step stopped between two layers because every sequence in it was aborted (the runner raises it)."""


@dataclass
class StepResult:
    """What one engine step produced.

    Attributes:
        events: new tokens and finishes, per sequence.
        first_token_latency_ms: for sequences that produced their first token this step, ms since arrival.
        step_time_s: wall time of the step.
        num_decode_tokens: tokens decoded this step.
        num_prefill_tokens: prompt tokens computed this step.
        logprobs: the log-probabilities of this step's token, for the sequences that asked for them.
    """

    events: list[SeqEvent]
    first_token_latency_ms: dict[str, float] = field(default_factory=dict)
    step_time_s: float = 0.0
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


class StepRunner(Protocol):
    """Runs a scheduled step and samples: the real :class:`worker.model_runner.ModelRunner` or the simulator's."""

    step_logprobs: dict[str, TokenLogprobs]  # of the last run, for the sequences whose sampling asks for them

    def run(self, out: SchedulerOutput) -> dict[str, int]:
        """Execute ``out``; return ``{request_id: sampled token id}`` for the sequences that sample."""
        ...


class Engine:
    """Continuous batching over one model and one KV pool.

    Args:
        scheduler: decides each step's batch.
        runner: runs a scheduled step and samples (:class:`StepRunner`).
        default_stop_token_ids: EOS ids of the model, added to every request's stop ids unless ``ignore_eos``.
        clock: the monotonic clock, seconds, that times steps (the measured rates' busy seconds).
    """

    def __init__(self, scheduler: Scheduler, runner: StepRunner, default_stop_token_ids: list[int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.default_stop_token_ids = list(default_stop_token_ids)
        self._arrival_s: dict[str, float] = {}
        self._clock = clock
        self._rates = StepRates()
        self._prompt_tokens_window = collections.deque()  # (now_s, prompt_tokens, cached_tokens)
        self._abort_requested: set[str] = set()  # added by the server's thread, read between layers
        self._kv_stats: dict[str, float] = self.scheduler.kv.stats_snapshot()
        self._kv_stats_at_s = clock()

    def add(self, request_id: str, msg: Generate, tier_priority: int = 0, received_s: float | None = None) -> None:
        """Queue a request under ``request_id`` (unique in this worker).

        ``received_s`` is the ``time.monotonic()`` at which the worker read the ``Generate`` frame; the worker's
        time to first token counts from there (default: now).
        """
        stop_token_ids = set(msg.stop_token_ids)
        if not msg.ignore_eos:
            stop_token_ids.update(self.default_stop_token_ids)
        seed = msg.sampling.seed if msg.sampling.seed is not None else random.getrandbits(63)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            sampling=msg.sampling,
            seed=seed,
            max_tokens=msg.max_tokens,
            stop_token_ids=stop_token_ids,
            ignore_eos=msg.ignore_eos,
            tier=msg.tier,
            tier_priority=tier_priority,
            cache_ttl_s=msg.cache_ttl_s,
            cache_key=msg.cache_key,
        )
        received_s = self._clock() if received_s is None else received_s
        self._arrival_s[request_id] = received_s
        if msg.deadline_s > 0:  # an absolute time.time(): on this machine's monotonic clock
            seq.start_deadline_s = received_s + (msg.deadline_s - time.time())
        self.scheduler.add(seq)

    def request_abort(self, request_id: str) -> None:
        """Mark a request as aborted while a step may be running (any thread): a step of only marked requests
        stops early. :meth:`abort` must follow, between steps."""
        self._abort_requested.add(request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks now; return whether it was known."""
        self._abort_requested.discard(request_id)
        self._arrival_s.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepResult:
        """Run one step: apply KV pressure, schedule, run the model, sample, update the scheduler."""
        start_s = self._clock()
        kv = self.scheduler.kv
        kv.update_pressure()
        self.scheduler.expire_unstarted(start_s)
        out = self.scheduler.schedule()
        if not out.scheduled:
            events = self.scheduler.update_from_output(out, {})
            for event in events:  # refused, or dropped unstarted at the start deadline
                if event.finish_reason is not None:
                    self._arrival_s.pop(event.request_id, None)
            now_s = self._clock()
            self._refresh_kv_stats(now_s)
            return StepResult(events=events, step_time_s=now_s - start_s)
        scheduled = out.scheduled
        if out.all_decode:
            num_decode, num_prefill = len(scheduled), 0
        else:
            num_decode = sum(1 for s in scheduled if s.num_new_tokens == 1 and s.seq.output_token_ids)
            num_prefill = sum(s.num_new_tokens for s in scheduled) - num_decode
        run_start_s = time.perf_counter()
        aborted = self._abort_requested

        def should_stop() -> bool:  # every sequence of the step is marked aborted
            return bool(aborted) and all(item.seq.request_id in aborted for item in scheduled)

        try:
            sampled = self.runner.run(out, should_stop)
        except StepAbandoned:
            return StepResult(events=[], step_time_s=self._clock() - start_s)
        kv.observe_prefill(num_prefill, num_decode, time.perf_counter() - run_start_s)
        events = self.scheduler.update_from_output(out, sampled)
        end_s = self._clock()
        self._refresh_kv_stats(end_s)
        step_time_s = end_s - start_s
        self._rates.observe(num_prefill, num_decode, step_time_s)
        result = StepResult(events, step_time_s=step_time_s, num_decode_tokens=num_decode,
                            num_prefill_tokens=num_prefill, logprobs=self.runner.step_logprobs)
        arrivals = self._arrival_s
        if not out.all_decode:  # a decode step's sequences have output already: no first token
            for event in events:
                # a first token: the event's tokens are all the request has produced
                if event.new_token_ids and event.completion_tokens == len(event.new_token_ids):
                    arrival_s = arrivals.get(event.request_id)
                    if arrival_s is not None:
                        result.first_token_latency_ms[event.request_id] = (end_s - arrival_s) * 1000.0
        for event in [event for event in events if event.finish_reason is not None]:
            arrivals.pop(event.request_id, None)
            if event.error is None:
                self._prompt_tokens_window.append((end_s, event.prompt_tokens, event.cached_tokens))
        while self._prompt_tokens_window and self._prompt_tokens_window[0][0] < end_s - 60.0:
            self._prompt_tokens_window.popleft()
        return result

    def _refresh_kv_stats(self, now_s: float) -> None:
        if now_s - self._kv_stats_at_s >= KV_STATS_INTERVAL_S:
            self._kv_stats = self.scheduler.kv.stats_snapshot()
            self._kv_stats_at_s = now_s

    def kv_stats(self) -> dict[str, float]:
        """The latest ``Capacity.kv_stats`` snapshot (made in the engine thread; safe to read from another)."""
        return self._kv_stats

    def decode_tokens_per_s(self) -> float:
        """Decode tokens per second of the steps that decode (``worker.step_rates``)."""
        return self._rates.decode_tokens_per_s()

    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of the steps that prefill (``worker.step_rates``)."""
        return self._rates.prefill_tokens_per_s()

    def sequence_prefill_tokens_per_s(self) -> float:
        """How fast a prompt goes once it is being prefilled: the prefill rate (every prompt chunk of a step
        moves at the step's pace)."""
        return self._rates.prefill_tokens_per_s()

    def sequence_decode_tokens_per_s(self) -> float:
        """1 / TPOT: the tokens/s one running sequence gets (``worker.step_rates``)."""
        return self._rates.sequence_decode_tokens_per_s()

    def busy_tokens_per_s(self) -> float:
        """Prompt + decode tokens per second of all steps: the work drained per busy second."""
        return self._rates.busy_tokens_per_s()

    def prefix_hit_rate(self) -> float:
        """Cached ÷ prompt tokens of requests finished in the last minute."""
        prompt = sum(w[1] for w in self._prompt_tokens_window)
        cached = sum(w[2] for w in self._prompt_tokens_window)
        return cached / prompt if prompt else 0.0
