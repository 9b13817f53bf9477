"""AdmissionController: exact dispatch decisions against a fake capacity view and a controllable clock.

The capacity view and the clock are fakes because these tests pin exact decisions (which ticket goes next, which
code a rejection carries, what Retry-After says); the real worker pool is exercised by the gateway's own tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from gateway.admission.controller import AdmissionController
from gateway.admission.tickets import TicketState
from gateway.admission.pressure import PressureLevel, PressureMonitor, pressure_signal_tier
from shared.config import (
    AdmissionConfig,
    Config,
    ConfigError,
    PressureConfig,
    PressureLevelConfig,
    TierConfig,
    validate_admission_config,
)
from shared.errors import ErrorCode, SluiceError

BLOCK_SIZE = 16


class FakeClock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class FakePool:
    """Workers with a KV block budget and a max_num_seqs; reservations are (worker index, blocks)."""

    def __init__(
        self, num_workers: int = 1, blocks_per_worker: int = 1000, max_num_seqs: int = 4, rate: float = 0.0
    ) -> None:
        self.free_blocks = [blocks_per_worker] * num_workers
        self.running = [0] * num_workers
        self.blocks_per_worker = blocks_per_worker
        self.max_num_seqs = max_num_seqs
        self.rate_tokens_per_s = rate
        self.reserved: list[tuple[int, int]] = []
        self.tiers_reserved: list[str] = []

    def try_reserve(
        self, demand_blocks: int, tier: str, prompt_token_ids: Sequence[int], avoid: object | None = None,
        group: object | None = None,
    ) -> object | None:
        for i, free in enumerate(self.free_blocks):
            if free >= demand_blocks and self.running[i] < self.max_num_seqs:
                self.free_blocks[i] -= demand_blocks
                self.running[i] += 1
                reservation = (i, demand_blocks)
                self.reserved.append(reservation)
                self.tiers_reserved.append(tier)
                return reservation
        return None

    def release(self, reservation: object) -> None:
        i, blocks = reservation  # type: ignore[misc]
        self.reserved.remove(reservation)  # type: ignore[arg-type]
        self.free_blocks[i] += blocks
        self.running[i] -= 1

    def total_kv_blocks(self) -> int:
        return self.blocks_per_worker * len(self.free_blocks)

    def booked_blocks(self, reservation: object) -> int:
        return reservation[1]  # type: ignore[index]

    def shared_prefix_blocks(self, prompt_token_ids: Sequence[int]) -> int:
        return 0  # no prefix sharing in this double (gateway/workers/kv_booking.py has its own tests)

    def block_size_tokens(self) -> int:
        return BLOCK_SIZE

    def drain_rate_tokens_per_s(self) -> float:
        return self.rate_tokens_per_s

    def kv_used_fraction(self) -> float:
        total = self.total_kv_blocks()
        return 1.0 - sum(self.free_blocks) / total if total else 0.0

    # The rest of the capacity view, as a pool that reports no slot counts, no per-sequence rates and no cold
    # starts: its rates count as one worker's.
    def num_serving_workers(self) -> int:
        return 1

    def no_worker_retry_after_s(self) -> float:
        return 1.0

    def num_starting_workers(self) -> int:
        return 0

    def total_sequence_slots(self) -> int:
        return 0

    def free_sequence_slots(self) -> int:
        return sum(self.max_num_seqs - running for running in self.running)

    def starting_sequence_slots(self) -> int:
        return 0

    def sequence_rates_tokens_per_s(self) -> tuple[float, float] | None:
        return None


NEVER = PressureLevelConfig(
    enter_queue_wait_s=1e9, leave_queue_wait_s=1e9, enter_kv_used_fraction=2.0, leave_kv_used_fraction=2.0
)
QUIET_PRESSURE = PressureConfig(elevated=NEVER, critical=NEVER)


def tiers(**overrides: dict) -> list[TierConfig]:
    base = {
        "vip": dict(priority=3, queue_capacity=8, queue_timeout_s=5.0),
        "standard": dict(priority=2, queue_capacity=8, queue_timeout_s=15.0),
        "free": dict(priority=1, queue_capacity=8, queue_timeout_s=30.0),
        "batch": dict(priority=0, queue_capacity=64, queue_timeout_s=300.0),
    }
    for name, values in overrides.items():
        base[name] = {**base[name], **values}
    return [TierConfig(name=name, **values) for name, values in base.items()]


def make_config(
    tier_list: list[TierConfig] | None = None,
    pressure: PressureConfig = QUIET_PRESSURE,
    **admission: object,
) -> Config:
    return Config(
        tiers=tier_list or tiers(),
        admission=AdmissionConfig(**admission),  # type: ignore[arg-type]
        pressure=pressure,
    )


def make_controller(
    pool: FakePool, clock: FakeClock | None = None, config: Config | None = None, **admission: object
) -> AdmissionController:
    return AdmissionController(config or make_config(**admission), pool, clock=clock or FakeClock())


def prompt(num_tokens: int) -> list[int]:
    return list(range(num_tokens))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def queued_task(controller: AdmissionController, ticket) -> asyncio.Task:
    return asyncio.get_running_loop().create_task(controller.admit(ticket))


# ---------------------------------------------------------------------------------------------------- dispatch


async def test_admits_at_once_when_a_worker_has_room():
    pool = FakePool()
    controller = make_controller(pool)
    ticket = controller.make_ticket("standard", prompt(20), max_tokens=12)
    assert ticket.demand_blocks == 2  # ceil((20 + 12) / 16)
    reservation = await controller.admit(ticket)
    assert reservation == (0, 2)
    assert ticket.state is TicketState.ADMITTED
    assert ticket.queue_wait_s == 0.0
    controller.release(ticket, completion_tokens=12)
    assert pool.reserved == []
    assert ticket.state is TicketState.RELEASED
    controller.release(ticket)  # idempotent
    assert pool.free_blocks == [1000]


def admitted(tickets) -> list:
    return [t for t in tickets if t.state is TicketState.ADMITTED]


async def test_strict_priority_dispatches_highest_tier_first():
    pool = FakePool(max_num_seqs=1)
    controller = make_controller(pool)
    blocker = controller.make_ticket("batch", prompt(8), 8)
    await controller.admit(blocker)
    tickets = [controller.make_ticket(tier, prompt(8), 8) for tier in ("free", "batch", "standard", "vip")]
    tasks = [queued_task(controller, t) for t in tickets]
    await settle()
    assert admitted(tickets) == []
    order = []
    controller.release(blocker)
    for _ in range(4):
        await settle()
        (running,) = admitted(tickets)
        order.append(running.tier.name)
        controller.release(running)
    await asyncio.gather(*tasks)
    assert order == ["vip", "standard", "free", "batch"]
    assert pool.reserved == []


async def test_bc28_top_tier_starts_first_when_capacity_frees_under_30_running_low_tier():
    pool = FakePool(max_num_seqs=30)
    clock = FakeClock()
    controller = make_controller(pool, clock)
    running = [controller.make_ticket("batch", prompt(30), 100) for _ in range(30)]
    for ticket in running:
        await controller.admit(ticket)
    waiting_low = [controller.make_ticket("batch", prompt(30), 100) for _ in range(5)]
    low_tasks = [queued_task(controller, t) for t in waiting_low]
    await settle()
    clock.advance(3.0)  # the low-tier ones have waited 3 s: aged 0.3, still far below the top tier
    high = controller.make_ticket("vip", prompt(30), 80)
    high_task = queued_task(controller, high)
    await settle()
    assert high.state is TicketState.QUEUED
    controller.release(running[0])  # one worker step frees one sequence
    await settle()
    assert high.state is TicketState.ADMITTED
    assert high_task.done()
    assert admitted(waiting_low) == []
    assert high.queue_wait_s == 0.0  # the fake clock did not move between arrival and the freed capacity
    for task in low_tasks:
        task.cancel()
    await asyncio.gather(*low_tasks, return_exceptions=True)


async def test_bc28_lone_low_tier_request_is_not_starved_by_a_top_tier_flood():
    # Gap vip (3) − free (1) = 2 priority points; at 0.1 per second waited the free request passes a fresh vip
    # request after 20 s, before its own 30 s deadline.
    pool = FakePool(max_num_seqs=1)
    clock = FakeClock()
    controller = make_controller(pool, clock, aging_rate_per_s=0.1)
    current = controller.make_ticket("vip", prompt(8), 8)
    await controller.admit(current)
    lone = controller.make_ticket("free", prompt(8), 8)
    lone_task = queued_task(controller, lone)
    waited_s_when_served = None
    for step in range(40):  # one vip request finishes and a fresh one arrives every second
        clock.advance(1.0)
        fresh = controller.make_ticket("vip", prompt(8), 8)
        fresh_task = queued_task(controller, fresh)
        await settle()
        controller.release(current)
        await settle()
        if lone.state is TicketState.ADMITTED:
            waited_s_when_served = clock() - lone.enqueued_s
            fresh_task.cancel()
            await asyncio.gather(fresh_task, return_exceptions=True)
            break
        assert fresh.state is TicketState.ADMITTED
        current = fresh
    assert lone_task.done() and lone_task.exception() is None
    assert waited_s_when_served is not None
    assert 19.0 <= waited_s_when_served <= 21.0


async def test_fifo_policy_orders_by_arrival_across_tiers():
    pool = FakePool(max_num_seqs=1)
    clock = FakeClock()
    controller = make_controller(pool, clock, order_policy="fifo")
    blocker = controller.make_ticket("vip", prompt(8), 8)
    await controller.admit(blocker)
    tickets = []
    for tier in ("batch", "vip", "free"):
        tickets.append(controller.make_ticket(tier, prompt(8), 8))
        queued_task(controller, tickets[-1])
        await settle()
        clock.advance(0.1)
    order = []
    controller.release(blocker)
    for _ in range(3):
        await settle()
        (running,) = admitted(tickets)
        order.append(running.tier.name)
        controller.release(running)
    assert order == ["batch", "vip", "free"]


def test_unknown_order_policy_lists_valid_ones():
    with pytest.raises(ConfigError, match="priority_aging.*fifo"):
        make_controller(FakePool(), order_policy="lottery")


async def test_head_that_does_not_fit_blocks_lower_tiers_strictly():
    # 100 blocks; a vip request needing 64 waits for room; a small free request must not jump ahead of it.
    pool = FakePool(blocks_per_worker=100, max_num_seqs=10)
    controller = make_controller(pool)
    filler = controller.make_ticket("standard", prompt(16 * 50 - 8), 8)  # 50 blocks
    await controller.admit(filler)
    big_vip = controller.make_ticket("vip", prompt(16 * 64 - 8), 8)
    small_free = controller.make_ticket("free", prompt(8), 8)
    tasks = [queued_task(controller, big_vip), queued_task(controller, small_free)]
    await settle()
    assert big_vip.state is TicketState.QUEUED and small_free.state is TicketState.QUEUED
    controller.release(filler)
    await settle()
    assert big_vip.state is TicketState.ADMITTED and small_free.state is TicketState.ADMITTED
    assert pool.tiers_reserved[-2:] == ["vip", "free"]
    await asyncio.gather(*tasks)


# ---------------------------------------------------------------------------------------------------- reserved shares


async def test_reserved_share_keeps_room_for_the_top_tier():
    # 100 blocks, vip reserves 20 %: free requests (10 blocks each) stop at 80 blocks; vip still starts at once.
    config = make_config(tiers(vip=dict(reserved_kv_fraction=0.2)))
    pool = FakePool(blocks_per_worker=100, max_num_seqs=100)
    controller = make_controller(pool, config=config)
    frees = [controller.make_ticket("free", prompt(16 * 10 - 8), 8) for _ in range(9)]
    tasks = [queued_task(controller, t) for t in frees]
    await settle()
    assert len(admitted(frees)) == 8
    assert sum(pool.free_blocks) == 20
    vip = controller.make_ticket("vip", prompt(16 * 10 - 8), 8)
    await controller.admit(vip)  # into the reserved share, no wait
    assert sum(pool.free_blocks) == 10
    assert controller.snapshot()["tiers"]["free"]["queue_depth"] == 1
    controller.release(vip)
    await settle()
    assert frees[8].state is TicketState.QUEUED  # the reserved share is held back again
    controller.release(frees[0])
    await settle()
    assert frees[8].state is TicketState.ADMITTED
    await asyncio.gather(*tasks)


async def test_tier_held_back_by_a_reserved_share_does_not_block_higher_tiers():
    config = make_config(tiers(vip=dict(reserved_kv_fraction=0.5)))
    pool = FakePool(blocks_per_worker=100, max_num_seqs=100)
    clock = FakeClock()
    controller = make_controller(pool, clock, config=config)
    standard_fill = controller.make_ticket("standard", prompt(16 * 50 - 8), 8)
    await controller.admit(standard_fill)  # 50 blocks: standard has used all that vip does not reserve
    held = controller.make_ticket("free", prompt(8), 8)
    held_task = queued_task(controller, held)
    await settle()
    clock.advance(25.0)  # aged above a fresh vip (1 + 2.5 > 3), but still held back by vip's unused reserved share
    vip = controller.make_ticket("vip", prompt(8), 8)
    await controller.admit(vip)
    assert held.state is TicketState.QUEUED
    controller.release(standard_fill)
    await settle()
    assert held.state is TicketState.ADMITTED
    await held_task


# ---------------------------------------------------------------------------------------------------- shedding


async def test_bc26_queue_timeout_sheds_with_503_at_the_deadline_and_never_reaches_a_worker():
    config = make_config(tiers(free=dict(queue_timeout_s=0.05)))
    pool = FakePool(max_num_seqs=1)
    controller = AdmissionController(config, pool)  # real monotonic clock: the deadline is a real timer
    await controller.admit(controller.make_ticket("vip", prompt(8), 8))
    ticket = controller.make_ticket("free", prompt(8), 8)
    started_s = time.monotonic()
    with pytest.raises(SluiceError) as info:
        await controller.admit(ticket)
    waited_s = time.monotonic() - started_s
    assert info.value.code is ErrorCode.QUEUE_TIMEOUT
    assert info.value.status == 503
    assert isinstance(info.value.retry_after_s, int) and info.value.retry_after_s >= 1
    assert 0.05 <= waited_s < 0.05 + 1.0
    assert ticket.state is TicketState.REJECTED
    assert pool.tiers_reserved == ["vip"]
    snap = controller.snapshot()["tiers"]["free"]
    assert snap["queue_depth"] == 0 and snap["rejected"] == {"queue_timeout": 1}


async def test_ticket_past_its_deadline_is_shed_even_when_capacity_frees():
    pool = FakePool(max_num_seqs=1)
    clock = FakeClock()
    controller = make_controller(pool, clock)
    blocker = controller.make_ticket("vip", prompt(8), 8)
    await controller.admit(blocker)
    late = controller.make_ticket("vip", prompt(8), 8)
    task = queued_task(controller, late)
    await settle()
    clock.advance(5.0)  # vip deadline 5 s
    controller.release(blocker)  # capacity frees after the deadline: shed, not dispatched
    with pytest.raises(SluiceError) as info:
        await task
    assert info.value.code is ErrorCode.QUEUE_TIMEOUT
    assert pool.tiers_reserved == ["vip"]


async def test_bc26_queue_full_is_503_at_once():
    pool = FakePool(max_num_seqs=1)
    controller = make_controller(pool, config=make_config(tiers(free=dict(queue_capacity=2))))
    await controller.admit(controller.make_ticket("free", prompt(8), 8))
    waiting = [queued_task(controller, controller.make_ticket("free", prompt(8), 8)) for _ in range(2)]
    await settle()
    with pytest.raises(SluiceError) as info:
        await controller.admit(controller.make_ticket("free", prompt(8), 8))
    assert info.value.code is ErrorCode.QUEUE_FULL
    assert info.value.status == 503
    assert info.value.retry_after_s >= 1
    # Another tier's queue is independent.
    other = queued_task(controller, controller.make_ticket("standard", prompt(8), 8))
    await settle()
    assert not other.done()
    for task in [*waiting, other]:
        task.cancel()
    await asyncio.gather(*waiting, other, return_exceptions=True)


async def test_bc25_retry_after_follows_the_measured_drain_rate():
    # Two queued free requests of 100 tokens of work each (prompt 36 + max_tokens 64) ahead of the rejected one.
    results = {}
    for rate in (10.0, 100.0):
        pool = FakePool(max_num_seqs=1, rate=rate)
        controller = make_controller(pool, config=make_config(tiers(free=dict(queue_capacity=2))))
        await controller.admit(controller.make_ticket("vip", prompt(36), 64))
        waiting = [queued_task(controller, controller.make_ticket("free", prompt(36), 64)) for _ in range(2)]
        await settle()
        with pytest.raises(SluiceError) as info:
            await controller.admit(controller.make_ticket("free", prompt(36), 64))
        results[rate] = info.value.retry_after_s
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    assert results == {10.0: 20, 100.0: 2}  # 200 tokens ÷ rate, rounded up


async def test_bc25_retry_after_without_any_measurement_falls_back_to_the_tier_deadline():
    pool = FakePool(max_num_seqs=1, rate=0.0)
    clock = FakeClock()
    config = make_config(tiers(free=dict(queue_capacity=1, queue_timeout_s=12.0)), rate_window_s=10.0)
    controller = make_controller(pool, clock, config=config)
    await controller.admit(controller.make_ticket("vip", prompt(8), 8))
    waiting = queued_task(controller, controller.make_ticket("free", prompt(8), 8))
    await settle()
    clock.advance(10.5)  # the one dispatch left the rate window: no rate measured at all
    with pytest.raises(SluiceError) as info:
        await controller.admit(controller.make_ticket("free", prompt(8), 8))
    assert info.value.retry_after_s == 12
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_early_rejection_when_the_predicted_wait_misses_the_deadline():
    # 100 tokens/s; vip deadline 5 s; each queued vip request is 100 tokens of work.
    pool = FakePool(max_num_seqs=1, rate=100.0)
    controller = make_controller(pool)
    await controller.admit(controller.make_ticket("vip", prompt(36), 64))
    waiting = [queued_task(controller, controller.make_ticket("vip", prompt(36), 64)) for _ in range(6)]
    await settle()
    assert not any(task.done() for task in waiting)  # each predicted ≤ 5 s when it arrived
    assert controller.predicted_wait_s("vip") == pytest.approx(6.0)
    with pytest.raises(SluiceError) as info:
        await controller.admit(controller.make_ticket("vip", prompt(36), 64))
    assert info.value.code is ErrorCode.PREDICTED_QUEUE_TIMEOUT
    assert info.value.status == 503
    assert info.value.retry_after_s == 1  # 6 s predicted − 5 s deadline
    pool.rate_tokens_per_s = 40.0  # the workers slow down: 600 tokens ÷ 40 tokens/s = 15 s
    with pytest.raises(SluiceError) as info:
        await controller.admit(controller.make_ticket("vip", prompt(36), 64))
    assert info.value.retry_after_s == 10
    # A lower tier sees the same work ahead (15 s) and has a 15 s deadline: it queues.
    standard = queued_task(controller, controller.make_ticket("standard", prompt(36), 64))
    await settle()
    assert not standard.done()
    assert controller.snapshot()["tiers"]["vip"]["rejected"] == {"predicted_queue_timeout": 2}
    for task in [*waiting, standard]:
        task.cancel()
    await asyncio.gather(*waiting, standard, return_exceptions=True)


class SlotRatesPool(FakePool):
    """A FakePool whose workers report per-sequence prefill and decode rates."""

    def __init__(self, sequence_rates: tuple[float, float] | None, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.sequence_rates = sequence_rates

    def sequence_rates_tokens_per_s(self) -> tuple[float, float] | None:
        return self.sequence_rates


async def test_predicted_wait_counts_until_a_sequence_slot_frees():
    # Per sequence: prefill 100 tokens/s, decode 10 tokens/s. Two slots, each holding a 40-token answer with a
    # 10-token prompt: 0.1 + 4.0 = 4.1 s in the slot. Little work queued and a fast drain rate: work ÷ rate alone
    # would predict a few milliseconds.
    pool = SlotRatesPool((100.0, 10.0), max_num_seqs=2, rate=1000.0)
    clock = FakeClock()
    controller = make_controller(pool, clock, config=make_config(tiers(vip=dict(queue_timeout_s=3.0))))
    await controller.admit(controller.make_ticket("standard", prompt(10), 40))  # its slot frees at 4.1 s
    clock.advance(2.0)
    await controller.admit(controller.make_ticket("standard", prompt(10), 40))  # at 2 + 4.1 = 6.1 s
    assert controller.predicted_wait_s("vip") == 0.0  # nothing held back yet: a slot may be free
    clock.advance(1.0)  # now = 3 s
    # a vip request (80-token prompt, 30-token answer: 0.8 + 3.0 = 3.8 s in its slot) queues for the first slot,
    # 1.1 s from now: within its 3 s deadline
    vip = queued_task(controller, controller.make_ticket("vip", prompt(80), 30))
    await settle()
    assert not vip.done()
    # behind it, the next request gets the second slot, 6.1 − 3 = 3.1 s from now
    assert controller.predicted_wait_s("vip") == pytest.approx(3.1)
    assert controller.predicted_wait_s("standard") == pytest.approx(3.1)
    standard = queued_task(controller, controller.make_ticket("standard", prompt(10), 40))
    await settle()
    assert not standard.done()  # 3.1 s ≤ standard's 15 s deadline
    # a batch request waits for both: vip's slot frees again at 1.1 + 3.8 = 4.9 s, before standard's (3.1 + 4.1)
    assert controller.predicted_wait_s("batch") == pytest.approx(4.9)
    # a second vip request would start 3.1 s from now, past its 3 s deadline: rejected at arrival
    with pytest.raises(SluiceError) as info:
        await controller.admit(controller.make_ticket("vip", prompt(80), 30))
    assert info.value.code is ErrorCode.PREDICTED_QUEUE_TIMEOUT
    assert info.value.retry_after_s == 1  # ceil(3.1 − 3)
    # requests past their estimate free their slots "now", never in the past: the queued vip and standard
    # requests take both slots at once, and the batch request follows the vip one
    clock.advance(5.0)
    assert controller.predicted_wait_s("batch") == pytest.approx(3.8)
    for task in (vip, standard):
        task.cancel()
    await asyncio.gather(vip, standard, return_exceptions=True)


async def test_a_decoding_request_frees_its_slot_after_the_output_it_has_not_produced_yet():
    """Once a request decodes, its slot's end follows its progress, not its admission time: a request that started
    late (its prefill slower than the measured rate) but has produced most of its answer frees its slot soon."""
    pool = SlotRatesPool((100.0, 10.0), max_num_seqs=1, rate=1000.0)
    clock = FakeClock()
    controller = make_controller(pool, clock, config=make_config(tiers(vip=dict(queue_timeout_s=3.0))))
    running = controller.make_ticket("vip", prompt(10), 40)  # by the rates: 0.1 + 4.0 s in its slot
    await controller.admit(running)
    clock.advance(3.0)
    queued = queued_task(controller, controller.make_ticket("vip", prompt(10), 40))
    await settle()
    assert controller.predicted_wait_s("standard") == pytest.approx(1.1 + 4.1)  # admission + 4.1 s, then queued's
    running.decoding, running.decoded_tokens = True, 10  # its prompt took 2 s: 30 tokens of 40 are left
    assert controller.predicted_wait_s("standard") == pytest.approx(3.0 + 4.1)
    running.decoded_tokens = 40  # past its expected output: frees "now"
    assert controller.predicted_wait_s("standard") == pytest.approx(4.1)
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)


async def test_predicted_wait_has_no_slot_term_without_measured_sequence_rates():
    pool = SlotRatesPool(None, max_num_seqs=1, rate=1000.0)
    controller = make_controller(pool)
    await controller.admit(controller.make_ticket("vip", prompt(10), 1000))
    waiting = queued_task(controller, controller.make_ticket("vip", prompt(10), 10))
    await settle()
    assert controller.predicted_wait_s("vip") == pytest.approx(20 / 1000.0)  # work ÷ rate only
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_early_rejection_uses_the_dispatch_rate_when_workers_report_none():
    pool = FakePool(max_num_seqs=1, rate=0.0)
    clock = FakeClock()
    controller = make_controller(pool, clock, rate_window_s=10.0)
    clock.advance(10.0)
    first = controller.make_ticket("vip", prompt(36), 64)
    await controller.admit(first)  # 100 tokens dispatched in the last 10 s: 10 tokens/s
    assert controller.rates.drain_rate_tokens_per_s() == pytest.approx(10.0)
    waiting = queued_task(controller, controller.make_ticket("vip", prompt(36), 64))
    await settle()
    with pytest.raises(SluiceError) as info:  # 100 tokens ahead ÷ 10 tokens/s = 10 s > 5 s
        await controller.admit(controller.make_ticket("vip", prompt(36), 64))
    assert info.value.code is ErrorCode.PREDICTED_QUEUE_TIMEOUT
    assert info.value.retry_after_s == 5
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_early_rejection_can_be_switched_off():
    pool = FakePool(max_num_seqs=1, rate=1.0)
    controller = make_controller(pool, early_rejection=False)
    await controller.admit(controller.make_ticket("vip", prompt(36), 64))
    waiting = [queued_task(controller, controller.make_ticket("vip", prompt(36), 64)) for _ in range(3)]
    await settle()
    assert not any(task.done() for task in waiting)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_bc26_rate_limit_is_429_and_distinct_from_overload_codes():
    pool = FakePool()
    clock = FakeClock()
    controller = make_controller(pool, clock)
    for _ in range(2):
        ticket = controller.make_ticket("free", prompt(8), 8, rate_limit_key="sk-a", rpm_limit=2)
        await controller.admit(ticket)
        controller.release(ticket)
    with pytest.raises(SluiceError) as info:
        await controller.admit(controller.make_ticket("free", prompt(8), 8, rate_limit_key="sk-a", rpm_limit=2))
    assert info.value.code is ErrorCode.RATE_LIMIT_EXCEEDED
    assert info.value.status == 429
    assert info.value.retry_after_s == 30  # one request token refills in 60 s ÷ 2
    # Another key is not affected.
    await controller.admit(controller.make_ticket("free", prompt(8), 8, rate_limit_key="sk-b", rpm_limit=2))
    clock.advance(30.0)
    await controller.admit(controller.make_ticket("free", prompt(8), 8, rate_limit_key="sk-a", rpm_limit=2))
    codes = {ErrorCode.RATE_LIMIT_EXCEEDED, ErrorCode.QUEUE_FULL, ErrorCode.QUEUE_TIMEOUT,
             ErrorCode.PREDICTED_QUEUE_TIMEOUT, ErrorCode.SERVER_OVERLOADED}
    assert len({code.value for code in codes}) == 5


async def test_token_rate_limit_counts_prompt_plus_capped_output():
    pool = FakePool()
    controller = make_controller(pool)
    key = dict(rate_limit_key="sk-t", tpm_limit=1000)
    await controller.admit(controller.make_ticket("free", prompt(400), 500, **key))  # 900 tokens
    with pytest.raises(SluiceError) as info:
        await controller.admit(controller.make_ticket("free", prompt(100), 100, **key))  # needs 200, has 100
    assert info.value.code is ErrorCode.RATE_LIMIT_EXCEEDED
    assert info.value.retry_after_s == 6  # 100 tokens at 1000/60 tokens per s


async def test_requests_shed_at_arrival_do_not_use_up_the_rate_limit():
    pool = FakePool(max_num_seqs=1)
    controller = make_controller(pool, config=make_config(tiers(free=dict(queue_capacity=1))))
    key = dict(rate_limit_key="sk-r", rpm_limit=3)
    await controller.admit(controller.make_ticket("free", prompt(8), 8, **key))
    waiting = queued_task(controller, controller.make_ticket("free", prompt(8), 8, **key))
    await settle()
    for _ in range(3):
        with pytest.raises(SluiceError) as info:
            await controller.admit(controller.make_ticket("free", prompt(8), 8, **key))
        assert info.value.code is ErrorCode.QUEUE_FULL  # not RATE_LIMIT_EXCEEDED: the refused ones were refunded
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_no_worker_is_503_at_once():
    pool = FakePool(num_workers=0)
    controller = make_controller(pool)
    with pytest.raises(SluiceError) as info:
        await controller.admit(controller.make_ticket("vip", prompt(8), 8))
    assert info.value.code is ErrorCode.NO_WORKER and info.value.retry_after_s >= 1


async def test_draining_sheds_queued_and_refuses_new_requests():
    pool = FakePool(max_num_seqs=1)
    controller = make_controller(pool)
    running = controller.make_ticket("vip", prompt(8), 8)
    await controller.admit(running)
    waiting = queued_task(controller, controller.make_ticket("free", prompt(8), 8))
    await settle()
    controller.start_draining()
    with pytest.raises(SluiceError) as info:
        await waiting
    assert info.value.code is ErrorCode.DRAINING
    with pytest.raises(SluiceError) as info:
        await controller.admit(controller.make_ticket("vip", prompt(8), 8))
    assert info.value.code is ErrorCode.DRAINING and info.value.retry_after_s >= 1
    controller.release(running)  # in-flight requests still finish normally
    assert pool.reserved == []


async def test_a_shed_its_owner_counts_is_not_counted_by_admission_so_the_rejected_counter_never_goes_down():
    """sluice_rejected_total is a Prometheus counter: a shed that was counted and then taken back (its request was
    deferred to a job, or was a job's own and went back to the job queue) read to a scrape in between as a counter
    reset, and rate() over it as a burst of rejections. A ticket whose owner counts its sheds
    (``counts_shed = False``) leaves the count to the owner, at arrival (queue full) and in the queue (deadline)."""
    pool = FakePool(max_num_seqs=1)
    clock = FakeClock()
    controller = make_controller(pool, config=make_config(tiers(free=dict(queue_capacity=1))), clock=clock)

    def rejected() -> dict[str, int]:
        return controller.stats().tiers["free"].rejected

    running = controller.make_ticket("free", prompt(8), 8)
    await controller.admit(running)
    queued = controller.make_ticket("free", prompt(8), 8)
    queued.counts_shed = False
    waiting = queued_task(controller, queued)
    await settle()
    refused = controller.make_ticket("free", prompt(8), 8)
    refused.counts_shed = False
    with pytest.raises(SluiceError) as info:
        await controller.admit(refused)
    assert info.value.code is ErrorCode.QUEUE_FULL and refused.shed_code is ErrorCode.QUEUE_FULL
    assert rejected() == {}
    clock.advance(60.0)  # past the free tier's deadline
    controller.on_capacity_changed()
    with pytest.raises(SluiceError) as info:
        await waiting
    assert info.value.code is ErrorCode.QUEUE_TIMEOUT and queued.shed_code is ErrorCode.QUEUE_TIMEOUT
    assert rejected() == {}
    controller.shedder.count_rejected("free", refused.shed_code)  # the owner answered that one with its 503
    controller.shedder.count_deferred("free", queued.shed_code)  # and made a job of the other
    assert rejected() == {"queue_full": 1}
    assert controller.stats().tiers["free"].deferred == {"queue_timeout": 1}
    filler = queued_task(controller, controller.make_ticket("free", prompt(8), 8))
    await settle()
    with pytest.raises(SluiceError):  # the default: admission counts the shed itself
        await controller.admit(controller.make_ticket("free", prompt(8), 8))
    assert rejected() == {"queue_full": 2}
    controller.release(running)
    await filler


# ---------------------------------------------------------------------------------------------------- cancellation


async def test_cancel_while_queued_leaves_no_ticket_and_no_reservation():
    pool = FakePool(max_num_seqs=1)
    controller = make_controller(pool)
    running = controller.make_ticket("vip", prompt(8), 8)
    await controller.admit(running)
    ticket = controller.make_ticket("free", prompt(8), 8)
    task = queued_task(controller, ticket)
    await settle()
    assert controller.snapshot()["tiers"]["free"]["queue_depth"] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    snap = controller.snapshot()["tiers"]["free"]
    assert snap["queue_depth"] == 0 and snap["cancelled"] == 1 and snap["in_flight"] == 0
    assert ticket.state is TicketState.CANCELLED
    controller.release(running)
    controller.on_capacity_changed()
    assert pool.reserved == []
    assert ticket.state is TicketState.CANCELLED


async def test_cancel_in_the_instant_of_admission_gives_the_reservation_back():
    pool = FakePool(max_num_seqs=1)
    controller = make_controller(pool)
    running = controller.make_ticket("vip", prompt(8), 8)
    await controller.admit(running)
    ticket = controller.make_ticket("free", prompt(8), 8)
    task = queued_task(controller, ticket)
    await settle()
    controller.release(running)  # grants the reservation to the waiting ticket...
    assert ticket.state is TicketState.ADMITTED
    task.cancel()  # ...but its waiter is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.reserved == []
    assert controller.snapshot()["tiers"]["free"]["in_flight"] == 0
    controller.release(ticket)  # the gateway's finally: a no-op now
    assert pool.free_blocks == [1000]


async def test_a_used_ticket_cannot_be_submitted_twice():
    controller = make_controller(FakePool())
    ticket = controller.make_ticket("vip", prompt(8), 8)
    await controller.admit(ticket)
    with pytest.raises(RuntimeError):
        await controller.admit(ticket)


# ---------------------------------------------------------------------------------------------------- pressure


PRESSURE = PressureConfig(
    min_dwell_s=5.0,
    elevated=PressureLevelConfig(
        enter_queue_wait_s=2.0, leave_queue_wait_s=1.0, enter_kv_used_fraction=0.8, leave_kv_used_fraction=0.7,
        queue_timeout_s_by_tier={"free": 3.0},
    ),
    critical=PressureLevelConfig(
        enter_queue_wait_s=8.0, leave_queue_wait_s=4.0, enter_kv_used_fraction=0.95, leave_kv_used_fraction=0.9,
        shed_tiers=["batch"],
    ),
)


async def test_critical_pressure_sheds_a_tier_at_arrival_and_in_its_queue():
    pool = FakePool(blocks_per_worker=100, max_num_seqs=100)
    clock = FakeClock()
    controller = make_controller(pool, clock, config=make_config(pressure=PRESSURE))
    fill = [controller.make_ticket("vip", prompt(16 * 47 - 8), 8) for _ in range(2)]  # 94 blocks
    for ticket in fill:
        await controller.admit(ticket)
    queued_batch = controller.make_ticket("batch", prompt(16 * 10 - 8), 8)
    batch_task = queued_task(controller, queued_batch)
    await settle()
    assert queued_batch.state is TicketState.QUEUED
    extra = controller.make_ticket("vip", prompt(8), 8)
    await controller.admit(extra)  # 95 blocks used
    controller.on_capacity_changed()
    assert controller.pressure.level is PressureLevel.CRITICAL
    with pytest.raises(SluiceError) as info:
        await batch_task
    assert info.value.code is ErrorCode.SERVER_OVERLOADED and info.value.retry_after_s >= 5  # dwell left
    with pytest.raises(SluiceError) as info:
        await controller.admit(controller.make_ticket("batch", prompt(8), 8))
    assert info.value.code is ErrorCode.SERVER_OVERLOADED
    assert controller.snapshot()["tiers"]["batch"]["rejected"] == {"server_overloaded": 2}


async def test_a_backlog_of_a_tier_that_pressure_sheds_does_not_raise_the_level_that_sheds_it():
    """Jobs run in the lowest tier and yield to every other tier: their own backlog, however old, is no pressure on
    the service the other tiers get, so it neither sheds itself nor tightens their caps."""
    pool = FakePool(max_num_seqs=1)
    clock = FakeClock()
    controller = make_controller(pool, clock, config=make_config(pressure=PRESSURE))
    running = controller.make_ticket("vip", prompt(8), 8)
    await controller.admit(running)
    backlog = [controller.make_ticket("batch", prompt(8), 8) for _ in range(3)]
    tasks = [queued_task(controller, t) for t in backlog]
    await settle()
    clock.advance(9.0)  # past critical's 8 s of queue wait
    controller.on_capacity_changed()
    assert controller.pressure.level is PressureLevel.NORMAL
    assert [t.state for t in backlog] == [TicketState.QUEUED] * 3
    controller.release(running)
    await settle()
    assert backlog[0].state is TicketState.ADMITTED  # the oldest job goes first once the slot frees
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_same_backlog_in_a_tier_that_pressure_never_sheds_raises_the_level_and_sheds_batch():
    pool = FakePool(max_num_seqs=1)
    clock = FakeClock()
    config = make_config(tiers(free={"queue_timeout_s": 60.0}), pressure=PRESSURE)
    controller = make_controller(pool, clock, config=config)
    await controller.admit(controller.make_ticket("vip", prompt(8), 8))
    waiting_free = controller.make_ticket("free", prompt(8), 8)
    waiting_batch = controller.make_ticket("batch", prompt(8), 8)
    tasks = [queued_task(controller, waiting_free), queued_task(controller, waiting_batch)]
    await settle()
    clock.advance(9.0)
    controller.on_capacity_changed()
    assert controller.pressure.level is PressureLevel.CRITICAL
    assert waiting_free.state is TicketState.QUEUED
    with pytest.raises(SluiceError) as info:
        await tasks[1]
    assert info.value.code is ErrorCode.SERVER_OVERLOADED
    tasks[0].cancel()
    await asyncio.gather(tasks[0], return_exceptions=True)


def test_the_pressure_signal_tier_is_the_lowest_that_no_level_sheds():
    both = PressureConfig(
        elevated=PressureLevelConfig(enter_queue_wait_s=2.0, leave_queue_wait_s=1.0, enter_kv_used_fraction=0.8,
                                     leave_kv_used_fraction=0.7, shed_tiers=["batch"]),
        critical=PressureLevelConfig(enter_queue_wait_s=8.0, leave_queue_wait_s=4.0, enter_kv_used_fraction=0.9,
                                     leave_kv_used_fraction=0.8, shed_tiers=["free", "batch"]),
    )
    ordered = tiers()
    assert pressure_signal_tier(ordered, PressureMonitor(both)).name == "standard"
    assert pressure_signal_tier(ordered, PressureMonitor(PRESSURE)).name == "free"
    assert pressure_signal_tier(ordered, PressureMonitor(QUIET_PRESSURE)).name == "batch"
    every = PressureConfig(elevated=NEVER, critical=PressureLevelConfig(
        enter_queue_wait_s=8.0, leave_queue_wait_s=4.0, enter_kv_used_fraction=0.9, leave_kv_used_fraction=0.8,
        shed_tiers=[tier.name for tier in ordered]))
    assert pressure_signal_tier(ordered, PressureMonitor(every)).name == "batch"  # nothing kept: the lowest


async def test_elevated_pressure_tightens_the_queue_deadline():
    pool = FakePool(blocks_per_worker=100, max_num_seqs=1)
    clock = FakeClock()
    controller = make_controller(pool, clock, config=make_config(pressure=PRESSURE))
    await controller.admit(controller.make_ticket("vip", prompt(16 * 81 - 8), 8))  # 81 % of KV: elevated
    ticket = controller.make_ticket("free", prompt(8), 8)
    task = queued_task(controller, ticket)
    await settle()
    assert controller.pressure.level is PressureLevel.ELEVATED
    assert ticket.deadline_s - ticket.enqueued_s == 3.0  # not the tier's 30 s
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_pressure_monitor_is_shared_and_injectable():
    clock = FakeClock()
    monitor = PressureMonitor(PRESSURE, clock)
    controller = AdmissionController(make_config(pressure=PRESSURE), FakePool(), pressure=monitor, clock=clock)
    assert controller.pressure is monitor


# ---------------------------------------------------------------------------------------------------- baseline + status


async def test_admission_disabled_is_one_fifo_queue_without_deadlines_or_rate_limits():
    pool = FakePool(max_num_seqs=1, rate=1.0)
    clock = FakeClock()
    controller = make_controller(pool, clock, enabled=False)
    first = controller.make_ticket("batch", prompt(8), 8, rate_limit_key="k", rpm_limit=1)
    await controller.admit(first)
    later = [controller.make_ticket(tier, prompt(8), 8, rate_limit_key="k", rpm_limit=1) for tier in ("free", "vip")]
    tasks = [queued_task(controller, t) for t in later]
    await settle()
    clock.advance(10_000.0)  # far past every deadline: nothing is shed
    controller.on_capacity_changed()
    await settle()
    assert [t.state for t in later] == [TicketState.QUEUED, TicketState.QUEUED]
    controller.release(first)
    await settle()
    assert [t.state for t in later] == [TicketState.ADMITTED, TicketState.QUEUED]  # arrival order, not tier
    controller.release(later[0])
    await asyncio.gather(*tasks)
    assert controller.snapshot()["order_policy"] == "fifo"


async def test_snapshot_reports_depth_wait_counts_and_rates():
    pool = FakePool(max_num_seqs=1, rate=50.0)
    clock = FakeClock()
    controller = make_controller(pool, clock)
    await controller.admit(controller.make_ticket("vip", prompt(36), 64))
    task = queued_task(controller, controller.make_ticket("standard", prompt(36), 64))
    await settle()
    clock.advance(1.5)
    snap = controller.snapshot()
    assert snap["drain_rate_tokens_per_s"] == 50.0
    assert snap["tiers"]["vip"]["admitted"] == 1 and snap["tiers"]["vip"]["in_flight"] == 1
    assert snap["tiers"]["standard"]["queue_depth"] == 1
    assert snap["tiers"]["standard"]["oldest_wait_s"] == 1.5
    assert snap["tiers"]["standard"]["predicted_wait_s"] == 2.0  # 100 tokens ÷ 50 tokens/s
    assert snap["tiers"]["free"]["predicted_wait_s"] == 2.0  # the standard work is ahead of free too
    assert snap["tiers"]["vip"]["predicted_wait_s"] == 0.0
    assert snap["pressure"]["level"] == "normal"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_expected_output_is_learned_from_finished_requests():
    pool = FakePool(rate=100.0)
    controller = make_controller(pool)
    for _ in range(100):
        ticket = controller.make_ticket("vip", prompt(10), 100)
        await controller.admit(ticket)
        controller.release(ticket, completion_tokens=10)
    assert controller.snapshot()["expected_output_fraction"] < 0.2
    assert controller.make_ticket("vip", prompt(10), 100).expected_work_tokens < 30


async def test_a_view_that_reports_capacity_from_inside_release_is_handled():
    class ReentrantPool(FakePool):
        controller: AdmissionController

        def release(self, reservation: object) -> None:
            super().release(reservation)
            self.controller.on_capacity_changed()  # e.g. the pool re-announces capacity synchronously

    pool = ReentrantPool(max_num_seqs=1)
    controller = make_controller(pool)
    pool.controller = controller
    first = controller.make_ticket("vip", prompt(8), 8)
    await controller.admit(first)
    second = controller.make_ticket("vip", prompt(8), 8)
    task = queued_task(controller, second)
    await settle()
    controller.release(first)
    await task
    assert second.state is TicketState.ADMITTED and len(pool.reserved) == 1


async def test_drain_rate_is_measured_while_the_queue_is_backlogged():
    # The workers report an optimistic 1000 tokens/s; the queue really drains one 100-token request per second.
    pool = FakePool(max_num_seqs=1, rate=1000.0)
    clock = FakeClock()
    controller = make_controller(pool, clock, rate_window_s=30.0)
    running = controller.make_ticket("vip", prompt(36), 64)
    await controller.admit(running)  # not backlogged: this dispatch measures nothing
    queued = [controller.make_ticket("vip", prompt(36), 64) for _ in range(5)]
    tasks = [queued_task(controller, t) for t in queued]
    await settle()
    assert controller.rates.backlog_rate_tokens_per_s() is None
    assert controller.rates.drain_rate_tokens_per_s() == pytest.approx(1000.0)  # the reports stand in meanwhile
    for ticket in [running, *queued[:2]]:
        clock.advance(1.0)
        controller.release(ticket)  # capacity frees once a second, and the head of the backlog goes
        await settle()
    # 3 dispatches of 100 tokens over 3 backlogged worker-seconds
    assert controller.rates.backlog_rate_tokens_per_s() == pytest.approx(100.0)
    assert controller.rates.drain_rate_tokens_per_s() == pytest.approx(100.0)
    assert controller.predicted_wait_s("vip") == pytest.approx(2.0)  # 2 × 100 tokens still queued
    # time with an empty queue is not service time: the measure stays put while idle
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    clock.advance(5.0)
    assert controller.rates.backlog_rate_tokens_per_s() == pytest.approx(100.0)


class ScalingPool(FakePool):
    """A FakePool that counts its serving workers and can gain one (a scale-up)."""

    def num_serving_workers(self) -> int:
        return len(self.free_blocks)

    def add_worker(self) -> None:
        self.free_blocks.append(self.blocks_per_worker)
        self.running.append(0)


async def backlog_measured_at_100_tokens_per_s(pool: FakePool, clock: FakeClock, controller: AdmissionController):
    """Queue 5 requests of 100 expected work tokens behind a running one, free a slot once a second three times:
    3 dispatches of 100 tokens over 3 backlogged worker-seconds. Returns the tasks of the 2 still queued."""
    running = controller.make_ticket("vip", prompt(36), 64)
    await controller.admit(running)
    queued = [controller.make_ticket("vip", prompt(36), 64) for _ in range(5)]
    tasks = [queued_task(controller, t) for t in queued]
    await settle()
    for ticket in [running, *queued[:2]]:
        clock.advance(1.0)
        controller.release(ticket)
        await settle()
    assert controller.rates.backlog_rate_tokens_per_s() == pytest.approx(100.0)
    return tasks[3:]


async def test_the_service_rate_measured_under_backlog_outlives_an_idle_window():
    pool = FakePool(max_num_seqs=1, rate=1000.0)  # the reports are optimistic, as in the test above
    clock = FakeClock()
    controller = make_controller(pool, clock, rate_window_s=30.0)
    still_queued = await backlog_measured_at_100_tokens_per_s(pool, clock, controller)
    for task in still_queued:
        task.cancel()
    await asyncio.gather(*still_queued, return_exceptions=True)
    clock.advance(120.0)  # the window holds no backlog any more (a gap between bursts, a scale to zero)
    assert controller.rates.backlog_rate_tokens_per_s() == pytest.approx(100.0)
    assert controller.rates.drain_rate_tokens_per_s() == pytest.approx(100.0)  # not the reports' 1000


async def test_the_room_a_joining_worker_brings_is_not_counted_as_service():
    pool = ScalingPool(num_workers=1, max_num_seqs=1)
    clock = FakeClock()
    controller = make_controller(pool, clock, rate_window_s=30.0)
    still_queued = await backlog_measured_at_100_tokens_per_s(pool, clock, controller)
    pool.add_worker()  # a scale-up: the new worker takes the head of the queue at once
    controller.on_capacity_changed()
    await settle()
    assert sum(pool.running) == 2  # it did take one
    # counted, that dispatch would read as 400 tokens over 3 worker-seconds: 133 tokens/s per worker
    assert controller.rates.backlog_rate_tokens_per_s() == pytest.approx(100.0)
    assert controller.rates.drain_rate_tokens_per_s() == pytest.approx(200.0)  # 100 per serving worker × 2
    clock.advance(1.0)
    controller.release(admitted_one := next(t for t in controller._in_flight.values()))
    await settle()
    # the next dispatch is service again: 400 tokens over 3 + 2 backlogged worker-seconds
    assert admitted_one.state is TicketState.RELEASED
    assert controller.rates.backlog_rate_tokens_per_s() == pytest.approx(400.0 / 5.0)
    for task in still_queued:
        task.cancel()
    await asyncio.gather(*still_queued, return_exceptions=True)


async def test_arrival_rate_counts_every_arrival_admitted_or_not():
    pool = FakePool(max_num_seqs=1, rate=100.0)
    clock = FakeClock()
    controller = make_controller(pool, clock, rate_window_s=10.0)
    await controller.admit(controller.make_ticket("vip", prompt(36), 64))
    waiting = [queued_task(controller, controller.make_ticket("vip", prompt(36), 64)) for _ in range(6)]
    await settle()
    with pytest.raises(SluiceError):  # 6 s of work ahead > the 5 s deadline: rejected, but it was offered load
        await controller.admit(controller.make_ticket("vip", prompt(36), 64))
    assert controller.rates.arrival_rate_tokens_per_s(5.0) == pytest.approx(8 * 100 / 5.0)
    clock.advance(6.0)
    assert controller.rates.arrival_rate_tokens_per_s(5.0) == 0.0
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


def test_arrival_rate_of_any_window_sums_the_arrivals_inside_it():
    pool = FakePool(max_num_seqs=1, rate=100.0)
    clock = FakeClock()
    controller = make_controller(pool, clock, rate_window_s=10.0)
    arrivals: list[tuple[float, float]] = []
    for i in range(40):
        ticket = controller.make_ticket("vip", prompt(10 + i), 64)
        controller._record_arrival(ticket)
        arrivals.append((clock(), ticket.expected_work_tokens))
        clock.advance(0.5 if i % 3 else 0.25)
    for window_s in (0.5, 1.0, 2.5, 4.9, 5.0, 7.5, 10.0, 30.0):
        effective_s = min(window_s, 10.0)
        expected = sum(work for at_s, work in arrivals if at_s >= clock() - effective_s) / effective_s
        assert controller.rates.arrival_rate_tokens_per_s(window_s) == pytest.approx(expected)
    clock.advance(10.5)
    assert controller.rates.arrival_rate_tokens_per_s(10.0) == 0.0


class SlotPool(FakePool):
    """A FakePool that reports its sequence slots (for reserved slot shares)."""

    def total_sequence_slots(self) -> int:
        return self.max_num_seqs * len(self.free_blocks)


async def test_bc28_reserved_slot_share_lets_a_top_tier_request_start_while_lower_tiers_wait():
    # 4 slots, vip keeps 0.2 × 4 = 0.8 → 1 of them; KV is plentiful, so slots are what binds
    pool = SlotPool(max_num_seqs=4)
    config = make_config(tiers(vip=dict(reserved_slot_fraction=0.2)))
    controller = make_controller(pool, config=config)
    free = [controller.make_ticket("free", prompt(10), 100) for _ in range(4)]
    for ticket in free[:3]:
        await controller.admit(ticket)  # three slots
    fourth = queued_task(controller, free[3])
    await settle()
    assert not fourth.done()  # the last slot is vip's: the free request waits although a slot is idle
    assert pool.running == [3]
    vip = controller.make_ticket("vip", prompt(10), 100)
    await controller.admit(vip)  # at once, in its reserved slot
    assert pool.running == [4] and vip.queue_wait_s == 0.0
    # a second vip request has no reserved slot left: it waits like anyone, and goes first when one frees
    vip2 = queued_task(controller, controller.make_ticket("vip", prompt(10), 100))
    await settle()
    controller.release(free[0], completion_tokens=100)
    await settle()
    assert vip2.done() and not fourth.done()
    controller.release(free[1], completion_tokens=100)  # vip holds 2 slots ≥ its 1 reserved: free may use the rest
    await settle()
    assert fourth.done()
    assert pool.tiers_reserved == ["free", "free", "free", "vip", "vip", "free"]


async def test_reserved_slot_shares_round_to_the_nearest_slot_and_need_a_view_that_counts_slots():
    config = make_config(tiers(vip=dict(reserved_slot_fraction=0.2)))
    # 2 slots: 0.4 of a slot rounds to none reserved
    pool = SlotPool(max_num_seqs=2)
    controller = make_controller(pool, config=config)
    for _ in range(2):
        await controller.admit(controller.make_ticket("free", prompt(10), 100))
    # a view that does not count slots (FakePool) reserves none either
    pool = FakePool(max_num_seqs=4)
    controller = make_controller(pool, config=config)
    for _ in range(4):
        await controller.admit(controller.make_ticket("free", prompt(10), 100))
    assert pool.running == [4]


async def admitted_vip_burst(num_slots: int, size: int):
    """Return (pool, clock, controller, burst): ``num_slots`` sequence slots, vip keeping no fixed share but as many
    slots as it had arrivals in the last 10 s while it runs, and ``size`` vip requests admitted."""
    pool = SlotPool(max_num_seqs=num_slots)
    clock = FakeClock()
    controller = make_controller(pool, clock, config=make_config(tiers(vip=dict(reserved_slot_window_s=10.0))))
    burst = [controller.make_ticket("vip", prompt(10), 100) for _ in range(size)]
    for ticket in burst:
        await controller.admit(ticket)
    return pool, clock, controller, burst


async def test_a_reserve_that_follows_a_tiers_arrivals_holds_lower_tiers_back_through_its_burst():
    pool, clock, controller, burst = await admitted_vip_burst(num_slots=4, size=3)
    for ticket in burst[1:]:
        controller.release(ticket, completion_tokens=100)  # one answer of the burst still runs
    clock.advance(1.0)
    free = [controller.make_ticket("free", prompt(10), 100) for _ in range(2)]
    await controller.admit(free[0])  # 3 idle slots, 2 of them vip's: 3 arrivals in the window, 1 running
    second = queued_task(controller, free[1])
    await settle()
    assert not second.done() and pool.running == [2]
    vip = controller.make_ticket("vip", prompt(10), 100)
    await controller.admit(vip)  # vip itself starts at once in its reserve
    assert vip.queue_wait_s == 0.0
    # the reserve never counts against what a request may ask for: n is judged by the fixed shares
    assert controller.usable_sequence_slots("free", 4) == 4
    clock.advance(9.5)  # the burst's 3 arrivals left the window; the last vip's is in it and it is running
    controller.on_capacity_changed()
    await settle()
    assert second.done() and pool.running == [4]
    assert pool.tiers_reserved == ["vip", "vip", "vip", "free", "vip", "free"]


async def test_a_reserve_that_follows_arrivals_ends_with_the_tiers_last_answer():
    # a short vip burst that has ended leaves no slot idle for the rest of its window
    _, _, controller, burst = await admitted_vip_burst(num_slots=2, size=2)
    standard = queued_task(controller, controller.make_ticket("standard", prompt(10), 100))
    await settle()
    assert not standard.done()  # both slots run vip
    controller.release(burst[0], completion_tokens=100)
    await settle()
    assert not standard.done()  # the freed slot is vip's while its burst runs: 2 arrivals in the window
    controller.release(burst[1], completion_tokens=100)
    await settle()
    assert standard.done()  # vip has nothing queued or running: its arrivals no longer hold a slot


async def test_requests_held_back_by_a_reserve_following_arrivals_start_when_the_window_passes_unprompted():
    # the real clock and a short window: no arrival, release or capacity report comes after the hold
    pool = SlotPool(max_num_seqs=3)
    config = make_config(tiers(vip=dict(reserved_slot_window_s=0.3)))
    controller = AdmissionController(config, pool, clock=time.monotonic)
    burst = [controller.make_ticket("vip", prompt(10), 100) for _ in range(2)]
    for ticket in burst:
        await controller.admit(ticket)
    controller.release(burst[1], completion_tokens=100)  # one vip answer still runs
    free = [controller.make_ticket("free", prompt(10), 100) for _ in range(2)]
    await controller.admit(free[0])
    second = queued_task(controller, free[1])
    await settle()
    assert not second.done()  # vip's 2 arrivals keep the third slot
    await asyncio.wait_for(second, timeout=10.0)  # the dispatcher's own pass when the arrivals leave the window
    assert pool.running == [3]


def test_reserved_slot_window_must_not_be_negative():
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.reserved_slot_window_s"):
        validate_admission_config(make_config(tiers(vip=dict(reserved_slot_window_s=-1.0))))


class SlotRatesAndCountPool(SlotRatesPool):
    """Counts its slots; ``refuse`` stands for the worker's prefill backlog limit (room, but not now)."""

    refuse = False

    def total_sequence_slots(self) -> int:
        return self.max_num_seqs * len(self.free_blocks)

    def try_reserve(self, demand_blocks, tier, prompt_token_ids, avoid=None, group=None):
        return None if self.refuse else super().try_reserve(demand_blocks, tier, prompt_token_ids, avoid, group)


async def test_idle_sequence_slots_leave_the_predicted_wait_to_work_over_rate():
    # 2 of 4 slots run answers of 10.1 s; the third request is held by the prefill backlog limit, not by slots
    pool = SlotRatesAndCountPool((100.0, 10.0), max_num_seqs=4, blocks_per_worker=100, rate=100.0)
    controller = make_controller(pool)
    for _ in range(2):
        await controller.admit(controller.make_ticket("standard", prompt(10), 100))  # 7 blocks each
    pool.refuse = True
    waiting = queued_task(controller, controller.make_ticket("standard", prompt(10), 100))
    await settle()
    assert not waiting.done()
    # two slots idle: no wait for an answer to end; 110 tokens queued ÷ 100 tokens/s
    assert controller.predicted_wait_s("standard") == pytest.approx(1.1)
    # one slot idle: a request behind the queued one waits for the first answer to end
    pool.max_num_seqs = 3
    assert controller.predicted_wait_s("standard") == pytest.approx(10.1)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_idle_slots_do_not_count_when_the_kv_left_cannot_hold_the_request():
    # vip keeps 80 of the 100 blocks: two 7-block answers fit in the other 20, a third is held back by the share
    pool = SlotRatesAndCountPool((100.0, 10.0), max_num_seqs=4, blocks_per_worker=100, rate=100.0)
    controller = make_controller(pool, config=make_config(tiers(vip=dict(reserved_kv_fraction=0.8))))
    for _ in range(2):
        await controller.admit(controller.make_ticket("standard", prompt(10), 100))
    waiting = queued_task(controller, controller.make_ticket("standard", prompt(10), 100))
    await settle()
    assert not waiting.done() and pool.running == [2]
    # two slots idle, but 6 blocks left to standard: the queued request waits for an answer to end (10.1 s),
    # and one behind it too (the other answer ends at the same time)
    assert controller.predicted_wait_s("standard") == pytest.approx(10.1)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_slots_of_starting_workers_count_as_free_in_the_slot_wait():
    # both slots run 10.1 s answers and a third request waits; a worker coming up brings 2 more slots
    pool = SlotRatesAndCountPool((100.0, 10.0), max_num_seqs=2, rate=100.0)
    controller = make_controller(pool)
    for _ in range(2):
        await controller.admit(controller.make_ticket("standard", prompt(10), 100))
    waiting = queued_task(controller, controller.make_ticket("standard", prompt(10), 100))
    await settle()
    assert controller.predicted_wait_s("standard") == pytest.approx(10.1)  # behind the queued one: an answer ends
    pool.starting_sequence_slots = lambda: 2  # type: ignore[attr-defined]
    # the queued request and the next one take the coming slots: work ÷ rate (110 tokens ÷ 100 tokens/s) decides
    assert controller.predicted_wait_s("standard") == pytest.approx(1.1)
    pool.starting_sequence_slots = lambda: 1  # type: ignore[attr-defined]
    assert controller.predicted_wait_s("standard") == pytest.approx(10.1)  # one coming slot: it takes the queued one
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
