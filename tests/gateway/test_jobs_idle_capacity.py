"""The job runner's idle-capacity gate, pinned over a fleet of two pools with scripted admission and workers.

Jobs are claimed before their model (so their pool) is known: the gate counts free slots in every pool and holds
every job back while any pool has interactive demand, drains or sheds the jobs' tier.
"""

from __future__ import annotations

from types import SimpleNamespace

from gateway.jobs.idle_capacity import FleetIdleCapacity, Room


def worker(max_num_seqs: int = 8, running: int = 0, waiting: int = 0, reserved: int = 0, ready: bool = True,
           can_take: bool = True) -> SimpleNamespace:
    return SimpleNamespace(ready=ready, hello=SimpleNamespace(max_num_seqs=max_num_seqs),
                           capacity=SimpleNamespace(num_running=running, num_waiting=waiting),
                           num_reserved=reserved, can_take=lambda n: can_take)


def runtime(*clients, queued: int = 0, draining: bool = False, shed_tiers: tuple[str, ...] = ()) -> SimpleNamespace:
    admission = SimpleNamespace(draining=draining, queue_depths=lambda: {"interactive": queued, "batch": 0},
                                pressure=SimpleNamespace(sheds=lambda tier: tier in shed_tiers))
    return SimpleNamespace(admission=admission, pool=SimpleNamespace(clients=list(clients)))


def gate(*runtimes) -> FleetIdleCapacity:
    return FleetIdleCapacity(lambda: runtimes, "batch")


def test_free_slots_of_every_pool_count_as_room():
    default = runtime(worker(8, running=3), worker(8, reserved=5, running=2))
    other = runtime(worker(4, running=1))
    assert gate(default, other).room_for_jobs() == Room(5 + 3 + 3, False)


def test_workers_that_cannot_take_a_sequence_or_are_not_ready_add_no_room():
    default = runtime(worker(8, can_take=False), worker(8, ready=False))
    other = runtime(worker(4))
    assert gate(default, other).room_for_jobs() == Room(4, False)


def test_interactive_demand_in_another_pool_holds_every_job_back():
    idle = runtime(worker(8))
    assert gate(idle, runtime(worker(4), queued=1)).room_for_jobs() == Room(0, True)
    assert gate(idle, runtime(worker(4, running=4, waiting=2))).room_for_jobs() == Room(0, True)


def test_a_pool_that_drains_or_sheds_the_jobs_tier_holds_every_job_back():
    idle = runtime(worker(8))
    assert gate(idle, runtime(worker(4), draining=True)).room_for_jobs() == Room(0, True)
    assert gate(idle, runtime(worker(4), shed_tiers=("batch",))).room_for_jobs() == Room(0, True)
    assert gate(idle, runtime(worker(4), shed_tiers=("free",))).room_for_jobs() == Room(12, False)


def test_a_pool_that_can_cold_start_lets_one_job_through_when_nothing_else_gives_room():
    scaled_to_zero = runtime()
    cold = FleetIdleCapacity(lambda: (scaled_to_zero,), "batch", lambda r: r is scaled_to_zero)
    assert cold.room_for_jobs() == Room(1, False)  # its admission starts the worker
    never = FleetIdleCapacity(lambda: (scaled_to_zero,), "batch", lambda r: False)
    assert never.room_for_jobs() == Room(0, False)  # no worker can come: the jobs wait, nothing is claimed
    busy = runtime(worker(4, running=4))
    both = FleetIdleCapacity(lambda: (busy, scaled_to_zero), "batch", lambda r: r is scaled_to_zero)
    assert both.room_for_jobs() == Room(1, False)
    idle = runtime(worker(4, running=1))
    assert FleetIdleCapacity(lambda: (idle, scaled_to_zero), "batch",
                             lambda r: r is scaled_to_zero).room_for_jobs() == Room(3, False)
    waiting = runtime(queued=1)  # the job let through queues in admission: the gate closes until it is served
    assert FleetIdleCapacity(lambda: (waiting,), "batch", lambda r: True).room_for_jobs() == Room(0, True)
