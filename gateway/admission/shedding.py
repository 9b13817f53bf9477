"""Taking queued requests out of admission with a 503: deadlines, early rejection, pressure and draining.

Every shed ticket leaves its queue, counts under its error code in its tier's ``rejected`` counters (unless its
owner counts it once its client got the answer: ``Ticket.counts_shed``) and fails its waiter with a
:class:`~shared.errors.SluiceError` whose ``retry_after_s`` is clamped to [1, ``admission.max_retry_after_s``] (the
table of causes is in ``gateway.admission.controller``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.admission.arrival import ArrivalChecks
from gateway.admission.capacity import CapacityView
from gateway.admission.pressure import PressureLevel, PressureMonitor
from gateway.admission.tickets import Ticket, TicketState, TierQueue
from gateway.admission.wait_estimate import WaitEstimator
from shared.config import TierConfig
from shared.errors import ErrorCode, SluiceError


class Shedder:
    """Sheds queued tickets of one admission controller.

    Args:
        queues: the controller's tier queues, by tier name (shared, not copied).
        waits: the wait estimator (predicted waits, ``Retry-After``).
        arrival: the arrival checks (rejections at arrival are counted and raised there).
        pressure: the pressure monitor shared with output caps.
        view: the pool's capacity view (its KV use feeds the pressure level).
        dispatch: re-runs dispatch; called after a ticket that may have held the others back leaves its queue.
        clock: monotonic time in seconds.
    """

    def __init__(self, queues: dict[str, TierQueue], waits: WaitEstimator, arrival: ArrivalChecks,
                 pressure: PressureMonitor, view: CapacityView[Any], dispatch: Callable[[], None],
                 clock: Callable[[], float]) -> None:
        self._queues = queues
        self._waits = waits
        self._arrival = arrival
        self._pressure = pressure
        self._view = view
        self._dispatch = dispatch
        self._clock = clock

    def shed(self, ticket: Ticket[Any], code: ErrorCode, message: str, retry_after_s: float | None = None) -> None:
        """Take a queued ticket out of its queue, count it in its tier's rejections (unless its owner counts it:
        ``Ticket.counts_shed``) and fail its waiter; a no-op when it is no longer queued.

        Args:
            retry_after_s: seconds for ``Retry-After`` before clamping; None = the drain time of its tier's queue.
        """
        queue = self._queues[ticket.tier.name]
        if not queue.remove(ticket):
            return
        ticket.state = TicketState.REJECTED
        queue.record_shed(ticket, code)
        seconds = self._waits.tier_retry_after_s(queue) if retry_after_s is None else retry_after_s
        error = SluiceError(code, message, retry_after_s=self._waits.clamp_retry_after(seconds))
        if ticket._future is not None and not ticket._future.done():
            ticket._future.set_exception(error)

    def shed_timed_out(self, ticket: Ticket[Any]) -> None:
        """Shed a ticket that waited past its deadline: 503 ``queue_timeout``."""
        waited_s = self._clock() - ticket.arrival_s
        self.shed(
            ticket,
            ErrorCode.QUEUE_TIMEOUT,
            f"The request waited {waited_s:.1f} s in the '{ticket.tier.name}' queue, past its deadline; "
            "the server is overloaded.",
        )

    def shed_expired(self, now_s: float) -> None:
        """Shed every queued ticket whose deadline is at or before ``now_s`` (monotonic seconds)."""
        for queue in self._queues.values():
            expired = [t for t in queue.tickets.values() if t.deadline_s is not None and t.deadline_s <= now_s]
            for ticket in expired:
                self.shed_timed_out(ticket)

    def shed_all(self, code: ErrorCode, message: str, retry_after_s: float | None = None) -> None:
        """Shed every queued ticket of every tier (draining; a pool that can no longer serve), with
        ``retry_after_s`` as :meth:`shed`."""
        for queue in self._queues.values():
            for ticket in list(queue.tickets.values()):
                self.shed(ticket, code, message, retry_after_s)

    def count_rejected(self, tier: str, code: ErrorCode) -> None:
        """Count a request of ``tier`` turned away with ``code`` that admission did not count itself: before it
        reached a queue (the fleet's cold-start check: ``gateway.fleet.scaling.ScalingLoop.check_cold_start``), or
        shed from a ticket whose owner counts its sheds (``Ticket.counts_shed``) once its client got the answer."""
        self._queues[tier].num_rejected[code.value] += 1

    def count_deferred(self, tier: str, code: ErrorCode) -> None:
        """Count a request of ``tier`` shed with ``code`` whose client got an async job instead (202) as deferred
        (``/status`` ``deferred``, ``sluice_deferred_total``), not rejected: its owner counted no rejection for it."""
        self._queues[tier].num_deferred[code.value] += 1

    def shed_at_worker(self, ticket: Ticket[Any], message: str) -> SluiceError:
        """Count a ``queue_timeout`` of a ticket the worker dropped unstarted at its start deadline, and return the
        503 to answer, with ``Retry-After`` from the tier's drain rate."""
        queue = self._queues[ticket.tier.name]
        queue.num_rejected[ErrorCode.QUEUE_TIMEOUT.value] += 1
        return SluiceError(ErrorCode.QUEUE_TIMEOUT, message,
                           retry_after_s=self._waits.clamp_retry_after(self._waits.tier_retry_after_s(queue)))

    def check_predicted_wait(self, ticket: Ticket[Any], queue: TierQueue, timeout_s: float) -> None:
        """Early rejection of a ticket that the dispatch at its arrival left queued: take it out of the queue and
        raise 503 ``predicted_queue_timeout`` when its predicted wait exceeds its deadline ``timeout_s``.

        Raises:
            SluiceError: the predicted wait exceeds the deadline.
        """
        priority = ticket.tier.priority
        predicted_s = self._waits.predicted_wait_behind_s(
            priority, self._waits.work_ahead_tokens(priority) - ticket.expected_work_tokens, ticket,
            ticket.demand_blocks,
        )
        if predicted_s is None or predicted_s <= timeout_s:
            return
        queue.remove(ticket)
        self._dispatch()  # it may have been the head that held the others back
        self._arrival.reject(
            ticket,
            queue,
            ErrorCode.PREDICTED_QUEUE_TIMEOUT,
            f"The predicted queue wait ({predicted_s:.1f} s) exceeds the '{ticket.tier.name}' tier's "
            f"deadline ({timeout_s:g} s); the server is overloaded.",
            predicted_s - timeout_s,
        )

    def observe_pressure(self, signal_tier: TierConfig) -> None:
        """Feed the pressure monitor the longest wait — the oldest queued request's in ``signal_tier`` and the tiers
        above it, or the predicted wait of a request arriving in ``signal_tier`` (behind all their queued work) when
        longer — and the pool's KV use; when the level rises to one that sheds a tier, shed that tier's queue too
        (503 ``server_overloaded``). Tiers below ``signal_tier`` (those a level sheds:
        :func:`~gateway.admission.pressure.pressure_signal_tier`) do not raise the level."""
        now_s = self._clock()
        oldest_wait_s = max(
            (
                now_s - head.enqueued_s
                for q in self._queues.values()
                if q.config.priority >= signal_tier.priority
                and (head := q.head()) is not None and head.enqueued_s is not None
            ),
            default=0.0,
        )
        predicted_s = self._waits.predicted_wait_s(signal_tier.name) or 0.0  # slots included
        before = self._pressure.level
        level = self._pressure.observe(max(oldest_wait_s, predicted_s), self._view.kv_used_fraction())
        if level <= before or level is PressureLevel.NORMAL:
            return
        for queue in self._queues.values():
            if self._pressure.sheds(queue.config.name):
                for ticket in list(queue.tickets.values()):
                    self.shed(
                        ticket,
                        ErrorCode.SERVER_OVERLOADED,
                        f"The server is overloaded ({level.label} pressure) and stopped serving the "
                        f"'{queue.config.name}' tier.",
                        self._waits.overload_retry_after_s(),
                    )
