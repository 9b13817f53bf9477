"""Eviction policies: exact victim order on small hand-built histories, TTL expiry, tier order, LFU aging, the
return-aware policy's learning, pressure switching, and the name registry."""

from __future__ import annotations

import math
import random

import pytest

from shared.config import KVConfig
from worker.kv_cache.eviction import (
    AdaptivePolicy,
    BlockMeta,
    ChainPolicy,
    EvictionPolicy,
    LFUPolicy,
    RetentionConfig,
    RetentionSettings,
    SluicePolicy,
    block_expiry_s,
    caches_new_request,
    make_policy,
    policy_names,
    retention_for_pressure,
)
from worker.kv_cache.cachesim import simulate_policy, trace_stats
from worker.kv_cache.manager import KVCacheManager
from worker.kv_cache.synthetic_trace import SHAPES, generate
from worker.sequence import Sequence, SequenceStatus


def drain(policy: EvictionPolicy, now_s: float = 0.0) -> list[int]:
    """Pop every victim in order."""
    victims = []
    while (block_id := policy.pop_victim(now_s)) is not None:
        victims.append(block_id)
    return victims


def meta(block_id: int, **fields) -> BlockMeta:
    return BlockMeta(block_hash=1000 + block_id, **fields)


def test_registry_lists_every_policy_and_rejects_unknown_names() -> None:
    assert policy_names() == ["adaptive", "chain", "lfu", "lru", "sluice", "tier", "ttl"]
    with pytest.raises(ValueError,
                       match=r"unknown eviction policy 'mru'; valid: adaptive, chain, lfu, lru, sluice, tier, ttl"):
        make_policy("mru")
    for name in policy_names():
        policy = make_policy(name)
        assert policy.name == name and len(policy) == 0 and policy.pop_victim(0.0) is None


@pytest.mark.parametrize("name", ["lru", "lfu", "ttl", "tier", "sluice", "chain", "adaptive"])
def test_every_policy_tracks_membership_and_removal(name: str) -> None:
    policy = make_policy(name)
    for block_id in (1, 2, 3):
        policy.insert(block_id, meta(block_id), 0.0)
    policy.remove(2)
    assert len(policy) == 2 and 2 not in policy and 1 in policy
    with pytest.raises(KeyError):
        policy.remove(2)
    assert sorted(drain(policy)) == [1, 3]
    assert len(policy) == 0


def test_lru_victim_order_follows_release_and_reuse() -> None:
    policy = make_policy("lru")
    for block_id in (3, 2, 1):  # one chain released tail first
        policy.insert(block_id, meta(block_id), 0.0)
    policy.insert(7, meta(7), 1.0)
    policy.remove(2)  # reused by a request ...
    policy.insert(2, meta(2), 2.0)  # ... and released again: now most recent
    assert drain(policy) == [3, 1, 7, 2]


def test_lfu_evicts_least_frequent_first_ties_oldest_first() -> None:
    policy = LFUPolicy()
    policy.insert(1, meta(1, num_hits=0), 0.0)  # key 1
    policy.insert(2, meta(2, num_hits=2), 0.0)  # key 3
    policy.insert(3, meta(3, num_hits=0), 0.0)  # key 1, inserted after block 1
    policy.insert(4, meta(4, num_hits=1), 0.0)  # key 2
    assert drain(policy) == [1, 3, 4, 2]


def test_lfu_aging_lets_a_new_block_outrank_a_stale_popular_one() -> None:
    """LFU-DA: the inflation value L rises to each victim's key, so new blocks enter above old counts."""
    policy = LFUPolicy()
    policy.insert(1, meta(1, num_hits=4), 0.0)  # key 5, popular long ago
    for block_id in (10, 11, 12, 13):
        policy.insert(block_id, meta(block_id, num_hits=2), 0.0)  # key 3
    assert [policy.pop_victim(0.0) for _ in range(4)] == [10, 11, 12, 13]
    assert policy.inflation == 3.0
    policy.insert(20, meta(20, num_hits=2), 0.0)  # key 3 + 3 = 6 > 5
    policy.insert(21, meta(21, num_hits=0), 0.0)  # key 4
    assert drain(policy) == [21, 1, 20]
    assert policy.inflation == 6.0


def test_lfu_without_aging_would_keep_the_stale_block() -> None:
    """Control for the aging test: with equal inflation, the popular block outlives a one-hit newcomer."""
    policy = LFUPolicy()
    policy.insert(1, meta(1, num_hits=4), 0.0)
    policy.insert(2, meta(2, num_hits=0), 0.0)
    assert drain(policy) == [2, 1]


def test_ttl_evicts_expired_blocks_first_then_lru() -> None:
    policy = make_policy("ttl")
    policy.insert(1, meta(1), 0.0)  # never expires, oldest
    policy.insert(2, meta(2, expires_at_s=50.0), 1.0)
    policy.insert(3, meta(3, expires_at_s=20.0), 2.0)
    policy.insert(4, meta(4, expires_at_s=500.0), 3.0)
    assert policy.pop_victim(10.0) == 1  # nothing expired yet: LRU
    assert policy.pop_victim(60.0) == 3  # both 2 and 3 expired: earliest deadline first
    assert policy.pop_victim(60.0) == 2
    assert policy.pop_victim(60.0) == 4  # not expired, LRU


def test_ttl_ignores_the_deadline_of_a_reused_block() -> None:
    policy = make_policy("ttl")
    policy.insert(1, meta(1, expires_at_s=5.0), 0.0)
    policy.insert(2, meta(2), 1.0)
    policy.remove(1)  # reused: the old deadline no longer applies
    policy.insert(1, meta(1, expires_at_s=100.0), 2.0)
    assert policy.pop_victim(10.0) == 2
    assert policy.pop_victim(200.0) == 1


def test_tier_evicts_lower_tiers_first_then_lru_within_a_tier() -> None:
    policy = make_policy("tier")
    policy.insert(1, meta(1, tier="vip", tier_priority=3), 0.0)
    policy.insert(2, meta(2, tier="free", tier_priority=1), 1.0)
    policy.insert(3, meta(3, tier="standard", tier_priority=2), 2.0)
    policy.insert(4, meta(4, tier="free", tier_priority=1), 3.0)
    policy.insert(5, meta(5, tier="batch", tier_priority=0), 4.0)
    policy.insert(6, meta(6, tier="vip", tier_priority=3), 5.0)
    policy.remove(2)
    policy.insert(2, meta(2, tier="free", tier_priority=1), 6.0)  # reused: newest of its tier
    assert drain(policy) == [5, 4, 2, 3, 1, 6]


def test_sluice_evicts_partial_tail_blocks_first_and_chains_tail_first() -> None:
    policy = SluicePolicy()
    request = dict(num_request_blocks=3, num_request_cached_blocks=0)
    # one request's chain released tail first at t=0: block 12 is the partial last block
    policy.insert(12, meta(12, block_idx=2, is_partial=True, **request), 0.0)
    policy.insert(11, meta(11, block_idx=1, **request), 0.0)
    policy.insert(10, meta(10, block_idx=0, **request), 0.0)
    assert drain(policy) == [12, 11, 10]


def test_sluice_keeps_a_reused_block_over_a_newer_one_time_block() -> None:
    policy = SluicePolicy(horizon_s=300.0, ghost_factor=0.0)  # evicted hashes leave the ghost list at once
    for block_id in range(100, 110):  # ten one-time blocks die unused: observed non-reuses of class "new"
        policy.insert(block_id, meta(block_id), 0.0)
        assert policy.pop_victim(0.0) == block_id
    policy.insert(1, meta(1), 0.0)
    policy.remove(1)  # a prefix hit: one reuse of class "new"
    policy.insert(1, meta(1, num_hits=1), 0.0)  # used twice now
    policy.insert(2, meta(2), 10.0)  # 10 s newer, used once
    assert policy.reuse_probability(("new", False, 1)) == pytest.approx((1 + 5) / (11 + 20))
    assert policy.reuse_probability(("used", 2)) == 0.25  # the prior: nothing observed yet
    # keys: block 1 = 0 + 300 ln 0.25 = -415.9; block 2 = 10 + 300 ln 0.194 = -482.9 -> LRU would evict 1 first
    assert drain(policy, 10.0) == [2, 1]


def test_sluice_learns_class_reuse_and_orders_by_log_probability() -> None:
    policy = SluicePolicy(horizon_s=100.0, prior_reuse=0.25, prior_weight=20.0)
    returning_short = dict(num_request_blocks=10, num_request_cached_blocks=8)  # returning, 2 new blocks
    fresh_long = dict(num_request_blocks=200, num_request_cached_blocks=0)  # fresh, 200 new blocks
    # Teach it: blocks of short returning turns come back (prefix hits), long fresh prompts' blocks do not
    # (evicted, and their ghosts age out).
    for i in range(60):
        policy.insert(i, meta(i, **returning_short), 0.0)
        policy.remove(i)
    policy.ghost_factor = 0.0  # every evicted hash leaves the ghost list at once: an observed non-reuse
    for i in range(100, 160):
        policy.insert(i, meta(i, **fresh_long), 0.0)
        assert policy.pop_victim(0.0) == i
    p_short = policy.reuse_probability(("new", True, 2))
    p_long = policy.reuse_probability(("new", False, 256))
    assert p_short == pytest.approx((60 + 5) / (60 + 20))
    assert p_long == pytest.approx(5 / (60 + 20))
    # A fresh long-prompt block released 100 s *after* a returning turn's block is still evicted first:
    # key = last_use + H ln p  ->  0 + 100 ln 0.8125 = -20.8  vs  100 + 100 ln 0.0625 = -177.3
    policy.insert(500, meta(500, **returning_short), 0.0)
    policy.insert(501, meta(501, **fresh_long), 100.0)
    assert drain(policy, 100.0) == [501, 500]
    assert 100.0 + 100.0 * math.log(p_long) < 100.0 * math.log(p_short)


def test_sluice_ghost_hit_counts_as_a_return_and_as_a_second_use() -> None:
    policy = SluicePolicy(ghost_factor=2.0)
    policy.insert(1, meta(1), 0.0)
    policy.insert(2, meta(2), 1.0)
    assert policy.pop_victim(1.0) == 1  # block_hash 1001 goes to the ghost list
    policy.insert(7, BlockMeta(block_hash=1001), 5.0)  # the same content is computed again in a new block
    assert policy.num_reuses == {("new", False, 1): 1}
    assert policy.num_outcomes == {("new", False, 1): 1}
    # the recomputed block is now known as used twice, so it outranks block 2 (used once) at equal probability
    assert policy._uses[7] == 2


def release(policy: EvictionPolicy, block_ids: list[int], now_s: float, num_cached: int = 0) -> None:
    """Release one request's block table as the pool does: tail first, one clock reading (block_idx = position)."""
    for block_idx in reversed(range(len(block_ids))):
        block_id = block_ids[block_idx]
        policy.insert(block_id, meta(block_id, block_idx=block_idx, num_request_blocks=len(block_ids),
                                     num_request_cached_blocks=num_cached), now_s)


def teach(policy: ChainPolicy, reuse_fraction_by_class: dict[tuple, float], num_blocks: float = 1e6) -> None:
    """Give the policy settled history: ``num_blocks`` blocks of each class, reused at the given fractions."""
    for block_class, fraction in reuse_fraction_by_class.items():
        policy.num_settled_blocks[block_class] = num_blocks
        policy.num_reused_blocks[block_class] = fraction * num_blocks


def test_chain_classifies_fresh_returning_and_shared_prefix_blocks() -> None:
    assert ChainPolicy.classify(turn=0, num_new_blocks=3, num_uses=0) == (0, 4)  # fresh, 3 blocks
    assert ChainPolicy.classify(turn=1, num_new_blocks=1, num_uses=1) == (1, 1)  # came back with one new block
    assert ChainPolicy.classify(turn=1, num_new_blocks=1, num_uses=0) == (1, 1)  # ... the new block itself
    assert ChainPolicy.classify(turn=1, num_new_blocks=1, num_uses=3) == ("shared", 3)  # an earlier turn's block
    assert ChainPolicy.classify(turn=2, num_new_blocks=40, num_uses=2) == (2, 64)
    assert ChainPolicy.classify(turn=7, num_new_blocks=300, num_uses=12) == ("shared", 8)


def test_chain_without_history_is_lru_with_chains_cut_tail_first() -> None:
    policy = ChainPolicy()
    release(policy, [1, 2, 3], 0.0)  # fresh chain
    release(policy, [7], 1.0)
    policy.remove(1)  # a request reuses the prefix [1] ...
    release(policy, [1, 4], 2.0, num_cached=1)  # ... and adds block 4
    assert len(policy) == 5 and 1 in policy
    assert drain(policy, 2.0) == [3, 2, 7, 4, 1]  # oldest release first; within a chain the tail first


def test_chain_evicts_by_learned_reuse_over_recency() -> None:
    """Fresh 2-block chains are rarely reused (p 0.1), one-block returns often (p 0.6).

    t=0 fresh [1 2]; t=10 a request reuses 1 and adds 3 (class (1, 1)); t=20 fresh [4 5].
    Rates p / (1 + idle / 100 s) at t=20: block 2: 0.1 / 1.2; block 3: 0.6 / 1.1; blocks 4, 5: 0.1 / 1.0.
    LRU would evict 2 3 1 5 4; the policy keeps the returning chain [1 3] over the newer fresh one.
    """
    policy = ChainPolicy()
    teach(policy, {(0, 2): 0.1, (1, 1): 0.6})
    release(policy, [1, 2], 0.0)
    policy.remove(1)
    release(policy, [1, 3], 10.0, num_cached=1)
    release(policy, [4, 5], 20.0)
    assert policy.return_rate((0, 2), 20.0) == pytest.approx(0.1 / 1.2, rel=1e-4)
    assert drain(policy, 20.0) == [2, 5, 4, 3, 1]


def test_chain_parks_a_prefix_until_its_last_child_is_gone() -> None:
    """Same history, but returns with one new block are the rare class now (p 0.1) and fresh chains common (0.6).

    Block 1 (released at t=10 with the return, class (1, 1)) has the lowest rate after block 3, but block 2 of the
    first chain still hangs below it: 1 is parked, 2 goes, then 1. Without leaves first: 3 1 2 5 4 (2 orphaned).
    """
    policy = ChainPolicy()
    teach(policy, {(0, 2): 0.6, (1, 1): 0.1})
    release(policy, [1, 2], 0.0)
    policy.remove(1)
    release(policy, [1, 3], 10.0, num_cached=1)
    release(policy, [4, 5], 20.0)
    assert [policy.pop_victim(20.0) for _ in range(2)] == [3, 2]
    assert len(policy) == 3 and 1 in policy
    assert drain(policy, 20.0) == [1, 5, 4]


def test_chain_parked_prefix_reused_again_leaves_the_evictable_set() -> None:
    policy = ChainPolicy()
    teach(policy, {(0, 2): 0.6, (1, 1): 0.1})
    release(policy, [1, 2], 0.0)
    policy.remove(1)
    release(policy, [1, 3], 10.0, num_cached=1)
    assert policy.pop_victim(20.0) == 3
    assert policy.pop_victim(20.0) == 2  # 1 was parked behind its child 2 and is next in line ...
    release(policy, [8, 9], 21.0)
    policy.remove(1)  # ... when a request reuses it: it leaves the evictable set
    assert 1 not in policy and len(policy) == 2
    assert drain(policy, 30.0) == [9, 8]


def test_chain_evicts_blocks_idle_past_the_window_first_whatever_their_class() -> None:
    """[1 2] of a class reused 90% of the time, idle 650 s > window_s, goes before a fresh block of a 5% class."""
    policy = ChainPolicy(window_s=600.0)
    teach(policy, {(0, 2): 0.9, (0, 1): 0.05})
    release(policy, [1, 2], 0.0)
    release(policy, [3], 650.0)
    assert policy.return_rate((0, 2), 650.0) == 0.0 and policy.return_rate((0, 2), 599.0) > 0.1
    assert drain(policy, 650.0) == [2, 1, 3]  # without the cut: 0.9 / 7.5 = 0.12 > 0.05, so 3 would go first


def test_chain_settles_reuse_fractions_after_the_window() -> None:
    """Reuse counts only once a chain is ``window_s`` old: [1 2 3 4] half reused at t=100, [5] never."""
    policy = ChainPolicy(window_s=600.0, prior_reuse=0.3, prior_weight_blocks=20.0)
    release(policy, [1, 2, 3, 4], 0.0)  # class (0, 4)
    release(policy, [5], 0.0)  # class (0, 1)
    for block_id in (1, 2):
        policy.remove(block_id)
    release(policy, [1, 2, 6], 100.0, num_cached=2)  # reuses the first 2 of 4 blocks
    assert policy.num_settled_blocks == {}  # nothing is 600 s old yet: every class at the prior
    assert policy.reuse_fraction((0, 4)) == policy.reuse_fraction((0, 1)) == pytest.approx(0.3)
    policy.pop_victim(600.0)
    assert policy.num_settled_blocks == {(0, 4): 4, (0, 1): 1}
    assert policy.num_reused_blocks == {(0, 4): 2, (0, 1): 0}
    pooled = (2 + 0.3 * 20) / (5 + 20)
    assert policy.reuse_fraction((0, 4)) == pytest.approx((2 + pooled * 20) / (4 + 20))
    assert policy.reuse_fraction((0, 1)) == pytest.approx(pooled * 20 / (1 + 20))


def test_chain_recomputed_after_eviction_counts_as_returning() -> None:
    policy = ChainPolicy(ghost_factor=2.0)
    release(policy, [1, 2], 0.0)
    assert drain(policy, 5.0) == [2, 1]  # their hashes go to the ghost list
    # the same content computed again in blocks 7 and 8, plus one new block 9: a return after eviction
    for block_id, block_hash, block_idx in ((9, 3000, 2), (8, 1002, 1), (7, 1001, 0)):
        policy.insert(block_id, BlockMeta(block_hash=block_hash, block_idx=block_idx), 30.0)
    assert policy._blocks[9].block_class == (1, 1)
    assert policy._blocks[8].num_uses == 2


def test_chain_drives_the_real_kv_cache_manager_through_overlapping_conversations_and_policy_switches() -> None:
    """Random overlapping chats on a 48-block manager (4-token blocks) with the chain policy, pressure switching to
    ``tier`` and back: block accounting holds at every step, prefixes hit, and every evictable block can be evicted
    (the pool never comes up short while the policy reports blocks)."""
    clock_s = [0.0]
    kv = KVCacheManager(48, 4, clock=lambda: clock_s[0], config=KVConfig(), eviction_policy="chain")
    rng = random.Random(7)
    histories: list[list[int]] = [[1000 * c + t for t in range(rng.randint(3, 12))] for c in range(12)]
    running: list[Sequence] = []
    num_hit_tokens = 0
    for step in range(400):
        clock_s[0] += rng.choice((1.0, 5.0, 60.0, 700.0))
        if step % 97 == 50:
            kv.set_pressure("critical")  # switches to the tier policy, blocks handed over in chain order
        elif step % 97 == 60:
            kv.set_pressure("normal")  # and back
        if running and (len(running) > 3 or rng.random() < 0.5):
            seq = running.pop(rng.randrange(len(running)))
            seq.num_computed_tokens = seq.num_tokens
            kv.cache_blocks(seq)
            kv.free(seq)
        conversation = rng.randrange(len(histories))
        history = histories[conversation]
        history.extend(1000 * conversation + len(history) + t for t in range(rng.randint(1, 6)))
        seq = Sequence(f"r{step}", list(history))
        num_hit = kv.admit(seq, max_new_tokens=10**9)
        if num_hit is not None:
            num_hit_tokens += num_hit
            seq.num_computed_tokens = seq.num_cached_tokens = num_hit
            seq.status = SequenceStatus.RUNNING
            running.append(seq)
        assert kv.num_used_blocks + kv.num_free_blocks == kv.num_total_blocks
        assert len(kv.pool.policy) == kv.num_cached_blocks
    for seq in running:
        kv.free(seq)
    assert num_hit_tokens > 0 and kv.pool.num_evictions > 100
    assert kv.num_used_blocks == 0
    assert len(kv.pool.allocate(48)) == 48  # every cached block could be evicted


def test_pressure_levels_return_their_settings_and_reject_unknown_levels() -> None:
    config = RetentionConfig()
    assert retention_for_pressure("normal", config) == RetentionSettings()
    elevated = retention_for_pressure("elevated", config)
    critical = retention_for_pressure("critical", config)
    assert (elevated.ttl_scale, elevated.max_ttl_s, elevated.min_retained_tier_priority) == (0.5, 300.0, 1)
    assert critical.eviction_policy == "tier" and critical.min_cached_tier_priority == 1
    with pytest.raises(ValueError, match="unknown pressure level 'panic'; valid: normal, elevated, critical"):
        retention_for_pressure("panic", config)


def test_pressure_switching_shortens_ttls_and_retains_only_top_tiers() -> None:
    config = RetentionConfig()
    normal, elevated, critical = (retention_for_pressure(level, config) for level in
                                  ("normal", "elevated", "critical"))
    vip, standard, free, batch = 3, 2, 1, 0
    now_s = 1000.0
    assert block_expiry_s(normal, vip, 1200.0, now_s) == 2200.0
    assert block_expiry_s(normal, batch, math.inf, now_s) == math.inf
    assert block_expiry_s(elevated, vip, 1200.0, now_s) == now_s + 300.0  # 600 s scaled, capped at 300 s
    assert block_expiry_s(elevated, standard, 200.0, now_s) == now_s + 100.0
    assert block_expiry_s(elevated, batch, 1200.0, now_s) == now_s  # below the retained tiers: expires now
    assert block_expiry_s(critical, vip, math.inf, now_s) == now_s + 60.0
    assert block_expiry_s(critical, free, 1200.0, now_s) == now_s
    assert [caches_new_request(normal, p) for p in (vip, standard, free, batch)] == [True] * 4
    assert [caches_new_request(critical, p) for p in (vip, standard, free, batch)] == [True, True, True, False]
    zero = RetentionSettings(ttl_scale=0.0)
    assert block_expiry_s(zero, vip, math.inf, now_s) == now_s  # no nan from inf × 0


def test_expired_blocks_under_pressure_go_first_in_the_ttl_policy() -> None:
    """Pressure settings feed the TTL policy: a batch block released under critical pressure is the first victim."""
    critical = retention_for_pressure("critical")
    policy = make_policy("ttl")
    policy.insert(1, meta(1, tier_priority=3, expires_at_s=block_expiry_s(critical, 3, 600.0, 0.0)), 0.0)
    policy.insert(2, meta(2, tier_priority=0, expires_at_s=block_expiry_s(critical, 0, 600.0, 1.0)), 1.0)
    assert drain(policy, 2.0) == [2, 1]


@pytest.mark.parametrize("name", ["lru", "lfu", "ttl", "tier", "sluice", "chain"])
def test_discard_drops_a_block_evicted_on_another_policys_choice(name: str) -> None:
    policy = make_policy(name)
    for block_id in (3, 2, 1):  # one chain, tail first
        policy.insert(block_id, meta(block_id, block_idx=block_id - 1), 0.0)
    policy.discard(2)
    assert len(policy) == 2 and 2 not in policy
    with pytest.raises(KeyError):
        policy.discard(2)
    assert sorted(drain(policy, 1.0)) == [1, 3]


def release_chain(policy: EvictionPolicy, block_ids: list[int], now_s: float, first_hash: int = 0,
                  **fields) -> None:
    """Release one request's blocks tail first, as the pool does; block ``i`` of the chain hashes to first_hash + i."""
    for block_idx in reversed(range(len(block_ids))):
        policy.insert(block_ids[block_idx], BlockMeta(block_hash=first_hash + block_idx, block_idx=block_idx,
                                                      **fields), now_s)


def test_adaptive_without_evidence_evicts_like_lru() -> None:
    adaptive, lru = AdaptivePolicy(), make_policy("lru")
    for policy in (adaptive, lru):
        release_chain(policy, [1, 2, 3], 0.0, first_hash=100)
        release_chain(policy, [4, 5], 1.0, first_hash=200)
        policy.remove(2)
        policy.insert(2, BlockMeta(block_hash=101, block_idx=1), 2.0)
    assert adaptive.leader_name == "lru"
    assert drain(adaptive, 3.0) == drain(lru, 3.0) == [3, 1, 5, 4, 2]


def test_adaptive_shadows_replay_released_chains_with_leading_run_hits() -> None:
    """Each shadow serves the released chain as the simulator does: a hit is the leading run of resident blocks,
    and a resident block after the first miss is not a hit."""
    adaptive = AdaptivePolicy()
    release_chain(adaptive, [1, 2, 3], 0.0, first_hash=100)  # hashes 100, 101, 102
    assert {shadow.num_hit_blocks for shadow in adaptive.shadows} == {0}
    adaptive.remove(1)
    adaptive.remove(2)
    for block_id, block_hash, block_idx in ((9, 201, 3), (8, 200, 2), (2, 101, 1), (1, 100, 0)):
        adaptive.insert(block_id, BlockMeta(block_hash=block_hash, block_idx=block_idx), 1.0)
    assert {shadow.num_hit_blocks for shadow in adaptive.shadows} == {2}
    for block_id, block_hash, block_idx in ((12, 102, 2), (11, 300, 1), (10, 100, 0)):  # 100 resident, then a miss
        adaptive.insert(block_id, BlockMeta(block_hash=block_hash, block_idx=block_idx), 2.0)
    assert {shadow.num_hit_blocks for shadow in adaptive.shadows} == {3}
    assert {len(shadow) for shadow in adaptive.shadows} == {6}  # 100, 101, 102, 200, 201, 300


def test_adaptive_fills_a_chain_gap_from_the_last_release_of_its_parent() -> None:
    """A cached block after the first miss is recomputed and not released again; the shadows still see it."""
    adaptive = AdaptivePolicy()
    adaptive.insert(3, BlockMeta(block_hash=102, block_idx=2), 0.0)
    adaptive.insert(2, BlockMeta(block_hash=101, block_idx=1), 0.0)
    adaptive.insert(1, BlockMeta(block_hash=100, block_idx=0, expires_at_s=0.5), 0.0)
    assert adaptive.pop_victim(1.0) == 1  # the head expired: 101 and 102 stay cached without it
    # the next turn (100 101 102 103) misses at its head: 100 and 103 are cached anew and released; 101 and 102
    # are recomputed into private blocks (their hashes are taken), so the pool releases only block_idx 3 and 0
    adaptive.insert(13, BlockMeta(block_hash=103, block_idx=3), 2.0)
    adaptive.insert(10, BlockMeta(block_hash=100, block_idx=0), 2.0)
    assert {shadow.num_hit_blocks for shadow in adaptive.shadows} == {3}  # 100, 101, 102: the gap was filled


def test_adaptive_follows_the_expert_whose_shadow_hits_most() -> None:
    """Shared system prompts under a stream of one-shot queries at 5% of the distinct blocks: the return-aware
    ranking keeps the prompts (its shadow hits far more than LRU's), so the adaptive policy ends up following it,
    and its own hit rate is within a point of that shadow's."""
    requests = generate(SHAPES["system_prompts"])
    capacity_blocks = trace_stats(requests)["num_distinct_blocks"] // 20
    adaptive = AdaptivePolicy()
    result = simulate_policy(requests, capacity_blocks, adaptive, {})
    shadow_hit_rate = {shadow.policy.name: shadow.num_hit_blocks / result.num_block_refs
                       for shadow in adaptive.shadows}
    assert shadow_hit_rate["sluice"] > shadow_hit_rate["lru"] + 0.05
    assert adaptive.leader_name == "sluice"
    assert result.hit_rate > shadow_hit_rate["sluice"] - 0.01


def test_adaptive_evicts_expired_blocks_first_whatever_the_leader() -> None:
    adaptive = AdaptivePolicy()
    release_chain(adaptive, [1, 2], 0.0, first_hash=100, expires_at_s=math.inf)
    release_chain(adaptive, [3, 4], 1.0, first_hash=200, expires_at_s=5.0)
    assert drain(adaptive, 4.0)[:2] == [2, 1]  # nothing expired yet: LRU order
    release_chain(adaptive, [1, 2], 6.0, first_hash=100, expires_at_s=math.inf)
    release_chain(adaptive, [5, 6], 7.0, first_hash=300, expires_at_s=7.5)
    assert drain(adaptive, 8.0) == [6, 5, 2, 1]  # the expired chain first, then LRU


@pytest.mark.parametrize("level, first_victim_tier", [("normal", "vip"), ("elevated", "batch")])
def test_pressure_makes_the_adaptive_policy_evict_lower_tiers_and_expired_blocks_first(
        level: str, first_victim_tier: str) -> None:
    """Through the real KV manager: a vip chat released first and a batch chat released after it. At normal
    pressure the older (vip) blocks go first (LRU order); at elevated pressure the batch tier is below the retained
    tiers, so its blocks expire on release and the adaptive policy evicts them first though they are newer."""
    clock_s = [0.0]
    kv = KVCacheManager(8, 4, clock=lambda: clock_s[0], config=KVConfig(), eviction_policy="adaptive")
    kv.set_pressure(level)
    tables = {}
    for name, priority, tokens in (("vip", 3, list(range(100, 112))), ("batch", 0, list(range(200, 212)))):
        clock_s[0] += 1.0
        seq = Sequence(name, tokens, tier=name, tier_priority=priority)
        assert kv.admit(seq, max_new_tokens=10**9) == 0
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_blocks(seq)
        tables[name] = kv.get_block_ids(name)
        kv.free(seq)
    assert isinstance(kv.pool.policy, AdaptivePolicy) and len(kv.pool.policy) == 6
    clock_s[0] += 1.0
    kv.pool.allocate(4)  # 2 free blocks, then 2 evictions
    evicted = {name: [block_id for block_id in table if not kv.pool.is_cached(block_id)]
               for name, table in tables.items()}
    assert len(evicted[first_victim_tier]) == 2 and sum(map(len, evicted.values())) == 2


@pytest.mark.parametrize("level, first_victim", [("normal", "long"), ("elevated", "short")])
def test_pressure_shortens_ttls_so_the_adaptive_policy_evicts_the_shortened_chat_first(
        level: str, first_victim: str) -> None:
    """Through the real KV manager, one tier: a chat without a TTL released first and a chat asking for 4 s released
    a second later. Three seconds on, at normal pressure nothing has expired and the older chat goes first (LRU
    order); at elevated pressure (TTLs × 0.5) the second chat's 2 s are over and it goes first though newer."""
    clock_s = [0.0]
    kv = KVCacheManager(8, 4, clock=lambda: clock_s[0], config=KVConfig(), eviction_policy="adaptive")
    kv.set_pressure(level)
    tables = {}
    for name, ttl_s, tokens in (("long", 0.0, list(range(100, 112))), ("short", 4.0, list(range(200, 212)))):
        clock_s[0] += 1.0
        seq = Sequence(name, tokens, tier="vip", tier_priority=3, cache_ttl_s=ttl_s)
        assert kv.admit(seq, max_new_tokens=10**9) == 0
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_blocks(seq)
        tables[name] = kv.get_block_ids(name)
        kv.free(seq)
    clock_s[0] += 3.0
    kv.pool.allocate(4)  # 2 free blocks, then 2 evictions
    evicted = {name: [block_id for block_id in table if not kv.pool.is_cached(block_id)]
               for name, table in tables.items()}
    assert len(evicted[first_victim]) == 2 and sum(map(len, evicted.values())) == 2
