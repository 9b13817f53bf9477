"""Swap space: host RAM holding the whole block table of sequences preempted by swap, until they resume.

Unlike the host tier (a cache of full, hashed blocks that may be dropped), swapped blocks include a sequence's
partial last block and are never evicted: a swapped sequence must get them back. A preallocated slab
(``[num_slots, block_bytes] uint8``, pinned on CUDA) as in :class:`~worker.kv_cache.offload.host.HostTier`.
"""

from __future__ import annotations

import time

import torch

from worker.kv_cache.stats import KVStats


class SwapSpace:
    """Slots of host RAM for swapped-out KV blocks, by request.

    Args:
        capacity_bytes: host RAM for swapped blocks; rounded down to whole blocks.
        io: the model runner's :class:`~worker.model_runner.KVBlockIO` (copies blocks out of / into the pool).
        stats: counters (``swapped_out_bytes``, ``swapped_in_bytes``).
    """

    def __init__(self, capacity_bytes: int, io, stats: KVStats | None = None) -> None:
        self.io = io
        self.block_bytes = io.block_bytes
        self.num_slots = max(0, capacity_bytes // self.block_bytes)
        self.capacity_bytes = self.num_slots * self.block_bytes
        self.stats = stats if stats is not None else KVStats()
        self.slab = torch.empty((self.num_slots, self.block_bytes), dtype=torch.uint8,
                                pin_memory=io.pin_memory and self.num_slots > 0)
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._slots_of: dict[str, list[int]] = {}

    @property
    def used_bytes(self) -> int:
        return (self.num_slots - len(self._free_slots)) * self.block_bytes

    def can_hold(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free_slots)

    def holds(self, request_id: str) -> bool:
        return request_id in self._slots_of

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._slots_of.get(request_id, ()))

    def swap_out(self, request_id: str, block_ids: list[int]) -> float:
        """Copy the blocks ``block_ids`` (a block table, in order) out of the pool; return the seconds it took.

        Raises:
            ValueError: not enough free slots (call :meth:`can_hold` first) or the request is already swapped.
        """
        if not self.can_hold(len(block_ids)) or request_id in self._slots_of:
            raise ValueError(f"cannot swap out {request_id!r}: {len(block_ids)} blocks, "
                             f"{len(self._free_slots)} free slots")
        start_s = time.perf_counter()
        slots = [self._free_slots.pop() for _ in block_ids]
        for slot, block_id in zip(slots, block_ids):
            self.io.read_block(block_id, out=self.slab[slot])
        self._slots_of[request_id] = slots
        self.stats.add("swapped_out_bytes", len(slots) * self.block_bytes)
        return time.perf_counter() - start_s

    def swap_in(self, request_id: str, block_ids: list[int], skip: int = 0) -> float:
        """Copy swapped blocks ``skip, skip + 1, …`` into the pool blocks ``block_ids`` and free the slots.

        The first ``skip`` swapped blocks are not copied (the caller found them in the prefix cache). Returns the
        seconds it took.
        """
        slots = self._slots_of.pop(request_id)
        start_s = time.perf_counter()
        for slot, block_id in zip(slots[skip:], block_ids):
            self.io.write_block(block_id, self.slab[slot])
        self._free_slots.extend(reversed(slots))
        self.stats.add("swapped_in_bytes", len(block_ids) * self.block_bytes)
        return time.perf_counter() - start_s

    def drop(self, request_id: str) -> None:
        """Free a request's slots without copying (it was aborted while swapped); unknown ids are ignored."""
        self._free_slots.extend(reversed(self._slots_of.pop(request_id, [])))
