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
import bisect
import heapq
import math
from collections import OrderedDict, deque
from typing import Callable

import msgspec

from shared.config import RetentionConfig, RetentionSettings  # noqa: F401  (defined with the config; re-exported)


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


class LFUPolicy(EvictionPolicy):
    """Least frequently used first, with dynamic aging: LFU-DA (Arlitt et al., "Evaluating content management
    techniques for Web proxy caches", 2000; GDSF with unit size and cost).

    A block's key is ``L + frequency`` where ``frequency = num_hits + 1`` when it becomes evictable and ``L`` (the
    inflation value) is the key of the last victim. ``L`` only grows, so a block that was popular long ago ages
    out instead of squatting forever (plain LFU's pollution). Ties go to the block made evictable first (a chain
    is freed tail first, so its tail goes before its head). Heap with lazy deletion: O(log n) per operation.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []  # (key, insertion seq, block_id)
        self._entry: dict[int, tuple[float, int]] = {}  # block_id -> live (key, seq)
        self._seq = 0
        self.inflation = 0.0  # L of LFU-DA: key of the last victim

    def insert(self, block_id: int, meta: BlockMeta, now_s: float) -> None:
        key = self.inflation + meta.num_hits + 1
        self._seq += 1
        self._entry[block_id] = (key, self._seq)
        heapq.heappush(self._heap, (key, self._seq, block_id))

    def remove(self, block_id: int) -> None:
        del self._entry[block_id]

    def pop_victim(self, now_s: float) -> int | None:
        while self._heap:
            key, seq, block_id = heapq.heappop(self._heap)
            if self._entry.get(block_id) == (key, seq):
                del self._entry[block_id]
                self.inflation = key
                return block_id
        return None

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._entry


class TTLPolicy(EvictionPolicy):
    """Expired blocks first (earliest deadline first), then least recently used.

    A block's deadline is ``BlockMeta.expires_at_s`` (the request's retention wish bounded by its tier, set by the
    manager); ``inf`` never expires and only leaves in LRU order. An LRU ``OrderedDict`` plus a heap of deadlines
    with lazy deletion: O(log n).
    """

    name = "ttl"

    def __init__(self) -> None:
        self._lru: OrderedDict[int, int] = OrderedDict()  # block_id -> insertion seq
        self._deadlines: list[tuple[float, int, int]] = []  # (expires_at_s, seq, block_id)
        self._seq = 0

    def insert(self, block_id: int, meta: BlockMeta, now_s: float) -> None:
        self._seq += 1
        self._lru[block_id] = self._seq
        if meta.expires_at_s != float("inf"):
            heapq.heappush(self._deadlines, (meta.expires_at_s, self._seq, block_id))

    def remove(self, block_id: int) -> None:
        del self._lru[block_id]

    def pop_victim(self, now_s: float) -> int | None:
        while self._deadlines:
            expires_at_s, seq, block_id = self._deadlines[0]
            if self._lru.get(block_id) != seq:
                heapq.heappop(self._deadlines)  # stale: reused or evicted since
                continue
            if expires_at_s > now_s:
                break
            heapq.heappop(self._deadlines)
            del self._lru[block_id]
            return block_id
        if not self._lru:
            return None
        block_id, _ = self._lru.popitem(last=False)
        return block_id

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._lru


class TierPolicy(EvictionPolicy):
    """Blocks of lower tiers go first (``BlockMeta.tier_priority`` ascending), then least recently used within a
    tier. One LRU ``OrderedDict`` per priority; O(number of tiers) per eviction, O(1) otherwise.
    """

    name = "tier"

    def __init__(self) -> None:
        self._by_priority: dict[int, OrderedDict[int, None]] = {}
        self._priorities: list[int] = []  # sorted ascending
        self._priority_of: dict[int, int] = {}  # block_id -> tier_priority

    def insert(self, block_id: int, meta: BlockMeta, now_s: float) -> None:
        priority = meta.tier_priority
        queue = self._by_priority.get(priority)
        if queue is None:
            queue = self._by_priority[priority] = OrderedDict()
            bisect.insort(self._priorities, priority)
        queue[block_id] = None
        self._priority_of[block_id] = priority

    def remove(self, block_id: int) -> None:
        priority = self._priority_of.pop(block_id)
        del self._by_priority[priority][block_id]

    def pop_victim(self, now_s: float) -> int | None:
        for priority in self._priorities:
            queue = self._by_priority[priority]
            if queue:
                block_id, _ = queue.popitem(last=False)
                del self._priority_of[block_id]
                return block_id
        return None

    def __len__(self) -> int:
        return len(self._priority_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._priority_of


def _size_bucket(num_blocks: int) -> int:
    """Round a block count up to a power of two (1, 2, 4, …, 128), larger counts to 256."""
    for bucket in (1, 2, 4, 8, 16, 32, 64, 128):
        if num_blocks <= bucket:
            return bucket
    return 256


class SluicePolicy(EvictionPolicy):
    """Return-aware eviction: keep a block as long as its *class* makes a return likely; learned online.

    Designed from the Mooncake conversation trace (FAST'25; 512-token blocks, block 0 left out), where the chance
    that a cached block is ever used again depends on what kind of block it is far more than on its recency:

    ============================================================  ===========
    block kind (when it becomes evictable)                        reused later
    ============================================================  ===========
    partial last block of a prompt                                1%
    new block of a fresh conversation, prompt ≤ 16 blocks          34%
    new block of a fresh conversation, prompt > 128 blocks         20%
    new block of a returning conversation that added ≤ 4 blocks    54%
    new block of a returning conversation that added 17–64 blocks  9%
    block already used 2 / 3 / ≥ 4 times                          42% / 50% / 70%
    ============================================================  ===========

    So each block gets a class when it becomes evictable: ``partial``; ``("used", min(uses, 4))`` for a block
    used more than once; ``("new", returning, bucket(new blocks of its request))`` otherwise. ``uses`` counts
    uses across evictions: an evicted block's hash stays in a ghost list (as in ARC, Megiddo & Modha 2003) for
    ``ghost_factor ×`` the evictable count, so a chain that comes back after eviction is recognised as returning.
    The policy learns each class's reuse probability ``p_c = (reuses + prior·n0) / (outcomes + n0)``: a reuse is
    a prefix hit (``remove``) or a ghost hit (re-``insert`` of a hash evicted recently); a non-reuse is a ghost
    entry that ages out.

    Ordering: with reuse gaps roughly exponential with mean ``H``, a block of class ``c`` idle for ``a`` seconds
    will be reused at a rate ``∝ p_c · exp(-a / H)``; evicting the lowest rate first is evicting the smallest
    ``last_use_s + H · ln p_c`` (a one-parameter form of hit-density eviction, LHD, Beckmann et al., NSDI'18).
    ``H = 300 s`` matches the trace's median reuse gap (~150 s) and was the best of 100–400 s. Ties (one request's
    blocks) go deepest block first, so a chain is cut from its tail and its shared prefix survives longest.
    Heap with lazy deletion: O(log n) per operation; class tables are O(1).

    Args:
        horizon_s: ``H``, seconds of idle time worth a factor ``e`` in reuse probability.
        ghost_factor: ghost list size as a multiple of the evictable block count.
        prior_reuse: reuse probability a class starts from.
        prior_weight: ``n0``, pseudo-observations behind the prior.
        partial_prior_reuse: the prior of the ``partial`` class: a partial block only matches a byte-identical
            prompt, so it starts near zero instead of at ``prior_reuse``.
    """

    name = "sluice"

    def __init__(self, horizon_s: float = 300.0, ghost_factor: float = 2.0, prior_reuse: float = 0.25,
                 prior_weight: float = 20.0, partial_prior_reuse: float = 0.02) -> None:
        if (horizon_s <= 0 or ghost_factor < 0 or not 0.0 < prior_reuse <= 1.0 or prior_weight <= 0
                or not 0.0 < partial_prior_reuse <= 1.0):
            raise ValueError("sluice policy: horizon_s > 0, ghost_factor >= 0, 0 < prior_reuse <= 1, "
                             "prior_weight > 0, 0 < partial_prior_reuse <= 1")
        self.horizon_s = horizon_s
        self.ghost_factor = ghost_factor
        self.prior_reuse = prior_reuse
        self.prior_weight = prior_weight
        self.partial_prior_reuse = partial_prior_reuse
        self.num_reuses: dict[tuple, int] = {}  # class -> observed reuses
        self.num_outcomes: dict[tuple, int] = {}  # class -> observed reuses + observed non-reuses
        self._heap: list[tuple[float, int, int, int]] = []  # (key_s, -block_idx, seq, block_id)
        self._entry: dict[int, tuple[float, int, int]] = {}  # evictable block_id -> live (key_s, -block_idx, seq)
        self._class_of: dict[int, tuple] = {}  # evictable block_id -> class at insert
        self._hash_of: dict[int, int] = {}  # evictable block_id -> block_hash
        self._uses: dict[int, int] = {}  # cached block_id (evictable or in use) -> uses so far
        self._ghost: OrderedDict[int, tuple[tuple, int]] = OrderedDict()  # evicted hash -> (class, uses)
        self._seq = 0

    def reuse_probability(self, block_class: tuple) -> float:
        """Return the learned reuse probability of a class (the prior before any observation)."""
        reuses = self.num_reuses.get(block_class, 0)
        outcomes = self.num_outcomes.get(block_class, 0)
        prior = self.partial_prior_reuse if block_class == ("partial",) else self.prior_reuse
        return (reuses + prior * self.prior_weight) / (outcomes + self.prior_weight)

    @staticmethod
    def classify(meta: BlockMeta, uses: int) -> tuple:
        """Return the class of a block that has been used ``uses`` times (this use included)."""
        if meta.is_partial:
            return ("partial",)
        if uses >= 2:
            return ("used", min(uses, 4))
        num_new_blocks = max(meta.num_request_blocks - meta.num_request_cached_blocks, 0)
        return ("new", meta.num_request_cached_blocks > 0, _size_bucket(num_new_blocks))

    def _observe(self, block_class: tuple, reused: bool) -> None:
        self.num_outcomes[block_class] = self.num_outcomes.get(block_class, 0) + 1
        if reused:
            self.num_reuses[block_class] = self.num_reuses.get(block_class, 0) + 1

    def insert(self, block_id: int, meta: BlockMeta, now_s: float) -> None:
        if block_id in self._uses:  # back from a request that reused it
            uses = self._uses[block_id] + 1
        else:
            ghost = self._ghost.pop(meta.block_hash, None)
            if ghost is not None:  # evicted earlier and needed again: a miss that proves its class returns
                self._observe(ghost[0], reused=True)
                uses = ghost[1] + 1
            else:
                uses = 1
        block_class = self.classify(meta, uses)
        key_s = now_s + self.horizon_s * math.log(max(self.reuse_probability(block_class), 1e-6))
        self._seq += 1
        entry = (key_s, -meta.block_idx, self._seq)
        self._entry[block_id] = entry
        self._class_of[block_id] = block_class
        self._hash_of[block_id] = meta.block_hash
        self._uses[block_id] = uses
        heapq.heappush(self._heap, (*entry, block_id))

    def remove(self, block_id: int) -> None:
        del self._entry[block_id]
        del self._hash_of[block_id]
        self._observe(self._class_of.pop(block_id), reused=True)

    def pop_victim(self, now_s: float) -> int | None:
        while self._heap:
            key_s, neg_idx, seq, block_id = heapq.heappop(self._heap)
            if self._entry.get(block_id) != (key_s, neg_idx, seq):
                continue
            del self._entry[block_id]
            block_class = self._class_of.pop(block_id)
            self._ghost[self._hash_of.pop(block_id)] = (block_class, self._uses.pop(block_id))
            max_ghosts = int(self.ghost_factor * len(self._entry))
            while len(self._ghost) > max_ghosts:
                _, (old_class, _) = self._ghost.popitem(last=False)
                self._observe(old_class, reused=False)
            return block_id
        return None

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._entry


class _ChainBlock:
    """What :class:`ChainPolicy` remembers of one cached block (evictable or in use)."""

    __slots__ = ("block_id", "block_hash", "block_class", "released_s", "num_uses", "parent", "num_children",
                 "state")

    def __init__(self, block_id: int, block_hash: int) -> None:
        self.block_id = block_id
        self.block_hash = block_hash
        self.block_class: tuple = ()
        self.released_s = 0.0
        self.num_uses = 0  # requests that used the block (this content), across evictions via the ghost list
        self.parent: _ChainBlock | None = None  # the block before it in its chain, as last released
        self.num_children = 0  # cached blocks whose parent this is
        self.state = _IN_USE


_IN_USE, _QUEUED, _PARKED, _READY = range(4)


class ChainPolicy(EvictionPolicy):
    """Chain-aware, return-aware eviction: learn which kinds of chains come back; cut chains leaf first.

    Each request's released chain is classified once, as a whole (the pool releases a block table tail first, with
    one clock reading: consecutive inserts whose ``block_idx`` falls by one are one chain). Let ``known`` be the
    deepest block of the chain the policy already knows (cached, or evicted and still in the ghost list) and
    ``turn`` the number of requests that used it before; ``new`` is the number of blocks after it. Classes::

        (min(turn, 3), size_bucket(new))   every block of the chain ...
        ("shared", min(uses, 8))           ... except a block used by more requests than ``max(turn, 1)``: a prefix
                                           that several requests or turns share (system prompt, earlier turns)

    ``turn == 0`` is a fresh conversation; ``turn == 1`` with few new blocks is a conversation coming back
    ("a conversation that has returned once tends to return again": on the Mooncake conversation trace a chain
    that returned with ≤ 4 new blocks comes back again 55–70% of the time, a fresh one 32%, a chain that gained
    ≥ 8 new blocks on a shared prefix ~10%).

    The policy learns each class's *reuse fraction* ``p_c``: the share of its released blocks that a later request
    uses again within ``window_s`` (found by looking up up to 8 checkpoint hashes per chain segment; a chain is
    settled when it is ``window_s`` old, reused or not, so quick returns are not over-counted). Classes shrink
    towards the pooled fraction with ``prior_weight_blocks`` pseudo-blocks; before any chain has settled every
    class has the same ``p`` and the policy is LRU.

    Victim: the evictable block with the lowest expected return rate ``p_c × G(idle)``, with a hyperbolic decay
    ``G(a) = 1 / (1 + a / idle_scale_s)`` of the return rate with idle time ``a`` (heavy-tailed turn gaps), and
    ``G = 0`` once ``a >= window_s``: the class statistics say nothing about returns that late, so such blocks go
    first, oldest first (without the cut, blocks of a class with a high ``p_c`` squat for long idle times when the
    pool is large). Blocks wait in one LRU queue per class (release order, each chain tail first), so the
    lowest-rate block of a class is its queue head and a victim costs one look at each head, O(number of
    classes) — as LHD ranks by hit density per class and age (Beckmann et al., "LHD: Improving Cache Hit Rate by
    Maximizing Hit Density", NSDI'18).

    Leaves first: a child block is useless without its prefix (a lookup stops at the first miss), so a block that
    still has cached children is not evicted; it is parked and goes (first) once its last child has gone, as the
    radix tree of SGLang evicts leaves only (Zheng et al., "SGLang", 2024). Parent links come from the release
    order; blocks whose chain the pool releases in pieces simply have no link.

    Ghost list: evicted hashes (with their use counts) are kept for ``ghost_factor ×`` the largest evictable count
    seen, as in ARC (Megiddo & Modha, FAST'03), so a chain recomputed after its eviction still counts as returning.

    Compared with ``sluice``: classes are per chain (and per shared prefix) instead of per block, the reuse fraction
    is settled after a fixed window instead of learned from the ghost list (which over-counts quick returns), the
    age decay is hyperbolic instead of exponential, and eviction is leaf first.

    Args:
        window_s: seconds within which a reuse counts toward ``p_c`` (and after which a chain is settled).
        idle_scale_s: ``a`` at which ``G`` halves: about one chat turn (reading an answer, typing the next one).
        prior_reuse: the reuse fraction before anything has settled.
        prior_weight_blocks: pseudo-blocks behind the pooled fraction a class starts from.
        ghost_factor: ghost list size as a multiple of the largest evictable count seen.
    """

    name = "chain"
    MAX_TURN = 3
    MAX_SHARED_USES = 8
    NUM_CHECKPOINTS = 8

    def __init__(self, window_s: float = 600.0, idle_scale_s: float = 100.0, prior_reuse: float = 0.3,
                 prior_weight_blocks: float = 20.0, ghost_factor: float = 2.0) -> None:
        if (window_s <= 0 or idle_scale_s <= 0 or not 0.0 < prior_reuse <= 1.0 or prior_weight_blocks <= 0
                or ghost_factor < 0):
            raise ValueError("chain policy: window_s > 0, idle_scale_s > 0, 0 < prior_reuse <= 1, "
                             "prior_weight_blocks > 0, ghost_factor >= 0")
        self.window_s = window_s
        self.idle_scale_s = idle_scale_s
        self.prior_reuse = prior_reuse
        self.prior_weight_blocks = prior_weight_blocks
        self.ghost_factor = ghost_factor
        self.num_settled_blocks: dict[tuple, float] = {}  # class -> blocks released, settled
        self.num_reused_blocks: dict[tuple, float] = {}  # class -> of those, reused within the window
        self._reuse_fraction: dict[tuple, float] = {}  # cache of reuse_fraction(), cleared when a chain settles
        self._blocks: dict[int, _ChainBlock] = {}  # block_id -> cached block (evictable or in use)
        self._queues: dict[tuple, OrderedDict[int, None]] = {}  # class -> queued block ids, release order
        self._parked: OrderedDict[int, None] = OrderedDict()  # evictable blocks waiting for their children to go
        self._ready: OrderedDict[int, None] = OrderedDict()  # parked blocks whose children have all gone
        self._pending: list[tuple[int, BlockMeta, float]] = []  # the chain being released (tail first)
        self._num_evictable = 0  # queued + parked + ready blocks (pending ones not included)
        self._max_evictable = 0
        self._ghosts: OrderedDict[int, int] = OrderedDict()  # evicted block hash -> uses
        self._checkpoints: dict[int, tuple[list, int]] = {}  # block hash -> (segment record, blocks up to it)
        self._segments: deque[tuple[float, list[int], list[list]]] = deque()  # (released_s, hashes, records)

    # ------------------------------------------------------------------ the learned model

    def reuse_fraction(self, block_class: tuple) -> float:
        """Return ``p_c``: the learned share of a class's blocks reused within ``window_s``."""
        fraction = self._reuse_fraction.get(block_class)
        if fraction is None:
            weight = self.prior_weight_blocks
            pooled = ((sum(self.num_reused_blocks.values()) + self.prior_reuse * weight)
                      / (sum(self.num_settled_blocks.values()) + weight))
            fraction = ((self.num_reused_blocks.get(block_class, 0.0) + pooled * weight)
                        / (self.num_settled_blocks.get(block_class, 0.0) + weight))
            self._reuse_fraction[block_class] = fraction
        return fraction

    def return_rate(self, block_class: tuple, idle_s: float) -> float:
        """Return the ranking score ``p_c × G(idle_s)``, 0 from ``window_s`` of idle time on (lowest goes first)."""
        if idle_s >= self.window_s:
            return 0.0
        return self.reuse_fraction(block_class) / (1.0 + max(idle_s, 0.0) / self.idle_scale_s)

    @classmethod
    def classify(cls, turn: int, num_new_blocks: int, num_uses: int) -> tuple:
        """Return the class of a block used ``num_uses`` times before, in a chain of the given turn and growth."""
        if num_uses > max(turn, 1):
            return ("shared", min(num_uses, cls.MAX_SHARED_USES))
        return (min(turn, cls.MAX_TURN), _size_bucket(max(num_new_blocks, 1)))

    def _settle(self, now_s: float) -> None:
        """Settle the chains released ``window_s`` ago or earlier: add their blocks and reuses to the counts."""
        settled = False
        while self._segments and now_s - self._segments[0][0] >= self.window_s:
            _, hashes, records = self._segments.popleft()
            for block_hash in hashes:
                entry = self._checkpoints.get(block_hash)
                if entry is not None and any(entry[0] is record for record in records):
                    del self._checkpoints[block_hash]
            for block_class, num_blocks, num_reused in records:
                self.num_settled_blocks[block_class] = self.num_settled_blocks.get(block_class, 0.0) + num_blocks
                self.num_reused_blocks[block_class] = self.num_reused_blocks.get(block_class, 0.0) + num_reused
            settled = True
        if settled:
            self._reuse_fraction.clear()

    def _record(self, chain: list[tuple[int, BlockMeta, float]], now_s: float) -> None:
        """Register the checkpoints of a released chain (head first), one record per class segment."""
        by_class: dict[tuple, list[int]] = {}
        for block_id, meta, _ in reversed(chain):
            by_class.setdefault(self._blocks[block_id].block_class, []).append(meta.block_hash)
        hashes, records = [], []
        for block_class, segment in by_class.items():
            record = [block_class, len(segment), 0]
            records.append(record)
            for j in range(1, self.NUM_CHECKPOINTS + 1):
                position = -(-len(segment) * j // self.NUM_CHECKPOINTS)  # blocks up to this checkpoint
                block_hash = segment[position - 1]
                if not hashes or hashes[-1] != block_hash:
                    self._checkpoints[block_hash] = (record, position)
                    hashes.append(block_hash)
        self._segments.append((now_s, hashes, records))

    # ------------------------------------------------------------------ release groups

    def _flush(self) -> None:
        """Classify and queue the pending chain (tail first), link parents, mark the reuses it proves."""
        chain, self._pending = self._pending, []
        if not chain:
            return
        now_s = chain[0][2]
        num_uses = []
        for block_id, meta, _ in chain:
            entry = self._checkpoints.get(meta.block_hash)
            if entry is not None:
                entry[0][2] = max(entry[0][2], entry[1])
            block = self._blocks.get(block_id)
            if block is not None and block.block_hash == meta.block_hash:
                num_uses.append(block.num_uses)
            else:
                num_uses.append(self._ghosts.pop(meta.block_hash, 0))
        known = next((i for i, uses in enumerate(num_uses) if uses > 0), None)  # the deepest known block
        num_blocks = chain[0][1].block_idx + 1
        if known is None:  # none in this chain; a prefix released apart from it (still in use) may have hit
            num_known = min(chain[0][1].num_request_cached_blocks, num_blocks - 1)
            turn = 1 if num_known > 0 else 0
        else:
            turn, num_known = num_uses[known], chain[known][1].block_idx + 1
        child: _ChainBlock | None = None
        for (block_id, meta, _), uses in zip(chain, num_uses):
            block = self._blocks.get(block_id)
            if block is not None and block.state != _IN_USE:  # inserted twice without a remove: re-queue it
                self._detach(block)
            if block is None or block.block_hash != meta.block_hash:
                if block is not None:  # the id holds other content now (a policy switched back to, say)
                    self._unlink(block)
                block = self._blocks[block_id] = _ChainBlock(block_id, meta.block_hash)
            block.num_uses = uses + 1
            block.block_class = self.classify(turn, num_blocks - num_known, uses)
            block.released_s = now_s
            block.state = _QUEUED
            self._queues.setdefault(block.block_class, OrderedDict())[block_id] = None
            if child is not None and child.parent is not block:
                self._unlink(child)
                child.parent = block
                block.num_children += 1
            child = block if meta.block_idx > 0 else None
        self._num_evictable += len(chain)
        self._max_evictable = max(self._max_evictable, self._num_evictable)
        self._record(chain, now_s)

    def _unlink(self, child: _ChainBlock) -> None:
        """Drop ``child``'s parent link; a parked parent left without children becomes ready."""
        parent, child.parent = child.parent, None
        if parent is None:
            return
        parent.num_children -= 1
        if parent.num_children == 0 and parent.state == _PARKED and self._blocks.get(parent.block_id) is parent:
            del self._parked[parent.block_id]
            parent.state = _READY
            self._ready[parent.block_id] = None

    def _detach(self, block: _ChainBlock) -> None:
        """Take an evictable block out of its queue (or the parked / ready set); it is in use afterwards."""
        if block.state == _QUEUED:
            del self._queues[block.block_class][block.block_id]
        elif block.state == _PARKED:
            del self._parked[block.block_id]
        elif block.state == _READY:
            del self._ready[block.block_id]
        block.state = _IN_USE
        self._num_evictable -= 1

    # ------------------------------------------------------------------ the interface

    def insert(self, block_id: int, meta: BlockMeta, now_s: float) -> None:
        self._settle(now_s)
        if self._pending:
            last_meta, last_now_s = self._pending[-1][1], self._pending[-1][2]
            if now_s != last_now_s or meta.block_idx != last_meta.block_idx - 1:
                self._flush()
        self._pending.append((block_id, meta, now_s))
        if meta.block_idx == 0:
            self._flush()

    def remove(self, block_id: int) -> None:
        self._flush()
        block = self._blocks.get(block_id)
        if block is None or block.state == _IN_USE:
            raise KeyError(block_id)
        self._detach(block)

    def pop_victim(self, now_s: float) -> int | None:
        self._settle(now_s)
        self._flush()
        while True:
            if self._ready:
                block_id, _ = self._ready.popitem(last=False)
                return self._evict(block_id)
            best = None
            for block_class, queue in self._queues.items():
                if not queue:
                    continue
                block_id = next(iter(queue))
                block = self._blocks[block_id]
                key = (self.return_rate(block_class, now_s - block.released_s), block.released_s)
                if best is None or key < best[0]:
                    best = (key, block_class, block_id)
            if best is None:
                if not self._parked:
                    return None
                block_id, _ = self._parked.popitem(last=False)  # children not evictable: a stale link
                return self._evict(block_id)
            _, block_class, block_id = best
            del self._queues[block_class][block_id]
            block = self._blocks[block_id]
            if block.num_children > 0:
                block.state = _PARKED  # its children go first; it follows the last of them
                self._parked[block_id] = None
                continue
            return self._evict(block_id)

    def _evict(self, block_id: int) -> int:
        block = self._blocks.pop(block_id)
        self._num_evictable -= 1
        self._unlink(block)
        self._ghosts[block.block_hash] = block.num_uses
        max_ghosts = int(self.ghost_factor * self._max_evictable)
        while len(self._ghosts) > max_ghosts:
            self._ghosts.popitem(last=False)
        return block_id

    def __len__(self) -> int:
        return self._num_evictable + len(self._pending)

    def __contains__(self, block_id: int) -> bool:
        block = self._blocks.get(block_id)
        if block is not None and block.state != _IN_USE:
            return True
        return any(pending_id == block_id for pending_id, _, _ in self._pending)


_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "ttl": TTLPolicy,
    "tier": TierPolicy,
    "sluice": SluicePolicy,
    "chain": ChainPolicy,
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


PRESSURE_LEVELS = ("normal", "elevated", "critical")


def retention_for_pressure(level: str, config: RetentionConfig = RetentionConfig()) -> RetentionSettings:
    """Return the retention settings to apply at pressure ``level``.

    Raises:
        ValueError: unknown level; the message lists the valid ones.
    """
    if level not in PRESSURE_LEVELS:
        raise ValueError(f"unknown pressure level {level!r}; valid: {', '.join(PRESSURE_LEVELS)}")
    return getattr(config, level)


def block_expiry_s(settings: RetentionSettings, tier_priority: int, retention_s: float, now_s: float) -> float:
    """Return the ``BlockMeta.expires_at_s`` of a block released at ``now_s`` under ``settings``.

    Args:
        settings: the current level's settings (:func:`retention_for_pressure`).
        tier_priority: priority of the tier of the request releasing the block.
        retention_s: the request's retention wish in seconds, already bounded by its tier (``inf`` = none).
        now_s: release time on the policy clock, seconds.
    """
    if tier_priority < settings.min_retained_tier_priority:
        return now_s
    scaled_s = retention_s * settings.ttl_scale if settings.ttl_scale > 0 else 0.0  # inf × 0 would be nan
    return now_s + min(scaled_s, settings.max_ttl_s)


def caches_new_request(settings: RetentionSettings, tier_priority: int) -> bool:
    """Whether a request of a tier with ``tier_priority`` admitted now may put its blocks in the prefix cache."""
    return tier_priority >= settings.min_cached_tier_priority
