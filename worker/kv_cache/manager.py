"""The KV cache facade the scheduler talks to: block tables per request over a :class:`BlockPool` + prefix cache.

Modelled on vLLM v1 ``KVCacheManager``. The scheduler asks before it acts: :meth:`KVCacheManager.get_computed_blocks`
at admission, then :meth:`KVCacheManager.allocate_slots`, which returns None when the pool cannot supply the blocks
(no exception). After a step has written K/V, :meth:`KVCacheManager.cache_blocks` hashes the blocks that became full
(prompt or generated tokens alike), so later requests can share them. :meth:`KVCacheManager.free` releases a block
table tail first: with LRU the tail of a chain is evicted before its head, keeping shared prefixes longest.

Block table of a request (``block_idx`` -> ``block_id``)::

    token t  ->  block_table[t // block_size], offset t % block_size
    [ device hits | reloaded from host/disk/Redis | computed by this request | room for the tokens scheduled now ]

Partial-block reuse: after the whole-block hits, the cached block that follows the same chain and shares the most
leading tokens with the request's next block lends those rows: they are copied into the request's own new block
(``block_copier``), so a repeated prompt computes its last token only, not up to ``block_size`` of them (SGLang's
radix cache reuses at token granularity the same way; vLLM v1 recomputes the partial block). A released request's
partly filled last block is cached too, as such a source only.

KV lifetime (issue 4): :meth:`KVCacheManager.admit` is the scheduler's admission call. After the device hits it
looks the chain up in the offload tiers and reloads the blocks the cost model says are cheaper to move than to
recompute; a sequence preempted by swap gets its swapped blocks back. A released request stamps its cached blocks
with its tier, retention deadline (its TTL wish bounded by config and the pressure level) and the facts the
``sluice`` policy classifies by; an evicted block is demoted to the offload chain unless its retention is over, the
blocks one allocation evicts together in one batch, copied out of the pool before the allocation returns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared.config import KVConfig
from worker.kv_cache.block_pool import BlockPool
from worker.kv_cache.eviction import (
    PRESSURE_LEVELS,
    BlockMeta,
    EvictionPolicy,
    block_expiry_s,
    caches_new_request,
    make_policy,
    retention_for_pressure,
)
from worker.kv_cache.prefix_cache import PrefixCache, hash_block_tokens, hash_token_blocks
from worker.kv_cache.stats import KVStats
from worker.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:  # the offload tiers import torch; a simulated worker never loads them
    from worker.kv_cache.offload.chain import OffloadChain

PREEMPT_SWAP = "swap"
PREEMPT_RECOMPUTE = "recompute"
# (enter, leave) fractions of used blocks for elevated and critical; config.pressure's KV thresholds by default
DEFAULT_PRESSURE_THRESHOLDS = ((0.85, 0.75), (0.95, 0.9))


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
        config: TTL bounds and retention per pressure level (``[kv]``); its ``eviction_policy`` is not read here.
        offload: the offload chain (tiers, swap space, cost model); None = evicted blocks are dropped and
            preemption always recomputes (the simulator, tests of the scheduler).
        stats: counters; the offload chain's when it has one.
        pressure_thresholds: ``((enter, leave) elevated, (enter, leave) critical)`` used-block fractions.
        block_copier: ``copy(src_block_id, dst_block_id, num_tokens)`` copies the K/V of a block's first
            ``num_tokens`` rows in every layer (:meth:`worker.model_runner.KVBlockIO.copy_block_prefix`); None = no
            partial-block reuse (the simulator has no KV to copy).

    Raises:
        ValueError: ``num_blocks < 1``, ``block_size < 1`` or an unknown policy name.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 eviction_policy: EvictionPolicy | str = "lru", clock: Callable[[], float] = time.monotonic,
                 config: KVConfig = KVConfig(), offload: OffloadChain | None = None, stats: KVStats | None = None,
                 pressure_thresholds: tuple[tuple[float, float], tuple[float, float]] = DEFAULT_PRESSURE_THRESHOLDS,
                 block_copier: Callable[[int, int, int], None] | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.clock = clock
        self.config = config
        self.offload = offload
        self.stats = stats if stats is not None else (offload.stats if offload is not None else KVStats())
        self.block_copier = block_copier
        self.prefix_cache = PrefixCache()
        self.pool = BlockPool(num_blocks, eviction_policy, clock=clock, on_evict=self._on_evict)
        self._policies: dict[str, EvictionPolicy] = {self.pool.policy.name: self.pool.policy}
        self._base_policy_name = self.pool.policy.name
        self.pressure_thresholds = pressure_thresholds
        self.pressure = "normal"
        self.retention = retention_for_pressure("normal", config.retention)
        self._req_to_blocks: dict[str, list[int]] = {}
        self._req_to_hashes: dict[str, list[int]] = {}  # chain hashes of the request's full blocks so far
        self._req_num_cached_blocks: dict[str, int] = {}  # leading blocks of the table already hashed
        self._no_cache: set[str] = set()  # requests admitted in no-cache mode (pressure): never hashed
        self._swapped_num_computed: dict[str, int] = {}  # request -> computed tokens when it was swapped out
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        # blocks evicted by the allocation in progress, demoted together once it returns:
        # (block_id, block_hash, parent_hash, token_ids, expires_at_s)
        self._pending_demotions: list[tuple[int, int, int | None, tuple[int, ...], float]] = []

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

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """The live map request id -> block table (``[num_blocks_of_request]`` block ids), not a copy: read it in
        the scheduler's hot loop, never change it (:meth:`allocate_slots` and :meth:`free` do)."""
        return self._req_to_blocks

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

    def admit(self, seq: Sequence, max_new_tokens: int) -> int | None:
        """Give a waiting ``seq`` its block table for admission: hits, reloads or swapped blocks, then new ones.

        Order: device prefix hits; a sequence preempted by swap gets its swapped blocks back; otherwise the run of
        blocks found in the offload tiers after the device hits is reloaded as far as the cost model says it pays
        (:meth:`worker.kv_cache.offload.cost.CostModel.num_blocks_to_reload`); without a reload, the leading rows
        of a cached block that continues the hits are copied into the first new block (partial-block reuse); then
        room for ``min(remaining tokens, max_new_tokens)`` tokens to compute now.

        Args:
            seq: a WAITING or PREEMPTED sequence (``num_computed_tokens == 0``, no blocks).
            max_new_tokens: the step's remaining token budget (>= 1).

        Returns:
            Tokens already computed (served from cache, reload or swap; the scheduler computes from there), or None
            when the pool cannot hold it now (nothing changes, except blocks reloaded into the device cache).
        """
        if self._swapped_num_computed.get(seq.request_id) is not None:
            return self._swap_in(seq, max_new_tokens)
        hit_blocks, num_hit = self.get_computed_blocks(seq)
        num_found, run_tiers = self._plan_reload(seq, len(hit_blocks))
        source_id, num_to_copy = self._match_partial(seq, len(hit_blocks))
        # (blocks to reload, source of a partial copy): the richest first, plain recompute last
        attempts = [(len(run_tiers), None)] if run_tiers else []
        attempts += [(0, source_id)] if source_id is not None else []
        attempts += [(0, None)]
        new_block_ids = None
        for num_reload, source_id in attempts:
            num_copied = num_to_copy if source_id is not None else 0
            if source_id is not None:
                self.pool.touch((source_id,))  # this allocation must not evict the rows it is about to copy
            num_new = min(seq.num_tokens - num_hit - num_reload * self.block_size - num_copied, max_new_tokens)
            new_block_ids = self.allocate_slots(seq, num_reload * self.block_size + num_copied + num_new, hit_blocks,
                                                record_query=False)
            if source_id is not None:
                if new_block_ids is not None:
                    self.block_copier(source_id, new_block_ids[0], num_copied)
                self.pool.free((source_id,))
            if new_block_ids is not None:
                break
        if new_block_ids is None:
            return None
        num_loaded = self._reload(seq, new_block_ids[:num_reload], run_tiers[:num_reload], len(hit_blocks))
        if num_found:
            self.stats.add("reload_decisions_total" if num_reload else "recompute_decisions_total")
            self.stats.add("recompute_decision_tokens", (num_found - num_loaded) * self.block_size)
        num_computed = num_hit + num_loaded * self.block_size + num_copied
        if seq.status is SequenceStatus.WAITING:
            self._record_prefix_query(seq.num_tokens, num_computed)
            self.stats.add("prefix_query_tokens", seq.num_tokens)
            self.stats.add("prefix_hit_tokens", num_hit + num_copied, tier="device")
            self.stats.add("partial_block_hit_tokens", num_copied)
            for tier_name in run_tiers[:num_loaded]:
                self.stats.add("prefix_hit_tokens", self.block_size, tier=tier_name)
        if not caches_new_request(self.retention, seq.tier_priority):
            self._no_cache.add(seq.request_id)
        return num_computed

    def preempt(self, seq: Sequence) -> str:
        """Take a running ``seq``'s blocks back: swap them to host RAM or drop them for recompute, by cost.

        Returns:
            :data:`PREEMPT_SWAP` (its blocks come back on :meth:`admit`) or :data:`PREEMPT_RECOMPUTE`.
        """
        table = self._req_to_blocks.get(seq.request_id, [])[:self.num_blocks_for(seq.num_computed_tokens)]
        swap = self.offload.swap if self.offload is not None else None
        mode = PREEMPT_RECOMPUTE
        if (swap is not None and table and swap.can_hold(len(table))
                and self.offload.cost.prefers_swap(len(table), swap.block_bytes, seq.num_computed_tokens)):
            elapsed_s = swap.swap_out(seq.request_id, table)
            self.offload.cost.observe_transfer("host", len(table) * swap.block_bytes, elapsed_s)
            self._swapped_num_computed[seq.request_id] = seq.num_computed_tokens
            mode = PREEMPT_SWAP
        self._release(seq)
        self.stats.add("preemptions", 1, mode=mode)
        return mode

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped_num_computed

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       new_computed_blocks: list[int] | tuple[int, ...] = (),
                       record_query: bool = True) -> list[int] | None:
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
        if not new_computed_blocks and table and len(table) * self.block_size >= num_tokens:
            return []  # the table already holds them: most decode steps
        num_needed = max(0, self.num_blocks_for(num_tokens) - len(table) - len(new_computed_blocks))
        num_hits_evictable = sum(1 for b in new_computed_blocks if self.pool.ref_count(b) == 0)
        if num_needed + num_hits_evictable > self.pool.num_free_blocks:
            return None
        if new_computed_blocks:  # a decode step's new block has no hits to count and touch
            self._observe_reuse_gaps(new_computed_blocks)
            self.pool.touch(new_computed_blocks)
        new_block_ids = self.pool.allocate(num_needed)
        self._flush_demotions()
        if new_block_ids is None:
            self.pool.free(reversed(new_computed_blocks))
            return None
        if record_query and seq.request_id not in self._req_to_blocks and seq.status is SequenceStatus.WAITING:
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
        if not self.enable_prefix_caching or seq.request_id in self._no_cache:
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
        """Release ``seq``'s blocks (finish or abort), tail first, and any swapped copy of them.

        Its cached blocks become evictable with its tier and retention. Unknown or already freed requests are
        ignored.
        """
        if self._swapped_num_computed.pop(seq.request_id, None) is not None:
            self.offload.swap.drop(seq.request_id)
        self._release(seq)

    # ------------------------------------------------------------------ pressure

    def update_pressure(self) -> str:
        """Recompute the pressure level from the used-block fraction (with hysteresis) and apply it."""
        usage = self.usage
        (enter_elevated, leave_elevated), (enter_critical, leave_critical) = self.pressure_thresholds
        level = self.pressure
        if usage >= enter_critical:
            level = "critical"
        elif level == "critical" and usage < leave_critical:
            level = "elevated" if usage >= leave_elevated else "normal"
        elif level == "normal" and usage >= enter_elevated:
            level = "elevated"
        elif level == "elevated" and usage < leave_elevated:
            level = "normal"
        self.set_pressure(level)
        return level

    def set_pressure(self, level: str) -> None:
        """Apply the retention settings of pressure ``level``: TTL scaling, retained and cached tiers, policy.

        Raises:
            ValueError: unknown level.
        """
        if level not in PRESSURE_LEVELS:
            raise ValueError(f"unknown pressure level {level!r}; valid: {', '.join(PRESSURE_LEVELS)}")
        if level == self.pressure:
            return
        self.pressure = level
        self.retention = retention_for_pressure(level, self.config.retention)
        name = self.retention.eviction_policy or self._base_policy_name
        policy = self._policies.get(name)
        if policy is None:
            policy = self._policies[name] = make_policy(name)
        self.pool.set_policy(policy)
        self.stats.add("pressure_switches_total", 1, level=level)

    def observe_prefill(self, num_prefill_tokens: int, num_decode_tokens: int, elapsed_s: float) -> None:
        """Feed one model step to the cost model's prefill rate (steps that are mostly prefill only)."""
        if self.offload is not None and num_prefill_tokens >= max(1, 4 * num_decode_tokens):
            self.offload.cost.observe_prefill(num_prefill_tokens, elapsed_s)

    def stats_snapshot(self) -> dict[str, float]:
        """Return ``Capacity.kv_stats`` (see :class:`worker.kv_cache.stats.KVStats` for the keys)."""
        if self.offload is not None:
            self.offload.publish_gauges()
        self.stats.set_gauge("pressure_level", PRESSURE_LEVELS.index(self.pressure))
        return self.stats.snapshot()

    # ------------------------------------------------------------------ internals

    def _release(self, seq: Sequence) -> None:
        table = self._req_to_blocks.get(seq.request_id)
        num_cached = self._req_num_cached_blocks.get(seq.request_id, 0)
        if table is not None and self.block_copier is not None and self.enable_prefix_caching \
                and seq.request_id not in self._no_cache:
            num_cached = self._cache_tail(seq, table, num_cached)
        self._req_to_blocks.pop(seq.request_id, None)
        self._req_num_cached_blocks.pop(seq.request_id, None)
        self._req_to_hashes.pop(seq.request_id, None)
        self._no_cache.discard(seq.request_id)
        if table is None:
            return
        self._update_metas(seq, table, num_cached)
        self.pool.free(reversed(table))

    def _cache_tail(self, seq: Sequence, table: list[int], num_cached: int) -> int:
        """Register the partly filled block after ``seq``'s cached chain (its last computed tokens) in the prefix
        cache, as a source of partial-block reuse only: its hash covers fewer than ``block_size`` tokens, so no
        whole-block lookup matches it. Returns the number of leading cached blocks of ``table`` after it."""
        tail_idx, num_rows = divmod(seq.num_computed_tokens, self.block_size)
        if num_rows == 0 or tail_idx != num_cached or tail_idx >= len(table) or self.pool.is_cached(table[tail_idx]):
            return num_cached
        token_ids = seq.all_token_ids
        parent = self._hashes(seq, token_ids, tail_idx)[tail_idx - 1] if tail_idx else None
        tokens = token_ids[tail_idx * self.block_size:seq.num_computed_tokens]
        block_hash = hash_block_tokens(parent, tokens)
        if not self.prefix_cache.insert(block_hash, parent, tokens, table[tail_idx]):
            return num_cached
        now_s = self.clock()
        self.pool.mark_cached(table[tail_idx], BlockMeta(block_hash=block_hash, block_idx=tail_idx, tier=seq.tier,
                                                         tier_priority=seq.tier_priority, last_access_s=now_s,
                                                         cached_at_s=now_s))
        return num_cached + 1

    def _match_partial(self, seq: Sequence, num_hit_blocks: int) -> tuple[int | None, int]:
        """Find a cached block whose leading rows ``seq`` can copy into table position ``num_hit_blocks``.

        At most ``seq.num_tokens - 1`` tokens count as computed (the last one must produce logits).

        Returns:
            ``(source block id, tokens to copy)``, or ``(None, 0)``.
        """
        if self.block_copier is None or not self.enable_prefix_caching:
            return None, 0
        start = num_hit_blocks * self.block_size
        token_ids = seq.all_token_ids
        num_reusable = min(self.block_size, len(token_ids) - 1 - start)
        if num_reusable <= 0:
            return None, 0
        parent = self._hashes(seq, token_ids, num_hit_blocks)[num_hit_blocks - 1] if num_hit_blocks else None
        return self.prefix_cache.match_partial(parent, token_ids[start:start + num_reusable])

    def _plan_reload(self, seq: Sequence, num_hit_blocks: int) -> tuple[int, list[str]]:
        """Find the run of blocks after the device hits held by the offload tiers and decide how much to reload.

        Returns:
            ``(blocks found, tier of each block to reload)``; the reload is the cost model's leading part.
        """
        if self.offload is None or not self.offload.tiers or not self.enable_prefix_caching:
            return 0, []
        token_ids = seq.all_token_ids
        max_blocks = (len(token_ids) - 1) // self.block_size
        if num_hit_blocks >= max_blocks:
            return 0, []
        hashes = self._hashes(seq, token_ids, max_blocks)[:max_blocks]
        run_tiers = self.offload.find(hashes, num_hit_blocks)
        # a later block still on the device (its chain was cut before it) cannot join a reload run: stop there
        on_device = next((i for i in range(len(run_tiers)) if hashes[num_hit_blocks + i] in self.prefix_cache), None)
        run_tiers = run_tiers[:on_device]
        if not run_tiers:
            return 0, []
        num_reload = self.offload.cost.num_blocks_to_reload(run_tiers, self.offload.block_bytes, self.block_size)
        return len(run_tiers), run_tiers[:num_reload]

    def _reload(self, seq: Sequence, block_ids: list[int], run_tiers: list[str], start_idx: int) -> int:
        """Fill fresh blocks ``block_ids`` (table positions ``start_idx, …``) from the tiers; register them cached.

        Stops at the first block a tier no longer has or whose token ids differ; returns how many were loaded.
        """
        if not block_ids:
            return 0
        token_ids = seq.all_token_ids
        hashes = self._hashes(seq, token_ids, start_idx + len(block_ids))
        now_s = self.clock()
        num_loaded = 0
        for offset, (block_id, tier_name) in enumerate(zip(block_ids, run_tiers)):
            block_idx = start_idx + offset
            parent = hashes[block_idx - 1] if block_idx > 0 else None
            tokens = token_ids[block_idx * self.block_size:(block_idx + 1) * self.block_size]
            if not self.offload.load(tier_name, block_id, hashes[block_idx], parent, tokens):
                break
            if not self.prefix_cache.insert(hashes[block_idx], parent, tokens, block_id):
                break
            self.pool.mark_cached(block_id, BlockMeta(block_hash=hashes[block_idx], block_idx=block_idx,
                                                      tier=seq.tier, tier_priority=seq.tier_priority,
                                                      last_access_s=now_s, cached_at_s=now_s))
            num_loaded += 1
        self._req_num_cached_blocks[seq.request_id] = start_idx + num_loaded
        return num_loaded

    def _swap_in(self, seq: Sequence, max_new_tokens: int) -> int | None:
        """Admit a sequence preempted by swap: device hits for its leading blocks, its swapped blocks for the rest."""
        num_computed = self._swapped_num_computed[seq.request_id]
        swap = self.offload.swap
        num_swapped = swap.num_blocks_of(seq.request_id)
        hit_blocks, _ = self.get_computed_blocks(seq)
        hit_blocks = hit_blocks[:min(num_swapped, num_computed // self.block_size)]
        num_new = min(seq.num_tokens - num_computed, max_new_tokens)
        new_block_ids = self.allocate_slots(seq, num_computed - len(hit_blocks) * self.block_size + num_new,
                                            hit_blocks, record_query=False)
        if new_block_ids is None:
            return None
        elapsed_s = swap.swap_in(seq.request_id, new_block_ids[:num_swapped - len(hit_blocks)], skip=len(hit_blocks))
        self.offload.cost.observe_transfer("host", (num_swapped - len(hit_blocks)) * swap.block_bytes, elapsed_s)
        del self._swapped_num_computed[seq.request_id]
        self._req_num_cached_blocks[seq.request_id] = len(hit_blocks)
        return num_computed

    def _observe_reuse_gaps(self, block_ids) -> None:
        now_s = self.clock()
        for block_id in block_ids:
            meta = self.pool.meta(block_id)
            if meta is not None and self.pool.ref_count(block_id) == 0:
                self.stats.reuse_gap_s.add(max(0.0, now_s - meta.last_access_s))

    def _retention_s(self, seq: Sequence) -> float:
        """The request's retention wish (or the default) bounded by config and its tier, seconds; inf = none."""
        wish_s = seq.cache_ttl_s if seq.cache_ttl_s > 0 else self.config.default_cache_ttl_s
        if wish_s <= 0:
            wish_s = math.inf
        bound_s = min(self.config.max_cache_ttl_s, self.config.max_cache_ttl_s_by_tier.get(seq.tier, math.inf))
        return min(wish_s, bound_s)

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
        now_s = self.clock()
        meta = BlockMeta(block_hash=hashes[block_idx], block_idx=block_idx, tier=seq.tier,
                         tier_priority=seq.tier_priority, last_access_s=now_s, cached_at_s=now_s)
        self.pool.mark_cached(block_id, meta)

    def _update_metas(self, seq: Sequence, table: list[int], num_cached: int) -> None:
        """Stamp the cached blocks of ``table`` with the request that releases them.

        Tier, retention deadline (:func:`~worker.kv_cache.eviction.block_expiry_s` at the current pressure), chain
        tail, and what the ``sluice`` policy classifies by: whether the block holds the prompt's partial last
        block, the prompt's length in blocks and how many of them the request found cached.
        """
        now_s = self.clock()
        expires_at_s = block_expiry_s(self.retention, seq.tier_priority, self._retention_s(seq), now_s)
        num_prompt = seq.num_prompt_tokens
        partial_idx = num_prompt // self.block_size if num_prompt % self.block_size else -1
        num_request_blocks = -(-num_prompt // self.block_size)
        num_request_cached_blocks = seq.num_cached_tokens // self.block_size
        metas = [(idx, self.pool.meta(table[idx])) for idx in range(num_cached)]
        metas = [(idx, meta) for idx, meta in metas if meta is not None]
        for block_idx, meta in metas:
            meta.block_idx = block_idx
            meta.tier = seq.tier
            meta.tier_priority = seq.tier_priority
            meta.expires_at_s = expires_at_s
            meta.last_access_s = now_s
            meta.is_chain_tail = block_idx == metas[-1][0]
            meta.is_partial = block_idx == partial_idx
            meta.num_request_blocks = num_request_blocks
            meta.num_request_cached_blocks = num_request_cached_blocks

    def _record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one first admission (not a resume after preemption) in the prefix hit counters."""
        self.prefix_queries_tokens += num_query_tokens
        self.prefix_hits_tokens += num_hit_tokens

    def _on_evict(self, block_id: int, block_hash: int) -> None:
        """Count the eviction and queue the block for demotion (its K/V stay in the pool until the allocation
        returns)."""
        meta = self.pool.meta(block_id)
        entry = self.prefix_cache.entry(block_id)
        now_s = self.clock()
        if meta is not None:
            self.stats.add("evicted_blocks", 1, policy=self.pool.policy.name, tier=meta.tier)
            self.stats.block_lifetime_s.add(max(0.0, now_s - meta.cached_at_s))
        if self.offload is not None and meta is not None and entry is not None and entry[0] == block_hash \
                and len(entry[2]) == self.block_size:  # a partly filled block is never looked up in the tiers
            if meta.expires_at_s <= now_s:
                self.stats.add("expired_blocks")
            else:
                self._pending_demotions.append((block_id, block_hash, entry[1], entry[2], meta.expires_at_s))
        self.prefix_cache.remove(block_id, block_hash)

    def _flush_demotions(self) -> None:
        """Demote the blocks evicted by the last allocation as one batch (one copy out of the pool), before the
        caller can write into them."""
        if self._pending_demotions:
            evicted, self._pending_demotions = self._pending_demotions, []
            self.offload.demote_many(evicted)
