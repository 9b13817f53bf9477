"""Dispatch order policies: which waiting request goes next, chosen by name (``admission.order_policy``)."""

from __future__ import annotations

import abc

from gateway.admission.tickets import Ticket
from shared.config import ConfigError


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
