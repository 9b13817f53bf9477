"""Turning a request away when it arrives: draining, no worker, a pressure level that sheds its tier, a full queue.

Every rejection is a :class:`~shared.errors.SluiceError` with ``Retry-After`` (see ``gateway.admission.controller``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from gateway.admission.capacity import CapacityView
from gateway.admission.pressure import PressureMonitor
from gateway.admission.tickets import Ticket, TicketState, TierQueue
from gateway.admission.wait_estimate import WaitEstimator
from shared.config import Config
from shared.errors import ErrorCode, SluiceError

# Retry-After, seconds, when no worker is available: about one worker reconnect / restart backoff.


class ArrivalChecks:
    """The checks a request passes before it may queue.

    Args:
        config: tiers and admission settings.
        queues: tier name → queue (shared with the controller, read only here).
        waits: the wait estimator (``Retry-After`` values).
        pressure: the pressure monitor (which tiers it sheds).
        view: the pool's capacity view (whether any worker is there).
        queued_elsewhere: tier name → requests of that tier queued on other gateways.
    """

    def __init__(self, config: Config, queues: dict[str, TierQueue], waits: WaitEstimator, pressure: PressureMonitor,
                 view: CapacityView[Any], queued_elsewhere: Callable[[str], int]) -> None:
        self._enabled = config.admission.enabled
        self._queues = queues
        self._waits = waits
        self.pressure = pressure
        self._view = view
        self._queued_elsewhere = queued_elsewhere
        self._total_queue_capacity = sum(queue.config.queue_capacity for queue in queues.values())

    def check(self, ticket: Ticket[Any], queue: TierQueue, draining: bool) -> None:
        """Reject at arrival when the request cannot be queued or cannot make its deadline."""
        if draining:
            self.reject(
                ticket, queue, ErrorCode.DRAINING, "The server is shutting down; retry on another instance."
            )
        if self._view.total_kv_blocks() <= 0:
            # no rate to measure without a worker: retry when one may be back (a breaker's probe, a reconnect)
            self.reject(
                ticket, queue, ErrorCode.NO_WORKER, "No worker is available to serve the request.",
                self._view.no_worker_retry_after_s(),
            )
        if ticket.resume_timeout_s is not None:
            return  # a preempted request resuming was admitted once: no queue bound or pressure turns it away
        if self._enabled and self.pressure.sheds(ticket.tier.name):
            self.reject(
                ticket,
                queue,
                ErrorCode.SERVER_OVERLOADED,
                f"The server is overloaded ({self.pressure.level.label} pressure) and is not serving the "
                f"'{ticket.tier.name}' tier now.",
                self._waits.overload_retry_after_s(),
            )
        full = (
            len(queue.tickets) + self._queued_elsewhere(ticket.tier.name) >= queue.config.queue_capacity
            if self._enabled
            else sum(len(q.tickets) for q in self._queues.values()) >= self._total_queue_capacity
        )
        if full:
            message = f"The '{ticket.tier.name}' queue is full; the server is overloaded."
            self.reject(ticket, queue, ErrorCode.QUEUE_FULL, message)

    def reject(
        self,
        ticket: Ticket[Any],
        queue: TierQueue,
        code: ErrorCode,
        message: str,
        retry_after_s: float | None = None,
    ) -> NoReturn:
        """Count a rejection of ``code`` in the tier (unless the ticket's owner counts it: ``Ticket.counts_shed``)
        and raise it, with ``Retry-After`` from the tier's drain time unless ``retry_after_s`` is given."""
        ticket.state = TicketState.REJECTED
        queue.record_shed(ticket, code)
        seconds = self._waits.tier_retry_after_s(queue) if retry_after_s is None else retry_after_s
        raise SluiceError(code, message, retry_after_s=self._waits.clamp_retry_after(seconds))
