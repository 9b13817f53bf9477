"""What admission needs from a pool of workers: the capacity view, implemented by ``gateway.workers.pool.WorkerPool``.

The view is generic in the reservation it hands out (``gateway.workers.reservation.Reservation`` in the gateway; test
doubles use their own), so admission passes it back to :meth:`CapacityView.release` and to its caller unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

ReservationT = TypeVar("ReservationT")


class CapacityView(Protocol[ReservationT]):
    """What admission needs from the worker pool (implemented by the gateway's ``WorkerPool``).

    Every method is synchronous and cheap: admission calls them on the event loop while dispatching.
    """

    def try_reserve(
        self, demand_blocks: int, tier: str, prompt_token_ids: Sequence[int], avoid: object | None = None,
        group: object | None = None,
    ) -> ReservationT | None:
        """Pick a worker (closed breaker, room for the request's KV, running < max_num_seqs; route by cached prefix,
        then most free KV) and hold room on it until :meth:`release`: ``demand_blocks`` less the leading prompt
        blocks that requests admitted there already hold (a shared prefix is booked once; :meth:`booked_blocks`
        says what was). ``avoid`` names a worker to skip while another one could serve (a retry goes elsewhere);
        ``group`` is the request whose choices are admitted together (``Ticket.group``).

        Returns:
            The reservation naming the worker, or None when no worker has room now.
        """

    def release(self, reservation: ReservationT) -> None:
        """Give back a reservation returned by :meth:`try_reserve` (the request finished or never ran)."""

    def booked_blocks(self, reservation: ReservationT) -> int:
        """Return the KV blocks :meth:`try_reserve` booked for the reservation (its demand less shared blocks)."""

    def shared_prefix_blocks(self, prompt_token_ids: Sequence[int]) -> int:
        """Return the most leading blocks of the prompt that admitted requests on one worker already hold: what a
        request routed there books less than its demand."""

    def total_kv_blocks(self) -> int:
        """Return KV blocks over the workers that can take requests now; 0 means no worker is available."""

    def block_size_tokens(self) -> int:
        """Return tokens per KV block."""

    def no_worker_retry_after_s(self) -> float:
        """Return when a client turned away because no worker can take requests should retry, in seconds (a
        breaker's cooldown left when that is what holds the workers back)."""

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
        0 for a view that does not count slots (then no reserved slot shares apply)."""

    def free_sequence_slots(self) -> int:
        """Return the sequence slots of the workers that can take requests now that this gateway has not
        reserved (preemption makes room only when there are none)."""

    def starting_sequence_slots(self) -> int:
        """Return the sequence slots of workers still starting (an elastic pool's cold starts; else 0)."""

    def sequence_rates_tokens_per_s(self) -> tuple[float, float] | None:
        """Return the (prefill, decode) tokens/s one running sequence gets on a busy worker now (prefill 0.0 when
        not measured); None when unknown (then the predicted wait has no sequence-slot term)."""
