"""Continuous batching: which sequences run in the next step, how many tokens each, and who is preempted.

One step spends a budget of ``max_num_batched_tokens`` (vLLM v1 scheduler, Sarathi-Serve chunked prefill)::

    1. decode   one token for every running sequence whose prefill is done   (never starved by a long prompt: BC29)
    2. prefill  tier by tier from the top: the next chunk of every running sequence of the tier still in prefill
                (oldest first), then admit the tier's waiting sequences (oldest first) while max_num_seqs, blocks
                and budget allow; once an admission fails, no lower tier is admitted in this step

A waiting request of a higher tier thus takes the prefill budget before a lower tier's long prompt that is already
mid-prefill (vLLM v1 schedules every running chunk before any waiting request, so a top-tier prompt arriving behind
a 7,000-token low-tier prompt waits for all of its chunks: a priority inversion the tiers exist to prevent).

Running sequences are visited highest tier first, oldest first. When one cannot get a block, the scheduler
preempts: the victim is the running sequence of the lowest tier, newest first. The KV manager picks the mode by
measured cost (:meth:`KVCacheManager.preempt`): *swap* copies its computed blocks to host RAM, *recompute* drops
them (full ones stay in the prefix cache, so the resume usually hits). Either way its blocks go back to the pool,
``num_computed_tokens`` resets to 0 and it waits again at its original (tier, arrival) place: the front of its
tier. On resume a swapped sequence gets its blocks back and continues where it stopped; a recomputed one
recomputes prompt + outputs so far; the sampler depends only on (seed, output position), so the answer continues
identically. No sequence is admitted in a step that preempted (vLLM v1).

Before each step the engine calls :meth:`Scheduler.expire_unstarted`: a request the gateway gave a start deadline
(``Generate.deadline_s``) and that higher tiers kept from starting, or held mid-prefill, past it is dropped with a
``queue_timeout`` error instead of being served long after its deadline.

``schedule()`` does not advance ``num_computed_tokens``: the model runner reads it as the start of each chunk;
:meth:`Scheduler.update_from_output` advances it and caches the blocks that became full.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import msgspec

from shared.errors import ErrorCode
from worker.kv_cache.manager import PREEMPT_SWAP, KVCacheManager
from worker.sequence import Sequence, SequenceStatus

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class ScheduledSeq(msgspec.Struct, gc=False):
    """One sequence's share of a step.

    A ``msgspec.Struct`` built in C, one per scheduled sequence per step, untracked by the cyclic garbage collector
    (``gc=False``: nothing it holds refers back to it), so a step's allocations trigger fewer collections.

    Attributes:
        seq: the sequence; its tokens ``[seq.num_computed_tokens, + num_new_tokens)`` are computed this step.
        num_new_tokens: tokens computed this step (1 for decode, a chunk for prefill).
        block_ids: the sequence's whole block table after this step's allocation, ``[num_blocks_of_seq]``; a copy
            that consecutive decode steps may share while the table does not grow: never change it.
        sample: the chunk reaches the last known token, so the step samples the next one.
    """

    seq: Sequence
    num_new_tokens: int
    block_ids: list[int]
    sample: bool


@dataclass
class SchedulerOutput:
    """The decision for one step: scheduled chunks in batch order, and who was preempted to make room.

    Attributes:
        scheduled: the chunks, in batch order.
        preempted_request_ids: the sequences preempted to make room, in preemption order.
        all_decode: every chunk is one generated token of a sequence that has output already (a decode step, which
            samples); :meth:`Scheduler.schedule` sets it when so, lets the engine and the batch builder skip their
            per-sequence checks. False promises nothing.
    """

    scheduled: list[ScheduledSeq]
    preempted_request_ids: list[str] = field(default_factory=list)
    all_decode: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)


class SeqEvent(msgspec.Struct, gc=False):
    """What happened to one sequence in a step.

    A ``msgspec.Struct`` built in C, one per sequence per step, untracked by the cyclic garbage collector
    (``gc=False``: it holds ids, counts and a fresh token list, nothing that refers back to it).

    Attributes:
        request_id: the sequence.
        new_token_ids: tokens sampled this step (0 or 1).
        finish_reason: None while running; ``"stop"``, ``"length"``, or ``"abort"`` (with ``error``).
        prompt_tokens, cached_tokens, completion_tokens: usage so far, in tokens; ``cached_tokens`` is the
            prompt tokens served by the prefix cache at the first admission.
        error: set when the worker refuses the request (the prompt can never fit the context or the KV pool) or
            drops it unstarted at its start deadline; then ``finish_reason == "abort"`` and nothing was generated.
        error_code: the :class:`shared.errors.ErrorCode` value of ``error``: ``queue_timeout`` for a start deadline
            that passed; None for a refusal (``context_length_exceeded``).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None = None
    error_code: str | None = None


@dataclass
class SchedulerStats:
    """Counters for capacity reports. Blocks: free = free list + evictable, so free + used == total."""

    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    num_preemptions_swap: int = 0


@dataclass
class _Step:
    """Mutable state of one ``schedule()`` call."""

    budget_tokens: int
    scheduled: dict[str, ScheduledSeq] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    """Continuous-batching scheduler over one :class:`KVCacheManager`.

    Args:
        kv_manager: the KV pool facade.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunk tokens).
        max_model_len_tokens: context length; a sequence ends with ``"length"`` when it reaches it.

    Raises:
        ValueError: a limit below 1.
    """

    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len_tokens: int) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len_tokens", max_model_len_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len_tokens = max_model_len_tokens
        self.waiting: list[Sequence] = []  # sorted by _queue_key
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self.num_preemptions_swap = 0
        self._requests: dict[str, Sequence] = {}
        self._arrival_idx: dict[str, int] = {}
        self._scheduled_last_step: set[str] = set()  # request ids the last schedule() gave tokens
        self._order: list[Sequence] = []  # running sorted by _queue_key, for the running list _order_of
        self._order_of: list[Sequence] = []
        # request id -> (its live block table, that table's length, the copy of it handed out in ScheduledSeq):
        # a decode step that adds no block hands out the same copy again
        self._block_ids: dict[str, tuple[list[int], int, list[int]]] = {}
        self._num_added = 0
        self._pending_events: list[SeqEvent] = []  # refusals and pool-limit finishes, returned by the next update

    # ------------------------------------------------------------------ requests in and out

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; a prompt that can never run is refused with an error event at the next update.

        Raises:
            ValueError: ``seq.request_id`` is already queued or running (a caller bug).
        """
        if seq.request_id in self._requests:
            raise ValueError(f"request {seq.request_id!r} is already scheduled")
        error = self._refusal(seq)
        if error is not None or seq.max_tokens < 1:
            seq.status = SequenceStatus.FINISHED
            reason = FINISH_ABORT if error is not None else FINISH_LENGTH
            self._pending_events.append(self._event(seq, [], reason, error))
            return
        seq.status = SequenceStatus.WAITING
        self._requests[seq.request_id] = seq
        self._arrival_idx[seq.request_id] = self._num_added
        self._num_added += 1
        bisect.insort(self.waiting, seq, key=self._queue_key)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (waiting, mid-prefill, decoding) and free its blocks now.

        Returns:
            True if the request was known. No event is emitted for it.
        """
        seq = self._requests.get(request_id)
        if seq is None:
            return False
        self._release(seq)
        return True

    def expire_unstarted(self, now_s: float) -> int:
        """Drop the sequences whose ``start_deadline_s`` has passed and that have not started: waiting and never
        admitted, or admitted but held mid-prefill, without a first token, by higher tiers that took the last step's
        whole prefill budget. Each gets an abort event with a ``queue_timeout`` error at the next update. A sequence
        whose prefill moved in the last step, one with output, or a preempted one is never dropped.

        Args:
            now_s: ``time.monotonic()`` now.

        Returns:
            How many were dropped.
        """
        waiting = [seq for seq in self.waiting
                   if seq.status is SequenceStatus.WAITING and seq.start_deadline_s <= now_s]
        held = [seq for seq in self.running
                if seq.start_deadline_s <= now_s and not seq.output_token_ids
                and seq.request_id not in self._scheduled_last_step]
        for seq, where in [(seq, "waited") for seq in waiting] + [(seq, "was held mid-prefill") for seq in held]:
            self._release(seq)
            self._pending_events.append(self._event(
                seq, [], FINISH_ABORT,
                f"the request was not started by its deadline: it {where} {now_s - seq.arrival_s:.1f} s on the "
                "worker behind higher tiers; the server is overloaded", ErrorCode.QUEUE_TIMEOUT.value))
        return len(waiting) + len(held)

    def has_unfinished(self) -> bool:
        """Whether a step has anything to do (sequences, or events still to report)."""
        return bool(self.running or self.waiting or self._pending_events)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_free_blocks=self.kv.num_free_blocks,
            num_used_blocks=self.kv.num_used_blocks,
            num_cached_blocks=self.kv.num_cached_blocks,
            num_total_blocks=self.kv.num_total_blocks,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            prefix_queries_tokens=self.kv.prefix_queries_tokens,
            prefix_hits_tokens=self.kv.prefix_hits_tokens,
            num_preemptions_swap=self.num_preemptions_swap,
        )

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks within the token budget (see the module docstring).

        A steady decode step (every running sequence decodes, nothing waits) ends after the decode pass: the prefill
        pass would schedule nothing. Its output has ``all_decode`` set.
        """
        step = _Step(budget_tokens=self.max_num_batched_tokens)
        order = self._running_order()
        prefill_pass_idle, all_decode = self._schedule_decode(step, order)
        if prefill_pass_idle and (not self.waiting or step.budget_tokens == 0):
            # no running sequence is mid-prefill, and nothing waits or no budget is left: the prefill pass below
            # would schedule nothing (a steady decode step)
            self._scheduled_last_step = set(step.scheduled)
            return SchedulerOutput(list(step.scheduled.values()), step.preempted,
                                   all_decode=all_decode and bool(step.scheduled))
        return self._prefill_pass(step, order)

    def _prefill_pass(self, step: _Step, order: list[Sequence]) -> SchedulerOutput:
        """After the decode pass over ``order``: the running sequences mid-prefill and the waiting ones, tier by
        tier (highest first), in the budget left; return the step."""
        prefilling = [s for s in order if s.request_id not in step.scheduled]  # mid-prefill, or preempted
        admitting = True
        for tier_priority in sorted({s.tier_priority for s in order} | {s.tier_priority for s in self.waiting},
                                    reverse=True):
            self._schedule_running(step, [s for s in prefilling if s.tier_priority == tier_priority], decode=False)
            if admitting and not step.preempted:
                admitting = self._admit_waiting(step, tier_priority)
        self._scheduled_last_step = set(step.scheduled)
        return SchedulerOutput(list(step.scheduled.values()), step.preempted)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[SeqEvent]:
        """Advance the scheduled sequences by the step's results.

        Args:
            out: what :meth:`schedule` returned for the step just run.
            sampled: ``{request_id: token id}`` for every scheduled sequence with ``sample`` set.

        Returns:
            One event per sampled token (with its finish reason) plus any refusals since the last call.

        Raises:
            ValueError: a sequence that had to sample has no token in ``sampled``.
        """
        requests = self._requests
        live = [item for item in out.scheduled if requests.get(item.seq.request_id) is item.seq]
        missing = [item.seq.request_id for item in live if item.sample and item.seq.request_id not in sampled]
        if missing:
            raise ValueError(f"no sampled token for {missing}")
        events, self._pending_events = self._pending_events, []
        append_event = events.append
        kv = self.kv
        block_size = kv.block_size
        max_model_len = self.max_model_len_tokens
        for item in live:
            seq = item.seq
            num_new = item.num_new_tokens
            num_computed = seq.num_computed_tokens + num_new
            seq.num_computed_tokens = num_computed
            # one decode token fills a block only at a block boundary; every earlier full block is cached already
            if num_new > 1 or num_computed % block_size == 0:
                kv.cache_blocks(seq)
            if not item.sample:
                continue
            token_id = sampled[seq.request_id]
            output = seq.output_token_ids
            output.append(token_id)
            num_output = len(output)
            num_prompt = len(seq.prompt_token_ids)
            reason = None
            if not seq.ignore_eos and token_id in seq.stop_token_ids:
                reason = FINISH_STOP
            elif num_output >= seq.max_tokens or num_prompt + num_output >= max_model_len:
                reason = FINISH_LENGTH
            if reason is not None:
                self._release(seq)
            append_event(SeqEvent(seq.request_id, [token_id], reason, num_prompt, seq.num_cached_tokens, num_output))
        return events

    # ------------------------------------------------------------------ scheduling internals

    def _running_order(self) -> list[Sequence]:
        """Return ``running`` sorted by :meth:`_queue_key`: the last sort when ``running`` holds the same sequences
        in the same order as then (a running sequence's key never changes), a new one otherwise."""
        if self._order_of != self.running:  # Sequence compares by identity
            self._order = sorted(self.running, key=self._queue_key)
            self._order_of = list(self.running)
        return self._order

    def _schedule_decode(self, step: _Step, order: list[Sequence]) -> tuple[bool, bool]:
        """Schedule one token for every running sequence of ``order`` whose prefill is done, in that order:
        ``_schedule_running(step, order, decode=True)`` with the table lookups inlined (the step's hot loop).

        Returns:
            ``(prefill_pass_idle, all_decode)``: no sequence of ``order`` is running mid-prefill or the budget ran
            out (the prefill chunks of running sequences have nothing to schedule); every scheduled chunk is a
            generated token (the sequence has output), not the last token of a prompt.
        """
        tables = self.kv.block_tables
        block_ids_of = self._block_ids
        block_size = self.kv.block_size
        scheduled = step.scheduled  # empty: each sequence of order is visited once, none is scheduled twice
        running = SequenceStatus.RUNNING
        budget = step.budget_tokens
        prefill_left = False
        all_decode = True
        for seq in order:
            if seq.status is not running:  # preempted or finished earlier in this loop
                continue
            num_computed = seq.num_computed_tokens
            output = seq.output_token_ids
            if len(seq.prompt_token_ids) + len(output) - num_computed != 1:
                prefill_left = True
                continue
            if budget == 0:
                step.budget_tokens = budget
                return True, all_decode
            request_id = seq.request_id
            table = tables.get(request_id)
            if not table or len(table) * block_size <= num_computed:  # no room for the token: a new block
                step.budget_tokens = budget
                allocated = self._allocate_or_preempt(step, seq, 1)
                budget = step.budget_tokens  # a preempted victim gave its tokens back
                if not allocated:
                    continue
                table = tables.get(request_id, [])
            # a table only grows while the request holds it (a new list once it is freed and admitted again)
            copy = block_ids_of.get(request_id)
            if copy is None or copy[0] is not table or copy[1] != len(table):
                copy = block_ids_of[request_id] = (table, len(table), list(table))
            scheduled[request_id] = ScheduledSeq(seq, 1, copy[2], True)
            budget -= 1
            if not output:
                all_decode = False
        step.budget_tokens = budget
        return not prefill_left, all_decode

    def _schedule_running(self, step: _Step, order: list[Sequence], decode: bool) -> None:
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING or seq.request_id in step.scheduled:
                continue
            num_remaining = seq.num_tokens - seq.num_computed_tokens
            if (num_remaining == 1) != decode:
                continue
            num_new = min(num_remaining, step.budget_tokens)
            if num_new == 0:
                return
            if self._allocate_or_preempt(step, seq, num_new):
                self._add_scheduled(step, seq, num_new, num_remaining)

    def _admit_waiting(self, step: _Step, tier_priority: int) -> bool:
        """Admit the waiting sequences of ``tier_priority`` (at the front of ``waiting``: no higher tier waits),
        oldest first. Returns False when one could not be admitted (slots, blocks or budget): lower tiers wait too."""
        while self.waiting and self.waiting[0].tier_priority == tier_priority:
            if len(self.running) >= self.max_num_seqs or step.budget_tokens <= 0:
                return False
            seq = self.waiting[0]
            num_computed = self.kv.admit(seq, step.budget_tokens)
            if num_computed is None:
                return False
            num_remaining = seq.num_tokens - num_computed
            num_new = min(num_remaining, step.budget_tokens)
            self.waiting.pop(0)
            if seq.status is SequenceStatus.WAITING:
                seq.num_cached_tokens = num_computed
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_scheduled(step, seq, num_new, num_remaining)
        return True

    def _allocate_or_preempt(self, step: _Step, seq: Sequence, num_new: int) -> bool:
        """Get blocks for ``num_new`` more tokens of a running ``seq``, preempting victims until they fit.

        Returns:
            False when ``seq`` itself was preempted, or finished because it outgrew the whole pool.
        """
        while self.kv.allocate_slots(seq, num_new) is None:
            if self.kv.num_blocks_for(seq.num_computed_tokens + num_new) > self.kv.num_total_blocks:
                self._release(seq)  # the KV pool caps the answer, as max_model_len would
                self._pending_events.append(self._event(seq, [], FINISH_LENGTH))
                return False
            victim = max(self.running, key=self._queue_key)
            self._preempt(step, victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, step: _Step, victim: Sequence) -> None:
        self.running.remove(victim)
        self._block_ids.pop(victim.request_id, None)
        item = step.scheduled.pop(victim.request_id, None)
        if item is not None:
            step.budget_tokens += item.num_new_tokens
        if self.kv.preempt(victim) == PREEMPT_SWAP:
            self.num_preemptions_swap += 1
        victim.num_computed_tokens = 0
        victim.status = SequenceStatus.PREEMPTED
        bisect.insort(self.waiting, victim, key=self._queue_key)
        step.preempted.append(victim.request_id)
        self.num_preemptions += 1

    def _add_scheduled(self, step: _Step, seq: Sequence, num_new: int, num_remaining: int) -> None:
        block_ids = self.kv.get_block_ids(seq.request_id)
        step.scheduled[seq.request_id] = ScheduledSeq(seq, num_new, block_ids, sample=num_new == num_remaining)
        step.budget_tokens -= num_new

    def _queue_key(self, seq: Sequence) -> tuple[int, float, int]:
        """Sort key: highest tier first, then oldest; ``max`` of it is the preemption victim."""
        return -seq.tier_priority, seq.arrival_s, self._arrival_idx.get(seq.request_id, 0)

    # ------------------------------------------------------------------ finishing

    def _refusal(self, seq: Sequence) -> str | None:
        num_prompt = seq.num_prompt_tokens
        if num_prompt == 0:
            return "the prompt is empty"
        if num_prompt >= self.max_model_len_tokens:
            return (f"the prompt has {num_prompt} tokens; the model's context is {self.max_model_len_tokens} "
                    "tokens, which leaves no room for an answer")
        num_blocks = self.kv.num_blocks_for(num_prompt)
        if num_blocks > self.kv.num_total_blocks:
            return (f"the prompt needs {num_blocks} KV blocks of {self.kv.block_size} tokens; this worker's pool "
                    f"holds {self.kv.num_total_blocks}")
        return None

    def _release(self, seq: Sequence) -> None:
        """Take ``seq`` out of every queue and free its blocks (finish or abort)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self._block_ids.pop(seq.request_id, None)
        self.kv.free(seq)
        self._requests.pop(seq.request_id, None)
        self._arrival_idx.pop(seq.request_id, None)

    def _event(self, seq: Sequence, new_token_ids: list[int], reason: str | None,
               error: str | None = None, error_code: str | None = None) -> SeqEvent:
        return SeqEvent(seq.request_id, new_token_ids, reason, seq.num_prompt_tokens, seq.num_cached_tokens,
                        seq.num_output_tokens, error, error_code)
