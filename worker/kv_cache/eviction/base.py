"""The seam between the block pool and its eviction policies: what a policy knows of a block, and its interface."""

from __future__ import annotations

import abc

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
        is_partial: the block holds a prompt's last, partial block (fewer than ``block_size`` tokens of the prompt);
            a later prompt that extends the text hashes it differently, so it almost never matches again
            (Mooncake conversation trace: 1.0% of them are reused, against 24% of all blocks).
        num_request_blocks: blocks of the prompt of the request that last released the block (0 = unknown).
        num_request_cached_blocks: how many of those leading blocks that request found in the cache (prefix hit
            length in blocks; 0 = a fresh conversation or unknown).
        cached_at_s: when the block entered the device prefix cache, on the policy clock (block lifetime metric).
    """

    block_hash: int
    block_idx: int = 0
    tier: str = "standard"
    tier_priority: int = 0
    expires_at_s: float = float("inf")
    last_access_s: float = 0.0
    num_hits: int = 0
    is_chain_tail: bool = False
    is_partial: bool = False
    num_request_blocks: int = 0
    num_request_cached_blocks: int = 0
    cached_at_s: float = 0.0


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

    def discard(self, block_id: int) -> None:
        """Drop an evictable block that the cache evicts on another policy's choice, as if this one had chosen it.

        :class:`~worker.kv_cache.eviction.adaptive.AdaptivePolicy` keeps several policies over one evictable set
        and asks one of them for each victim; the others learn of the eviction here. Unknown ids are an error
        (KeyError). The default is :meth:`remove`, right for a policy that learns nothing from a reuse.
        """
        self.remove(block_id)

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of evictable blocks."""

    @abc.abstractmethod
    def __contains__(self, block_id: int) -> bool: ...
