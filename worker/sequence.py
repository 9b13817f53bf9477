"""One request inside the worker: its tokens, its progress through the KV cache, its status.

A sequence's tokens are ``prompt_token_ids + output_token_ids``. ``num_computed_tokens`` counts the leading tokens
whose K/V are in the pool (computed by the model or served by the prefix cache); the scheduler advances it after
each step. A running sequence in decode has ``num_computed_tokens == num_tokens - 1``: its last sampled token is
fed to the model in the next step::

    tokens:   [ p0 p1 ... p(P-1) | o0 o1 ... o(k-1) ]
    computed: [ ............................... ]  <- every token but the last once prefill is done
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from shared.protocol import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in the scheduler.

    WAITING: queued, never admitted. RUNNING: holds blocks, scheduled every step. PREEMPTED: its blocks were
    taken back (recompute); it waits again and resumes from its full token history. FINISHED: done or aborted.
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request as the scheduler and the KV cache manager see it.

    Attributes:
        request_id: unique within the worker.
        prompt_token_ids: the prompt, ``[num_prompt_tokens]`` token ids.
        output_token_ids: tokens sampled so far, appended by the scheduler.
        sampling: sampling parameters.
        seed: sampling seed (the engine draws one when the request has none).
        max_tokens: output cap in tokens (``len(output_token_ids)`` never exceeds it).
        stop_token_ids: sampled ids that end the answer with ``"stop"``; ignored when ``ignore_eos``.
        ignore_eos: never stop on a token (benchmarks).
        tier: admission tier label, carried into the eviction metadata of its blocks.
        tier_priority: the request's priority (``Generate.priority``): larger is admitted first and preempted last.
        cache_ttl_s: requested KV retention after the request ends, seconds; 0 = the worker's default
            (``kv.default_cache_ttl_s``). The KV manager bounds it by ``kv.max_cache_ttl_s`` (and per tier).
        cache_key: the request's session / prompt cache key ("" = none); informational (logs), the chain hash
            already identifies the shared prefix.
        arrival_s: arrival time on ``time.monotonic()``, seconds; breaks ties within a tier.
        start_deadline_s: ``time.monotonic()`` by which the sequence must be admitted (its prefill started), else
            the scheduler drops it with a ``queue_timeout`` error (``Generate.deadline_s``); ``inf`` = none.
        num_computed_tokens: leading tokens whose K/V are in the pool.
        num_cached_tokens: prompt tokens served by the prefix cache at the first admission.
        status: see :class:`SequenceStatus`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: set[int] = field(default_factory=set)
    ignore_eos: bool = False
    tier: str = "standard"
    tier_priority: int = 0
    cache_ttl_s: float = 0.0
    cache_key: str = ""
    arrival_s: float = field(default_factory=time.monotonic)
    start_deadline_s: float = math.inf
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING

    @property
    def all_token_ids(self) -> list[int]:
        """Return prompt + output token ids, ``[num_tokens]`` (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
