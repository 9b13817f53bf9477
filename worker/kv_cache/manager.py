"""The KV cache facade the scheduler talks to: block tables per request over a :class:`BlockPool` + prefix cache.

Modelled on vLLM v1 ``KVCacheManager``. The scheduler asks before it acts: :meth:`KVCacheManager.get_computed_blocks`
at admission, then :meth:`KVCacheManager.allocate_slots`, which returns None when the pool cannot supply the blocks
(no exception). After a step has written K/V, :meth:`KVCacheManager.cache_blocks` hashes the blocks that became full
(prompt or generated tokens alike), so later requests can share them. :meth:`KVCacheManager.free` releases a block
table tail first: with LRU the tail of a chain is evicted before its head, keeping shared prefixes longest.

Block table of a request (``block_idx`` -> ``block_id``)::

    token t  ->  block_table[t // block_size], offset t % block_size
    [ cached hit blocks | blocks computed by this request | room for the tokens scheduled now ]
"""

from __future__ import annotations

import time
from collections.abc import Callable

from worker.kv_cache.block_pool import BlockPool
from worker.kv_cache.eviction import BlockMeta, EvictionPolicy
from worker.kv_cache.prefix_cache import PrefixCache, hash_token_blocks
from worker.sequence import Sequence, SequenceStatus


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables, prefix reuse and block accounting for one worker's KV pool.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: reuse cached full blocks across requests; off, every request computes its prompt.
        eviction_policy: policy name or instance (see :mod:`worker.kv_cache.eviction`).
        clock: monotonic seconds, for block expiry and recency.

    Raises:
        ValueError: ``num_blocks < 1``, ``block_size < 1`` or an unknown policy name.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 eviction_policy: EvictionPolicy | str = "lru", clock: Callable[[], float] = time.monotonic) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.clock = clock
        self.prefix_cache = PrefixCache()
        self.pool = BlockPool(num_blocks, eviction_policy, clock=clock, on_evict=self._on_evict)
        self._req_to_blocks: dict[str, list[int]] = {}
        self._req_to_hashes: dict[str, list[int]] = {}  # chain hashes of the request's full blocks so far
        self._req_num_cached_blocks: dict[str, int] = {}  # leading blocks of the table already hashed
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    # ------------------------------------------------------------------ counters

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to new allocations: free + evictable cached."""
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by running requests."""
        return self.pool.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Evictable cached blocks (unreferenced, reusable by a prefix hit)."""
        return self.pool.num_cached_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by running requests, 0..1."""
        return self.num_used_blocks / self.num_total_blocks

    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens ÷ queried prompt tokens over all first admissions so far."""
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks a table needs to hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """Return a copy of the request's block table, ``[num_blocks_of_request]`` block ids ([] if unknown)."""
        return list(self._req_to_blocks.get(request_id, ()))

    # ------------------------------------------------------------------ the scheduler's calls

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Find the longest cached prefix of ``seq``'s tokens (prompt and, after a preemption, outputs).

        Never covers the last token: the model must compute at least one token to produce logits, so a fully
        cached sequence backs off one block (vLLM v1 does the same).

        Returns:
            ``(block_ids, num_computed_tokens)`` with ``num_computed_tokens == len(block_ids) * block_size``.
            Pass ``block_ids`` to :meth:`allocate_slots` as ``new_computed_blocks``.
        """
        if not self.enable_prefix_caching:
            return [], 0
        token_ids = seq.all_token_ids
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = self._hashes(seq, token_ids, max_blocks)
        block_ids = self.prefix_cache.match_prefix(token_ids, hashes[:max_blocks], self.block_size)
        return block_ids, len(block_ids) * self.block_size

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       new_computed_blocks: list[int] | tuple[int, ...] = ()) -> list[int] | None:
        """Grow ``seq``'s block table to hold its computed tokens, the cache hits and ``num_new_tokens`` more.

        Args:
            seq: the sequence; ``seq.num_computed_tokens`` counts tokens already in its own table.
            num_new_tokens: tokens to compute this step.
            new_computed_blocks: cached blocks from :meth:`get_computed_blocks` (only at admission).

        Returns:
            The newly allocated block ids (possibly []), or None when the pool is short; then nothing changes.
            The first successful call for a WAITING sequence counts its prefix query and hit tokens.
        """
        table = self._req_to_blocks.get(seq.request_id, [])
        num_tokens = seq.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_needed = max(0, self.num_blocks_for(num_tokens) - len(table) - len(new_computed_blocks))
        num_hits_evictable = sum(1 for b in new_computed_blocks if self.pool.ref_count(b) == 0)
        if num_needed + num_hits_evictable > self.pool.num_free_blocks:
            return None
        self.pool.touch(new_computed_blocks)
        new_block_ids = self.pool.allocate(num_needed)
        if new_block_ids is None:
            self.pool.free(reversed(new_computed_blocks))
            return None
        if seq.request_id not in self._req_to_blocks and seq.status is SequenceStatus.WAITING:
            self._record_prefix_query(seq.num_tokens, len(new_computed_blocks) * self.block_size)
        table = self._req_to_blocks.setdefault(seq.request_id, table)
        table.extend(new_computed_blocks)
        table.extend(new_block_ids)
        if new_computed_blocks:
            self._req_num_cached_blocks[seq.request_id] = len(table) - len(new_block_ids)
        return new_block_ids

    def cache_blocks(self, seq: Sequence) -> None:
        """Hash and register every block of ``seq`` that is full of computed tokens and not yet cached.

        Call after the step that computed them (``seq.num_computed_tokens`` already advanced), so a block is
        shared only once its K/V are written.
        """
        if not self.enable_prefix_caching:
            return
        table = self._req_to_blocks.get(seq.request_id)
        if table is None:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        start = self._req_num_cached_blocks.get(seq.request_id, 0)
        if num_full <= start:
            return
        token_ids = seq.all_token_ids
        hashes = self._hashes(seq, token_ids, num_full)
        for block_idx in range(start, num_full):
            self._cache_one(seq, table[block_idx], block_idx, hashes, token_ids)
        self._req_num_cached_blocks[seq.request_id] = num_full

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first; its cached blocks become evictable with its tier and TTL.

        Unknown or already freed requests are ignored.
        """
        table = self._req_to_blocks.pop(seq.request_id, None)
        num_cached = self._req_num_cached_blocks.pop(seq.request_id, 0)
        self._req_to_hashes.pop(seq.request_id, None)
        if table is None:
            return
        self._update_metas(seq, table, num_cached)
        self.pool.free(reversed(table))

    # ------------------------------------------------------------------ internals

    def _hashes(self, seq: Sequence, token_ids: list[int], num_blocks: int) -> list[int]:
        known = self._req_to_hashes.get(seq.request_id, [])
        if len(known) >= num_blocks:
            return known
        hashes = hash_token_blocks(token_ids, self.block_size, num_blocks, known)
        self._req_to_hashes[seq.request_id] = hashes
        return hashes

    def _cache_one(self, seq: Sequence, block_id: int, block_idx: int, hashes: list[int],
                   token_ids: list[int]) -> None:
        if self.pool.is_cached(block_id):
            return
        parent = hashes[block_idx - 1] if block_idx > 0 else None
        tokens = token_ids[block_idx * self.block_size:(block_idx + 1) * self.block_size]
        if not self.prefix_cache.insert(hashes[block_idx], parent, tokens, block_id):
            return  # the same content is already cached in another block; this one stays private
        meta = BlockMeta(block_hash=hashes[block_idx], block_idx=block_idx, tier=seq.tier,
                         tier_priority=seq.tier_priority, last_access_s=self.clock())
        self.pool.mark_cached(block_id, meta)

    def _update_metas(self, seq: Sequence, table: list[int], num_cached: int) -> None:
        """Stamp the cached blocks of ``table`` with the request that releases them (tier, expiry, chain tail)."""
        now_s = self.clock()
        expires_at_s = now_s + seq.cache_ttl_s if seq.cache_ttl_s > 0 else float("inf")
        metas = [(idx, self.pool.meta(table[idx])) for idx in range(num_cached)]
        metas = [(idx, meta) for idx, meta in metas if meta is not None]
        for block_idx, meta in metas:
            meta.block_idx = block_idx
            meta.tier = seq.tier
            meta.tier_priority = seq.tier_priority
            meta.expires_at_s = expires_at_s
            meta.last_access_s = now_s
            meta.is_chain_tail = block_idx == metas[-1][0]

    def _record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one first admission (not a resume after preemption) in the prefix hit counters."""
        self.prefix_queries_tokens += num_query_tokens
        self.prefix_hits_tokens += num_hit_tokens

    def _on_evict(self, block_id: int, block_hash: int) -> None:
        self.prefix_cache.remove(block_id, block_hash)
