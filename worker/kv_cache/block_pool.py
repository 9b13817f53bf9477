"""The pool of fixed-size KV blocks: ref counts, a free list, and the evictable cached blocks (mechanism only).

Every block is in exactly one of three states::

    referenced  ref_count > 0                      (a running sequence's block table holds it)
    free        ref_count == 0, no hash            (in the free list, FIFO)
    evictable   ref_count == 0, hashed (cached)    (held by the EvictionPolicy; reusable by a prefix hit)

``num_free_blocks`` counts free + evictable: both can be handed out by :meth:`BlockPool.allocate`, which takes the
free list first and then evicts the policy's victim (vLLM v1 ``BlockPool.get_new_blocks``). Which cached block
goes first is the policy's business, not the pool's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from worker.kv_cache.eviction import BlockMeta, EvictionPolicy, make_policy

EvictCallback = Callable[[int, int], None]
"""Called as ``on_evict(block_id, block_hash)`` when a cached block is evicted (the prefix cache drops it). During
the call the block still has its :meth:`BlockPool.meta` and its K/V are still in the pool (offload reads them)."""


class BlockPool:
    """Hand out and take back KV block ids ``0 .. num_blocks - 1``.

    Args:
        num_blocks: blocks in the pool (the KV tensor's ``num_blocks`` dimension).
        eviction_policy: an :class:`EvictionPolicy` or its config name (``"lru"``, ...).
        clock: seconds, monotonic; the policy's notion of now.
        on_evict: told about every evicted cached block, so the prefix cache forgets its hash.

    Raises:
        ValueError: ``num_blocks < 1`` or an unknown policy name.
    """

    def __init__(self, num_blocks: int, eviction_policy: EvictionPolicy | str = "lru",
                 clock: Callable[[], float] = time.monotonic, on_evict: EvictCallback | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.policy = make_policy(eviction_policy) if isinstance(eviction_policy, str) else eviction_policy
        self.clock = clock
        self.on_evict = on_evict
        self._ref_counts = [0] * num_blocks
        self._metas: list[BlockMeta | None] = [None] * num_blocks  # set while the block is cached (hashed)
        self._free: deque[int] = deque(range(num_blocks))
        self.num_evictions = 0

    # ------------------------------------------------------------------ counters

    @property
    def num_free_blocks(self) -> int:
        """Blocks :meth:`allocate` can hand out now: free list + evictable cached blocks."""
        return len(self._free) + len(self.policy)

    @property
    def num_cached_blocks(self) -> int:
        """Evictable cached blocks (ref count 0, hashed)."""
        return len(self.policy)

    @property
    def num_used_blocks(self) -> int:
        """Referenced blocks (ref count > 0)."""
        return self.num_blocks - self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def meta(self, block_id: int) -> BlockMeta | None:
        """Return the cache metadata of a hashed block, None for an unhashed one."""
        return self._metas[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether the block carries a hash (referenced or evictable)."""
        return self._metas[block_id] is not None

    # ------------------------------------------------------------------ allocate / free

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` blocks (ref count 1 each, no hash): free list first, then evicted victims.

        Returns:
            The block ids in allocation order, or None when the pool cannot supply them (nothing is taken).
        """
        if not self.can_allocate(num_blocks):
            return None
        now_s = self.clock()
        block_ids: list[int] = []
        for _ in range(num_blocks):
            block_id = self._free.popleft() if self._free else self._evict(now_s)
            if block_id is None:  # a policy that reported more blocks than it yields
                self._return_to_free(block_ids)
                return None
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each cached block (a prefix hit); evictable ones leave the policy."""
        now_s = self.clock()
        for block_id in block_ids:
            meta = self._metas[block_id]
            if meta is None:
                raise ValueError(f"block {block_id} is not cached; only cached blocks can be shared")
            if self._ref_counts[block_id] == 0:
                self.policy.remove(block_id)
            self._ref_counts[block_id] += 1
            meta.num_hits += 1
            meta.last_access_s = now_s

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order.

        A block whose count reaches 0 becomes evictable when it is cached (handed to the policy in this order,
        so callers pass a block table tail first), free otherwise.
        """
        now_s = self.clock()
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed more often than referenced")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] > 0:
                continue
            meta = self._metas[block_id]
            if meta is None:
                self._free.append(block_id)
            else:
                self.policy.insert(block_id, meta, now_s)

    def mark_cached(self, block_id: int, meta: BlockMeta) -> None:
        """Record that a referenced block now holds the full, hashed content described by ``meta``."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} must be referenced to be cached")
        self._metas[block_id] = meta

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Hand every evictable block over to ``policy`` (a pressure level switched the policy).

        The blocks enter the new policy in the old one's eviction order, victims first. O(n log n), once per switch.
        """
        if policy is self.policy:
            return
        now_s = self.clock()
        order: list[int] = []
        while (block_id := self.policy.pop_victim(now_s)) is not None:
            order.append(block_id)
        self.policy = policy
        for block_id in order:
            policy.insert(block_id, self._metas[block_id], now_s)

    # ------------------------------------------------------------------ internals

    def _evict(self, now_s: float) -> int | None:
        block_id = self.policy.pop_victim(now_s)
        if block_id is None:
            return None
        meta = self._metas[block_id]
        self.num_evictions += 1
        if self.on_evict is not None and meta is not None:
            self.on_evict(block_id, meta.block_hash)
        self._metas[block_id] = None
        return block_id

    def _return_to_free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self._ref_counts[block_id] = 0
        self._free.extendleft(reversed(block_ids))
