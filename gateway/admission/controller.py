"""Admission control: tiered queues, deadlines, early rejection, reserved shares (DESIGN.md, step 5).

One bounded FIFO queue per tier. A request is dispatched when the capacity view (the gateway's worker pool) finds a
worker with room for its KV demand — prompt + capped output tokens, in blocks, less the leading prompt blocks that
requests admitted on that worker already hold (a shared prefix is cached there once and booked once) — and below
its ``max_num_seqs``.
Which waiting request goes first is a small policy chosen by name (``admission.order_policy``):

- ``priority_aging``: strict priority with aging. Effective priority = tier priority + seconds waited ×
  ``aging_rate_per_s``, the classic cure for starvation under priority scheduling (aging, as in Silberschatz,
  Galvin & Gagne, "Operating System Concepts", CPU scheduling). A low tier still moves; a fresh top-tier request
  goes ahead of every low-tier request that has not waited long.
- ``fifo``: arrival order across tiers (the benchmark baseline).

Dispatch is strict: when the request that should go next does not fit on any worker, nobody behind it jumps ahead,
so freed capacity goes to it first ("starts within one worker step of capacity freeing"). Only a request
held back by a **reserved share** is stepped over: tier T's ``reserved_kv_fraction`` of the pool's KV blocks and
its ``reserved_slot_fraction`` of the pool's sequence slots are kept for it, and lower-priority tiers may not take
the part of them that T is not using — so a top-tier request finds a slot at once even while lower tiers' long
answers would fill every one. With ``reserved_slot_window_s``, T's reserved slots are at least its arrivals of
that window while T has a request queued or running: during T's burst lower tiers start nothing new (on an engine
that prefills side by side, a lower tier's prompt started beside T's requests slows each of them by a whole
prefill).

Shedding, every case an :class:`~shared.errors.SluiceError` with ``retry_after_s`` (integer ≥ 1):

============================  ======  ===================================================================
cause                         status  when
============================  ======  ===================================================================
``rate_limit_exceeded``       429     the API key exceeds its requests/tokens per minute (at arrival)
``server_overloaded``         503     the pressure level sheds the tier (at arrival, and queued ones)
``queue_full``                503     the tier's queue holds ``queue_capacity`` requests (at arrival; with tier
                                      counters in Redis, its queues on all gateways together)
``predicted_queue_timeout``   503     predicted wait > the tier's deadline (at arrival; Mooncake, FAST'25)
``queue_timeout``             503     waited past the tier's ``queue_timeout_s`` (timeout circuit breaking)
``no_worker_available``       503     the capacity view has no worker at all (at arrival)
``server_draining``           503     the gateway is shutting down
============================  ======  ===================================================================

Predicted wait and ``Retry-After``: :mod:`gateway.admission.wait_estimate` says how each is computed (work ahead ÷
the measured drain rate, or the time until a sequence slot frees while requests are held for lack of room; Mooncake,
FAST'25).

Per request, the gateway calls::

    ticket = controller.make_ticket_for(principal, prompt_token_ids, max_tokens)
    try:
        reservation = await controller.admit(ticket)  # waits; raises SluiceError when shed
        ...send to the worker the reservation names; ticket.queue_wait_s for x-sluice-queue-ms...
    finally:
        controller.release(ticket, completion_tokens)  # always; a no-op unless admitted
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic

import msgspec

from gateway.admission.arrival import ArrivalChecks
from gateway.admission.capacity import CapacityView, ReservationT
from gateway.admission.dispatch import Dispatcher
from gateway.admission.order import FifoOrder, make_dispatch_order
from gateway.admission.preemption import Preemption
from gateway.admission.pressure import PressureMonitor, pressure_signal_tier
from gateway.admission.ratelimit import RateLimiter, TokenBucketRateLimiter
from gateway.admission.rates import ServiceRates
from gateway.admission.shedding import Shedder
from gateway.admission.stats import AdmissionStats, tier_stats
from gateway.admission.tickets import Ticket, TicketState, TierQueue
from gateway.admission.wait_estimate import WaitEstimator
from shared.config import Config, effective_tiers, validate_admission_config
from shared.errors import ErrorCode, SluiceError

if TYPE_CHECKING:
    from gateway.pipeline.classify import Principal

# The rate-limit key of requests without an API key.
ANONYMOUS_KEY = "anonymous"


class AdmissionController(Generic[ReservationT]):
    """Tiered admission queues in front of the workers; see the module docstring for the rules.

    Args:
        config: tiers, admission and pressure settings.
        view: the worker pool's capacity view.
        pressure: the pressure monitor shared with output caps; None = a new one from ``config.pressure``.
        limiter: per-key rate limiter; None = an in-process token bucket.
        clock: monotonic time in seconds (injectable for tests; must be the event loop's time base in production
            because deadlines are awaited with real timers).

    Raises:
        ConfigError: inconsistent tiers/pressure config, or an unknown ``admission.order_policy``.
    """

    def __init__(
        self,
        config: Config,
        view: CapacityView[ReservationT],
        pressure: PressureMonitor | None = None,
        limiter: RateLimiter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        validate_admission_config(config)
        self._config = config
        self._admission = config.admission
        self._enabled = config.admission.enabled
        self._view = view
        self._clock = clock
        self.pressure = pressure if pressure is not None else PressureMonitor(config.pressure, clock)
        self._limiter = limiter if limiter is not None else TokenBucketRateLimiter(clock)
        order_name = config.admission.order_policy if self._enabled else FifoOrder.name
        self._order = make_dispatch_order(order_name, config.admission.aging_rate_per_s)
        tiers = sorted(effective_tiers(config), key=lambda tier: -tier.priority)
        self._queues: dict[str, TierQueue] = {tier.name: TierQueue(tier) for tier in tiers}
        self._lowest_tier = tiers[-1].name  # its predicted wait is behind every queued request (the autoscaler's)
        self._pressure_tier = pressure_signal_tier(tiers, self.pressure)
        self._ticket_ids = itertools.count(1)
        self._in_flight: dict[int, Ticket[ReservationT]] = {}  # admitted, not yet released, by ticket id
        self.rates = ServiceRates(config.admission, view, clock)  # drain, arrival and service rates (``/status``)
        self.preemption = Preemption(self._enabled and self._admission.preempt_lower_tiers
                                     and self._admission.order_policy != "fifo", self._in_flight, view)
        self._waits = WaitEstimator(config, self._queues, self._in_flight, self.rates, self._order, view,
                                    self.pressure, clock, self.preemption.enabled)
        self._dispatcher = Dispatcher(self._enabled, self._queues, self._in_flight, self.rates, self._waits,
                                      self._order, view, clock, lambda now_s: self.shedder.shed_expired(now_s),
                                      self.preemption)
        self._arrival = ArrivalChecks(config, self._queues, self._waits, self.pressure, view,
                                      lambda tier: self.queued_elsewhere(tier))
        self.shedder = Shedder(self._queues, self._waits, self._arrival, self.pressure, view,
                               self._dispatcher.dispatch, clock)
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the first admit
        # tier name → requests of that tier queued on the other gateways (``gateway.admission.tier_counters``),
        # counted against
        # the tier's queue_capacity at arrival; the default: this gateway alone
        self.queued_elsewhere: Callable[[str], int] = lambda tier: 0
        # called after every arrival is recorded (the offered load grew): the fleet's autoscaler looks at once
        self.on_arrival: Callable[[], None] | None = None

    # ----------------------------------------------------------------------------------------------- per request

    def make_ticket(
        self,
        tier: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        rate_limit_key: str = ANONYMOUS_KEY,
        rpm_limit: int = 0,
        tpm_limit: int = 0,
        avoid: object | None = None,
        group: object | None = None,
    ) -> Ticket[ReservationT]:
        """Make the admission ticket of one request.

        Args:
            tier: the tier name (already resolved and possibly lowered, see ``gateway.pipeline.classify``).
            prompt_token_ids: the tokenized prompt.
            max_tokens: the capped output budget in tokens (``gateway.admission.caps``), ≥ 1.
            rate_limit_key, rpm_limit, tpm_limit: the API key's identity and per-minute limits (0 = unlimited).
            avoid: a worker to skip when another can serve (a retry after a failure before the first byte).
            group: the request whose choices are admitted together (``Ticket.group``).

        Raises:
            KeyError: unknown tier (a bug: tiers are resolved before).
        """
        tier_config = self._queues[tier].config
        block_size = max(1, self._view.block_size_tokens())
        total_tokens = len(prompt_token_ids) + max_tokens
        ticket = Ticket(
            ticket_id=next(self._ticket_ids),
            tier=tier_config,
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            demand_blocks=math.ceil(total_tokens / block_size),
            rate_limit_key=rate_limit_key,
            rpm_limit=rpm_limit if self._enabled else 0,
            tpm_limit=tpm_limit if self._enabled else 0,
            arrival_s=self._clock(),
            avoid=avoid,
            group=group,
        )
        ticket.expected_work_tokens = len(prompt_token_ids) + max_tokens * self.rates.output_fraction
        return ticket

    def make_resume_ticket(self, preempted: Ticket[ReservationT], prompt_token_ids: Sequence[int], max_tokens: int,
                           timeout_s: float) -> Ticket[ReservationT]:
        """Make the ticket of a preempted request's resumption (:mod:`gateway.admission.preemption`).

        It keeps the preempted ticket's tier and first arrival (its place in the tier's queue); it asks for the
        prompt it continues from and the output budget left. Its queue deadline is ``timeout_s`` from when it is
        queued; it is not rejected early, not bounded by the queue's capacity, not turned away by pressure and not
        charged to a rate limit (it was admitted once).
        """
        ticket = self.make_ticket(preempted.tier.name, prompt_token_ids, max_tokens)
        ticket.arrival_s = preempted.arrival_s
        ticket.resume_timeout_s = timeout_s
        return ticket

    def make_requeue_ticket(self, turned_away: Ticket[ReservationT]) -> Ticket[ReservationT]:
        """Make the ticket of a request that an engine turned away with its own 429/503 before its first token
        (``gateway.upstream``): a resumption (:meth:`make_resume_ticket`) of the same prompt and output budget whose
        queue deadline is what was left of ``turned_away``'s, so the client waits at most its tier's deadline in all
        and then gets Sluice's own 503 with ``Retry-After``, never the engine's."""
        left_s = math.inf if turned_away.deadline_s is None else max(0.0, turned_away.deadline_s - self._clock())
        return self.make_resume_ticket(turned_away, turned_away.prompt_token_ids, turned_away.max_tokens, left_s)

    def make_ticket_for(self, principal: Principal, prompt_token_ids: Sequence[int],
                        max_tokens: int, group: object | None = None) -> Ticket[ReservationT]:
        """Make a ticket for a resolved :class:`~gateway.pipeline.classify.Principal` (tier and per-key limits)."""
        return self.make_ticket(
            principal.tier.name,
            prompt_token_ids,
            max_tokens,
            rate_limit_key=principal.rate_limit_key,
            rpm_limit=principal.rpm_limit,
            tpm_limit=principal.tpm_limit,
            group=group,
        )

    async def admit(self, ticket: Ticket[ReservationT]) -> ReservationT:
        """Queue the ticket and wait until a worker has room; return the capacity view's reservation.

        Cancelling the caller (client disconnect) removes the ticket from its queue, or gives its reservation
        back when it was admitted in the same instant.

        Raises:
            SluiceError: shed (see the module docstring), always with ``retry_after_s`` ≥ 1.
            RuntimeError: the ticket was already used.
        """
        if ticket.state is not TicketState.NEW:
            raise RuntimeError(f"ticket {ticket.ticket_id} was already submitted ({ticket.state.value})")
        queue = self._queues[ticket.tier.name]
        self._observe_pressure()
        decision = await self._limiter.try_acquire(
            ticket.rate_limit_key, ticket.rpm_limit, ticket.tpm_limit, len(ticket.prompt_token_ids) + ticket.max_tokens
        )
        if not decision.allowed:
            limit_name = "requests" if decision.limit == "rpm" else "tokens"
            self._arrival.reject(
                ticket,
                queue,
                ErrorCode.RATE_LIMIT_EXCEEDED,
                f"Rate limit reached for {limit_name} per minute on this API key. Retry after the indicated time.",
                decision.retry_after_s,
            )
        resuming = ticket.resume_timeout_s is not None  # a preempted request (gateway.admission.preemption)
        if not resuming:
            self._record_arrival(ticket)
        timeout_s = (
            self.pressure.queue_timeout_s(ticket.tier.name, ticket.tier.queue_timeout_s) if self._enabled else math.inf
        )
        loop = self._loop  # kept: asking for the running loop costs a getpid system call on Python 3.11
        if loop is None or not loop.is_running():
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[ReservationT] = loop.create_future()
        try:
            self._arrival.check(ticket, queue, self._draining)
            ticket.enqueued_s = self._clock()
            if resuming:
                timeout_s = ticket.resume_timeout_s
                ticket.deadline_s = ticket.enqueued_s + timeout_s
            else:
                ticket.deadline_s = ticket.arrival_s + timeout_s  # from arrival (rate limiter included)
            ticket.state = TicketState.QUEUED
            ticket._future = future
            if resuming:
                queue.push_in_place(ticket, ticket.arrival_s)  # its place in its tier: its first arrival
            else:
                queue.push(ticket)
            self._dispatcher.dispatch()
            if (ticket.state is TicketState.QUEUED and self._enabled and self._admission.early_rejection
                    and not resuming):
                self.shedder.check_predicted_wait(ticket, queue, timeout_s)
        except SluiceError:
            await self._limiter.refund(ticket.rate_limit_key, len(ticket.prompt_token_ids) + ticket.max_tokens)
            raise
        try:
            while not future.done():
                remaining_s = ticket.deadline_s - self._clock()
                if remaining_s <= 0:
                    self.shedder.shed_timed_out(ticket)
                    break
                await asyncio.wait((future,), timeout=None if math.isinf(remaining_s) else remaining_s)
        except asyncio.CancelledError:
            self._cancel(ticket)
            raise
        return future.result()

    def release(self, ticket: Ticket[ReservationT], completion_tokens: int | None = None) -> None:
        """Give back an admitted ticket's reservation (the request finished, failed or was aborted); re-dispatch.

        Safe to call for any ticket in a ``finally``: a no-op unless the ticket is admitted.

        Args:
            ticket: the ticket.
            completion_tokens: output tokens the request produced, to learn how much of ``max_tokens`` answers use.
        """
        if ticket.state is not TicketState.ADMITTED:
            return
        ticket.state = TicketState.RELEASED
        self._in_flight.pop(ticket.ticket_id, None)
        queue = self._queues[ticket.tier.name]
        queue.num_in_flight -= 1
        queue.in_flight_blocks -= ticket.booked_blocks
        if completion_tokens is not None and ticket.max_tokens > 0:
            self.rates.record_output(completion_tokens, ticket.max_tokens)
        reservation, ticket.reservation = ticket.reservation, None
        self._view.release(reservation)
        self._dispatcher.dispatch()

    def worker_start_deadline_s(self, ticket: Ticket[ReservationT], allowance_s: float) -> float:
        """Return the ``time.time()`` by which the worker must start the admitted ticket's request, else drop it
        unstarted (``Generate.deadline_s``): the ticket's queue deadline, or ``allowance_s`` from now when later
        (the ticket may have used most of its deadline here; the worker holds at most that much prefill work of its
        tier and above ahead of it, ``admission.worker_prefill_queue_s``). 0 = none (admission off, no deadline).

        Higher tiers dispatched after it overtake it on the worker; under sustained overload a low-tier request
        could otherwise wait there for tens of seconds, past any deadline.
        """
        if not self._enabled or ticket.deadline_s is None or math.isinf(ticket.deadline_s):
            return 0.0
        return time.time() + max(ticket.deadline_s - self._clock(), allowance_s)

    def shed_at_worker(self, ticket: Ticket[ReservationT], message: str) -> SluiceError:
        """The worker dropped the ticket's request unstarted at its start deadline: count a ``queue_timeout`` of
        its tier and return the 503 to answer (:meth:`Shedder.shed_at_worker`)."""
        return self.shedder.shed_at_worker(ticket, message)

    def on_capacity_changed(self) -> None:
        """Re-run dispatch (and shed expired tickets): call when a worker reports capacity or a request ends."""
        self._observe_pressure()
        self._dispatcher.dispatch()

    @property
    def draining(self) -> bool:
        """Return whether :meth:`start_draining` was called."""
        return self._draining

    def start_draining(self) -> None:
        """Stop admitting: shed queued tickets and reject new ones with 503 ``server_draining`` (SIGTERM)."""
        self._draining = True
        self.shedder.shed_all(ErrorCode.DRAINING, "The server is shutting down; retry on another instance.")

    def shed_queued(self, code: ErrorCode, message: str, retry_after_s: float) -> None:
        """Turn every queued ticket away with ``code`` and ``message`` (Retry-After ``retry_after_s``, clamped): no
        capacity can come for them (the pool's workers cannot start)."""
        self.shedder.shed_all(code, message, retry_after_s)

    # ----------------------------------------------------------------------------------------------- estimates

    @property
    def lowest_tier(self) -> str:
        """Return the name of the tier of the lowest priority (its predicted wait is behind all queued work)."""
        return self._lowest_tier

    def usable_sequence_slots(self, tier: str, total_slots: int) -> int:
        """Return the most of ``total_slots`` sequence slots that requests of ``tier`` can hold at once: all but the
        shares the tiers above it reserve, as the dispatcher counts them (``WaitEstimator.usable_slots``); all
        with admission off (no reserved shares)."""
        if not self._enabled:
            return total_slots
        return self._waits.usable_slots(self._queues[tier].config.priority, total_slots)

    def queue_depths(self) -> dict[str, int]:
        """Return the requests queued per tier, by tier name."""
        return {name: len(queue.tickets) for name, queue in self._queues.items()}

    def num_queued(self) -> int:
        """Return the requests queued in every tier."""
        return sum(len(queue.tickets) for queue in self._queues.values())

    def predicted_wait_s(self, tier: str) -> float | None:
        """Return the predicted queue wait in seconds of a request arriving now in ``tier``, None when unknown
        (see :meth:`WaitEstimator.predicted_wait_s`)."""
        return self._waits.predicted_wait_s(tier)

    def stats(self) -> AdmissionStats:
        """Return per tier queue depth, oldest wait, in-flight, admitted / rejected by reason, predicted wait and
        dispatch rate; plus the drain rate and the pressure level. For ``/status`` and metrics."""
        now_s = self._clock()
        tiers = {name: tier_stats(queue, now_s, self.predicted_wait_s(name),
                                  self.rates.tier_dispatch_rate_per_s(queue, now_s),
                                  self.preemption.num_preempted[name])
                 for name, queue in self._queues.items()}
        return AdmissionStats(
            enabled=self._enabled,
            order_policy=self._order.name,
            draining=self._draining,
            drain_rate_tokens_per_s=round(self.rates.drain_rate_tokens_per_s(), 1),
            expected_output_fraction=round(self.rates.output_fraction, 3),
            pressure=self.pressure.stats(),
            tiers=tiers,
        )

    def snapshot(self) -> dict[str, Any]:
        """Return :meth:`stats` as JSON-ready builtins (the ``/status`` view)."""
        return msgspec.to_builtins(self.stats())

    # ----------------------------------------------------------------------------------------------- internals

    def _cancel(self, ticket: Ticket[ReservationT]) -> None:
        """The waiter was cancelled: leave the queue, or give back a reservation granted in the same instant."""
        if ticket.state is TicketState.QUEUED:
            queue = self._queues[ticket.tier.name]
            queue.remove(ticket)
            queue.num_cancelled += 1
            ticket.state = TicketState.CANCELLED
            self._dispatcher.dispatch()  # it may have been the head holding others back
        elif ticket.state is TicketState.ADMITTED:
            self.release(ticket)
            ticket.state = TicketState.CANCELLED
        if ticket._future is not None:
            if not ticket._future.done():
                ticket._future.cancel()
            elif not ticket._future.cancelled():
                ticket._future.exception()  # mark retrieved: nobody awaits it any more

    def _record_arrival(self, ticket: Ticket[ReservationT]) -> None:
        self.rates.record_arrival(ticket.expected_work_tokens)
        self._queues[ticket.tier.name].record_arrival(ticket.arrival_s)
        if self.on_arrival is not None:
            self.on_arrival()

    def _observe_pressure(self) -> None:
        """Feed the pressure monitor (``Shedder.observe_pressure``); a no-op with admission off."""
        if self._enabled:
            self.shedder.observe_pressure(self._pressure_tier)
