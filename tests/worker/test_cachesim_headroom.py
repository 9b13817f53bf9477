"""The offline reuse oracle of ``bench/cachesim_headroom.py``: never-again blocks go first, then LRU."""

from __future__ import annotations

from bench.cachesim_headroom import ReuseOraclePolicy, block_uses_s, idle_bucket
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
