"""The room one admitted request holds on one worker, from admission until it ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.workers.client import WorkerClient


@dataclass(eq=False)
class Reservation:
    """Room held on one worker for one admitted request (one choice), from admission until it ends.

    Attributes:
        reservation_id: unique per pool.
        worker: the worker the request goes to.
        demand_blocks: KV blocks the request may need (prompt + capped output).
        booked_blocks: the blocks it added to its worker's booking: ``demand_blocks`` less the shareable prompt
            blocks other admitted requests held already (:mod:`gateway.workers.kv_booking`).
        shareable_hashes: chain hashes of its prompt blocks the worker can share with other requests.
        verdict_given: the breaker heard whether the worker served it (else releasing counts it as abandoned).
        group: the request whose choices are reserved together (``Ticket.group``), None for one choice.
    """

    reservation_id: int
    worker: WorkerClient
    demand_blocks: int
    verdict_given: bool = False
    block_hashes: list[int] = field(default_factory=list, repr=False)
    prefill_tokens: int = 0  # uncached prompt tokens, in the worker's prefill backlog while prefill_pending
    prefill_pending: bool = True
    priority: int = 0  # the request's tier priority as the worker orders prefills
    shareable_hashes: Sequence[int] = ()
    booked_blocks: int = 0
    group: object | None = None  # the request whose choices are reserved together (``Ticket.group``)
