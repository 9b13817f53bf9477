"""Preemption by tier (gateway.admission.preemption): which running request is stopped for which, decided against
the fake capacity view of test_admission (exact decisions); the stop-and-resume of a real stream is in
tests/gateway/test_upstream_preemption.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from gateway.admission.tickets import TicketState
from gateway.pipeline.choice import MAX_PREEMPTIONS_PER_CHOICE, MIN_TOKENS_LEFT_TO_PREEMPT, ChoiceRunner
from gateway.pipeline.choice_state import ChoiceState
from gateway.workers.breaker import CircuitBreaker
from gateway.workers.stream import RequestStream
from tests.gateway.test_admission import (FakeClock, FakePool, SlotRatesPool, make_controller, prompt, queued_task,
                                          settle)
from shared.protocol import SamplingParams


def preemptible(controller, ticket, stopped: list, can_stop: bool = True) -> None:
    """Give an admitted ticket the hook its owner (gateway.pipeline.choice) sets: stop = release at once."""

    def on_preempt() -> bool:
        if not can_stop:
            return False
        stopped.append(ticket.tier.name)
        controller.release(ticket)
        return True

    ticket.on_preempt = on_preempt


async def admit_running(controller, tier: str, stopped: list, can_stop: bool = True):
    ticket = controller.make_ticket(tier, prompt(8), 8)
    await controller.admit(ticket)
    preemptible(controller, ticket, stopped, can_stop)
    return ticket


async def test_a_higher_tier_stops_the_newest_request_of_the_lowest_tier_and_takes_its_slot():
    pool = FakePool(max_num_seqs=3)
    controller = make_controller(pool)
    stopped: list[str] = []
    old_free = await admit_running(controller, "free", stopped)
    new_free = await admit_running(controller, "free", stopped)
    standard = await admit_running(controller, "standard", stopped)
    vip = controller.make_ticket("vip", prompt(8), 8)
    await controller.admit(vip)  # admitted at once: no wait, no early rejection
    assert stopped == ["free"]
    assert (new_free.state, old_free.state, standard.state) == (TicketState.RELEASED, TicketState.ADMITTED,
                                                                TicketState.ADMITTED)
    assert vip.state is TicketState.ADMITTED and vip.queue_wait_s == 0.0
    stats = controller.stats().tiers
    assert (stats["free"].preempted, stats["standard"].preempted, stats["vip"].preempted) == (1, 0, 0)


async def test_nobody_is_stopped_for_an_equal_tier_or_when_the_owner_says_no_or_when_off():
    for tier, can_stop, setting, expect_stop in [("standard", True, True, False), ("vip", False, True, False),
                                                 ("vip", True, False, False), ("vip", True, True, True)]:
        pool = FakePool(max_num_seqs=1)
        controller = make_controller(pool, preempt_lower_tiers=setting, early_rejection=False)
        stopped: list[str] = []
        running = await admit_running(controller, "standard", stopped, can_stop)
        waiting = controller.make_ticket(tier, prompt(8), 8)
        task = queued_task(controller, waiting)
        await settle()
        assert (waiting.state is TicketState.ADMITTED) is expect_stop, (tier, can_stop, setting)
        assert stopped == (["standard"] if expect_stop else [])
        if not expect_stop:
            assert running.state is TicketState.ADMITTED
            controller.release(running)
        await task
        controller.release(waiting)


async def test_the_fifo_order_never_preempts():
    pool = FakePool(max_num_seqs=1)
    controller = make_controller(pool, order_policy="fifo", early_rejection=False)
    stopped: list[str] = []
    running = await admit_running(controller, "free", stopped)
    vip = controller.make_ticket("vip", prompt(8), 8)
    task = queued_task(controller, vip)
    await settle()
    assert stopped == [] and vip.state is TicketState.QUEUED
    controller.release(running)
    await task


async def test_a_resumption_keeps_its_place_in_its_tier_and_is_not_rejected_early():
    pool = FakePool(max_num_seqs=1)
    clock = FakeClock()
    controller = make_controller(pool, clock)
    stopped: list[str] = []
    first = await admit_running(controller, "standard", stopped)
    clock.advance(1.0)
    later = controller.make_ticket("standard", prompt(8), 8)
    later_task = queued_task(controller, later)
    await settle()
    vip = controller.make_ticket("vip", prompt(8), 8)
    await controller.admit(vip)
    assert stopped == ["standard"]
    resumed = controller.make_resume_ticket(first, prompt(12), 4, timeout_s=7.0)
    resumed_task = queued_task(controller, resumed)
    await settle()
    assert resumed.state is TicketState.QUEUED
    assert resumed.deadline_s == clock.now_s + 7.0  # from when it was queued, not from its first arrival
    assert resumed.enqueued_s == clock.now_s  # its wait counts from now (pressure, aging); its place is older
    controller.release(vip)
    await settle()
    assert resumed.state is TicketState.ADMITTED and later.state is TicketState.QUEUED  # ahead of a later arrival
    controller.release(resumed)
    await resumed_task
    await later_task
    controller.release(later)


async def test_a_decoding_victim_goes_before_a_newer_one_still_prefilling():
    """An engine frees a decoding victim's slot at its next token, a prefilling one's only after its prompt."""
    pool = FakePool(max_num_seqs=2)
    controller = make_controller(pool)
    stopped: list[str] = []
    decoding = await admit_running(controller, "free", stopped)
    decoding.decoding = True
    prefilling = await admit_running(controller, "free", stopped)
    await controller.admit(controller.make_ticket("vip", prompt(8), 8))
    assert (decoding.state, prefilling.state) == (TicketState.RELEASED, TicketState.ADMITTED)


async def test_nothing_is_stopped_while_a_slot_is_free():
    """What holds the request back is then not a slot (here its KV demand): stopping a request would not help."""
    pool = FakePool(max_num_seqs=4, blocks_per_worker=3)
    controller = make_controller(pool, early_rejection=False)
    stopped: list[str] = []
    running = await admit_running(controller, "free", stopped)  # 1 of 3 blocks, 1 of 4 slots
    vip = controller.make_ticket("vip", prompt(40), 8)  # 3 blocks
    task = queued_task(controller, vip)
    await settle()
    assert stopped == [] and vip.state is TicketState.QUEUED
    controller.release(running)
    await task


async def test_the_predicted_wait_counts_a_slot_a_higher_tier_can_stop_as_free():
    """Early rejection predicts what the dispatcher will do: a vip request need not wait for a standard request's
    answer to end when it may stop it, so it is not rejected as predicted to miss its deadline."""
    # per sequence: prefill 100 tokens/s, decode 10 tokens/s: a 10-token prompt with a 40-token answer holds its
    # slot 4.1 s
    pool = SlotRatesPool((100.0, 10.0), max_num_seqs=2, rate=1000.0)
    clock = FakeClock()
    controller = make_controller(pool, clock, early_rejection=False)
    stopped: list[str] = []
    await controller.admit(controller.make_ticket("vip", prompt(10), 40))  # frees at 4.1 s, cannot be stopped
    standard = controller.make_ticket("standard", prompt(10), 40)
    await controller.admit(standard)  # frees at 4.1 s, unless stopped
    preemptible(controller, standard, stopped)
    queued_free = queued_task(controller, controller.make_ticket("free", prompt(10), 40))  # held: no slot
    await settle()
    clock.advance(1.0)
    standard.can_preempt = lambda: True
    standard.decoding = True
    assert controller.predicted_wait_s("vip") == 0.0  # a stop frees its slot at the next token
    assert controller.predicted_wait_s("standard") == pytest.approx(3.1)  # an equal tier waits for an end
    standard.decoding = False
    assert controller.predicted_wait_s("vip") == 0.0  # its 10-token prompt took 0.1 s: past it already
    standard.can_preempt = lambda: False  # its owner would not stop it now (e.g. near the end of its budget)
    assert controller.predicted_wait_s("vip") == pytest.approx(3.1)
    assert stopped == []
    queued_free.cancel()
    await asyncio.gather(queued_free, return_exceptions=True)


def test_the_owner_refuses_a_stop_near_the_end_of_the_output_budget_or_past_its_preemptions():
    """ChoiceRunner._can_preempt, the owner's side (no side effects): a running choice on an upstream may be stopped
    while it has no output yet or at least MIN_TOKENS_LEFT_TO_PREEMPT tokens of its budget are left, and it was
    stopped fewer than MAX_PREEMPTIONS_PER_CHOICE times."""
    worker = SimpleNamespace(name="upstream-0", preemptible_by_gateway=True, ready=True, resumes_from_token_ids=True,
                             breaker=CircuitBreaker(3, 1.0))
    runner = ChoiceRunner(request_id="r", prompts=[[1, 2, 3]], max_tokens=[16], sampling=SamplingParams(),
                          stop_strings=[], tier="standard", admission=None, pool=None, tokenizer=None, metrics=None,
                          first_token_timeout_s=1.0, stall_timeout_s=1.0, cache_key="", ignore_eos=False,
                          upstream_prompts=None, on_first_token=lambda now_s, ttft_ms: None)
    choice = ChoiceState(0, 0, "r-0", 3)
    choice.ticket = SimpleNamespace(reservation=SimpleNamespace(worker=worker))
    choice.stream = RequestStream("r-0", worker)
    verdicts = {}
    for completion_tokens in (0, 16 - MIN_TOKENS_LEFT_TO_PREEMPT, 16 - MIN_TOKENS_LEFT_TO_PREEMPT + 1, 16):
        choice.completion_tokens = completion_tokens
        verdicts[completion_tokens] = runner._can_preempt(choice)
    assert verdicts == {0: True, 12: True, 13: False, 16: False}
    choice.completion_tokens = 5
    choice.num_preemptions = MAX_PREEMPTIONS_PER_CHOICE
    assert not runner._can_preempt(choice)
    choice.num_preemptions = 0
    worker.resumes_from_token_ids = False  # TGI, transformers serve, generic: only a choice without output
    assert not runner._can_preempt(choice)
    choice.completion_tokens = 0
    assert runner._can_preempt(choice)
    choice.stream.end()
    assert not runner._can_preempt(choice)  # no longer running
    # a short answer's prompt may be long: before its first token the rule of the budget's end does not apply
    runner.max_tokens = [2]
    choice.stream = RequestStream("r-0", worker)
    worker.resumes_from_token_ids = True
    assert runner._can_preempt(choice)
    choice.completion_tokens = 1
    assert not runner._can_preempt(choice)
