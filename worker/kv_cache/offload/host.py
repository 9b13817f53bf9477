"""Host RAM tier: a preallocated slab of block-sized slots (pinned memory when the pool is on CUDA).

::

    slab: [num_slots, block_bytes] uint8, CPU (pinned on CUDA)      num_slots = capacity_bytes // block_bytes
    slot s holds one block's [num_layers, 2, num_kv_heads, block_size, head_dim] slice of the pool, as bytes

One allocation at start (the pages are only touched when used), so serving never allocates host memory per block
and the worker's RSS stays flat (BC33).
"""

from __future__ import annotations

import time
from collections.abc import Callable

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

    def _load(self, entry: _Entry) -> tuple[int | None, tuple[int, ...], torch.Tensor]:
        return entry.parent_hash, entry.token_ids, self.slab[entry.handle]

    def _drop(self, entry: _Entry) -> None:
        self._free_slots.append(entry.handle)
