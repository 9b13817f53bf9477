"""A worker's prefill backlog as this gateway sees it: the reservations whose prompt has not started yet.

The pool sends a request to a worker only while the worker's not-yet-started prompt tokens of that tier or
higher fit ``admission.worker_prefill_queue_s`` seconds of its measured prefill rate (the worker prefills higher
tiers first), so a burst waits in the gateway's tiered queues, where deadlines and early rejection act, instead of
in the worker's FIFO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.workers.reservation import Reservation

# Floor of a worker's prefill backlog budget, tokens: one default engine step (worker.max_num_batched_tokens), so
# short prompts batch into one step even when the measured rate is low (a mostly-decoding worker).
MIN_PREFILL_BUDGET_TOKENS = 512


def prefill_budget_tokens(prefill_tokens_per_s: float, prefill_queue_s: float) -> float:
    """Return how many not-yet-started prompt tokens a worker may hold: ``prefill_queue_s`` seconds at
    ``prefill_tokens_per_s`` (tokens/s of busy time), at least :data:`MIN_PREFILL_BUDGET_TOKENS`; infinite when
    the rate is unknown (0) or ``prefill_queue_s`` is 0 (no limit)."""
    if prefill_queue_s <= 0 or prefill_tokens_per_s <= 0:
        return float("inf")
    return max(MIN_PREFILL_BUDGET_TOKENS, prefill_tokens_per_s * prefill_queue_s)


class PrefillBacklog:
    """Reservations on one worker whose prompt has not started, and their uncached prompt tokens, per tier priority.

    A reservation enters with :meth:`hold` when it is dispatched and leaves with :meth:`started` at its first token,
    its end, its failure or its release, whichever comes first.
    """

    def __init__(self) -> None:
        self.by_priority: dict[int, list[int]] = {}  # tier priority → [reservations, uncached prompt tokens]

    @property
    def num_pending(self) -> int:
        """Reservations whose prompt has not started, all tiers."""
        return sum(count for count, _ in self.by_priority.values())

    @property
    def pending_tokens(self) -> int:
        """Their uncached prompt tokens."""
        return sum(tokens for _, tokens in self.by_priority.values())

    def ahead(self, priority: int) -> tuple[int, int]:
        """Return (reservations, tokens) of not-yet-started prompts of tier priority ≥ ``priority``."""
        num, tokens = 0, 0
        for pending_priority, (count, pending_tokens) in self.by_priority.items():
            if pending_priority >= priority:
                num += count
                tokens += pending_tokens
        return num, tokens

    def hold(self, reservation: Reservation) -> None:
        """Count the reservation's prompt until :meth:`started`."""
        entry = self.by_priority.setdefault(reservation.priority, [0, 0])
        entry[0] += 1
        entry[1] += reservation.prefill_tokens

    def started(self, reservation: Reservation) -> bool:
        """The reservation's prompt started: stop counting it. Returns False (nothing changes) when it already had."""
        if not reservation.prefill_pending:
            return False
        reservation.prefill_pending = False
        entry = self.by_priority[reservation.priority]
        entry[0] -= 1
        entry[1] -= reservation.prefill_tokens
        if entry[0] == 0:
            del self.by_priority[reservation.priority]
        return True
