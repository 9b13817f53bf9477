"""Eviction policies of the prefix cache: which cached, unreferenced KV block to reuse next.

A block is *evictable* when the prefix cache holds it (it has a hash) and no running sequence references it
(ref count 0). The :class:`~worker.kv_cache.block_pool.BlockPool` hands every evictable block to the policy
with :meth:`EvictionPolicy.insert`, takes it back with :meth:`EvictionPolicy.remove` when a new request reuses it,
and asks :meth:`EvictionPolicy.pop_victim` for the block to evict when the free list is empty.

Policies are small classes chosen by name in config (``worker.eviction_policy``); :func:`make_policy` builds one and
names the valid choices on an unknown name.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from typing import Callable

import msgspec


class BlockMeta(msgspec.Struct, kw_only=True):
    """What a policy may know about one cached block.

    Attributes:
        block_hash: the chained hash of the block (parent hash + token ids).
        block_idx: position of the block in its sequence's block table (0 = first).
        tier: admission tier label of the request that last used the block.
        tier_priority: that tier's priority; larger is kept longer by the ``tier`` policy.
        expires_at_s: retention deadline on the policy clock (``ttl`` policy), ``inf`` for none.
        last_access_s: last time a request used the block, on the policy clock (seconds).
        num_hits: how many times a later request reused the block from the cache.
        is_chain_tail: the block was the last full block of the request that cached it.
    """

    block_hash: int
    block_idx: int = 0
    tier: str = "standard"
    tier_priority: int = 0
    expires_at_s: float = float("inf")
    last_access_s: float = 0.0
    num_hits: int = 0
    is_chain_tail: bool = False


class EvictionPolicy(abc.ABC):
    """Order of eviction among evictable blocks. All operations must be O(1) or O(log n)."""

    name: str = ""

    @abc.abstractmethod
    def insert(self, block_id: int, meta: BlockMeta, now_s: float) -> None:
        """Add a block that just became evictable (its last reference was dropped)."""

    @abc.abstractmethod
    def remove(self, block_id: int) -> None:
        """Take a block out of the evictable set (a request reused it). Unknown ids are an error (KeyError)."""

    @abc.abstractmethod
    def pop_victim(self, now_s: float) -> int | None:
        """Remove and return the block to evict now, or None when no block is evictable."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of evictable blocks."""

    @abc.abstractmethod
    def __contains__(self, block_id: int) -> bool: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first: the policy of vLLM's free-block queue.

    Blocks of one sequence are freed tail first by the pool, so within a chain the tail goes before the head
    (vLLM v1 ``KVCacheManager.free``), which keeps shared prefixes longest.
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, block_id: int, meta: BlockMeta, now_s: float) -> None:
        self._order[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._order[block_id]

    def pop_victim(self, now_s: float) -> int | None:
        if not self._order:
            return None
        block_id, _ = self._order.popitem(last=False)
        return block_id

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order


_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
}


def register_policy(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    """Make a policy available to :func:`make_policy` under ``name``."""
    _POLICIES[name] = factory


def policy_names() -> list[str]:
    """Return the valid policy names, sorted."""
    return sorted(_POLICIES)


def make_policy(name: str) -> EvictionPolicy:
    """Build the policy called ``name``.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(policy_names())}") from None
