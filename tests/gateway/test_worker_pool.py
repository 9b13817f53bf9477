"""WorkerPool routing decisions: the prefill backlog limit that keeps the queue in the gateway.

The clients are real :class:`WorkerClient` objects whose Hello / Capacity are set by hand and whose writer is a
recorder (:mod:`tests.gateway.ready_client`), because these tests pin exact decisions (which worker, or none); the
real connection is exercised by the gateway's end-to-end tests.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from gateway.admission.controller import AdmissionController
from gateway.fleet.pools import ElasticWorkerPool
from gateway.workers.breaker import CircuitBreaker
from gateway.workers.client import WorkerClient
from gateway.workers.pool import WorkerPool
from gateway.workers.prefill_backlog import MIN_PREFILL_BUDGET_TOKENS
from shared.config import Config
from shared.protocol import Capacity, Finished, Generate, SamplingParams, TokenDelta
from tests.gateway.ready_client import ready_client as client


def prompt(num_tokens: int, salt: int = 0) -> list[int]:
    return [salt * 100_000 + i for i in range(num_tokens)]


def test_a_worker_holds_at_most_its_prefill_budget_of_unstarted_prompts():
    a, b = client("a"), client("b")
    pool = WorkerPool([a, b], prefill_queue_s=0.5)  # budget: 2000 tokens/s × 0.5 s = 1000 tokens per worker
    assert a.prefill_budget_tokens(0.5) == 1000
    first = pool.try_reserve(60, "standard", prompt(800, 1))
    second = pool.try_reserve(60, "standard", prompt(800, 2))
    assert {first.worker.name, second.worker.name} == {"a", "b"}  # the second goes where nothing is pending
    assert pool.try_reserve(60, "standard", prompt(800, 3)) is None  # 800 + 800 > 1000 on both: wait in the queue
    assert pool.try_reserve(5, "standard", prompt(200, 4)) is not None  # 800 + 200 fits
    # the first prompt starts (its first token arrives): its worker has room again
    stream = first.worker.start_request(Generate(request_id="r1", prompt_token_ids=prompt(800, 1),
                                                 sampling=SamplingParams(), max_tokens=8), first)
    first.worker._on_message(TokenDelta(request_id="r1", token_ids=[7], first_token_latency_ms=5.0))
    assert not first.prefill_pending
    third = pool.try_reserve(60, "standard", prompt(800, 3))
    assert third is not None and third.worker is first.worker
    assert stream.reservation is first
    # releasing a reservation whose prompt never started takes it out of the backlog as well, once
    pending_before = second.worker.prefill.pending_tokens
    pool.release(second)
    assert second.worker.prefill.pending_tokens == pending_before - 800
    second.worker.prefill_started(second)  # a late first token after the release changes nothing
    assert second.worker.prefill.pending_tokens == pending_before - 800


def test_one_prompt_larger_than_the_budget_still_goes_to_an_idle_worker():
    a = client("a", prefill_tokens_per_s=100.0)  # a tiny measured rate: the floor applies
    pool = WorkerPool([a], prefill_queue_s=0.5)
    assert a.prefill_budget_tokens(0.5) == MIN_PREFILL_BUDGET_TOKENS
    big = pool.try_reserve(300, "vip", prompt(4000))
    assert big is not None  # nothing pending: one request always goes
    assert pool.try_reserve(2, "vip", prompt(20, 1)) is None  # now 4000 tokens are pending
    a.start_request(Generate(request_id="big", prompt_token_ids=prompt(4000), sampling=SamplingParams(),
                             max_tokens=4), big)
    a._on_message(Finished(request_id="big", finish_reason="length", prompt_tokens=4000, cached_tokens=0,
                           completion_tokens=4))
    assert a.prefill.num_pending == 0 and a.prefill.pending_tokens == 0
    assert pool.try_reserve(2, "vip", prompt(20, 1)) is not None


def test_no_prefill_limit_when_switched_off_or_before_a_rate_is_measured():
    a = client("a")
    pool = WorkerPool([a], prefill_queue_s=0.0)
    assert [pool.try_reserve(60, "standard", prompt(900, i)) is not None for i in range(8)] == [True] * 8
    assert pool.try_reserve(60, "standard", prompt(900, 9)) is None  # max_num_seqs still holds
    b = client("b", prefill_tokens_per_s=0.0)
    pool = WorkerPool([b], prefill_queue_s=0.5)
    assert b.prefill_budget_tokens(0.5) == float("inf")
    assert pool.try_reserve(60, "standard", prompt(900, 1)) is not None
    assert pool.try_reserve(60, "standard", prompt(900, 2)) is not None


def test_a_worker_that_has_measured_no_rate_yet_gets_its_siblings_budget_even_after_they_left():
    a = client("a", prefill_tokens_per_s=2000.0)
    fresh = client("fresh", prefill_tokens_per_s=0.0)  # just said Hello: no capacity report with a rate yet
    pool = WorkerPool([a, fresh], prefill_queue_s=0.5)
    assert pool.known_prefill_tokens_per_s() == 2000.0
    assert fresh.prefill_budget_tokens(0.5, pool.known_prefill_tokens_per_s()) == 1000
    on_fresh = [pool.try_reserve(60, "standard", prompt(800, i)) for i in range(4)]
    assert sorted(r.worker.name for r in on_fresh[:2]) == ["a", "fresh"]
    assert on_fresh[2:] == [None, None]  # 800 + 800 > 1000 on both, the fresh one too: the queue holds them
    # the pool scales to zero and a new worker starts: the rate its predecessors measured still holds
    pool.clients.remove(a)
    pool.clients.remove(fresh)
    new = client("new", prefill_tokens_per_s=0.0)
    pool.clients.append(new)
    assert pool.known_prefill_tokens_per_s() == 2000.0
    assert pool.try_reserve(60, "standard", prompt(800, 5)) is not None
    assert pool.try_reserve(60, "standard", prompt(800, 6)) is None


def test_an_elastic_pool_counts_new_and_starting_workers_at_the_rate_their_siblings_measured():
    measured = client("measured", prefill_tokens_per_s=2000.0)
    measured.capacity = msgspec.structs.replace(measured.capacity, decode_tokens_per_s=1000.0,
                                                busy_tokens_per_s=3000.0)
    fresh = client("fresh")
    fresh.capacity = None  # said Hello, no capacity report yet
    pool = ElasticWorkerPool("sim")
    assert pool.drain_rate_tokens_per_s() == 0.0  # never measured
    pool.add_client(measured)
    pool.add_client(fresh)
    assert pool.drain_rate_tokens_per_s() == 6000.0  # 3000 tokens/s each, the fresh one too
    starting = WorkerClient("unix:/nonexistent/starting", "starting")  # no Hello yet: a cold start under way
    pool.add_client(starting)
    assert pool.drain_rate_tokens_per_s() == 9000.0
    # a scale to zero, then a new worker that has not reported yet: the rate measured before still holds
    for worker in (measured, fresh, starting):
        pool.remove_client(worker)
    assert pool.drain_rate_tokens_per_s() == 0.0  # no worker at all
    newcomer = client("newcomer", prefill_tokens_per_s=0.0)
    pool.add_client(newcomer)
    assert pool.drain_rate_tokens_per_s() == 3000.0


def test_cached_prefix_does_not_count_as_prefill_work():
    a = client("a")
    pool = WorkerPool([a], prefill_queue_s=0.5)  # budget 1000 tokens
    history = prompt(960)
    first = pool.try_reserve(70, "standard", history)
    pool.dispatched(first)  # the history's blocks are now in a's prefix cache (as far as the gateway knows)
    a.prefill_started(first)
    turn = pool.try_reserve(70, "standard", history + prompt(40, 7))
    assert turn.prefill_tokens == 40  # 960 cached tokens, 40 new
    assert pool.try_reserve(60, "standard", prompt(900, 8)) is not None  # 40 + 900 ≤ 1000


def test_lower_tiers_pending_prompts_do_not_hold_back_a_higher_tier():
    a = client("a")
    pool = WorkerPool([a], prefill_queue_s=0.5)  # budget 1000 tokens
    pool.tier_priorities = {"vip": 3, "standard": 2, "free": 1}
    assert pool.try_reserve(60, "free", prompt(900, 1)) is not None
    assert pool.try_reserve(60, "free", prompt(900, 2)) is None  # free behind free: over budget
    assert pool.try_reserve(60, "standard", prompt(900, 3)) is not None  # the worker prefills standard first
    assert pool.try_reserve(60, "standard", prompt(900, 4)) is None  # standard behind standard: over budget
    assert pool.try_reserve(60, "vip", prompt(900, 5)) is not None
    assert a.prefill.ahead(3) == (1, 900)
    assert a.prefill.ahead(1) == (3, 2700)
    # with every tier alike (the FIFO baseline), all pending prompts count
    pool.tier_priorities = {}
    assert pool.try_reserve(60, "vip", prompt(10, 6)) is None


def _report(worker: WorkerClient, num_running: int, prefill: float, decode: float, sequence_decode: float,
            sequence_prefill: float = 0.0, busy: float = 0.0) -> None:
    worker.capacity = Capacity(free_kv_blocks=10_000, total_kv_blocks=10_000, used_kv_blocks=0, cached_kv_blocks=0,
                               num_running=num_running, num_waiting=0, prefill_tokens_per_s=prefill,
                               decode_tokens_per_s=decode, sequence_decode_tokens_per_s=sequence_decode,
                               sequence_prefill_tokens_per_s=sequence_prefill, busy_tokens_per_s=busy)


def test_drain_rate_is_the_work_per_busy_second_not_the_sum_of_the_phase_rates():
    """Mixed steps count in both phases' rates, so prefill + decode overstates the work a worker drains."""
    a, b = client("a"), client("b")
    pool = WorkerPool([a, b])
    _report(a, 4, prefill=1000.0, decode=200.0, sequence_decode=50.0, busy=900.0)
    _report(b, 0, prefill=0.0, decode=0.0, sequence_decode=0.0)
    assert pool.drain_rate_tokens_per_s() == 900.0


def test_sequence_rates_come_from_busy_workers_only():
    a, b, c = client("a"), client("b"), client("c")
    pool = WorkerPool([a, b, c])
    assert pool.sequence_rates_tokens_per_s() is None  # nobody decoding yet
    # 4 sequences, 40 decode steps/s; prompts go at 3000 tokens/s while prefilled (1000 per busy second)
    _report(a, 4, prefill=1000.0, decode=200.0, sequence_decode=40.0, sequence_prefill=3000.0)
    _report(b, 2, prefill=1000.0, decode=120.0, sequence_decode=0.0)  # an older worker: 120 ÷ 2 running
    _report(c, 0, prefill=9000.0, decode=900.0, sequence_decode=90.0)  # idle: its rates say nothing of now
    assert pool.sequence_rates_tokens_per_s() == (2000.0, 50.0)  # (3000 + 1000) / 2, (40 + 60) / 2


def test_an_elastic_pool_counts_the_slots_its_starting_workers_bring():
    from gateway.fleet.pools import ElasticWorkerPool

    pool = ElasticWorkerPool("sim")
    starting = WorkerClient("unix:/nonexistent/s", "s")  # no Hello yet: starting
    pool.add_client(starting)
    assert pool.starting_sequence_slots() == 0  # nobody serves: no max_num_seqs to go by
    pool.add_client(client("a", max_num_seqs=8))
    pool.add_client(client("b", max_num_seqs=4))
    assert pool.total_sequence_slots() == 12
    assert pool.starting_sequence_slots() == 6  # one starting worker at the serving ones' mean


def test_max_model_len_is_what_the_largest_kv_pool_and_the_unreserved_share_can_hold():
    small, large = client("small"), client("large")
    for worker, num_blocks in ((small, 72), (large, 145)):
        worker.capacity = msgspec.structs.replace(worker.capacity, total_kv_blocks=num_blocks,
                                                  free_kv_blocks=num_blocks)
    assert WorkerPool([]).max_model_len_tokens(4096) == 4096  # no worker ready yet: the config alone
    assert WorkerPool([small]).max_model_len_tokens(4096) == 72 * 16  # 1,152 tokens, not 4,096
    assert WorkerPool([small, large]).max_model_len_tokens(4096) == 145 * 16  # one request lives on one worker
    assert WorkerPool([small, large]).max_model_len_tokens(2048) == 2048
    # tiers above keep 30% of the 72 blocks: 50 blocks are left for the request
    assert WorkerPool([small]).max_model_len_tokens(4096, reserved_kv_fraction=0.3) == 50 * 16
    assert WorkerPool([small]).max_model_len_tokens(640, reserved_kv_fraction=0.3) == 640


# A 1,504-token system prompt (94 blocks of 16) shared by 16 requests, each with 8 tokens of its own and 24 output
# tokens: 96 blocks of demand each, on a worker of 145 blocks.
SHARED_PREFIX = list(range(1000, 1000 + 94 * 16))


def shared_prefix_prompt(i: int) -> list[int]:
    return SHARED_PREFIX + [50_000 + i] * 8


def test_requests_sharing_a_prompt_prefix_book_it_once_and_each_its_own_blocks():
    worker = client("w", max_num_seqs=16)
    worker.capacity = msgspec.structs.replace(worker.capacity, total_kv_blocks=145, free_kv_blocks=145)
    pool = WorkerPool([worker])
    reservations = [pool.try_reserve(96, "standard", shared_prefix_prompt(i)) for i in range(16)]
    assert all(r is not None for r in reservations)  # booked as their demand, only one would fit
    assert [r.booked_blocks for r in reservations] == [96] + [2] * 15
    assert worker.reserved_blocks == 94 + 16 * 2
    pool.release(reservations[0])  # the first to book the prefix ends: the others still hold it
    assert worker.reserved_blocks == 94 + 15 * 2
    assert pool.shared_prefix_blocks(shared_prefix_prompt(99)) == 94
    for reservation in reservations[1:]:
        pool.release(reservation)
    assert worker.reserved_blocks == 0 and pool.shared_prefix_blocks(shared_prefix_prompt(99)) == 0
    # a prompt that ends on a block boundary shares all but its last block, which the worker computes anew
    first = pool.try_reserve(96, "standard", SHARED_PREFIX + [7] * 16)
    second = pool.try_reserve(96, "standard", SHARED_PREFIX + [7] * 16)
    assert (first.booked_blocks, second.booked_blocks) == (96, 96 - 94)


async def test_admission_admits_requests_sharing_a_prefix_together_within_the_reserved_shares():
    # default tiers: vip keeps 20% of the blocks and of the slots; the standard tier has the other 116 blocks
    worker = client("w", max_num_seqs=20)
    worker.capacity = msgspec.structs.replace(worker.capacity, total_kv_blocks=145, free_kv_blocks=145)
    pool = WorkerPool([worker])
    controller = AdmissionController(Config(), pool)
    tickets = [controller.make_ticket("standard", shared_prefix_prompt(i), 8) for i in range(16)]
    assert {t.demand_blocks for t in tickets} == {95}  # 16 × 95 blocks booked whole: only one at a time
    admitted = [asyncio.create_task(controller.admit(t)) for t in tickets]
    await asyncio.sleep(0)
    assert all(task.done() for task in admitted), sum(task.done() for task in admitted)
    assert {task.result().worker for task in admitted} == {worker}  # admitted, none shed
    assert controller.stats().tiers["standard"].in_flight_kv_blocks == 94 + 16 * 1
    for ticket in tickets:
        controller.release(ticket)
    assert worker.reserved_blocks == 0 and controller.stats().tiers["standard"].in_flight_kv_blocks == 0


def test_a_worker_that_lost_its_connection_is_down_with_the_reason_not_starting():
    never = WorkerClient("unix:/nonexistent/never", "never")
    lost = client("lost")
    lost.num_connections, lost._writer = 1, None
    lost._disconnect("worker closed the connection")  # its Hello is gone with the connection
    pool = WorkerPool([never, lost])
    states = {worker.name: (worker.state, worker.not_ready_reason) for worker in pool.status()}
    assert states == {
        "never": ("starting", "worker never at unix:/nonexistent/never: not connected"),
        "lost": ("down", "worker lost at unix:/nonexistent/lost: down (worker closed the connection)"),
    }


def test_no_worker_retry_after_is_the_soonest_probe_of_an_open_breaker():
    """README trial 5: with every ready worker's breaker open, the 503 no_worker_available said Retry-After: 1 while
    the breakers stayed open for up to their 10 s cooldown."""
    now_s = [100.0]
    a, b = client("a"), client("b")
    a.breaker = CircuitBreaker(1, 10.0, clock=lambda: now_s[0])
    b.breaker = CircuitBreaker(1, 10.0, clock=lambda: now_s[0])
    pool = WorkerPool([a, b])
    assert pool.no_worker_retry_after_s() == 1.0  # no breaker open
    a.breaker.on_failure()
    now_s[0] += 3.0
    b.breaker.on_failure()
    assert pool.total_kv_blocks() == 0 and pool.no_worker_retry_after_s() == 7.0  # a's probe comes first
    now_s[0] += 6.5
    assert pool.no_worker_retry_after_s() == 1.0  # half a second left: a reconnect's 1 s at least


def test_a_generate_that_cannot_be_encoded_leaves_no_stream_on_its_worker():
    """README trial 14: a top_k past msgpack's ints failed the frame's encoding after its stream was registered; the
    stream stayed in the worker's in-flight count for good (its pool never scaled down, a drain would wait on it)."""
    worker = client("a")
    message = Generate(request_id="r1", prompt_token_ids=prompt(8), sampling=SamplingParams(top_k=2**64),
                       max_tokens=4)
    with pytest.raises(OverflowError):
        worker.start_request(message)
    assert worker.num_in_flight == 0 and worker._writer.frames == []
    worker.start_request(Generate(request_id="r2", prompt_token_ids=prompt(8), sampling=SamplingParams(),
                                  max_tokens=4))
    assert worker.num_in_flight == 1
