"""The return-aware policy: rank blocks by the learned reuse probability of their class and their idle time."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from worker.kv_cache.eviction.base import BlockMeta, EvictionPolicy


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
            self._evict(block_id)
            return block_id
        return None

    def discard(self, block_id: int) -> None:
        """Drop an evictable block evicted on another policy's choice: it enters the ghost list like a victim."""
        if block_id not in self._entry:
            raise KeyError(block_id)
        self._evict(block_id)  # its heap entry goes stale and is skipped later

    def _evict(self, block_id: int) -> None:
        del self._entry[block_id]
        block_class = self._class_of.pop(block_id)
        self._ghost[self._hash_of.pop(block_id)] = (block_class, self._uses.pop(block_id))
        max_ghosts = int(self.ghost_factor * len(self._entry))
        while len(self._ghost) > max_ghosts:
            _, (old_class, _) = self._ghost.popitem(last=False)
            self._observe(old_class, reused=False)

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._entry
