"""The adaptive policy: follow whichever of several rankings is winning on shadow caches of the same traffic."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from worker.kv_cache.eviction.base import BlockMeta, EvictionPolicy
from worker.kv_cache.eviction.chain import ChainPolicy
from worker.kv_cache.eviction.classic import LFUPolicy, LRUPolicy
from worker.kv_cache.eviction.sluice import SluicePolicy


class ShadowCache:
    """A cache of block hashes with its own instance of one policy, fed the chains the real cache releases.

    It counts the prefix hits that policy would have had if it had made every decision, at the size it is given:
    an auxiliary tag directory in the sense of Qureshi et al. ("Adaptive Insertion Policies for High Performance
    Caching", ISCA'07), for a fully associative cache of prefix chains. A chain is replayed as the cache simulator
    serves a request: the leading run of resident hashes is a hit (reuse stops at the first miss); each
    later hash not resident takes a slot (evicting the policy's victims once ``capacity_blocks`` are resident);
    a resident hash after the first miss is recomputed and its cached copy left alone. Then every block of the
    chain is released tail first, as the pool releases a block table.

    Attributes:
        policy: the shadow's own policy instance; its block ids are block hashes.
        score: hit blocks since the real pool first evicted (what :class:`AdaptivePolicy` ranks experts by).
        num_hit_blocks: hit blocks since the start.
        on_evict: called with each hash the shadow evicts.
    """

    def __init__(self, policy: EvictionPolicy, on_evict: Callable[[int], None] | None = None) -> None:
        self.policy = policy
        self.on_evict = on_evict
        self.score = 0.0
        self.num_hit_blocks = 0
        self._num_uses: dict[int, int] = {}  # resident block hash -> requests that used it

    def __len__(self) -> int:
        """Number of resident blocks."""
        return len(self._num_uses)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._num_uses

    def replay(self, chain: Sequence[BlockMeta], now_s: float, capacity_blocks: int | None) -> int:
        """Serve one released chain (head first); return its leading-run hit blocks.

        Args:
            chain: ``[num_blocks]`` metas of the chain's blocks, ``block_idx`` ascending.
            now_s: release time on the policy clock, seconds.
            capacity_blocks: resident blocks at most; None = unbounded (the real pool has not evicted yet).
        """
        num_hits = 0
        for meta in chain:
            if meta.block_hash not in self._num_uses:
                break
            num_hits += 1
        released: list[BlockMeta] = []
        for meta in chain[:num_hits]:
            if meta.block_hash in self.policy:
                self.policy.remove(meta.block_hash)
                self._num_uses[meta.block_hash] += 1
                released.append(meta)
        for meta in chain[num_hits:]:
            if meta.block_hash in self._num_uses:
                continue
            if capacity_blocks is not None and not self._make_room(capacity_blocks, now_s):
                continue  # every resident block is in use: served uncached
            self._num_uses[meta.block_hash] = 1
            released.append(meta)
        for meta in reversed(released):
            num_uses = self._num_uses[meta.block_hash]
            shadow_meta = msgspec.structs.replace(meta, expires_at_s=float("inf"), last_access_s=now_s,
                                                  num_hits=num_uses - 1, num_request_cached_blocks=num_hits)
            self.policy.insert(meta.block_hash, shadow_meta, now_s)
        self.num_hit_blocks += num_hits
        return num_hits

    def _make_room(self, capacity_blocks: int, now_s: float) -> bool:
        while len(self._num_uses) >= capacity_blocks:
            victim = self.policy.pop_victim(now_s)
            if victim is None:
                return False
            del self._num_uses[victim]
            if self.on_evict is not None:
                self.on_evict(victim)
        return True


DEFAULT_EXPERTS: tuple[Callable[[], EvictionPolicy], ...] = (LRUPolicy, LFUPolicy, SluicePolicy, ChainPolicy)


class AdaptivePolicy(EvictionPolicy):
    """Evict by whichever ranking is winning on this traffic (LRU, LFU, return-aware, chain-aware), learned online.

    No ranking wins on every trace: the return-aware ``sluice`` ranking beats LRU by 5–17 points of Belady's hit
    share on conversation traffic with returns and falls 10 points below it on chats that come back within seconds;
    LFU wins where a few prefixes are hot. So this policy runs them all and learns online which one to follow, as
    ARC adapts between recency and frequency from ghost hits (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead
    Replacement Cache", FAST'03) and LeCaR weighs LRU against LFU by their regrets (Vietri et al., "Driving Cache
    Replacement with ML-based LeCaR", HotStorage'18). The choice is made as in dynamic insertion with auxiliary tag
    directories (Qureshi et al., "Adaptive Insertion Policies for High Performance Caching", ISCA'07): each expert
    also runs alone on a :class:`ShadowCache` of the real cache's size, fed the same released chains, and the real
    cache follows the expert whose shadow has hit most.

    - **Experts over the real set.** Every expert keeps its order over the real evictable blocks. The leader picks
      each victim and the others drop it with :meth:`EvictionPolicy.discard` (their ghost lists and learned classes
      follow the real cache's evictions), so a switch of leader takes effect at the next eviction.
    - **Catching up with the leader.** A block of the real cache that the leader's shadow no longer holds (the
      leader would have evicted it already) goes before the leader's own ranking, oldest first: after a switch the
      real cache converges to the content the winning policy would have, instead of mixing two policies' choices.
    - **Shadow size.** The largest evictable count seen: the real cache's room for cached blocks once it is full.
      The shadows are unbounded (and identical, so no evidence accrues) until the real pool first evicts.
    - **Whole requests.** The pool releases only the blocks it caches: a block recomputed after the first miss
      whose hash is still cached elsewhere is not released, and the shadows get it back from the parent → child
      links of earlier releases (:meth:`_complete`).
    - **Leader.** The expert with the most shadow hits since the real pool first evicted; the incumbent keeps the
      lead on a tie, and LRU leads before any evidence, so traffic on which no ranking is better is served exactly
      as LRU. Counts are not decayed: any window would be a constant to fit, and on a stationary mix the
      cumulative count is the least noisy estimate. After a change of traffic the new best expert takes over once
      its hits since the change outweigh the old leader's lead.
    - **Retention.** A block whose retention deadline (``BlockMeta.expires_at_s``) has passed goes first, earliest
      deadline first, whatever the leader (as in the ``ttl`` policy): a pressure level that shortens TTLs or stops
      retaining lower tiers (:func:`~worker.kv_cache.eviction.retention.block_expiry_s`) makes this policy evict
      those blocks before any other.

    Cost: every event goes to every expert (O(log n) each, O(classes) for ``chain``'s victim) and every released
    chain is replayed in every shadow: about twice the work and the memory of running the experts alone, each.

    Args:
        experts: factories of the candidate policies; the first one leads before any evidence.

    Raises:
        ValueError: no expert.
    """

    name = "adaptive"

    def __init__(self, experts: Sequence[Callable[[], EvictionPolicy]] = DEFAULT_EXPERTS) -> None:
        if not experts:
            raise ValueError("adaptive policy: at least one expert policy")
        self.experts = [factory() for factory in experts]
        self.shadows = [ShadowCache(factory(), self._orphan_callback(idx)) for idx, factory in enumerate(experts)]
        self._orphans: list[dict[int, None]] = [{} for _ in experts]  # per shadow: evictable ids it does not hold
        self._hash_of: dict[int, int] = {}  # evictable block_id -> block_hash
        self._id_of_hash: dict[int, int] = {}  # block_hash -> evictable block_id
        self.leader = 0
        self.num_victims_by_expert = [0] * len(self.experts)
        self._seq_of: dict[int, int] = {}  # evictable block_id -> insertion seq
        self._deadlines: list[tuple[float, int, int]] = []  # (expires_at_s, seq, block_id), lazy deletion
        self._seq = 0
        self._pending: list[BlockMeta] = []  # the chain being released, tail first
        self._pending_s = 0.0
        self._max_evictable = 0
        self._has_evicted = False
        self._child_of: OrderedDict[int, int] = OrderedDict()  # block hash -> its last child's, oldest first

    @property
    def leader_name(self) -> str:
        """Name of the expert that picks the victims now."""
        return self.experts[self.leader].name

    def insert(self, block_id: int, meta: BlockMeta, now_s: float) -> None:
        if self._pending and (now_s != self._pending_s or meta.block_idx >= self._pending[-1].block_idx):
            self._replay()
        self._pending.append(meta)
        self._pending_s = now_s
        for expert in self.experts:
            expert.insert(block_id, meta, now_s)
        self._seq += 1
        self._seq_of[block_id] = self._seq
        self._hash_of[block_id] = meta.block_hash
        self._id_of_hash[meta.block_hash] = block_id
        if meta.expires_at_s != float("inf"):
            heapq.heappush(self._deadlines, (meta.expires_at_s, self._seq, block_id))
        self._max_evictable = max(self._max_evictable, len(self._seq_of))
        if meta.block_idx == 0:
            self._replay()

    def remove(self, block_id: int) -> None:
        if block_id not in self._seq_of:
            raise KeyError(block_id)
        self._replay()
        self._forget(block_id)
        for expert in self.experts:
            expert.remove(block_id)

    def pop_victim(self, now_s: float) -> int | None:
        self._replay()
        self._has_evicted = True
        victim = self._pop_expired(now_s)
        chooser = None
        if victim is None and self._orphans[self.leader]:
            victim = next(iter(self._orphans[self.leader]))
        if victim is None:
            chooser = self.leader
            victim = self.experts[chooser].pop_victim(now_s)
            if victim is None:
                return None
            self.num_victims_by_expert[chooser] += 1
        for idx, expert in enumerate(self.experts):
            if idx != chooser:
                expert.discard(victim)
        self._forget(victim)
        return victim

    def _forget(self, block_id: int) -> None:
        del self._seq_of[block_id]
        block_hash = self._hash_of.pop(block_id)
        if self._id_of_hash.get(block_hash) == block_id:
            del self._id_of_hash[block_hash]
        for orphans in self._orphans:
            orphans.pop(block_id, None)

    def _orphan_callback(self, idx: int) -> Callable[[int], None]:
        def on_shadow_evict(block_hash: int) -> None:
            block_id = self._id_of_hash.get(block_hash)
            if block_id is not None:
                self._orphans[idx][block_id] = None
        return on_shadow_evict

    def __len__(self) -> int:
        return len(self._seq_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._seq_of

    def _pop_expired(self, now_s: float) -> int | None:
        while self._deadlines and self._deadlines[0][0] <= now_s:
            _, seq, block_id = heapq.heappop(self._deadlines)
            if self._seq_of.get(block_id) == seq:
                return block_id
        return None

    def _complete(self, released: list[BlockMeta]) -> list[BlockMeta]:
        """Return the released chain head first, with the blocks the pool did not release filled in.

        The pool releases only the blocks it caches. A block after the first miss whose hash another cached
        block already holds is recomputed and not cached again, so that cached copy is neither reused nor
        released: a gap in ``block_idx``. The shadows need the whole request, so a gap is filled with the child
        its previous block had in the last release that held both, provided the real cache holds that child (a
        gap block always is in the real cache). Child links are kept for the ``(1 + number of shadows) ×``
        shadow size most recently released hashes: the real cache and the shadows hold no more blocks than that.
        """
        chain = [released[-1]]  # head first
        for meta in reversed(released[:-1]):
            while chain[-1].block_idx + 1 < meta.block_idx:
                child_hash = self._child_of.get(chain[-1].block_hash)
                if child_hash is None or child_hash not in self._id_of_hash:
                    break
                chain.append(msgspec.structs.replace(meta, block_hash=child_hash,
                                                     block_idx=chain[-1].block_idx + 1, is_partial=False))
            chain.append(meta)
        for parent, child in zip(chain, chain[1:]):
            if child.block_idx == parent.block_idx + 1:
                self._child_of[parent.block_hash] = child.block_hash
                self._child_of.move_to_end(parent.block_hash)
        max_links = (1 + len(self.shadows)) * max(self._max_evictable, len(chain))
        while len(self._child_of) > max_links:
            self._child_of.popitem(last=False)
        return chain

    def _replay(self) -> None:
        """Replay the pending chain in every shadow, decay and add their hits, and pick the leader."""
        released, self._pending = self._pending, []
        if not released:
            return
        chain = self._complete(released)
        capacity_blocks = self._max_evictable if self._has_evicted else None
        hits = [shadow.replay(chain, self._pending_s, capacity_blocks) for shadow in self.shadows]
        for meta in chain:
            block_id = self._id_of_hash.get(meta.block_hash)
            if block_id is None:
                continue
            for shadow, orphans in zip(self.shadows, self._orphans):
                if meta.block_hash in shadow:
                    orphans.pop(block_id, None)
                else:
                    orphans[block_id] = None
        if capacity_blocks is None:
            return  # the real cache has not evicted: every shadow holds everything, no evidence yet
        for shadow, num_hits in zip(self.shadows, hits):
            shadow.score += num_hits
        best = max(range(len(self.shadows)), key=lambda idx: self.shadows[idx].score)
        if self.shadows[best].score > self.shadows[self.leader].score:
            self.leader = best
