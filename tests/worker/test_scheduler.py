"""Scheduler: exact decisions pinned by feeding fake step results (a deterministic fake sampler + a fake KV store).

The fake sampler picks the next token as a pure function of the token history, as a greedy model would, so a
preempted and recomputed sequence must produce the same tokens. The fake KV store writes, for each computed token,
a fingerprint of the whole prefix ending at it into that token's slot, and checks before every step that the
slots a sequence attends over hold exactly its own prefix: a wrong block table, a block shared with another
conversation's continuation, or a cache hit on the wrong content fails the check.
"""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.kv_cache.eviction import policy_names
from worker.kv_cache.manager import KVCacheManager
from worker.scheduler import Scheduler, SchedulerOutput, SeqEvent, _Step
from worker.sequence import Sequence, SequenceStatus

BS = 4  # tokens per block
EOS = 2


def fake_token(history: list[int]) -> int:
    """Next token as a deterministic function of the history; never EOS (ids 3..502)."""
    digest = hashlib.blake2b(repr(history).encode(), digest_size=4).digest()
    return 3 + int.from_bytes(digest, "little") % 500


class FakeKV:
    """Slot -> fingerprint of the prefix whose last token wrote it (stands in for the KV tensor)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, int] = {}

    def slot(self, block_ids: list[int], t: int) -> int:
        return block_ids[t // self.block_size] * self.block_size + t % self.block_size

    def run(self, out: SchedulerOutput) -> None:
        """Write this step's tokens, then check every scheduled sequence reads its own prefix."""
        for item in out.scheduled:
            seq = item.seq
            fingerprints = _prefix_fingerprints(seq.all_token_ids)
            for t in range(seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens):
                self.slots[self.slot(item.block_ids, t)] = fingerprints[t]
        for item in out.scheduled:
            seq = item.seq
            fingerprints = _prefix_fingerprints(seq.all_token_ids)
            end = seq.num_computed_tokens + item.num_new_tokens
            assert len(item.block_ids) * self.block_size >= end
            for t in range(end):
                assert self.slots.get(self.slot(item.block_ids, t)) == fingerprints[t], (seq.request_id, t)


def _prefix_fingerprints(token_ids: list[int]) -> list[int]:
    out, running = [], 0
    for token in token_ids:
        running = hash((running, token))
        out.append(running)
    return out


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                   max_model_len_tokens: int = 1024, **kv_kwargs) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, **kv_kwargs)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len_tokens)


def seq(request_id: str, prompt: list[int], max_tokens: int = 8, tier_priority: int = 0, arrival_s: float = 0.0,
        **kwargs) -> Sequence:
    kwargs.setdefault("stop_token_ids", {EOS})
    return Sequence(request_id, list(prompt), max_tokens=max_tokens, tier_priority=tier_priority,
                    arrival_s=arrival_s, **kwargs)


def step(sched: Scheduler, fake_kv: FakeKV | None = None) -> tuple[SchedulerOutput, list[SeqEvent]]:
    """One engine step with the fake model: schedule, write/check KV, sample, update."""
    out = sched.schedule()
    if fake_kv is not None:
        fake_kv.run(out)
    sampled = {item.seq.request_id: fake_token(item.seq.all_token_ids) for item in out.scheduled if item.sample}
    return out, sched.update_from_output(out, sampled)


def plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(item.seq.request_id, item.num_new_tokens, item.sample) for item in out.scheduled]


def run_to_end(sched: Scheduler, fake_kv: FakeKV | None = None, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outputs
        _, events = step(sched, fake_kv)
        for event in events:
            outputs.setdefault(event.request_id, []).extend(event.new_token_ids)
    raise AssertionError("scheduler did not finish")


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    assert kv.num_used_blocks + kv.num_free_blocks == kv.num_total_blocks
    refs = [0] * kv.num_total_blocks
    for s in sched.running:
        table = kv.get_block_ids(s.request_id)
        assert len(table) * BS >= s.num_computed_tokens
        for block_id in table:
            refs[block_id] += 1
    for block_id, count in enumerate(refs):
        assert kv.pool.ref_count(block_id) == count >= 0
    for s in sched.waiting:
        assert kv.get_block_ids(s.request_id) == [] and s.num_computed_tokens == 0
    assert len(sched.running) <= sched.max_num_seqs


# ---------------------------------------------------------------- batching


def test_chunked_prefill_token_counts_and_sampling():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add(seq("a", range(20), max_tokens=2))
    counts = [plan(step(sched)[0]) for _ in range(5)]
    assert counts == [[("a", 8, False)], [("a", 8, False)], [("a", 4, True)], [("a", 1, True)], []]
    assert not sched.has_unfinished()


def test_bc29_long_prompt_never_stops_decode_of_others():
    sched = make_scheduler(max_num_batched_tokens=16)
    fake_kv = FakeKV(BS)
    sched.add(seq("a", range(10, 15), max_tokens=50))
    sched.add(seq("b", range(20, 25), max_tokens=50, arrival_s=1.0))
    assert plan(step(sched, fake_kv)[0]) == [("a", 5, True), ("b", 5, True)]
    sched.add(seq("long", range(100, 200), max_tokens=1, arrival_s=2.0))
    plans = []
    while "long" in sched._requests:
        out, events = step(sched, fake_kv)
        plans.append(plan(out))
        assert {e.request_id for e in events if e.new_token_ids} >= {"a", "b"}  # every step decodes them
    # 100 prompt tokens at 14 per step: 7 chunks of 14, then 2 tokens that sample
    assert plans == [[("a", 1, True), ("b", 1, True), ("long", 14, False)]] * 7 + [
        [("a", 1, True), ("b", 1, True), ("long", 2, True)]]


def test_admission_order_is_tier_priority_then_arrival_within_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    sched.add(seq("low-old", [1, 3, 4], tier_priority=0, arrival_s=0.0))
    sched.add(seq("high-new", [1, 3, 5], tier_priority=10, arrival_s=2.0))
    sched.add(seq("high-old", [1, 3, 6], tier_priority=10, arrival_s=1.0))
    out, _ = step(sched)
    assert [item.seq.request_id for item in out.scheduled] == ["high-old", "high-new"]
    assert [s.request_id for s in sched.waiting] == ["low-old"]


def test_waiting_top_tier_prompt_is_prefilled_before_a_lower_tier_prompt_already_mid_prefill():
    # a low-tier 60-token prompt starts chunked prefill; a vip prompt arriving after its first chunk takes the
    # budget at the next step (no priority inversion), and the low-tier prompt resumes with what is left
    sched = make_scheduler(max_num_batched_tokens=16)
    fake_kv = FakeKV(BS)
    sched.add(seq("low", range(100, 160), max_tokens=2, tier_priority=0, arrival_s=0.0))
    assert plan(step(sched, fake_kv)[0]) == [("low", 16, False)]
    sched.add(seq("vip", range(200, 210), max_tokens=2, tier_priority=10, arrival_s=1.0))
    assert plan(step(sched, fake_kv)[0]) == [("vip", 10, True), ("low", 6, False)]
    assert plan(step(sched, fake_kv)[0]) == [("vip", 1, True), ("low", 15, False)]
    # a same-tier newcomer still waits behind the running prompt of its tier (oldest first)
    sched.add(seq("low-new", range(300, 304), max_tokens=1, tier_priority=0, arrival_s=2.0))
    assert plan(step(sched, fake_kv)[0]) == [("low", 16, False)]
    assert plan(step(sched, fake_kv)[0]) == [("low", 7, True), ("low-new", 4, True)]
    assert set(run_to_end(sched, fake_kv)) == {"low"}  # low-new sampled its one token above
    check_invariants(sched)
    assert sched.kv.num_used_blocks == 0



def test_a_waiting_sequence_not_started_by_its_deadline_is_dropped_with_queue_timeout_and_no_block_leaks():
    sched = make_scheduler(max_num_seqs=1)
    sched.add(seq("running", [1, 3, 4], max_tokens=50, tier_priority=5, arrival_s=0.0))
    starved = seq("starved", [5, 6, 7], tier_priority=0, arrival_s=1.0)
    starved.start_deadline_s = 10.0
    sched.add(starved)
    patient = seq("patient", [8, 9], tier_priority=0, arrival_s=2.0)  # no deadline
    sched.add(patient)
    step(sched)  # "running" takes the only slot
    assert sched.expire_unstarted(9.99) == 0
    assert sched.expire_unstarted(10.0) == 1
    _, events = step(sched)
    [dropped] = [e for e in events if e.request_id == "starved"]
    assert (dropped.finish_reason, dropped.error_code, dropped.completion_tokens) == ("abort", "queue_timeout", 0)
    assert "9.0 s" in dropped.error  # waited from its arrival at 1.0 s
    assert [s.request_id for s in sched.waiting] == ["patient"]
    assert "starved" not in sched._requests
    # a preempted sequence has started: never dropped, whatever its deadline
    victim = sched.running[0]
    victim.start_deadline_s = 0.0
    preempting_step = _Step(budget_tokens=0)
    sched._preempt(preempting_step, victim)
    assert victim.status is SequenceStatus.PREEMPTED and preempting_step.preempted == ["running"]
    assert sched.expire_unstarted(100.0) == 0
    run_to_end(sched)
    check_invariants(sched)
    assert sched.kv.num_used_blocks == 0


def test_a_started_prompt_held_mid_prefill_by_higher_tiers_past_its_deadline_is_dropped_but_a_moving_one_is_not():
    sched = make_scheduler(max_num_batched_tokens=8)
    fake_kv = FakeKV(BS)
    low = seq("low", range(100, 124), max_tokens=2, tier_priority=0, arrival_s=0.0)
    low.start_deadline_s = 5.0
    sched.add(low)
    assert plan(step(sched, fake_kv)[0]) == [("low", 8, False)]  # started: 8 of its 24 prompt tokens
    assert sched.expire_unstarted(6.0) == 0  # past its deadline, but its prefill moved in the last step
    sched.add(seq("vip", range(200, 216), max_tokens=2, tier_priority=10, arrival_s=1.0))
    assert plan(step(sched, fake_kv)[0]) == [("vip", 8, False)]  # vip takes the whole budget: low is held
    assert sched.expire_unstarted(4.9) == 0  # held, but before its deadline
    assert sched.expire_unstarted(6.0) == 1
    _, events = step(sched, fake_kv)
    [dropped] = [e for e in events if e.request_id == "low"]
    assert (dropped.finish_reason, dropped.error_code) == ("abort", "queue_timeout")
    assert "held mid-prefill" in dropped.error
    assert set(run_to_end(sched, fake_kv)) == {"vip"}
    check_invariants(sched)
    assert sched.kv.num_used_blocks == 0 and sched._requests == {}

def test_decode_budget_runs_out_before_max_num_seqs():
    sched = make_scheduler(max_num_batched_tokens=2)
    for i in range(3):
        sched.add(seq(f"s{i}", [5, 6], max_tokens=4, arrival_s=float(i)))
    assert plan(step(sched)[0]) == [("s0", 2, True)]
    assert plan(step(sched)[0]) == [("s0", 1, True), ("s1", 1, False)]


# ---------------------------------------------------------------- finishing


def test_finish_reasons_stop_length_and_context():
    sched = make_scheduler(max_model_len_tokens=7)
    first_token = fake_token([1, 3])
    sched.add(seq("stop", [1, 3], stop_token_ids={first_token}))
    sched.add(seq("ignore", [1, 3], max_tokens=2, ignore_eos=True, stop_token_ids={first_token}, arrival_s=1.0))
    sched.add(seq("ctx", [1, 3, 5, 7, 9], max_tokens=100, arrival_s=2.0))
    finished = {}
    for _ in range(5):
        for event in step(sched)[1]:
            if event.finish_reason:
                finished[event.request_id] = (event.finish_reason, event.completion_tokens)
    assert finished == {"stop": ("stop", 1), "ignore": ("length", 2), "ctx": ("length", 2)}
    assert sched.kv.num_used_blocks == 0


def test_prompt_that_can_never_fit_is_refused_with_an_error():
    sched = make_scheduler(num_blocks=4, max_model_len_tokens=64)
    sched.add(seq("huge", range(17)))  # 5 blocks > a pool of 4
    sched.add(seq("ctx", range(64)))  # no room left in the context
    sched.add(seq("empty", []))
    sched.add(seq("zero", [1, 3], max_tokens=0))
    assert sched.has_unfinished()
    out, events = step(sched)
    assert out.scheduled == []
    assert [(e.request_id, e.finish_reason) for e in events] == [("huge", "abort"), ("ctx", "abort"),
                                                               ("empty", "abort"), ("zero", "length")]
    assert events[3].error is None and events[3].completion_tokens == 0
    assert "KV blocks" in events[0].error and "context" in events[1].error and "empty" in events[2].error
    assert not sched.has_unfinished()


def test_sequence_outgrowing_the_whole_pool_finishes_with_length():
    sched = make_scheduler(num_blocks=2, max_model_len_tokens=64)
    sched.add(seq("a", range(6), max_tokens=100))
    outputs = run_to_end(sched)
    # tokens 0..7 fill the 2 blocks; token 8 is sampled from token 7, but computing it needs a third block
    assert len(outputs["a"]) == 3
    assert sched.kv.num_used_blocks == 0 and sched.num_preemptions == 0


# ---------------------------------------------------------------- preemption


def test_preemption_victim_is_lowest_tier_then_newest():
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    fake_kv = FakeKV(BS)
    sched.add(seq("high", range(10, 18), tier_priority=5, max_tokens=20, arrival_s=2.0))
    sched.add(seq("low-old", range(20, 28), tier_priority=0, max_tokens=20, arrival_s=0.0))
    sched.add(seq("low-new", range(30, 38), tier_priority=0, max_tokens=20, arrival_s=1.0))
    out, _ = step(sched, fake_kv)  # 8 prompt tokens = 2 blocks each: the pool is full
    assert [i.seq.request_id for i in out.scheduled] == ["high", "low-old", "low-new"]
    out, _ = step(sched, fake_kv)  # decoding token 8 needs a third block
    assert out.preempted_request_ids == ["low-new"]
    assert plan(out) == [("high", 1, True), ("low-old", 1, True)]
    for _ in range(3):  # tokens 9..11 fit the third blocks
        assert step(sched, fake_kv)[0].preempted_request_ids == []
    out, _ = step(sched, fake_kv)  # token 12: "high" needs a fourth block; the older low tier goes
    assert out.preempted_request_ids == ["low-old"]
    assert plan(out) == [("high", 1, True)]
    assert sched.num_preemptions == 2
    assert [s.request_id for s in sched.waiting] == ["low-old", "low-new"]
    assert all(s.status is SequenceStatus.PREEMPTED for s in sched.waiting)
    check_invariants(sched)
    run_to_end(sched, fake_kv)
    assert sched.kv.num_used_blocks == 0


def test_preempting_an_already_scheduled_victim_takes_it_out_of_the_step():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=8)
    fake_kv = FakeKV(BS)
    sched.add(seq("low", range(6), max_tokens=20))
    step(sched, fake_kv)
    sched.add(seq("high", range(50, 66), tier_priority=5, max_tokens=2, arrival_s=1.0))
    assert plan(step(sched, fake_kv)[0]) == [("low", 1, True), ("high", 7, False)]  # the pool is now full
    # "low" decodes first (no new block needed), then "high"'s next chunk needs 2 blocks: "low" is the victim
    out, events = step(sched, fake_kv)
    assert out.preempted_request_ids == ["low"]
    assert plan(out) == [("high", 7, False)]
    assert events == []
    check_invariants(sched)
    run_to_end(sched, fake_kv)
    assert sched.kv.num_used_blocks == 0


def test_preempted_sequence_resumes_through_prefix_cache_with_identical_output():
    def make_seqs():
        return [seq(f"s{i}", [7, i, 8, i, 9, i], max_tokens=24, tier_priority=i % 2, arrival_s=float(i))
                for i in range(4)]

    roomy = make_scheduler(num_blocks=64)
    for s in make_seqs():
        roomy.add(s)
    expected = run_to_end(roomy, FakeKV(BS))
    assert roomy.num_preemptions == 0

    tight = make_scheduler(num_blocks=14)
    fake_kv = FakeKV(BS)
    for s in make_seqs():
        tight.add(s)
    resumed_hits = []
    outputs: dict[str, list[int]] = {}
    while tight.has_unfinished():
        preempted = {s.request_id for s in tight.waiting if s.status is SequenceStatus.PREEMPTED}
        out, events = step(tight, fake_kv)
        check_invariants(tight)
        resumed_hits += [item.seq.num_computed_tokens for item in out.scheduled if item.seq.request_id in preempted]
        for event in events:
            outputs.setdefault(event.request_id, []).extend(event.new_token_ids)
    assert tight.num_preemptions > 0
    assert outputs == expected
    assert any(hit > 0 for hit in resumed_hits)  # the freed blocks were still cached on resume
    assert tight.kv.num_used_blocks == 0


def test_num_cached_tokens_is_recorded_at_first_admission_only():
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
    sched.add(seq("warm", range(8), max_tokens=1))
    run_to_end(sched)
    sched.add(seq("big", list(range(8)) + [50, 51, 52], max_tokens=20, tier_priority=0, arrival_s=5.0))
    sched.add(seq("vip", [60, 61, 62], max_tokens=12, tier_priority=9, arrival_s=6.0))
    events = []
    while sched.has_unfinished():
        events += step(sched)[1]
    assert sched.num_preemptions > 0
    cached = {e.request_id: e.cached_tokens for e in events if e.finish_reason}
    assert cached == {"big": 8, "vip": 0}


# ---------------------------------------------------------------- abort


def test_abort_frees_blocks_when_waiting_mid_prefill_or_decoding():
    sched = make_scheduler(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=8)
    sched.add(seq("dec", range(4), max_tokens=50))
    step(sched)
    sched.add(seq("pre", range(100, 130), max_tokens=50, arrival_s=1.0))
    sched.add(seq("wait", range(200, 204), max_tokens=50, arrival_s=2.0))
    step(sched)  # "pre" is mid-prefill (7 of 30 tokens), "wait" has no slot
    pre = sched._requests["pre"]
    assert 0 < pre.num_computed_tokens < pre.num_prompt_tokens
    assert [s.request_id for s in sched.waiting] == ["wait"]
    assert sched.abort("wait") and sched.abort("pre")
    assert sched.kv.get_block_ids("pre") == [] and pre.status is SequenceStatus.FINISHED
    assert sched.abort("dec")
    assert not sched.abort("dec") and not sched.abort("nope")
    assert sched.kv.num_used_blocks == 0 and not sched.has_unfinished()
    assert sched.stats().num_free_blocks == 16


def test_update_after_abort_ignores_the_aborted_sequence():
    sched = make_scheduler()
    sched.add(seq("a", range(4)))
    out = sched.schedule()
    sched.abort("a")
    assert sched.update_from_output(out, {}) == []
    assert sched.kv.num_used_blocks == 0


# ---------------------------------------------------------------- prefix sharing


def test_second_turn_extending_the_history_hits_the_prefix_cache():
    sched = make_scheduler(num_blocks=64)
    first_prompt = [(7 * i) % 301 + 3 for i in range(100)]
    sched.add(seq("turn1", first_prompt, max_tokens=20))
    answer = run_to_end(sched)["turn1"]
    second_prompt = first_prompt + answer + [11, 12, 13, 14, 15]
    sched.add(seq("turn2", second_prompt, max_tokens=2))
    events = []
    while sched.has_unfinished():
        events += step(sched, None)[1]
    cached = events[-1].cached_tokens
    assert cached >= 0.9 * len(first_prompt)
    assert cached == (len(first_prompt) + len(answer) - 1) // BS * BS  # every full computed block
    assert sched.stats().prefix_hits_tokens == cached


def test_two_conversations_share_prefix_blocks_but_never_continuations():
    sched = make_scheduler(num_blocks=64)
    fake_kv = FakeKV(BS)
    system = list(range(40, 52))  # 3 full blocks
    sched.add(seq("a", system + [1, 2, 3, 4, 5, 6], max_tokens=30))
    step(sched, fake_kv)
    sched.add(seq("b", system + [1, 2, 9, 9, 9, 9], max_tokens=30, arrival_s=1.0))
    step(sched, fake_kv)
    table_a, table_b = sched.kv.get_block_ids("a"), sched.kv.get_block_ids("b")
    assert table_a[:3] == table_b[:3]
    assert set(table_a[3:]).isdisjoint(table_b[3:])
    assert sched._requests["b"].num_cached_tokens == 12
    run_to_end(sched, fake_kv)  # the fake KV check proves neither read the other's continuation
    assert sched.kv.num_used_blocks == 0


# ---------------------------------------------------------------- randomized


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 30), st.integers(1, 12), st.integers(0, 2)),
        st.tuples(st.just("abort"), st.integers(0, 40)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, num_blocks=st.integers(8, 24), budget=st.integers(4, 24))
def test_randomized_add_abort_step_never_leaks_blocks(ops, num_blocks, budget):
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=budget,
                           max_model_len_tokens=96)
    fake_kv = FakeKV(BS)
    prefixes = [list(range(100, 112)), list(range(200, 205)), [], list(range(100, 108))]
    num_added = 0
    for op in ops:
        if op[0] == "add":
            _, prefix_idx, tail_len, max_tokens, tier = op
            prompt = prefixes[prefix_idx] + [num_added % 7 + 3] * tail_len
            sched.add(seq(f"r{num_added}", prompt, max_tokens=max_tokens, tier_priority=tier,
                          arrival_s=float(num_added)))
            num_added += 1
        elif op[0] == "abort":
            sched.abort(f"r{op[1]}")
        else:
            for _ in range(op[1]):
                out, _ = step(sched, fake_kv)
                assert out.num_batched_tokens <= budget
                check_invariants(sched)
        check_invariants(sched)
    run_to_end(sched, fake_kv)
    check_invariants(sched)
    assert sched.kv.num_used_blocks == 0
    assert sched.kv.num_free_blocks == num_blocks


@pytest.mark.parametrize("policy", policy_names())
def test_every_eviction_policy_keeps_kv_correct_and_leak_free(policy):
    sched = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=12, max_model_len_tokens=96,
                           eviction_policy=policy)
    fake_kv = FakeKV(BS)
    rng = random.Random(7)
    prefixes = [list(range(100, 112)), list(range(200, 208))]
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 10))]
        sched.add(seq(f"r{i}", prompt, max_tokens=rng.randrange(1, 12), tier_priority=rng.randrange(3),
                      arrival_s=float(i), tier=f"t{i % 3}", cache_ttl_s=rng.choice([0.0, 60.0])))
        for _ in range(rng.randrange(0, 4)):
            step(sched, fake_kv)
            check_invariants(sched)
        if rng.random() < 0.1:
            sched.abort(f"r{rng.randrange(i + 1)}")
    run_to_end(sched, fake_kv)
    assert sched.kv.num_used_blocks == 0 and sched.kv.num_free_blocks == 12
    assert sched.kv.pool.num_evictions > 0 and sched.kv.prefix_hits_tokens > 0
