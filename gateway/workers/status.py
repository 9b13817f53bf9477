"""One worker as ``/status`` shows it and Prometheus exports it: :class:`WorkerStatus`, made by :func:`worker_status`
from its :class:`~gateway.workers.client.WorkerClient` (``WorkerPool.status`` gives the pool's)."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.workers.client import WorkerClient


class WorkerStatus(msgspec.Struct):
    """One worker as ``/status`` shows it and Prometheus exports it.

    Attributes:
        name, address: its label and where the gateway connects.
        ready, backend, simulator: connected and said Hello; its backend (``sim`` = the roofline simulator).
        breaker: its circuit breaker's state and counters.
        in_flight, reservations, pending_prefill, reserved_kv_blocks: this gateway's requests running on it,
            reservations held, prompts not yet started, KV blocks promised.
        connections: connections made so far.
        hello, capacity: its last ``Hello`` and ``Capacity`` fields (None before the first).
        capacity_age_s: seconds since the last capacity report.
        state: ``ready``; ``starting`` (never connected yet, or an upstream not polled yet); ``draining``;
            ``down`` (it was connected once and is not now); the fleet puts a local worker process's own state here.
        not_ready_reason: why it takes no request now (``/readyz``'s words), None when it does.
        pool, local: the pool it serves and whether this gateway spawned it (set by the fleet; ``""`` / False from
            a bare pool).
    """

    name: str
    address: str
    ready: bool
    backend: str
    simulator: bool
    breaker: dict[str, Any]
    in_flight: int
    reservations: int
    pending_prefill: int
    reserved_kv_blocks: int
    connections: int
    hello: dict[str, Any] | None
    capacity: dict[str, Any] | None
    capacity_age_s: float | None
    state: str = ""
    not_ready_reason: str | None = None
    pool: str = ""
    local: bool = False


def worker_status(client: WorkerClient, now_s: float) -> WorkerStatus:
    """Return the snapshot of one worker (``now_s``: ``time.time()``, for the capacity report's age)."""
    return WorkerStatus(
        name=client.name,
        address=client.address,
        ready=client.ready,
        backend=client.backend,
        simulator=client.backend == "sim",
        breaker=client.breaker.snapshot(),
        in_flight=client.num_in_flight,
        reservations=client.num_reserved,
        pending_prefill=client.prefill.num_pending,
        reserved_kv_blocks=client.reserved_blocks,
        connections=client.num_connections,
        hello=msgspec.structs.asdict(client.hello) if client.hello else None,
        capacity=msgspec.structs.asdict(client.capacity) if client.capacity else None,
        capacity_age_s=round(now_s - client.capacity_at_s, 3) if client.capacity else None,
        state=_worker_state(client),
        not_ready_reason=client.not_ready_reason(),
    )


def _worker_state(client: WorkerClient) -> str:
    """Return ``WorkerStatus.state`` of a worker as this pool sees it."""
    if client.ready:
        return "ready"
    if client.draining or (client.capacity is not None and client.capacity.draining):
        return "draining"
    if client.hello is None and client.num_connections == 0:
        return "starting"
    return "down"  # it was connected once (a lost connection clears its Hello) and is not now
