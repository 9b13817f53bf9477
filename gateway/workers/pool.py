"""The workers of one pool as admission sees them: the capacity view and the router.

:class:`WorkerPool` is the admission controller's :class:`~gateway.admission.capacity.CapacityView` (DESIGN.md, step 6):
a worker may take a request when it is connected, not draining, its circuit breaker lets a request through, it
runs fewer than ``max_num_seqs`` of this gateway's requests and the KV blocks not yet promised to requests cover
the new one's demand (prompt + capped output). Among those, the one holding the longest cached prefix of the
prompt wins (a gateway-side index of the prompt blocks recently sent to each worker; session affinity falls out of
it), then the one with the most free KV.

A worker also takes no new request while the prompts already sent to it and not yet started (no first token), of
the request's tier or a higher one, hold more than ``prefill_queue_s`` seconds of prefill work at its measured
prefill rate (one such prompt is always allowed). Lower tiers' prompts do not count: the worker's scheduler
prefills higher tiers first (``worker.scheduler``), so a vip request overtakes them there. The backlog then waits in the gateway's tier queues, where priority, deadlines and early rejection act,
instead of in the worker's FIFO, where they cannot: Mooncake (FAST'25) and SGLang's router keep the same rule of
a short per-instance queue behind a global scheduler.
"""


from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Sequence
from typing import Callable

from gateway.workers.breaker import BreakerState, CircuitBreaker
from gateway.workers.client import WorkerClient
from gateway.workers.kv_booking import shareable_hashes
from gateway.workers.reservation import Reservation
from gateway.workers.status import WorkerStatus, worker_status
from shared.config import BreakerConfig
from shared.prefix_hash import hash_token_blocks

NO_WORKER_RETRY_AFTER_S = 1.0  # Retry-After while no worker is ready (a reconnect or restart takes about this)


class _PromptHashes:
    """The chain hashes of one prompt's full blocks, per block size, computed once when first asked."""

    def __init__(self, prompt_token_ids: Sequence[int]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self._by_block_size: dict[int, list[int]] = {}
        self._shareable_by_block_size: dict[int, Sequence[int]] = {}

    def full(self, block_size_tokens: int) -> list[int]:
        """Return the hashes of the prompt's full blocks (prefix-aware routing)."""
        hashes = self._by_block_size.get(block_size_tokens)
        if hashes is None:
            hashes = self._by_block_size[block_size_tokens] = hash_token_blocks(self.prompt_token_ids,
                                                                                block_size_tokens)
        return hashes

    def shareable(self, block_size_tokens: int) -> Sequence[int]:
        """Return the hashes of the blocks a worker can share with other requests (:func:`shareable_hashes`)."""
        hashes = self._shareable_by_block_size.get(block_size_tokens)
        if hashes is None:  # asked once per worker per dispatch pass: computed once
            hashes = self._shareable_by_block_size[block_size_tokens] = shareable_hashes(
                self.full(block_size_tokens), len(self.prompt_token_ids), block_size_tokens)
        return hashes


class WorkerPool:
    """The workers this gateway serves from: the admission controller's capacity view and the router.

    Args:
        clients: one per worker.
        on_change: called whenever capacity may have changed (a capacity report, Hello, a lost connection, a
            released reservation); the app points it at ``AdmissionController.on_capacity_changed``.
    """

    def __init__(self, clients: list[WorkerClient], on_change: Callable[[], None] | None = None,
                 prefill_queue_s: float = 0.0) -> None:
        self.clients = clients
        self.prefill_queue_s = prefill_queue_s  # see the module docstring; 0 = no prefill backlog limit
        # tier name → priority, as the workers order prefills; {} = every tier alike (the FIFO baseline)
        self.tier_priorities: dict[str, int] = {}
        self._reservation_ids = itertools.count(1)
        self._known_prefill_tokens_per_s = 0.0
        self.on_change = on_change
        self._client_change_scheduled = False
        self._last_hashes: _PromptHashes | None = None  # see _prompt_hashes
        self._loop: asyncio.AbstractEventLoop | None = None  # see _client_changed
        for client in clients:
            client.on_change = self._client_changed

    @classmethod
    def make_breaker(cls, config: BreakerConfig) -> CircuitBreaker:
        """Return a new breaker with the configured threshold and cooldown."""
        return CircuitBreaker(config.failure_threshold, config.cooldown_s)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _client_changed(self) -> None:
        """A worker's capacity may have changed (a capacity report, a first token, Hello, a lost connection): call
        ``on_change`` once at the end of this event-loop iteration, however many of the worker messages read in it
        changed something — one dispatch pass for a step's batch of first tokens and reports, not one each.
        Without a running loop, at once."""
        if self._client_change_scheduled:
            return
        loop = self._loop  # kept: asking for the running loop costs a getpid system call on Python 3.11
        if loop is None or not loop.is_running():
            try:
                loop = self._loop = asyncio.get_running_loop()
            except RuntimeError:
                self._changed()
                return
        self._client_change_scheduled = True
        loop.call_soon(self._run_client_change)

    def _run_client_change(self) -> None:
        self._client_change_scheduled = False
        self._changed()

    def ready_clients(self) -> list[WorkerClient]:
        return [c for c in self.clients if c.ready]

    @property
    def is_ready(self) -> bool:
        return any(c.ready for c in self.clients)

    def max_model_len_tokens(self, configured_tokens: int, reserved_kv_fraction: float = 0.0) -> int:
        """Return the longest sequence (prompt + output, tokens) the pool can ever serve: the config's context,
        lowered to what the ready workers announce and to what their KV pools hold.

        A request is dispatched only when one worker has room for its KV demand (prompt + output, in blocks), and
        only within the pool's blocks less the shares that tiers above it reserve; a sequence longer than the
        largest worker's pool, or than that remainder, would wait in its queue until its deadline. Before any
        worker is ready (a cold start) only the config and nothing else bounds it.

        Args:
            configured_tokens: ``model.max_model_len_tokens``.
            reserved_kv_fraction: the fraction of the pool's KV blocks that tiers above the request's keep for
                themselves (admission's reserved shares, :meth:`OutputCapper.reserved_kv_fraction_above`).
        """
        limit_tokens = configured_tokens
        largest_pool_tokens = total_blocks = block_size = 0
        for client in self.clients:  # one pass: asked twice per request (tokenize, caps)
            hello = client.hello
            if hello is None or not client.ready:
                continue
            blocks = client.total_kv_blocks
            block_size = block_size or hello.block_size_tokens
            limit_tokens = min(limit_tokens, hello.max_model_len_tokens)
            largest_pool_tokens = max(largest_pool_tokens, blocks * hello.block_size_tokens)
            total_blocks += blocks
        if not block_size:
            return configured_tokens
        unreserved_blocks = math.floor(total_blocks * (1.0 - reserved_kv_fraction) + 1e-9)
        return min(limit_tokens, largest_pool_tokens, unreserved_blocks * block_size)

    def known_prefill_tokens_per_s(self) -> float:
        """Return the prefill rate, tokens/s, to assume for a worker that has measured none yet: the mean over
        the workers that have, else the last such mean (kept through a scale to zero); 0.0 = never measured.

        Workers of one pool run the same model on the same kind of device, so a worker that just started prefills
        at about its siblings' rate. Without it, the backlog limit would not hold for the first capacity reports
        of a new worker, and a burst that meets a cold start would be sent to the new worker whole, past the
        tier queues where priority, deadlines and early rejection act.
        """
        rates = [c.prefill_tokens_per_s for c in self.clients if c.prefill_tokens_per_s > 0]
        if rates:
            self._known_prefill_tokens_per_s = sum(rates) / len(rates)
        return self._known_prefill_tokens_per_s

    # ------------------------------------------------------------------ CapacityView

    def _serving_clients(self) -> list[WorkerClient]:
        """Ready workers whose breaker is not open (closed, or half-open and able to probe soon)."""
        return [c for c in self.ready_clients() if c.breaker.state is not BreakerState.OPEN]

    def _prompt_hashes(self, prompt_token_ids: Sequence[int]) -> _PromptHashes:
        """Return the block hashes of this prompt list, computed once for consecutive asks about the same list
        object (a dispatch asks :meth:`shared_prefix_blocks` then :meth:`try_reserve` for one ticket's prompt)."""
        hashes = self._last_hashes
        if hashes is None or hashes.prompt_token_ids is not prompt_token_ids:
            hashes = self._last_hashes = _PromptHashes(prompt_token_ids)
        return hashes

    def try_reserve(self, demand_blocks: int, tier: str, prompt_token_ids: Sequence[int],
                    avoid: object | None = None, group: object | None = None) -> Reservation | None:
        """Pick a worker for a request and book on it the KV blocks the request will newly allocate, and one
        sequence slot.

        The booking is ``demand_blocks`` less the leading prompt blocks that requests admitted on that worker
        already hold: their prefix is cached there once and shared (:mod:`gateway.workers.kv_booking`).

        Args:
            demand_blocks: KV blocks the request may need (prompt + capped output).
            tier: the request's tier (not used for the choice today).
            prompt_token_ids: the prompt, to find the worker with the longest cached prefix.
            avoid: a worker (:class:`WorkerClient`) to skip while another ready worker with an available breaker
                exists: a retry goes to another worker when there is one.
            group: the request whose choices are reserved together (``Ticket.group``): on an upstream engine, their
                reservations do not hold one another back (:meth:`UpstreamClient.can_take`).

        Returns:
            The reservation, or None when no worker has room now.
        """
        num_prompt_tokens = len(prompt_token_ids)
        priority = self.tier_priorities.get(tier, 0)
        fallback_rate = self.known_prefill_tokens_per_s() if self.prefill_queue_s > 0 else 0.0
        hashes = self._prompt_hashes(prompt_token_ids)
        candidates = [c for c in self.clients if c.ready and c.can_take(
            c.kv_booking.new_blocks(demand_blocks, hashes.shareable(c.block_size_tokens)), num_prompt_tokens,
            self.prefill_queue_s, priority, fallback_rate, group=group)]
        if avoid is not None and any(c is not avoid and c.ready and c.breaker.available() for c in self.clients):
            candidates = [c for c in candidates if c is not avoid]
        if not candidates:
            return None

        def rank(client: WorkerClient) -> tuple[int, int, int]:
            cached = client.prefix_memory.cached_blocks(hashes.full(client.block_size_tokens))
            free = client.total_kv_blocks - client.committed_kv_blocks
            return cached, free, -client.num_reserved

        best = max(candidates, key=rank)
        if not best.breaker.allow_request():
            return None
        block_hashes = hashes.full(best.block_size_tokens)
        shareable = hashes.shareable(best.block_size_tokens)
        best.num_reserved += 1
        booked_blocks = best.kv_booking.book(demand_blocks, shareable)
        prefill_tokens = max(1, num_prompt_tokens - best.prefix_memory.cached_blocks(block_hashes) * best.block_size_tokens)
        reservation = Reservation(next(self._reservation_ids), best, demand_blocks, block_hashes=block_hashes,
                                  prefill_tokens=prefill_tokens, priority=priority, shareable_hashes=shareable,
                                  booked_blocks=booked_blocks, group=group)
        best.hold_prefill(reservation)
        return reservation

    def release(self, reservation: Reservation) -> None:
        """Give back a reservation; a request that ended without a breaker verdict counts as abandoned."""
        worker = reservation.worker
        worker.num_reserved -= 1
        worker.kv_booking.release(reservation.demand_blocks, reservation.shareable_hashes)
        worker.prefill_started(reservation)
        if not reservation.verdict_given:
            worker.breaker.on_abandoned()

    def booked_blocks(self, reservation: Reservation) -> int:
        """Return the KV blocks the reservation added to its worker's booking (its demand less the shared prompt
        blocks others held already)."""
        return reservation.booked_blocks

    def shared_prefix_blocks(self, prompt_token_ids: Sequence[int]) -> int:
        """Return the most leading prompt blocks of ``prompt_token_ids`` that admitted requests on one ready worker
        hold already (booked there, so a request routed there books that many fewer)."""
        hashes = self._prompt_hashes(prompt_token_ids)
        return max((c.kv_booking.num_held(hashes.shareable(c.block_size_tokens)) for c in self.ready_clients()
                    if c.kv_booking.num_shared_blocks > 0), default=0)

    def no_worker_retry_after_s(self) -> float:
        """Return when a client turned away for want of a worker should retry, in seconds: the soonest probe of a
        ready worker whose breaker is open, else :data:`NO_WORKER_RETRY_AFTER_S` (about one reconnect or restart
        backoff of a worker that is down)."""
        waits = [c.breaker.seconds_until_probe() for c in self.ready_clients()
                 if c.breaker.state is BreakerState.OPEN]
        return max(NO_WORKER_RETRY_AFTER_S, min(waits)) if waits else NO_WORKER_RETRY_AFTER_S

    def num_serving_workers(self) -> int:
        """Return the ready workers whose breaker is not open."""
        return len(self._serving_clients())

    def num_starting_workers(self) -> int:
        """Return workers that will serve soon without having said Hello yet (none in a fixed pool)."""
        return 0

    def total_kv_blocks(self) -> int:
        """Return the KV blocks of ready workers whose breaker is not open; 0 = no worker can serve."""
        return sum(c.total_kv_blocks for c in self._serving_clients())

    def total_sequence_slots(self) -> int:
        """Return ``max_num_seqs`` summed over ready workers whose breaker is not open."""
        return sum(c.hello.max_num_seqs for c in self._serving_clients() if c.hello is not None)

    def free_sequence_slots(self) -> int:
        """Return the sequence slots of ready workers whose breaker is not open that no reservation holds."""
        return sum(max(0, c.hello.max_num_seqs - c.num_reserved) for c in self._serving_clients()
                   if c.hello is not None)

    def starting_sequence_slots(self) -> int:
        """Return the sequence slots of workers still starting: 0 (a fixed pool has no cold starts)."""
        return 0

    def block_size_tokens(self) -> int:
        """Return tokens per KV block (the first ready worker's; 16 before any said Hello)."""
        ready = self.ready_clients()
        return ready[0].block_size_tokens if ready else 16

    def drain_rate_tokens_per_s(self) -> float:
        """Return the rate at which the workers work off prompt + output tokens, summed over serving workers.

        Per worker: its measured ``busy_tokens_per_s``, the prompt + output tokens of its steps ÷ the seconds those
        steps took. A step prefills prompt chunks and decodes running sequences together, so the per-phase rates
        overlap and their sum would overstate the work done per busy second. 0.0 when nothing is measured yet.
        """
        total = 0.0
        for client in self._serving_clients():
            capacity = client.capacity
            if capacity is not None:
                total += capacity.busy_tokens_per_s
        return total

    def sequence_rates_tokens_per_s(self) -> tuple[float, float] | None:
        """Return (prefill, decode) tokens/s that one running sequence gets on a busy serving worker now.

        Per busy worker (one that reported running sequences and a measured decode rate): prefill at the worker's
        prompt tokens per second of its prefilling steps (``Capacity.sequence_prefill_tokens_per_s``, else its
        prefill rate per busy second); decode at its measured decode steps per second (``Capacity.
        sequence_decode_tokens_per_s``: a decode step advances every running sequence by one token), or, from a
        worker that does not report it, its decode tokens/s ÷ its running sequences. Each is the mean over those
        workers (prefill 0.0 when no busy worker has measured it). Admission turns these into how long an admitted
        request holds its sequence slot. None when no busy worker has measured its decode rate.
        """
        prefill_rates, decode_rates = [], []
        for client in self._serving_clients():
            capacity = client.capacity
            if capacity is None or capacity.num_running <= 0 or capacity.decode_tokens_per_s <= 0:
                continue
            decode_rates.append(capacity.sequence_decode_tokens_per_s
                                or capacity.decode_tokens_per_s / capacity.num_running)
            prefill = capacity.sequence_prefill_tokens_per_s or capacity.prefill_tokens_per_s
            if prefill > 0:
                prefill_rates.append(prefill)
        if not decode_rates:
            return None
        prefill = sum(prefill_rates) / len(prefill_rates) if prefill_rates else 0.0
        return prefill, sum(decode_rates) / len(decode_rates)

    def kv_used_fraction(self) -> float:
        """Return committed ÷ total KV blocks over serving workers (reservations or reported use, the larger)."""
        total = committed = 0
        for client in self._serving_clients():  # one pass: the pressure monitor asks on every admit
            total += client.total_kv_blocks
            committed += min(client.committed_kv_blocks, client.total_kv_blocks)
        return committed / total if total else 0.0

    # ------------------------------------------------------------------ breaker verdicts and routing memory

    def dispatched(self, reservation: Reservation) -> None:
        """Remember that the reservation's prompt was sent to its worker (prefix-aware routing)."""
        reservation.worker.prefix_memory.remember(reservation.block_hashes)

    def record_success(self, reservation: Reservation) -> None:
        """The worker served the request (first token or a clean answer): tell its breaker once."""
        if not reservation.verdict_given:
            reservation.verdict_given = True
            reservation.worker.breaker.on_success()

    def record_failure(self, reservation: Reservation) -> None:
        """The worker failed or timed out on the request: count it against its breaker."""
        reservation.verdict_given = True
        reservation.worker.breaker.on_failure()
        self._changed()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for client in self.clients:
            client.start()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    def status(self) -> list[WorkerStatus]:
        """Return a snapshot of every worker (for ``/status`` and metrics)."""
        now_s = time.time()
        return [worker_status(client, now_s) for client in self.clients]
