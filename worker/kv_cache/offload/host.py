"""Host RAM tier: a preallocated slab of block-sized slots (pinned memory when the pool is on CUDA).

::

    slab: [num_slots, block_bytes] uint8, CPU (pinned on CUDA)      num_slots = capacity_bytes // block_bytes
    slot s holds one block's [num_layers, 2, num_kv_heads, block_size, head_dim] slice of the pool, as bytes

One allocation at start (the pages are only touched when used), so serving never allocates host memory per block
and the worker's RSS stays flat (BC33).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from worker.kv_cache.offload.base import OffloadedBlock, OffloadTier, _Entry, stacked_rows
from worker.kv_cache.stats import KVStats


class HostTier(OffloadTier):
    """Bounded host-RAM store of KV blocks.

    Args:
        capacity_bytes: host RAM for block data; rounded down to whole blocks.
        block_bytes: bytes of one block (:attr:`worker.model_runner.KVBlockIO.block_bytes`).
        pin_memory: allocate the slab in page-locked memory (fast, asynchronous copies to and from CUDA).
        stats, lower, clock: see :class:`OffloadTier`.
    """

    name = "host"

    def __init__(self, capacity_bytes: int, block_bytes: int, pin_memory: bool = False, stats: KVStats | None = None,
                 lower: OffloadTier | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if block_bytes < 1:
            raise ValueError(f"host tier: block_bytes must be >= 1, got {block_bytes}")
        num_slots = capacity_bytes // block_bytes
        super().__init__(num_slots * block_bytes, stats, lower, clock)
        self.block_bytes = block_bytes
        self.slab = torch.empty((num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin_memory and num_slots > 0)
        self._free_slots = list(range(num_slots - 1, -1, -1))

    def _store(self, block: OffloadedBlock) -> int | None:
        if block.data.numel() != self.block_bytes or not self._free_slots:
            return None
        slot = self._free_slots.pop()
        self.slab[slot].copy_(block.data)
        return slot

    def _store_many(self, blocks) -> list[int | None]:
        """Copy the batch into free slots with one copy (blocks that do not fit a slot get None)."""
        handles: list[int | None] = [None] * len(blocks)
        fits = [pos for pos, block in enumerate(blocks) if block.data.numel() == self.block_bytes]
        fits = fits[:len(self._free_slots)]
        if not fits:
            return handles
        slots = [self._free_slots.pop() for _ in fits]
        self.slab.index_copy_(0, torch.tensor(slots), stacked_rows([blocks[pos].data for pos in fits]))
        for pos, slot in zip(fits, slots):
            handles[pos] = slot
        return handles

    def put_from_pool(self, io, evicted: Sequence[tuple[int, int, int | None, Sequence[int], float]]) -> list[bool]:
        """Store evicted pool blocks as :meth:`put_many` does, each copied from the pool straight into its slot.

        One copy per block and no staging buffer: for a pool on the CPU, where a copy costs the same however it is
        batched (on CUDA one gathered transfer beats a transfer per block: use ``put_many``).

        Args:
            io: :class:`~worker.model_runner.KVBlockIO` over the pool.
            evicted: ``(block_id, block_hash, parent_hash, token_ids, expires_at_s)`` per block, at most
                ``num_slots`` of them.

        Returns:
            Per block, whether the tier now holds it.

        Raises:
            ValueError: more blocks than slots.
        """
        if len(evicted) > self.slab.shape[0]:
            raise ValueError(f"host tier: {len(evicted)} blocks for {self.slab.shape[0]} slots; use put_many")
        now_s = self.clock()
        new: dict[int, int] = {}  # block_hash -> position in evicted
        for pos, (_, block_hash, _, _, expires_at_s) in enumerate(evicted):
            if expires_at_s <= now_s:
                continue
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
            elif block_hash not in new:
                new[block_hash] = pos
        self._make_room(len(new) * self.block_bytes, [])
        for block_hash, pos in new.items():
            block_id, _, parent_hash, token_ids, expires_at_s = evicted[pos]
            slot = self._free_slots.pop()
            io.read_block(block_id, out=self.slab[slot])
            self._index[block_hash] = _Entry(parent_hash, tuple(token_ids), self.block_bytes, expires_at_s, slot)
            self.used_bytes += self.block_bytes
        if new:
            self.stats.add("offloaded_bytes", len(new) * self.block_bytes, tier=self.name)
            self.stats.add("offloaded_blocks", len(new), tier=self.name)
        return [block_hash in self._index for _, block_hash, _, _, _ in evicted]

    def _load(self, entry: _Entry) -> tuple[int | None, tuple[int, ...], torch.Tensor]:
        return entry.parent_hash, entry.token_ids, self.slab[entry.handle]

    def _drop(self, entry: _Entry) -> None:
        self._free_slots.append(entry.handle)
