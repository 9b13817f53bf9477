"""Admission control: tiered queues, deadlines, early rejection, reserved shares (DESIGN.md, step 5).

One bounded FIFO queue per tier. A request is dispatched when the capacity view (the gateway's worker pool) finds a
worker with room for its KV demand — prompt + capped output tokens, in blocks — and below its ``max_num_seqs``.
Which waiting request goes first is a small policy chosen by name (``admission.order_policy``):

- ``priority_aging``: strict priority with aging. Effective priority = tier priority + seconds waited ×
  ``aging_rate_per_s``, the classic cure for starvation under priority scheduling (aging, as in Silberschatz,
  Galvin & Gagne, "Operating System Concepts", CPU scheduling). A low tier still moves; a fresh top-tier request
  goes ahead of every low-tier request that has not waited long (BC28).
- ``fifo``: arrival order across tiers (the benchmark baseline).

Dispatch is strict: when the request that should go next does not fit on any worker, nobody behind it jumps ahead,
so freed capacity goes to it first ("starts within one worker step of capacity freeing", BC28). Only a request
held back by a **reserved share** is stepped over: tier T's ``reserved_kv_fraction`` of the pool's KV blocks and
its ``reserved_slot_fraction`` of the pool's sequence slots are kept for it, and lower-priority tiers may not take
the part of them that T is not using — so a top-tier request finds a slot at once even while lower tiers' long
answers would fill every one (BC28).

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

Predicted wait (prediction-based early rejection, after Qin et al., "Mooncake: Trading More Storage for Less
Computation — A KVCache-centric Architecture for Serving LLM Chatbot", FAST'25): tokens of work ahead of the request
— the expected prompt + output tokens of everything queued in its tier and higher tiers — ÷ the drain rate in
tokens/s. The drain rate is measured where it happens: the expected work admission dispatched while requests were
held in the queue for lack of room (a backlog: every dispatch then is the workers' capacity freeing), ÷ the serving
worker-seconds of those backlogged periods over ``admission.rate_window_s``, × the workers serving (and, for an
elastic pool, starting) now. That is the queue's service rate under load whatever limits it (prefill backlog,
sequence slots, KV), as in the M/G/c busy-period throughput. The room a worker brings when it joins (a scale-up: its
first prefill backlog and sequence slots fill at once) is not service, so the dispatch pass that meets a new serving
worker is left out of the measure. A window with too little backlog in it (``MIN_BACKLOG_WORKER_S``) keeps the last
per-worker rate it measured: that is a property of the workers, and a pool that was idle or scaled to zero between
two bursts serves the next one at it (the next backlog measures it anew). Until some backlog has ever been seen, the
workers' decode + prefill rates from their capacity reports stand in; before those, the plain dispatch rate.
Expected output is ``max_tokens`` × the measured fraction of ``max_tokens`` that finished requests actually
produced. Work ÷ rate alone misses a full pool of long answers: nobody is admitted until one of them ends, however
little work is queued. So while requests are held because sequence slots or KV blocks are taken, the prediction is
instead the time until a slot frees for the request: list scheduling of the requests ahead over the admitted
requests' expected ends, from the workers' per-sequence prefill and decode rates
(:meth:`AdmissionController._slot_wait_s`); work ÷ rate stays for a queue held by the prefill backlog limit (idle
slots) or before those rates are measured. The check runs after the dispatch at arrival, so a request that starts at
once is never rejected for it.
``Retry-After`` is that drain time of the tier's queue (for a predicted miss: the part beyond the deadline; for a
pressure shed: the drain time of all queues, at least the dwell left in the level; for a 429: when the key's
bucket has refilled enough); with no rate measured yet it falls back to the tier's deadline. Clamped to
[1, ``admission.max_retry_after_s``].

Per request, the gateway calls::

    ticket = controller.make_ticket_for(principal, prompt_token_ids, max_tokens)
    try:
        reservation = await controller.admit(ticket)  # waits; raises SluiceError when shed
        ...send to the worker the reservation names; ticket.queue_wait_s for x-sluice-queue-ms...
    finally:
        controller.release(ticket, completion_tokens)  # always; a no-op unless admitted
"""

from __future__ import annotations

import abc
import asyncio
import enum
import heapq
import itertools
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gateway.pressure import PressureLevel, PressureMonitor
from gateway.ratelimit import RateLimiter, TokenBucketRateLimiter
from shared.config import Config, ConfigError, TierConfig, effective_tiers, validate_admission_config
from shared.errors import ErrorCode, SluiceError

if TYPE_CHECKING:
    from gateway.tiers import Principal

ANONYMOUS_KEY = "anonymous"
# Backlogged serving worker-seconds needed in the window before the measured service rate replaces the workers'
# reported rates in the predicted wait.
MIN_BACKLOG_WORKER_S = 2.0
NO_WORKER_RETRY_AFTER_S = 1.0
# Queued requests the predicted wait places on sequence slots one by one; the rest count at their mean.
MAX_SCHEDULED_AHEAD = 256
# Weight of one finished request in the running mean of (completion tokens ÷ max_tokens).
_OUTPUT_FRACTION_EWMA_WEIGHT = 0.05


FIFO_WORKER_TIER = "fifo"

class CapacityView(Protocol):
    """What admission needs from the worker pool (implemented by the gateway's ``WorkerPool``).

    Every method is synchronous and cheap: admission calls them on the event loop while dispatching.
    """

    def try_reserve(
        self, demand_blocks: int, tier: str, prompt_token_ids: Sequence[int], avoid: object | None = None
    ) -> object | None:
        """Pick a worker (closed breaker, ``demand_blocks`` KV blocks free, running < max_num_seqs; route by
        cached prefix, then most free KV) and hold ``demand_blocks`` on it until :meth:`release`. ``avoid`` names
        a worker to skip while another one could serve (a retry goes elsewhere).

        Returns:
            An opaque reservation naming the worker, or None when no worker has room now.
        """

    def release(self, reservation: object) -> None:
        """Give back a reservation returned by :meth:`try_reserve` (the request finished or never ran)."""

    def total_kv_blocks(self) -> int:
        """Return KV blocks over the workers that can take requests now; 0 means no worker is available."""

    def block_size_tokens(self) -> int:
        """Return tokens per KV block."""

    def num_serving_workers(self) -> int:
        """Return how many workers can take requests now (ready, breaker not open)."""

    def num_starting_workers(self) -> int:
        """Return how many workers are starting and will serve soon (an elastic pool's cold starts; else 0)."""

    def drain_rate_tokens_per_s(self) -> float:
        """Return the measured decode + prefill tokens/s summed over the workers (0.0 when unknown)."""

    def kv_used_fraction(self) -> float:
        """Return used ÷ total KV blocks over the workers, 0–1: blocks held by sequences (not the evictable prefix
        cache) per the latest reports, plus reservations not yet reflected in a report."""

    def total_sequence_slots(self) -> int:
        """Return the sequence slots (``max_num_seqs``) summed over the workers that can take requests now.
        Optional: a view without it has no reserved slot shares."""

    def starting_sequence_slots(self) -> int:
        """Return the sequence slots of workers still starting (an elastic pool's cold starts). Optional (0)."""

    def sequence_rates_tokens_per_s(self) -> tuple[float, float] | None:
        """Return the (prefill, decode) tokens/s one running sequence gets on a busy worker now (prefill 0.0 when
        not measured); None when unknown. Optional: a view without it gives no sequence-slot term to the predicted
        wait."""


class TicketState(str, enum.Enum):
    """Where a ticket is in its life."""

    NEW = "new"
    QUEUED = "queued"
    ADMITTED = "admitted"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    RELEASED = "released"


@dataclass(eq=False)
class Ticket:
    """One request's place in admission. Made by :meth:`AdmissionController.make_ticket`.

    Attributes:
        ticket_id: unique and increasing in arrival order.
        tier: the tier the request is served in.
        prompt_token_ids: the prompt, for prefix-aware routing.
        max_tokens: the capped output budget (``gateway.caps``).
        demand_blocks: KV blocks the request may need: ceil((prompt + max_tokens) ÷ block size).
        rate_limit_key, rpm_limit, tpm_limit: per-key limits (0 = unlimited).
        arrival_s: clock time of ``make_ticket``.
        enqueued_s, deadline_s, admitted_s: clock times, None until they happen.
        reservation: the capacity view's reservation once admitted.
        state: see :class:`TicketState`.
        avoid: a worker the capacity view should skip when another can serve (the worker a retry left).
        expected_work_tokens: prompt + the output expected from the measured fraction of ``max_tokens`` used, in
            tokens: what this request adds to the predicted wait of those behind it.
    """

    ticket_id: int
    tier: TierConfig
    prompt_token_ids: Sequence[int]
    max_tokens: int
    demand_blocks: int
    rate_limit_key: str
    rpm_limit: int
    tpm_limit: int
    arrival_s: float
    enqueued_s: float | None = None
    deadline_s: float | None = None
    admitted_s: float | None = None
    reservation: object | None = None
    state: TicketState = TicketState.NEW
    avoid: object | None = None
    expected_work_tokens: float = 0.0
    _future: asyncio.Future[object] | None = field(default=None, repr=False)

    @property
    def prompt_tokens(self) -> int:
        """Return the prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def queue_wait_s(self) -> float:
        """Return the seconds spent queued (arrival → admission); 0.0 before admission."""
        return 0.0 if self.admitted_s is None else self.admitted_s - self.arrival_s


class DispatchOrder(abc.ABC):
    """Which waiting request goes next: the candidate with the highest :meth:`score` (ties: older ticket)."""

    name: str

    @abc.abstractmethod
    def score(self, ticket: Ticket, now_s: float) -> float:
        """Return the ticket's rank now; higher goes first."""


class PriorityAgingOrder(DispatchOrder):
    """Strict priority with aging: priority + seconds waited × ``aging_rate_per_s``."""

    name = "priority_aging"

    def __init__(self, aging_rate_per_s: float) -> None:
        self.aging_rate_per_s = aging_rate_per_s

    def score(self, ticket: Ticket, now_s: float) -> float:
        """See :meth:`DispatchOrder.score`."""
        waited_s = now_s - (ticket.enqueued_s if ticket.enqueued_s is not None else now_s)
        return ticket.tier.priority + waited_s * self.aging_rate_per_s


class FifoOrder(DispatchOrder):
    """Arrival order across all tiers."""

    name = "fifo"

    def score(self, ticket: Ticket, now_s: float) -> float:
        """See :meth:`DispatchOrder.score`."""
        return -(ticket.enqueued_s if ticket.enqueued_s is not None else now_s)


def make_dispatch_order(name: str, aging_rate_per_s: float) -> DispatchOrder:
    """Return the dispatch order called ``name``.

    Raises:
        ConfigError: an unknown name; the message lists the valid ones.
    """
    if name == PriorityAgingOrder.name:
        return PriorityAgingOrder(aging_rate_per_s)
    if name == FifoOrder.name:
        return FifoOrder()
    raise ConfigError(
        f"admission.order_policy: unknown policy {name!r}; valid: {PriorityAgingOrder.name}, {FifoOrder.name}"
    )


class _TierQueue:
    """One tier's queue and its counters."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self.tickets: dict[int, Ticket] = {}  # insertion-ordered FIFO with O(1) removal from the middle
        self.queued_work_tokens = 0.0
        self.num_in_flight = 0
        self.in_flight_blocks = 0
        self.num_admitted = 0
        self.num_rejected: Counter[str] = Counter()
        self.num_cancelled = 0
        self.dispatch_times_s: deque[float] = deque()

    def head(self) -> Ticket | None:
        return next(iter(self.tickets.values()), None)

    def push(self, ticket: Ticket) -> None:
        self.tickets[ticket.ticket_id] = ticket
        self.queued_work_tokens += ticket.expected_work_tokens

    def remove(self, ticket: Ticket) -> bool:
        if self.tickets.pop(ticket.ticket_id, None) is None:
            return False
        self.queued_work_tokens = max(0.0, self.queued_work_tokens - ticket.expected_work_tokens)
        if not self.tickets:
            self.queued_work_tokens = 0.0  # no float drift
        return True


class AdmissionController:
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
        view: CapacityView,
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
        self._queues: dict[str, _TierQueue] = {tier.name: _TierQueue(tier) for tier in tiers}
        self._lowest_tier = tiers[-1].name  # for the pressure level: the wait behind every queued request
        self._total_queue_capacity = sum(tier.queue_capacity for tier in tiers)
        self._ticket_ids = itertools.count(1)
        self._started_s = clock()
        self._dispatch_log: deque[tuple[float, float]] = deque()  # (time s, expected work tokens) per dispatch
        # service rate under backlog: (time s, expected work tokens dispatched, serving worker-seconds backlogged)
        self._backlog_log: deque[tuple[float, float, float]] = deque()
        self._backlogged = False  # the last dispatch pass left a request queued for lack of room
        self._last_backlog_rate_tokens_per_s: float | None = None  # per serving worker, the last one measured
        self._num_serving_at_last_pass = 0
        self._in_flight: dict[int, Ticket] = {}  # admitted, not yet released, by ticket id
        self._arrival_log: deque[tuple[float, float]] = deque()  # (time s, expected work tokens) per arrival
        self._arrival_log_work_tokens = 0.0  # sum of the log's expected work tokens
        self._backlog_mark_s = clock()
        self._output_fraction = 1.0
        self._draining = False
        self._dispatching = False
        self._dispatch_requested = False
        # tier name → requests of that tier queued on the other gateways (``gateway.tier_counters``), counted against
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
    ) -> Ticket:
        """Make the admission ticket of one request.

        Args:
            tier: the tier name (already resolved and possibly lowered, see ``gateway.tiers``).
            prompt_token_ids: the tokenized prompt.
            max_tokens: the capped output budget in tokens (``gateway.caps``), ≥ 1.
            rate_limit_key, rpm_limit, tpm_limit: the API key's identity and per-minute limits (0 = unlimited).
            avoid: a worker to skip when another can serve (a retry after a failure before the first byte).

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
        )
        ticket.expected_work_tokens = len(prompt_token_ids) + max_tokens * self._output_fraction
        return ticket

    def make_ticket_for(self, principal: Principal, prompt_token_ids: Sequence[int], max_tokens: int) -> Ticket:
        """Make a ticket for a resolved :class:`~gateway.tiers.Principal` (tier and per-key limits)."""
        return self.make_ticket(
            principal.tier.name,
            prompt_token_ids,
            max_tokens,
            rate_limit_key=principal.rate_limit_key,
            rpm_limit=principal.rpm_limit,
            tpm_limit=principal.tpm_limit,
        )

    async def admit(self, ticket: Ticket) -> object:
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
            self._reject_at_arrival(
                ticket,
                queue,
                ErrorCode.RATE_LIMIT_EXCEEDED,
                f"Rate limit reached for {limit_name} per minute on this API key. Retry after the indicated time.",
                decision.retry_after_s,
            )
        self._record_arrival(ticket)
        timeout_s = (
            self.pressure.queue_timeout_s(ticket.tier.name, ticket.tier.queue_timeout_s) if self._enabled else math.inf
        )
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        try:
            self._check_arrival(ticket, queue)
            ticket.enqueued_s = self._clock()
            ticket.deadline_s = ticket.arrival_s + timeout_s  # the deadline holds from arrival (rate limiter included)
            ticket.state = TicketState.QUEUED
            ticket._future = future
            queue.push(ticket)
            self._dispatch()
            if ticket.state is TicketState.QUEUED and self._enabled and self._admission.early_rejection:
                self._check_predicted_wait(ticket, queue, timeout_s)
        except SluiceError:
            await self._limiter.refund(ticket.rate_limit_key, len(ticket.prompt_token_ids) + ticket.max_tokens)
            raise
        try:
            while not future.done():
                remaining_s = ticket.deadline_s - self._clock()
                if remaining_s <= 0:
                    self._shed_timed_out(ticket)
                    break
                await asyncio.wait((future,), timeout=None if math.isinf(remaining_s) else remaining_s)
        except asyncio.CancelledError:
            self._cancel(ticket)
            raise
        return future.result()

    def release(self, ticket: Ticket, completion_tokens: int | None = None) -> None:
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
        queue.in_flight_blocks -= ticket.demand_blocks
        if completion_tokens is not None and ticket.max_tokens > 0:
            fraction = min(1.0, max(0.0, completion_tokens / ticket.max_tokens))
            weight = _OUTPUT_FRACTION_EWMA_WEIGHT
            self._output_fraction = (1.0 - weight) * self._output_fraction + weight * fraction
        reservation, ticket.reservation = ticket.reservation, None
        self._view.release(reservation)
        self._dispatch()

    def worker_start_deadline_s(self, ticket: Ticket, allowance_s: float) -> float:
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

    def shed_at_worker(self, ticket: Ticket, message: str) -> SluiceError:
        """The worker dropped the ticket's request unstarted at its start deadline: count a ``queue_timeout`` of
        its tier and return the 503 to answer, with ``Retry-After`` from the tier's drain rate."""
        queue = self._queues[ticket.tier.name]
        queue.num_rejected[ErrorCode.QUEUE_TIMEOUT.value] += 1
        return SluiceError(ErrorCode.QUEUE_TIMEOUT, message,
                           retry_after_s=self._clamp_retry_after(self._tier_retry_after_s(queue)))

    def on_capacity_changed(self) -> None:
        """Re-run dispatch (and shed expired tickets): call when a worker reports capacity or a request ends."""
        self._observe_pressure()
        self._dispatch()

    @property
    def draining(self) -> bool:
        """Return whether :meth:`start_draining` was called."""
        return self._draining

    def worker_tier(self, tier: str) -> str:
        """Return the tier label to send to the worker: the tier itself, or one shared label when admission is
        off, so the worker's scheduler keeps arrival order too (the FIFO baseline of the overload benchmark)."""
        return tier if self._enabled else FIFO_WORKER_TIER

    def start_draining(self) -> None:
        """Stop admitting: shed queued tickets and reject new ones with 503 ``server_draining`` (SIGTERM)."""
        self._draining = True
        for queue in self._queues.values():
            for ticket in list(queue.tickets.values()):
                self._shed(ticket, ErrorCode.DRAINING, "The server is shutting down; retry on another instance.")

    # ----------------------------------------------------------------------------------------------- estimates

    def drain_rate_tokens_per_s(self) -> float:
        """Return the drain rate of the queues in expected work tokens/s (see the module docstring): the service
        rate measured under backlog × the serving workers, else the workers' measured decode + prefill rate, else
        the measured dispatch rate; 0.0 when none is known."""
        per_worker = self.backlog_rate_tokens_per_s()
        if per_worker is not None:
            return per_worker * self._num_workers(starting=True)
        rate = self._view.drain_rate_tokens_per_s()
        if rate > 0:
            return rate
        return self._dispatch_rate_tokens_per_s()

    def predicted_wait_s(self, tier: str) -> float | None:
        """Return the predicted queue wait in seconds of a request arriving now in ``tier``, None when unknown.

        While requests are held because slots or KV are taken: the time until a sequence slot frees for it
        (:meth:`_slot_wait_s`); else the work queued in this tier and higher ones ÷ :meth:`drain_rate_tokens_per_s`
        (see the module docstring).
        """
        priority = self._queues[tier].config.priority
        return self._predicted_wait_s(priority, self._work_ahead_tokens(priority), None, 1)

    def _predicted_wait_s(self, priority: int, work_ahead_tokens: float, behind: Ticket | None,
                          demand_blocks: int) -> float | None:
        slot_wait_s = self._slot_wait_s(priority, behind, demand_blocks)
        if slot_wait_s is not None:
            return slot_wait_s
        if work_ahead_tokens <= 0:
            return 0.0
        rate = self.drain_rate_tokens_per_s()
        return work_ahead_tokens / rate if rate > 0 else None

    def _slot_wait_s(self, priority: int, behind: Ticket | None, demand_blocks: int) -> float | None:
        """Return when a sequence slot frees for a request of tier priority ``priority`` and ``demand_blocks`` KV
        blocks behind the queued tickets ahead of it (:meth:`_queued_ahead`; ``behind``: the request itself when it
        is queued already), in seconds from now; None where this model
        does not decide: nothing is held for lack of room, the workers' rates are unknown, or idle slots with KV
        room remain for everyone ahead (the prefill backlog limit holds the queue: work ÷ rate decides).

        While the last dispatch pass left a request queued for lack of room, a queued request starts when a slot
        is free for it: one of the pool's idle slots (``CapacityView.total_sequence_slots`` − admitted requests −
        the unused slots reserved for higher tiers) at once — unless the KV blocks left to it (less the unused
        shares of higher tiers) cannot hold the next request, which then waits for blocks an ending request
        frees — or a slot of a worker still starting (``CapacityView.starting_sequence_slots``, counted free now,
        as the drain rate counts starting workers), else when an admitted request ends. A request holds
        its slot for its prompt at the prefill rate plus its expected output (``max_tokens`` × the measured output
        fraction) at the decode rate one running sequence gets (``CapacityView.sequence_rates_tokens_per_s``); the
        admitted requests' slots free at their admission + that service time (one past its estimate frees "now").
        List scheduling then gives each request ahead, in order, the slot that frees first, for its own service
        time, and the request starts when the next slot frees. The first :data:`MAX_SCHEDULED_AHEAD` requests ahead
        are placed one by one, the rest at their mean service time spread over the slots. Work ÷ rate alone misses
        this: a full pool of long answers admits nobody until one of them ends, however little work is queued; and
        it counts a prompt token like an output token, where a prompt costs a small part of an answer's slot time.
        """
        if not self._backlogged or not self._in_flight:
            return None
        rates = getattr(self._view, "sequence_rates_tokens_per_s", None)
        rates = rates() if rates is not None else None
        if rates is None or rates[1] <= 0:
            return None
        prefill_tokens_per_s, decode_tokens_per_s = rates
        ahead = self._queued_ahead(priority, behind)  # sorted: only once the cheap checks above have passed

        def service_s(ticket: Ticket) -> float:
            prefill_s = ticket.prompt_tokens / prefill_tokens_per_s if prefill_tokens_per_s > 0 else 0.0
            return prefill_s + ticket.max_tokens * self._output_fraction / decode_tokens_per_s

        now_s = self._clock()
        slots_free_s = [
            max(0.0, ticket.admitted_s + service_s(ticket) - now_s)
            for ticket in self._in_flight.values()
            if ticket.admitted_s is not None
        ]
        total_slots = self._total_sequence_slots()
        if total_slots > 0:
            idle = self._free_slots(priority, total_slots)[0]
            if self._free_blocks(priority)[0] < (ahead[0].demand_blocks if ahead else demand_blocks):
                idle = 0  # KV binds: idle slots wait for blocks too
            starting = getattr(self._view, "starting_sequence_slots", None)
            idle = max(0, idle) + (starting() if starting is not None else 0)  # coming workers bring their own KV
            if idle > len(ahead):
                return None
            slots_free_s += [0.0] * idle
        if not slots_free_s:
            return None
        heapq.heapify(slots_free_s)
        for ticket in ahead[:MAX_SCHEDULED_AHEAD]:
            heapq.heapreplace(slots_free_s, slots_free_s[0] + service_s(ticket))
        rest = ahead[MAX_SCHEDULED_AHEAD:]
        rest_s = sum(service_s(ticket) for ticket in rest) / len(slots_free_s) if rest else 0.0
        return slots_free_s[0] + rest_s

    def _total_sequence_slots(self) -> int:
        """Sequence slots of the view's serving workers; 0 for a view that does not count them."""
        total_slots = getattr(self._view, "total_sequence_slots", None)
        return total_slots() if total_slots is not None else 0

    def _free_blocks(self, priority: int) -> tuple[float, float]:
        """Return (free, unused reserved) KV blocks for a request of tier priority ``priority``: free = the view's
        total − admitted requests' demand − the unused reserved ones, those that tiers above it keep
        (``reserved_kv_fraction``) and are not using."""
        total_blocks = self._view.total_kv_blocks()
        unused_reserved = sum(
            max(0.0, queue.config.reserved_kv_fraction * total_blocks - queue.in_flight_blocks)
            for queue in self._queues.values()
            if queue.config.priority > priority and queue.config.reserved_kv_fraction > 0
        )
        free = total_blocks - sum(queue.in_flight_blocks for queue in self._queues.values()) - unused_reserved
        return free, unused_reserved

    def _free_slots(self, priority: int, total_slots: int) -> tuple[int, int]:
        """Return (free, unused reserved) sequence slots of ``total_slots`` for a request of tier priority
        ``priority``: free = those not admitted − the unused reserved ones, those that tiers above it keep
        (``reserved_slot_fraction``, rounded) and are not using; free may be negative."""
        unused_reserved = sum(
            max(0, math.floor(queue.config.reserved_slot_fraction * total_slots + 0.5) - queue.num_in_flight)
            for queue in self._queues.values()
            if queue.config.priority > priority and queue.config.reserved_slot_fraction > 0
        )
        return total_slots - len(self._in_flight) - unused_reserved, unused_reserved

    def snapshot(self) -> dict[str, Any]:
        """Return per tier queue depth, oldest wait, in-flight, admitted / rejected by reason, predicted wait and
        dispatch rate; plus the drain rate and the pressure level. For ``/status`` and metrics."""
        now_s = self._clock()
        tiers: dict[str, Any] = {}
        for name, queue in self._queues.items():
            head = queue.head()
            predicted_s = self.predicted_wait_s(name)
            tiers[name] = {
                "priority": queue.config.priority,
                "queue_depth": len(queue.tickets),
                "queue_capacity": queue.config.queue_capacity,
                "oldest_wait_s": round(now_s - head.enqueued_s, 3) if head and head.enqueued_s is not None else 0.0,
                "in_flight": queue.num_in_flight,
                "in_flight_kv_blocks": queue.in_flight_blocks,
                "admitted": queue.num_admitted,
                "rejected": dict(queue.num_rejected),
                "cancelled": queue.num_cancelled,
                "predicted_wait_s": None if predicted_s is None else round(predicted_s, 3),
                "dispatch_rate_per_s": round(self._tier_dispatch_rate_per_s(queue, now_s), 3),
            }
        return {
            "enabled": self._enabled,
            "order_policy": self._order.name,
            "draining": self._draining,
            "drain_rate_tokens_per_s": round(self.drain_rate_tokens_per_s(), 1),
            "expected_output_fraction": round(self._output_fraction, 3),
            "pressure": self.pressure.snapshot(),
            "tiers": tiers,
        }

    # ----------------------------------------------------------------------------------------------- internals

    def _check_arrival(self, ticket: Ticket, queue: _TierQueue) -> None:
        """Reject at arrival when the request cannot be queued or cannot make its deadline."""
        if self._draining:
            self._reject_at_arrival(
                ticket, queue, ErrorCode.DRAINING, "The server is shutting down; retry on another instance."
            )
        if self._view.total_kv_blocks() <= 0:
            # No rate to measure without a worker: retry after about one worker reconnect / restart backoff.
            self._reject_at_arrival(
                ticket, queue, ErrorCode.NO_WORKER, "No worker is available to serve the request.",
                NO_WORKER_RETRY_AFTER_S,
            )
        if self._enabled and self.pressure.sheds(ticket.tier.name):
            self._reject_at_arrival(
                ticket,
                queue,
                ErrorCode.SERVER_OVERLOADED,
                f"The server is overloaded ({self.pressure.level.label} pressure) and is not serving the "
                f"'{ticket.tier.name}' tier now.",
                self._overload_retry_after_s(),
            )
        full = (
            len(queue.tickets) + self.queued_elsewhere(ticket.tier.name) >= queue.config.queue_capacity
            if self._enabled
            else sum(len(q.tickets) for q in self._queues.values()) >= self._total_queue_capacity
        )
        if full:
            message = f"The '{ticket.tier.name}' queue is full; the server is overloaded."
            self._reject_at_arrival(ticket, queue, ErrorCode.QUEUE_FULL, message)

    def _check_predicted_wait(self, ticket: Ticket, queue: _TierQueue, timeout_s: float) -> None:
        """Early rejection of a ticket that the dispatch at its arrival left queued: take it out of the queue and
        raise 503 ``predicted_queue_timeout`` when its predicted wait exceeds its deadline."""
        priority = ticket.tier.priority
        predicted_s = self._predicted_wait_s(
            priority, self._work_ahead_tokens(priority) - ticket.expected_work_tokens, ticket, ticket.demand_blocks
        )
        if predicted_s is None or predicted_s <= timeout_s:
            return
        queue.remove(ticket)
        self._dispatch()  # it may have been the head that held the others back
        self._reject_at_arrival(
            ticket,
            queue,
            ErrorCode.PREDICTED_QUEUE_TIMEOUT,
            f"The predicted queue wait ({predicted_s:.1f} s) exceeds the '{ticket.tier.name}' tier's "
            f"deadline ({timeout_s:g} s); the server is overloaded.",
            predicted_s - timeout_s,
        )

    def _reject_at_arrival(
        self,
        ticket: Ticket,
        queue: _TierQueue,
        code: ErrorCode,
        message: str,
        retry_after_s: float | None = None,
    ) -> None:
        ticket.state = TicketState.REJECTED
        queue.num_rejected[code.value] += 1
        seconds = self._tier_retry_after_s(queue) if retry_after_s is None else retry_after_s
        raise SluiceError(code, message, retry_after_s=self._clamp_retry_after(seconds))

    def _shed(self, ticket: Ticket, code: ErrorCode, message: str, retry_after_s: float | None = None) -> None:
        """Take a queued ticket out of its queue and fail its waiter."""
        queue = self._queues[ticket.tier.name]
        if not queue.remove(ticket):
            return
        ticket.state = TicketState.REJECTED
        queue.num_rejected[code.value] += 1
        seconds = self._tier_retry_after_s(queue) if retry_after_s is None else retry_after_s
        error = SluiceError(code, message, retry_after_s=self._clamp_retry_after(seconds))
        if ticket._future is not None and not ticket._future.done():
            ticket._future.set_exception(error)

    def _shed_timed_out(self, ticket: Ticket) -> None:
        waited_s = self._clock() - ticket.arrival_s
        self._shed(
            ticket,
            ErrorCode.QUEUE_TIMEOUT,
            f"The request waited {waited_s:.1f} s in the '{ticket.tier.name}' queue, past its deadline; "
            "the server is overloaded.",
        )

    def _shed_expired(self, now_s: float) -> None:
        for queue in self._queues.values():
            expired = [t for t in queue.tickets.values() if t.deadline_s is not None and t.deadline_s <= now_s]
            for ticket in expired:
                self._shed_timed_out(ticket)

    def _cancel(self, ticket: Ticket) -> None:
        """The waiter was cancelled: leave the queue, or give back a reservation granted in the same instant."""
        if ticket.state is TicketState.QUEUED:
            queue = self._queues[ticket.tier.name]
            queue.remove(ticket)
            queue.num_cancelled += 1
            ticket.state = TicketState.CANCELLED
            self._dispatch()  # it may have been the head holding others back
        elif ticket.state is TicketState.ADMITTED:
            self.release(ticket)
            ticket.state = TicketState.CANCELLED
        if ticket._future is not None:
            if not ticket._future.done():
                ticket._future.cancel()
            elif not ticket._future.cancelled():
                ticket._future.exception()  # mark retrieved: nobody awaits it any more

    def _dispatch(self) -> None:
        """Admit queued tickets, best first, while the capacity view finds room (re-entrancy safe)."""
        if self._dispatching:
            self._dispatch_requested = True
            return
        self._dispatching = True
        try:
            self._dispatch_requested = True
            while self._dispatch_requested:
                self._dispatch_requested = False
                self._dispatch_once()
        finally:
            self._dispatching = False

    def _record_arrival(self, ticket: Ticket) -> None:
        now_s = self._clock()
        self._arrival_log.append((now_s, ticket.expected_work_tokens))
        self._arrival_log_work_tokens += ticket.expected_work_tokens
        while self._arrival_log and self._arrival_log[0][0] < now_s - self._admission.rate_window_s:
            self._arrival_log_work_tokens -= self._arrival_log.popleft()[1]
        if self.on_arrival is not None:
            self.on_arrival()

    def arrival_rate_tokens_per_s(self, window_s: float) -> float:
        """Return the expected work (prompt + expected output tokens) of requests that arrived within the last
        ``window_s`` seconds (at most ``admission.rate_window_s``; rate-limited ones left out), ÷ ``window_s``:
        the offered load, admitted or not, that the autoscaler sizes the pool for."""
        now_s = self._clock()
        window_s = min(window_s, self._admission.rate_window_s)
        if window_s <= 0:
            return 0.0
        cutoff_s = now_s - window_s
        log = self._arrival_log
        if not log or log[-1][0] < cutoff_s:
            return 0.0
        if window_s < self._admission.rate_window_s / 2:  # the newest few: sum them
            work_tokens = 0.0
            for at_s, work in reversed(log):
                if at_s < cutoff_s:
                    break
                work_tokens += work
            return work_tokens / window_s
        work_tokens = self._arrival_log_work_tokens  # the whole log, less its oldest entries outside the window
        for at_s, work in log:
            if at_s >= cutoff_s:
                break
            work_tokens -= work
        return max(0.0, work_tokens) / window_s

    def service_rate_per_worker_tokens_per_s(self) -> float | None:
        """Return the expected work tokens/s one serving worker drains: measured under backlog, else the workers'
        reported rates ÷ their number; None when neither is known."""
        per_worker = self.backlog_rate_tokens_per_s()
        if per_worker is not None:
            return per_worker
        # an elastic pool's rate already counts its starting workers at the serving ones' mean rate
        workers = self._num_workers(starting=True)
        rate = self._view.drain_rate_tokens_per_s()
        return rate / workers if rate > 0 and workers > 0 else None

    def _account_backlog(self, now_s: float, work_tokens: float = 0.0) -> None:
        """Add the serving worker-seconds since the last mark (when backlogged) and ``work_tokens`` dispatched."""
        busy_s = 0.0
        if self._backlogged:
            busy_s = max(0.0, now_s - self._backlog_mark_s) * self._num_workers()
        self._backlog_mark_s = now_s
        if busy_s > 0 or work_tokens > 0:
            self._backlog_log.append((now_s, work_tokens, busy_s))
        window_start_s = now_s - self._admission.rate_window_s
        while self._backlog_log and self._backlog_log[0][0] < window_start_s:
            self._backlog_log.popleft()

    def _num_workers(self, starting: bool = False) -> int:
        """Serving workers of the view (+ starting ones); 1 for a view that does not count them."""
        serving = getattr(self._view, "num_serving_workers", None)
        if serving is None:
            return 1
        coming = getattr(self._view, "num_starting_workers", None)
        return serving() + (coming() if starting and coming is not None else 0)

    def backlog_rate_tokens_per_s(self) -> float | None:
        """Return the measured service rate per serving worker under backlog, expected work tokens/s: over the
        window once :data:`MIN_BACKLOG_WORKER_S` backlogged worker-seconds fall in it, else the last one so
        measured; None when none ever was."""
        self._account_backlog(self._clock())
        work = sum(sample[1] for sample in self._backlog_log)
        worker_s = sum(sample[2] for sample in self._backlog_log)
        if worker_s >= MIN_BACKLOG_WORKER_S and work > 0:
            self._last_backlog_rate_tokens_per_s = work / worker_s
        return self._last_backlog_rate_tokens_per_s

    def _dispatch_once(self) -> None:
        now_s = self._clock()
        self._shed_expired(now_s)
        self._account_backlog(now_s)
        num_serving = self._num_workers()
        # a worker that joined since the last pass brings room, not service: this pass fills it uncounted
        count_service = num_serving <= self._num_serving_at_last_pass
        self._num_serving_at_last_pass = num_serving
        held_back_tiers: set[str] = set()
        while True:
            candidates = [
                head
                for name, queue in self._queues.items()
                if name not in held_back_tiers and (head := queue.head()) is not None
            ]
            if not candidates:
                # requests held back only by reserved shares wait for lack of room too (for lower tiers)
                self._backlogged = bool(held_back_tiers)
                return
            best = max(candidates, key=lambda t: (self._order.score(t, now_s), -t.ticket_id))
            if not self._fits_reserved_shares(best):
                held_back_tiers.add(best.tier.name)
                continue
            reservation = self._view.try_reserve(
                best.demand_blocks, best.tier.name, best.prompt_token_ids, avoid=best.avoid
            )
            if reservation is None:
                self._backlogged = True
                return  # strict order: nobody jumps ahead of the request that should go next
            if self._backlogged and count_service:
                self._account_backlog(now_s, best.expected_work_tokens)
            self._grant(best, reservation, now_s)

    def _grant(self, ticket: Ticket, reservation: object, now_s: float) -> None:
        queue = self._queues[ticket.tier.name]
        queue.remove(ticket)
        ticket.state = TicketState.ADMITTED
        ticket.reservation = reservation
        ticket.admitted_s = now_s
        self._in_flight[ticket.ticket_id] = ticket
        queue.num_in_flight += 1
        queue.in_flight_blocks += ticket.demand_blocks
        queue.num_admitted += 1
        queue.dispatch_times_s.append(now_s)
        self._dispatch_log.append((now_s, ticket.expected_work_tokens))
        if ticket._future is not None and not ticket._future.done():
            ticket._future.set_result(reservation)

    def _fits_reserved_shares(self, ticket: Ticket) -> bool:
        """Return whether dispatching leaves the unused reserved shares of higher tiers untouched: their
        ``reserved_kv_fraction`` of the KV blocks and their ``reserved_slot_fraction`` of the sequence slots."""
        if not self._enabled:
            return True
        free_blocks, unused_reserved_blocks = self._free_blocks(ticket.tier.priority)
        if unused_reserved_blocks > 0 and free_blocks < ticket.demand_blocks:
            return False
        free_slots, unused_reserved_slots = self._free_slots(ticket.tier.priority, self._total_sequence_slots())
        return not (unused_reserved_slots > 0 and free_slots < 1)

    def _work_ahead_tokens(self, priority: int) -> float:
        return sum(q.queued_work_tokens for q in self._queues.values() if q.config.priority >= priority)

    def _queued_ahead(self, priority: int, behind: Ticket | None = None) -> list[Ticket]:
        """Return the queued tickets of tiers with at least ``priority``, best first (the dispatch order now),
        ``behind`` itself left out."""
        now_s = self._clock()
        tickets = [
            ticket
            for queue in self._queues.values()
            if queue.config.priority >= priority
            for ticket in queue.tickets.values()
            if ticket is not behind
        ]
        tickets.sort(key=lambda t: (-self._order.score(t, now_s), t.ticket_id))
        return tickets

    def _dispatch_rate_tokens_per_s(self) -> float:
        now_s = self._clock()
        window_s = self._admission.rate_window_s
        while self._dispatch_log and self._dispatch_log[0][0] < now_s - window_s:
            self._dispatch_log.popleft()
        if not self._dispatch_log:
            return 0.0
        span_s = max(1.0, min(window_s, now_s - self._started_s))
        return sum(work for _, work in self._dispatch_log) / span_s

    def _tier_dispatch_rate_per_s(self, queue: _TierQueue, now_s: float) -> float:
        window_s = self._admission.rate_window_s
        while queue.dispatch_times_s and queue.dispatch_times_s[0] < now_s - window_s:
            queue.dispatch_times_s.popleft()
        return len(queue.dispatch_times_s) / max(1.0, min(window_s, now_s - self._started_s))

    def _tier_retry_after_s(self, queue: _TierQueue) -> float:
        """Seconds until the work queued in this tier and above drains at the measured rate (else the deadline)."""
        rate = self.drain_rate_tokens_per_s()
        if rate <= 0:
            return queue.config.queue_timeout_s
        return self._work_ahead_tokens(queue.config.priority) / rate

    def _overload_retry_after_s(self) -> float:
        """Seconds until all queued work drains at the measured rate, at least the pressure level's dwell left."""
        rate = self.drain_rate_tokens_per_s()
        total_work = self._work_ahead_tokens(min(q.config.priority for q in self._queues.values()))
        drain_s = total_work / rate if rate > 0 else self._config.pressure.min_dwell_s
        return max(drain_s, self.pressure.seconds_until_may_step_down())

    def _clamp_retry_after(self, seconds: float) -> int:
        return int(min(self._admission.max_retry_after_s, max(1, math.ceil(seconds))))

    def _observe_pressure(self) -> None:
        """Feed the pressure monitor; when the level starts shedding a tier, shed that tier's queue too."""
        if not self._enabled:
            return
        now_s = self._clock()
        oldest_wait_s = max(
            (
                now_s - head.enqueued_s
                for q in self._queues.values()
                if (head := q.head()) is not None and head.enqueued_s is not None
            ),
            default=0.0,
        )
        predicted_s = self.predicted_wait_s(self._lowest_tier) or 0.0  # behind all queued work, slots included
        before = self.pressure.level
        level = self.pressure.observe(max(oldest_wait_s, predicted_s), self._view.kv_used_fraction())
        if level > before and level is not PressureLevel.NORMAL:
            for queue in self._queues.values():
                if self.pressure.sheds(queue.config.name):
                    for ticket in list(queue.tickets.values()):
                        self._shed(
                            ticket,
                            ErrorCode.SERVER_OVERLOADED,
                            f"The server is overloaded ({level.label} pressure) and stopped serving the "
                            f"'{queue.config.name}' tier.",
                            self._overload_retry_after_s(),
                        )
