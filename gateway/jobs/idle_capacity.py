"""The idle-capacity gate of the job runner: how many jobs may start now without taking an interactive request's room.

The gate looks at every pool of the fleet. A job's model decides its pool only once the pipeline routes it, and the
runner claims jobs in queue order without reading their bodies, so the gate is fleet-wide: interactive demand in any
pool holds every job back, and free sequence slots of every pool count as room. A pool scaled to zero has no slots:
while nothing else gives room, one job at a time is let through to it, and its admission starts a worker (the cold
start a request would trigger), which the next jobs then find.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from gateway.fleet.pools import PoolRuntime


class Room(NamedTuple):
    """What the idle-capacity gate sees now.

    Attributes:
        num_slots: jobs that may start now (0 while anything waits).
        waiting: some request waits in admission or on a worker (interactive demand), or the jobs' tier is shed.
    """

    num_slots: int
    waiting: bool


class IdleCapacity(Protocol):
    """How many jobs may start now without taking capacity an interactive request is waiting for."""

    def room_for_jobs(self) -> Room:
        """Return the room for jobs now."""


class FleetIdleCapacity:
    """The idle-capacity gate over every pool's admission controller and workers.

    Room = 0 (and ``waiting``) while any pool drains, sheds the jobs' tier at its pressure level, has a request
    waiting in any admission queue (an interactive one, or a job already handed to admission), or has a worker
    that reports waiting sequences (possibly from other gateways). Otherwise the sum over ready workers of all
    pools that can take a sequence of ``max_num_seqs`` − sequences in use, where in use is the larger of this
    gateway's reservations and the worker's last report of running + waiting; when that is 0 and a pool can
    cold-start (no ready worker, one may be started), 1: the job claimed goes through admission, whose cold-start
    check starts the worker (:meth:`gateway.fleet.fleet.Fleet.check_cold_start`), and queues for it.

    Args:
        runtimes: returns the fleet's pools (:class:`gateway.fleet.pools.PoolRuntime`: ``admission`` and ``pool``).
        jobs_tier: the tier jobs run in (the lowest).
        can_cold_start: whether a pool has no ready worker and may start one (``Fleet.can_cold_start``); None =
            never.
    """

    def __init__(self, runtimes: Callable[[], Iterable[PoolRuntime]], jobs_tier: str,
                 can_cold_start: Callable[[PoolRuntime], bool] | None = None) -> None:
        self._runtimes = runtimes
        self._jobs_tier = jobs_tier
        self._can_cold_start = can_cold_start

    def room_for_jobs(self) -> Room:
        """See :meth:`IdleCapacity.room_for_jobs`."""
        num_slots = 0
        cold = False
        for runtime in self._runtimes():
            admission = runtime.admission
            if admission.draining or admission.pressure.sheds(self._jobs_tier) \
                    or any(depth > 0 for depth in admission.queue_depths().values()):
                return Room(0, True)
            for client in runtime.pool.clients:
                if not client.ready or client.hello is None:
                    continue
                capacity = client.capacity
                if capacity is not None and capacity.num_waiting > 0:
                    return Room(0, True)
                if not client.can_take(1):
                    continue
                reported = capacity.num_running + capacity.num_waiting if capacity is not None else 0
                num_slots += max(0, client.hello.max_num_seqs - max(client.num_reserved, reported))
            cold = cold or (self._can_cold_start is not None and self._can_cold_start(runtime))
        return Room(num_slots or int(cold), False)
