"""The offline reuse oracle of ``bench/cachesim_headroom.py``: never-again blocks go first, then LRU."""

from __future__ import annotations

import pytest

from bench.cachesim_headroom import (
    KeepTimePolicy,
    ReuseOraclePolicy,
    block_uses_s,
    class_age_ceiling,
    idle_bucket,
    release_classes,
    replay_ceiling,
)
from worker.kv_cache.cachesim import TraceRequest, simulate_belady, simulate_policy
from worker.kv_cache.eviction import BlockMeta


def test_reuse_oracle_evicts_blocks_never_used_again_first_then_least_recently_used():
    uses_s = {10: [0.0, 5.0], 11: [0.0], 12: [1.0, 9.0], 13: [2.0]}
    policy = ReuseOraclePolicy(uses_s)
    for block_id, (block_hash, now_s) in enumerate([(10, 0.0), (11, 0.0), (12, 1.0), (13, 2.0)]):
        policy.insert(block_id, BlockMeta(block_hash=block_hash), now_s)
    policy.remove(2)  # block 12 is reused
    assert len(policy) == 3 and 2 not in policy
    assert [policy.pop_victim(3.0) for _ in range(4)] == [1, 3, 0, None]


def test_reuse_oracle_reaches_belady_on_a_small_trace():
    # three conversations of 2 blocks in a 4-block pool: only A comes back; LRU loses it to C, the oracle keeps it
    requests = [TraceRequest(0.0, (1, 2), False), TraceRequest(1.0, (3, 4), False),
                TraceRequest(2.0, (5, 6), False), TraceRequest(3.0, (1, 2, 7), False)]
    oracle = simulate_policy(requests, 4, ReuseOraclePolicy(block_uses_s(requests))).hit_rate
    assert oracle == simulate_belady(requests, 4).hit_rate == 2 / 9
    assert simulate_policy(requests, 4, "lru").hit_rate == 0.0


def test_idle_buckets_are_labelled_by_their_upper_bound():
    assert [idle_bucket(s) for s in (0.0, 60.0, 61.0, 960.0, 961.0)] == ["<=60", "<=60", "<=120", "<=960", ">960"]


def test_class_age_ceiling_is_the_best_keep_time_per_class_under_the_time_averaged_pool():
    # block 1 comes back after 10 s, block 2 after 20 s, block 9 never; span 30 s. Idle intervals: reused gaps
    # [10, 20]; cut by the end [20 (1 after t=10), 10 (2 after t=20), 0 (9)]. One class: keep 10 s → 1 hit for
    # 10 + 10 + 10 + 10 = 40 block-s; keep 20 s → 2 hits for 10 + 20 + 20 + 10 = 60 block-s
    requests = [TraceRequest(0.0, (1,), False), TraceRequest(0.0, (2,), False), TraceRequest(10.0, (1,), False),
                TraceRequest(20.0, (2,), False), TraceRequest(30.0, (9,), False)]
    assert class_age_ceiling(requests, 2, ())["hits"] == pytest.approx(2.0)  # 60 block-s: both
    # 30 block-s: "keep 20 s" half the time beats "keep 10 s" (1 hit for 40 block-s is under the hull of
    # (0, 0)–(60, 2)): 1 hit
    one = class_age_ceiling(requests, 1, ())
    assert one["hits"] == pytest.approx(1.0)
    assert one["reuse_refs"] == 2 and one["num_classes"] == 1 and one["fraction_of_reuses"] == pytest.approx(0.5)
    # by use count the first releases (use 1: gaps [10, 20], block 9 cut at 0) and the later ones (use 2: cut
    # at 20 and 10, never reused) differ: keep use-1 blocks 20 s (10 + 20 + 0 block-s), drop use-2 ones at once
    assert class_age_ceiling(requests, 1, ("uses",))["hits"] == pytest.approx(2.0)


def test_keep_time_policy_evicts_the_block_whose_keep_time_ends_first_tail_first_on_a_tie():
    class_at = {(10, 0.0): ("a",), (11, 0.0): ("a",), (12, 1.0): ("b",)}
    policy = KeepTimePolicy(class_at, {("a",): 5.0, ("b",): 2.0})
    policy.insert(0, BlockMeta(block_hash=10, block_idx=0), 0.0)  # ends at 5
    policy.insert(1, BlockMeta(block_hash=11, block_idx=1), 0.0)  # ends at 5, the chain's tail
    policy.insert(2, BlockMeta(block_hash=12, block_idx=0), 1.0)  # ends at 3
    policy.insert(3, BlockMeta(block_hash=99, block_idx=0), 2.0)  # unknown class: kept 0 s, ends at 2
    policy.remove(2)
    assert len(policy) == 3 and 2 not in policy and 3 in policy
    assert [policy.pop_victim(4.0) for _ in range(4)] == [3, 1, 0, None]


def test_the_ceiling_played_in_a_real_pool_gets_its_hits_when_the_pool_holds_the_kept_blocks():
    # block 1 back after 10 s, block 2 after 20 s; a pool of 2 holds both for their whole gaps: 2 hits of 5 refs
    requests = [TraceRequest(0.0, (1,), False), TraceRequest(0.0, (2,), False), TraceRequest(10.0, (1,), False),
                TraceRequest(20.0, (2,), False), TraceRequest(30.0, (9,), False)]
    class_at = release_classes(requests, ())[0]
    assert class_at[(1, 0.0)] == () and class_at[(1, 10.0)] == () and len(class_at) == 5
    ceiling = class_age_ceiling(requests, 2, ())
    assert ceiling["keep_s_by_class"] == {(): 20.0} and ceiling["class_at"] == class_at
    assert replay_ceiling(requests, 2, ceiling) == pytest.approx(2 / 5)
