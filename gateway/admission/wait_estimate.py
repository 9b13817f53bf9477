"""Predicted queue wait and ``Retry-After`` (admission's rules: :mod:`gateway.admission.controller`).

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
(:meth:`WaitEstimator.slot_wait_s`); work ÷ rate stays for a queue held by the
prefill backlog limit (idle slots) or before those rates are measured. The check runs after the dispatch at arrival,
so a request that starts at once is never rejected for it.

``Retry-After`` is that drain time of the tier's queue (for a predicted miss: the part beyond the deadline; for a
pressure shed: the drain time of all queues, at least the dwell left in the level; for a 429: when the key's
bucket has refilled enough); with no rate measured yet it falls back to the tier's deadline. Clamped to
[1, ``admission.max_retry_after_s``].
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

from gateway.admission.capacity import CapacityView
from gateway.admission.order import DispatchOrder
from gateway.admission.pressure import PressureMonitor
from gateway.admission.rates import ServiceRates
from gateway.admission.tickets import Ticket, TierQueue
from shared.config import Config

# Queued requests the predicted wait places on sequence slots one by one; the rest count at their mean.
MAX_SCHEDULED_AHEAD = 256


class WaitEstimator:
    """Predict queue waits from the queues, the admitted requests and the measured rates.

    Args:
        config: the whole config (``admission.max_retry_after_s``, ``pressure.min_dwell_s``).
        queues: tier name → queue, highest priority first (shared with the controller, read only here).
        in_flight: admitted tickets by id (shared with the controller, read only here).
        rates: the measured rates.
        order: the dispatch order (who is ahead of whom).
        view: the pool's capacity view.
        pressure: the pressure monitor (the dwell left in its level bounds an overload ``Retry-After``).
        clock: monotonic time in seconds.
        preemption: the dispatcher stops lower-tier requests for a request that finds no slot
            (``gateway.admission.preemption``): their slots count as freeing when a stop would free them.
    """

    def __init__(self, config: Config, queues: dict[str, TierQueue], in_flight: dict[int, Ticket[Any]],
                 rates: ServiceRates, order: DispatchOrder, view: CapacityView[Any], pressure: PressureMonitor,
                 clock: Callable[[], float], preemption: bool = False) -> None:
        self._config = config
        self._queues = queues
        self._in_flight = in_flight
        self._rates = rates
        self._order = order
        self._view = view
        self._pressure = pressure
        self._clock = clock
        self._preemption = preemption

    def predicted_wait_s(self, tier: str) -> float | None:
        """Return the predicted queue wait in seconds of a request arriving now in ``tier``, None when unknown.

        While requests are held because slots or KV are taken: the time until a sequence slot frees for it
        (:meth:`slot_wait_s`); else the work queued in this tier and higher ones ÷ the drain rate.
        """
        priority = self._queues[tier].config.priority
        return self.predicted_wait_behind_s(priority, self.work_ahead_tokens(priority), None, 1)

    def predicted_wait_behind_s(self, priority: int, work_ahead_tokens: float, behind: Ticket[Any] | None,
                                demand_blocks: int) -> float | None:
        """Return the predicted wait of a request of tier priority ``priority`` behind ``work_ahead_tokens`` of
        queued work (``behind``: the request itself when it is queued already); None when unknown."""
        slot_wait_s = self.slot_wait_s(priority, behind, demand_blocks)
        if slot_wait_s is not None:
            return slot_wait_s
        if work_ahead_tokens <= 0:
            return 0.0
        rate = self._rates.drain_rate_tokens_per_s()
        return work_ahead_tokens / rate if rate > 0 else None

    def slot_wait_s(self, priority: int, behind: Ticket[Any] | None, demand_blocks: int) -> float | None:
        """Return when a sequence slot frees for a request of tier priority ``priority`` and ``demand_blocks`` KV
        blocks behind the queued tickets ahead of it (:meth:`queued_ahead`; ``behind``: the request itself when it
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
        admitted requests' slots free at their admission + that service time, or, once one decodes, after the
        expected output it has not produced yet (``Ticket.decoded_tokens``) at that decode rate (one past its
        estimate frees "now"),
        and, with preemption, a request of a lower tier that may be stopped (``Ticket.can_preempt``) frees its slot
        at once when it is decoding, at the end of its prompt when it is prefilling (an engine notices a stop at
        the victim's next token). List scheduling then gives each request ahead, in order, the slot that frees
        first, for its own service time, and the request starts when the next slot frees. The first
        :data:`MAX_SCHEDULED_AHEAD` requests ahead are placed one by one, the rest at their mean service time spread
        over the slots. Work ÷ rate alone misses
        this: a full pool of long answers admits nobody until one of them ends, however little work is queued; and
        it counts a prompt token like an output token, where a prompt costs a small part of an answer's slot time.
        """
        if not self._rates.backlogged or not self._in_flight:
            return None
        rates = self._view.sequence_rates_tokens_per_s()
        if rates is None or rates[1] <= 0:
            return None
        prefill_tokens_per_s, decode_tokens_per_s = rates
        ahead = self.queued_ahead(priority, behind)  # sorted: only once the cheap checks above have passed
        output_fraction = self._rates.output_fraction

        def service_s(ticket: Ticket[Any]) -> float:
            prefill_s = ticket.prompt_tokens / prefill_tokens_per_s if prefill_tokens_per_s > 0 else 0.0
            return prefill_s + ticket.max_tokens * output_fraction / decode_tokens_per_s

        def slot_free_s(ticket: Ticket[Any]) -> float:
            if (self._preemption and ticket.tier.priority < priority and ticket.can_preempt is not None
                    and ticket.can_preempt()):
                if ticket.decoding or prefill_tokens_per_s <= 0:
                    return 0.0
                return max(0.0, ticket.admitted_s + ticket.prompt_tokens / prefill_tokens_per_s - now_s)
            if ticket.decoding:  # from its progress: the expected output it has not produced yet
                return max(0.0, ticket.max_tokens * output_fraction - ticket.decoded_tokens) / decode_tokens_per_s
            return max(0.0, ticket.admitted_s + service_s(ticket) - now_s)

        now_s = self._clock()
        slots_free_s = [slot_free_s(ticket) for ticket in self._in_flight.values() if ticket.admitted_s is not None]
        total_slots = self._view.total_sequence_slots()
        if total_slots > 0:
            idle = self.free_slots(priority, total_slots)[0]
            if self.free_blocks(priority)[0] < (ahead[0].demand_blocks if ahead else demand_blocks):
                idle = 0  # KV binds: idle slots wait for blocks too
            idle = max(0, idle) + self._view.starting_sequence_slots()  # coming workers bring their own KV
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

    def free_blocks(self, priority: int) -> tuple[float, float]:
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

    def free_slots(self, priority: int, total_slots: int) -> tuple[int, int]:
        """Return (free, unused reserved) sequence slots of ``total_slots`` for a request of tier priority
        ``priority``: free = those not admitted − the unused reserved ones, those that tiers above it keep
        (:meth:`_reserved_slots_above`) and are not using; free may be negative."""
        unused_reserved = sum(max(0, reserved - queue.num_in_flight)
                              for queue, reserved in self._reserved_slots_above(priority, total_slots))
        return total_slots - len(self._in_flight) - unused_reserved, unused_reserved

    def usable_slots(self, priority: int, total_slots: int) -> int:
        """Return the most of ``total_slots`` sequence slots requests of tier priority ``priority`` can ever hold
        at once: all but the fixed shares the tiers above it reserve (:meth:`_reserved_slots_above`; a reserve that
        follows a tier's arrivals is gone once its burst is)."""
        return total_slots - sum(reserved for _, reserved
                                 in self._reserved_slots_above(priority, total_slots, follow_arrivals=False))

    def _reserved_slots_above(self, priority: int, total_slots: int,
                              follow_arrivals: bool = True) -> list[tuple[TierQueue, int]]:
        """Return each tier above ``priority`` that reserves slots, with its reserve of ``total_slots``: its
        ``reserved_slot_fraction`` × total, rounded half up, or, with ``follow_arrivals`` when more and at most the
        total, its arrivals within its ``reserved_slot_window_s`` while it has a request queued or running (once
        its burst's answers have all ended, its fixed share)."""
        reserved = []
        now_s: float | None = None
        for queue in self._queues.values():
            tier = queue.config
            if tier.priority <= priority or (tier.reserved_slot_fraction <= 0 and tier.reserved_slot_window_s <= 0):
                continue
            slots = math.floor(tier.reserved_slot_fraction * total_slots + 0.5)
            if follow_arrivals and tier.reserved_slot_window_s > 0 and (queue.num_in_flight or queue.tickets):
                now_s = self._clock() if now_s is None else now_s
                slots = max(slots, min(total_slots, queue.recent_arrivals(now_s)))
            reserved.append((queue, slots))
        return reserved

    def next_reserve_drop_s(self, now_s: float) -> float | None:
        """Return the seconds from ``now_s`` until a reserve that follows a tier's arrivals may shrink (its oldest
        arrival leaves the window), or None when no tier's reserve follows arrivals in a window now."""
        ends_s = [end_s for queue in self._queues.values() if (end_s := queue.arrival_window_end_s()) is not None]
        return max(0.0, min(ends_s) - now_s) if ends_s else None

    def work_ahead_tokens(self, priority: int) -> float:
        """Return the expected work tokens queued in tiers of at least ``priority``."""
        return sum(q.queued_work_tokens for q in self._queues.values() if q.config.priority >= priority)

    def queued_ahead(self, priority: int, behind: Ticket[Any] | None = None) -> list[Ticket[Any]]:
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

    # ------------------------------------------------------------------------------------------- Retry-After

    def tier_retry_after_s(self, queue: TierQueue) -> float:
        """Seconds until the work queued in this tier and above drains at the measured rate (else the deadline)."""
        rate = self._rates.drain_rate_tokens_per_s()
        if rate <= 0:
            return queue.config.queue_timeout_s
        return self.work_ahead_tokens(queue.config.priority) / rate

    def overload_retry_after_s(self) -> float:
        """Seconds until all queued work drains at the measured rate, at least the pressure level's dwell left."""
        rate = self._rates.drain_rate_tokens_per_s()
        total_work = self.work_ahead_tokens(min(q.config.priority for q in self._queues.values()))
        drain_s = total_work / rate if rate > 0 else self._config.pressure.min_dwell_s
        return max(drain_s, self._pressure.seconds_until_may_step_down())

    def clamp_retry_after(self, seconds: float) -> int:
        """Return ``seconds`` as a ``Retry-After``: whole seconds in [1, ``admission.max_retry_after_s``]."""
        return int(min(self._config.admission.max_retry_after_s, max(1, math.ceil(seconds))))
