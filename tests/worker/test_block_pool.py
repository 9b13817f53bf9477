"""BlockPool: exact block ids, ref counts, free list vs evictable cached blocks, eviction through the policy."""

from __future__ import annotations

import pytest

from worker.kv_cache.block_pool import BlockPool
from worker.kv_cache.eviction import BlockMeta, LRUPolicy


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_pool(num_blocks: int = 4) -> tuple[BlockPool, list[tuple[int, int]]]:
    evicted: list[tuple[int, int]] = []
    pool = BlockPool(num_blocks, "lru", clock=FakeClock(), on_evict=lambda b, h: evicted.append((b, h)))
    return pool, evicted


def cache(pool: BlockPool, block_id: int, block_hash: int) -> None:
    pool.mark_cached(block_id, BlockMeta(block_hash=block_hash))


def test_allocate_takes_free_list_in_order_and_counts():
    pool, _ = make_pool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert (pool.num_used_blocks, pool.num_free_blocks, pool.num_cached_blocks) == (3, 1, 0)
    pool.free([1, 0])
    assert pool.allocate(3) == [3, 1, 0]  # free list is FIFO: 3, then the freed 1, 0 in free order


def test_no_memory_is_a_return_value_and_takes_nothing():
    pool, _ = make_pool(4)
    assert pool.allocate(2) == [0, 1]
    assert not pool.can_allocate(3)
    assert pool.allocate(3) is None
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [2, 3]


def test_cached_blocks_become_evictable_and_are_evicted_in_policy_order():
    pool, evicted = make_pool(4)
    blocks = pool.allocate(3)
    for block_id, block_hash in zip(blocks, (100, 101, 102)):
        cache(pool, block_id, block_hash)
    pool.free(reversed(blocks))  # tail first, as the manager does
    assert (pool.num_used_blocks, pool.num_free_blocks, pool.num_cached_blocks) == (0, 4, 3)
    # free list first (block 3), then LRU victims: the tail 2, then 1
    assert pool.allocate(3) == [3, 2, 1]
    assert evicted == [(2, 102), (1, 101)]
    assert pool.num_evictions == 2
    assert not pool.is_cached(2) and pool.is_cached(0)
    assert pool.num_cached_blocks == 1


def test_touch_shares_a_cached_block_and_pulls_it_from_the_policy():
    pool, evicted = make_pool(2)
    (block,) = pool.allocate(1)
    cache(pool, block, 7)
    pool.free([block])
    assert block in pool.policy
    pool.touch([block])
    pool.touch([block])
    assert pool.ref_count(block) == 2 and block not in pool.policy
    assert pool.meta(block).num_hits == 2
    assert pool.allocate(2) is None  # only block 1 is left
    pool.free([block])
    assert pool.ref_count(block) == 1 and block not in pool.policy
    pool.free([block])
    assert block in pool.policy and evicted == []


def test_touch_rejects_uncached_block_and_double_free_is_an_error():
    pool, _ = make_pool(2)
    (block,) = pool.allocate(1)
    with pytest.raises(ValueError, match="not cached"):
        pool.touch([block])
    pool.free([block])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([block])
    with pytest.raises(ValueError, match="referenced to be cached"):
        cache(pool, block, 1)


def test_unknown_policy_name_lists_valid_ones():
    with pytest.raises(ValueError, match="lru"):
        BlockPool(4, "no-such-policy")
    with pytest.raises(ValueError):
        BlockPool(0)


class _LyingPolicy(LRUPolicy):
    """Reports one more evictable block than it yields (to check the pool's rollback)."""

    def __len__(self) -> int:
        return super().__len__() + 1


def test_allocation_rolls_back_when_policy_yields_no_victim():
    pool = BlockPool(2, _LyingPolicy())
    assert pool.can_allocate(3)
    assert pool.allocate(3) is None
    assert [pool.ref_count(b) for b in range(2)] == [0, 0]
    assert pool.allocate(2) == [0, 1]
