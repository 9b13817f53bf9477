"""The dispatch loop: admit queued tickets, best first by the dispatch order, while the capacity view finds room.

Dispatch is strict: when the request that should go next does not fit on any worker, nobody behind it jumps ahead,
so freed capacity goes to it first. Only a request held back by a reserved share of a higher tier is stepped over.
Before it waits, a request may preempt a running one of a lower tier on engines without priorities of their own
(:mod:`gateway.admission.preemption`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gateway.admission.capacity import CapacityView
from gateway.admission.order import DispatchOrder
from gateway.admission.preemption import Preemption
from gateway.admission.rates import ServiceRates
from gateway.admission.tickets import Ticket, TicketState, TierQueue
from gateway.admission.wait_estimate import WaitEstimator

RESERVE_WAKE_SLACK_S = 0.001  # past the moment an arrival leaves its window, so the pass finds it gone


class Dispatcher:
    """Move tickets from the tier queues to the workers (re-entrancy safe: a dispatch asked for during a pass runs
    once the pass ends).

    Args:
        enabled: admission control is on (off: no reserved shares).
        queues: tier name → queue; in_flight: admitted tickets by id (both shared with the controller).
        rates: the measured rates (dispatches, backlog); waits: free blocks and slots per priority.
        order: the dispatch order; view: the pool's capacity view.
        clock: monotonic seconds.
        before_pass: called with the time at the start of every pass (the controller sheds expired tickets).
        preemption: stops lower-tier requests for one that finds no room (None = never).
    """

    def __init__(self, enabled: bool, queues: dict[str, TierQueue], in_flight: dict[int, Ticket[Any]],
                 rates: ServiceRates, waits: WaitEstimator, order: DispatchOrder, view: CapacityView[Any],
                 clock: Callable[[], float], before_pass: Callable[[float], None],
                 preemption: Preemption | None = None) -> None:
        self._enabled = enabled
        self._queues = queues
        self._in_flight = in_flight
        self._rates = rates
        self._waits = waits
        self._order = order
        self._view = view
        self._clock = clock
        self._before_pass = before_pass
        self._preemption = preemption
        self._dispatching = False
        self._dispatch_requested = False
        self._wake: asyncio.TimerHandle | None = None  # the pass when a reserve following arrivals may shrink

    def dispatch(self) -> None:
        """Admit queued tickets, best first, while the capacity view finds room (re-entrancy safe). With nothing
        queued and no backlog, returns at once: a pass would shed, account and admit nothing (every request's
        release asks for one)."""
        if not self._rates.backlogged and not any(queue.tickets for queue in self._queues.values()):
            return
        if self._dispatching:
            self._dispatch_requested = True
            return
        self._dispatching = True
        victims_for: dict[int, int] = {}  # ticket id → requests preempted for it in this call (its passes too)
        try:
            self._dispatch_requested = True
            while self._dispatch_requested:
                self._dispatch_requested = False
                self._dispatch_once(victims_for)
        finally:
            self._dispatching = False

    def _dispatch_once(self, victims_for: dict[int, int]) -> None:
        now_s = self._clock()
        self._before_pass(now_s)
        count_service = self._rates.start_pass(now_s)
        held_back_tiers: set[str] = set()
        while True:
            candidates = [
                head
                for name, queue in self._queues.items()
                if name not in held_back_tiers and (head := queue.head()) is not None
            ]
            if not candidates:
                # requests held back only by reserved shares wait for lack of room too (for lower tiers)
                self._rates.backlogged = bool(held_back_tiers)
                if held_back_tiers:
                    self._wake_when_reserves_drop(now_s)
                return
            best = max(candidates, key=lambda t: (self._order.score(t, now_s), -t.ticket_id))
            if not self._fits_reserved_shares(best):
                held_back_tiers.add(best.tier.name)
                continue
            reservation = self._view.try_reserve(
                best.demand_blocks, best.tier.name, best.prompt_token_ids, avoid=best.avoid, group=best.group
            )
            if reservation is None:
                victims = victims_for.get(best.ticket_id, 0)
                if self._preemption is not None and self._preemption.make_room(best, victims):
                    victims_for[best.ticket_id] = victims + 1
                    continue
                self._rates.backlogged = True
                return  # strict order: nobody jumps ahead of the request that should go next
            self._rates.record_dispatch(now_s, best.expected_work_tokens, count_service)
            self._grant(best, reservation, now_s)

    def _wake_when_reserves_drop(self, now_s: float) -> None:
        """Run a dispatch pass when the next reserve that follows a tier's arrivals may shrink
        (``tiers.reserved_slot_window_s``): the requests it holds back then start without waiting for another
        arrival or release. One timer at a time; none outside an event loop."""
        delay_s = self._waits.next_reserve_drop_s(now_s)
        if delay_s is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._wake is not None:
            self._wake.cancel()
        self._wake = loop.call_later(delay_s + RESERVE_WAKE_SLACK_S, self.dispatch)

    def _grant(self, ticket: Ticket[Any], reservation: Any, now_s: float) -> None:
        queue = self._queues[ticket.tier.name]
        queue.remove(ticket)
        ticket.state = TicketState.ADMITTED
        ticket.reservation = reservation
        ticket.admitted_s = now_s
        self._in_flight[ticket.ticket_id] = ticket
        queue.num_in_flight += 1
        ticket.booked_blocks = self._view.booked_blocks(reservation)
        queue.in_flight_blocks += ticket.booked_blocks
        queue.num_admitted += 1
        queue.dispatch_times_s.append(now_s)
        if ticket._future is not None and not ticket._future.done():
            ticket._future.set_result(reservation)

    def _fits_reserved_shares(self, ticket: Ticket[Any]) -> bool:
        """Return whether dispatching leaves the unused reserved shares of higher tiers untouched: their
        ``reserved_kv_fraction`` of the KV blocks and their ``reserved_slot_fraction`` of the sequence slots."""
        if not self._enabled:
            return True
        free_blocks, unused_reserved_blocks = self._waits.free_blocks(ticket.tier.priority)
        # the prompt's shared prefix lowers what it books: looked up only when its whole demand does not fit
        if (unused_reserved_blocks > 0 and free_blocks < ticket.demand_blocks
                and free_blocks < ticket.demand_blocks - self._view.shared_prefix_blocks(ticket.prompt_token_ids)):
            return False
        total_slots = self._view.total_sequence_slots()
        free_slots, unused_reserved_slots = self._waits.free_slots(ticket.tier.priority, total_slots)
        return not (unused_reserved_slots > 0 and free_slots < 1)
