"""The classic policies: least recently used, least frequently used (with aging), deadlines, tiers."""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict

from worker.kv_cache.eviction.base import BlockMeta, EvictionPolicy


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
