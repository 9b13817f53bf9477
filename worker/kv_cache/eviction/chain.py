"""The chain-aware, return-aware policy: learn which kinds of chains come back; cut chains leaf first."""

from __future__ import annotations

from collections import OrderedDict, deque

from worker.kv_cache.eviction.base import BlockMeta, EvictionPolicy
from worker.kv_cache.eviction.sluice import _size_bucket


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

    def discard(self, block_id: int) -> None:
        """Drop an evictable block evicted on another policy's choice: unlinked and ghost-listed like a victim."""
        self._flush()
        block = self._blocks.get(block_id)
        if block is None or block.state == _IN_USE:
            raise KeyError(block_id)
        self._detach(block)
        self._num_evictable += 1  # _evict counts it out
        self._evict(block_id)

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
