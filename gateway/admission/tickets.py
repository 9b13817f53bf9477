"""Admission tickets (one per request) and the per-tier queues that hold them."""

from __future__ import annotations

import asyncio
import enum
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic

from gateway.admission.capacity import ReservationT
from shared.config import TierConfig
from shared.errors import ErrorCode


class TicketState(str, enum.Enum):
    """Where a ticket is in its life."""

    NEW = "new"
    QUEUED = "queued"
    ADMITTED = "admitted"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    RELEASED = "released"


@dataclass(eq=False)
class Ticket(Generic[ReservationT]):
    """One request's place in admission. Made by :meth:`AdmissionController.make_ticket`.

    Attributes:
        ticket_id: unique and increasing in arrival order.
        tier: the tier the request is served in.
        prompt_token_ids: the prompt, for prefix-aware routing.
        max_tokens: the capped output budget (``gateway.admission.caps``).
        demand_blocks: KV blocks the request may need: ceil((prompt + max_tokens) ÷ block size).
        rate_limit_key, rpm_limit, tpm_limit: per-key limits (0 = unlimited).
        arrival_s: clock time of ``make_ticket``.
        enqueued_s, deadline_s, admitted_s: clock times, None until they happen.
        reservation: the capacity view's reservation once admitted.
        booked_blocks: the KV blocks the view booked for it once admitted (``demand_blocks`` less the prompt
            blocks it shares with requests admitted before it); counted in its tier's ``in_flight_blocks``.
        state: see :class:`TicketState`.
        avoid: a worker the capacity view should skip when another can serve (the worker a retry left).
        group: the request whose choices are admitted together (n > 1, several prompts): the capacity view does
            not let one choice's reservation hold back another's (they are sent together once all are admitted);
            None for a request of one choice.
        expected_work_tokens: prompt + the output expected from the measured fraction of ``max_tokens`` used, in
            tokens: what this request adds to the predicted wait of those behind it.
        resume_timeout_s: set on the ticket of a preempted request's resumption: its queue deadline, seconds from
            when it is queued (instead of the tier's from arrival), and it is never rejected early.
        on_preempt: set by the request's owner once it runs where the gateway may preempt it: stops the request
            and releases this ticket at once, returning True; False when it cannot be preempted now
            (:mod:`gateway.admission.preemption`).
        can_preempt: set with ``on_preempt``: whether ``on_preempt`` would stop the request now, without stopping
            it (the wait estimate counts such a request's slot as one a higher tier can take).
        decoding: set by the owner at the request's first token: its prompt is done on the worker.
        decoded_tokens: output tokens of this admission the owner has read so far (its progress, for the
            predicted end of its slot).
        counts_shed: a shed of this ticket is counted in its tier's rejections at once (``/status`` ``rejected``,
            ``sluice_rejected_total``); False: its owner counts it once it knows whether a client got the 429/503
            (a request that may be deferred to a job, or a job's own request, which its runner puts back in the
            job queue), so the counter never has to go back down.
        shed_code: the code it was shed with (429/503), None while it was not.
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
    reservation: ReservationT | None = None
    booked_blocks: int = 0
    state: TicketState = TicketState.NEW
    avoid: object | None = None
    group: object | None = None
    expected_work_tokens: float = 0.0
    resume_timeout_s: float | None = None
    on_preempt: Callable[[], bool] | None = field(default=None, repr=False)
    can_preempt: Callable[[], bool] | None = field(default=None, repr=False)
    decoding: bool = False
    decoded_tokens: int = 0
    counts_shed: bool = True
    shed_code: ErrorCode | None = None
    _future: asyncio.Future[ReservationT] | None = field(default=None, repr=False)

    @property
    def prompt_tokens(self) -> int:
        """Return the prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def queue_wait_s(self) -> float:
        """Return the seconds spent queued (arrival → admission); 0.0 before admission."""
        return 0.0 if self.admitted_s is None else self.admitted_s - self.arrival_s


class TierQueue:
    """One tier's queue and its counters."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self.tickets: dict[int, Ticket] = {}  # insertion-ordered FIFO with O(1) removal from the middle
        self.queued_work_tokens = 0.0
        self.num_in_flight = 0
        self.in_flight_blocks = 0
        self.num_admitted = 0
        self.num_rejected: Counter[str] = Counter()
        self.num_deferred: Counter[str] = Counter()  # shed, then served as an async job instead (by shed code)
        self.num_cancelled = 0
        self.dispatch_times_s: deque[float] = deque()
        # arrival times within ``reserved_slot_window_s`` (logged only when the tier sets one)
        self.arrival_times_s: deque[float] = deque()

    def record_shed(self, ticket: Ticket, code: ErrorCode) -> None:
        """Note that ``ticket`` was shed with ``code``, and count it in :attr:`num_rejected` unless its owner counts
        it (``Ticket.counts_shed``)."""
        ticket.shed_code = code
        if ticket.counts_shed:
            self.num_rejected[code.value] += 1

    def head(self) -> Ticket | None:
        return next(iter(self.tickets.values()), None)

    def record_arrival(self, now_s: float) -> None:
        """Log an arrival at ``now_s`` when the tier's reserved slots follow its arrivals
        (``reserved_slot_window_s`` > 0); older entries than the window are dropped."""
        if self.config.reserved_slot_window_s > 0:
            self.arrival_times_s.append(now_s)
            self.recent_arrivals(now_s)

    def arrival_window_end_s(self) -> float | None:
        """Return when the oldest arrival in the window leaves it (clock seconds), or None when none is in it."""
        return self.arrival_times_s[0] + self.config.reserved_slot_window_s if self.arrival_times_s else None

    def recent_arrivals(self, now_s: float) -> int:
        """Return this tier's arrivals within the last ``reserved_slot_window_s`` seconds before ``now_s``."""
        times = self.arrival_times_s
        while times and times[0] <= now_s - self.config.reserved_slot_window_s:
            times.popleft()
        return len(times)

    def push(self, ticket: Ticket) -> None:
        self.tickets[ticket.ticket_id] = ticket
        self.queued_work_tokens += ticket.expected_work_tokens

    def push_in_place(self, ticket: Ticket, since_s: float) -> None:
        """Queue ``ticket`` ahead of every queued ticket enqueued after ``since_s`` (a preempted request resuming
        keeps the place of its first arrival; its own ``enqueued_s`` stays the time it queued again, which waits
        and pressure read; O(queue length), once per preemption)."""
        later = [t for t in self.tickets.values() if (t.enqueued_s or 0.0) > since_s]
        for other in later:
            del self.tickets[other.ticket_id]
        self.tickets[ticket.ticket_id] = ticket
        for other in later:
            self.tickets[other.ticket_id] = other
        self.queued_work_tokens += ticket.expected_work_tokens

    def remove(self, ticket: Ticket) -> bool:
        if self.tickets.pop(ticket.ticket_id, None) is None:
            return False
        self.queued_work_tokens = max(0.0, self.queued_work_tokens - ticket.expected_work_tokens)
        if not self.tickets:
            self.queued_work_tokens = 0.0  # no float drift
        return True
