"""One offload tier: a bounded store of KV blocks keyed by chain hash, least recently used evicted first.

A tier stores a block's bytes (``[block_bytes] uint8`` on the CPU: the block's ``[num_layers, 2, num_kv_heads,
block_size, head_dim]`` slice of the pool, whatever its dtype) with the parent hash and token ids it was computed
from, so a reload can verify it serves exactly the asked prefix. A tier never holds more than ``capacity_bytes``;
its least recently used block is pushed out first and handed to the ``lower`` tier, if any (host → disk → Redis).
"""

from __future__ import annotations

import abc
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker.kv_cache.stats import KVStats


@dataclass
class OffloadedBlock:
    """A KV block outside the device pool.

    Attributes:
        block_hash: chain hash of the block (:func:`worker.kv_cache.prefix_cache.hash_block_tokens`).
        parent_hash: chain hash of the previous block, None for block 0.
        token_ids: the ``block_size`` token ids the block's K/V were computed from.
        data: ``[block_bytes] uint8``, CPU; from a tier's ``get`` it may be a view into the tier's memory, valid
            until the next call on that tier.
        expires_at_s: retention deadline on the tier's clock (seconds); ``inf`` = none.
    """

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    data: torch.Tensor
    expires_at_s: float = float("inf")

    def matches(self, parent_hash: int | None, token_ids: Sequence[int]) -> bool:
        """Whether the block holds exactly this content (a hash collision never passes)."""
        return self.parent_hash == parent_hash and self.token_ids == tuple(token_ids)


def stacked_rows(datas: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[n, block_bytes] uint8``: the blocks' data as one tensor; no copy when they are already consecutive rows of
    one 2-D tensor (as :meth:`~worker.model_runner.KVBlockIO.read_blocks` returns them), else one copy."""
    base = datas[0]._base if datas else None
    if base is not None and base.dim() == 2 and base.is_contiguous() and base.shape[1] == datas[0].numel():
        row_bytes = base.shape[1] * base.element_size()
        first_row, misaligned = divmod(datas[0].data_ptr() - base.data_ptr(), row_bytes)
        if (not misaligned and first_row + len(datas) <= base.shape[0]
                and all(data._base is base and data.data_ptr() == datas[0].data_ptr() + i * row_bytes
                        for i, data in enumerate(datas))):
            return base[first_row:first_row + len(datas)]
    return torch.stack(list(datas))


class ReusableRows:
    """Row buffers (``[num_rows, row_bytes] uint8``, CPU) that a background writer hands back for reuse.

    A tier that keeps a copy of a batch until its writer thread is done with it takes the copy's memory here instead
    of allocating it: fresh memory of a batch's size (tens of MB) comes straight from the kernel and is page-faulted
    in on the first write, which costs several times the copy itself on the engine step. Buffers are sized in powers
    of two rows so that batches of varying sizes reuse them; at most ``max_spare_buffers`` wait for reuse.

    :meth:`take` is called by one thread (the engine's); :meth:`release` by any.
    """

    def __init__(self, row_bytes: int, max_spare_buffers: int = 4) -> None:
        self.row_bytes = row_bytes
        self.max_spare_buffers = max_spare_buffers
        self._spare: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, num_rows: int) -> torch.Tensor:
        """Return ``[num_rows, row_bytes] uint8`` rows (contents undefined), the leading rows of a spare buffer
        when one is large enough, else of a new one."""
        with self._lock:
            fits = [idx for idx, buf in enumerate(self._spare) if buf.shape[0] >= num_rows]
            # by position: list.remove would compare tensors element by element
            buffer = self._spare.pop(min(fits, key=lambda idx: self._spare[idx].shape[0])) if fits else None
        if buffer is None:
            buffer = torch.empty((1 << max(0, num_rows - 1).bit_length(), self.row_bytes), dtype=torch.uint8)
        return buffer[:num_rows]

    def release(self, rows: torch.Tensor) -> None:
        """Hand back rows from :meth:`take` (the caller no longer reads or writes them)."""
        buffer = rows._base if rows._base is not None else rows
        with self._lock:
            if len(self._spare) < self.max_spare_buffers:
                self._spare.append(buffer)


@dataclass
class _Entry:
    parent_hash: int | None
    token_ids: tuple[int, ...]
    nbytes: int
    expires_at_s: float
    handle: object  # where the tier keeps the bytes: a slot, a file path, a Redis key


class OffloadTier(abc.ABC):
    """A bounded LRU store of :class:`OffloadedBlock` keyed by chain hash.

    Subclasses say where bytes live (:meth:`_store`, :meth:`_load`, :meth:`_drop`); the bound, recency, expiry
    and demotion to ``lower`` are common.

    Args:
        capacity_bytes: most bytes of block data held at once.
        stats: counters (``offloaded_*``, ``offload_evicted_blocks``, ``reloaded_*`` are kept by the chain).
        lower: the next tier down, which receives blocks pushed out of this one; None drops them.
        clock: seconds, the same clock as ``OffloadedBlock.expires_at_s``.
    """

    name: str = ""

    def __init__(self, capacity_bytes: int, stats: KVStats | None = None, lower: OffloadTier | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{self.name} tier: capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = stats if stats is not None else KVStats()
        self.lower = lower
        self.clock = clock
        self.used_bytes = 0
        self._index: OrderedDict[int, _Entry] = OrderedDict()  # LRU first

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def contains(self, block_hash: int) -> bool:
        """Whether the tier holds an unexpired block with this hash."""
        entry = self._index.get(block_hash)
        return entry is not None and entry.expires_at_s > self.clock()

    def contains_many(self, block_hashes: Sequence[int]) -> list[bool]:
        """Return :meth:`contains` for each hash (a remote tier answers in one round trip)."""
        return [self.contains(block_hash) for block_hash in block_hashes]

    def put(self, block: OffloadedBlock) -> bool:
        """Store ``block`` (copying its data), pushing least recently used blocks down to make room.

        Returns:
            True when the tier now holds the block; False when it cannot (larger than the tier, already expired,
            or a storage error).
        """
        return self.put_many([block])[0]

    def put_many(self, blocks: Sequence[OffloadedBlock]) -> list[bool]:
        """Store ``blocks`` (copying their data) as one batch: room is made once, the least recently used blocks
        pushed out go to ``lower`` as one batch, and the storage copies the batch at once (:meth:`_store_many`).

        Returns:
            Per block, whether the tier now holds it (see :meth:`put`), or for a block of a batch larger than the
            tier, one passed straight down, whether ``lower`` does.
        """
        now_s = self.clock()
        new: dict[int, int] = {}  # block_hash -> position in blocks (a hash repeated in the batch is stored once)
        for pos, block in enumerate(blocks):
            nbytes = block.data.numel() * block.data.element_size()
            if nbytes > self.capacity_bytes or block.expires_at_s <= now_s:
                continue
            if block.block_hash in self._index:
                self._index.move_to_end(block.block_hash)
            elif block.block_hash not in new:
                new[block.block_hash] = pos
        batch = [blocks[pos] for pos in new.values()]
        batch_nbytes = [block.data.numel() * block.data.element_size() for block in batch]
        overflow: list[OffloadedBlock] = []  # more than the tier holds: the oldest go straight down
        while batch and sum(batch_nbytes) > self.capacity_bytes:
            overflow.append(batch.pop(0))
            batch_nbytes.pop(0)
        held_below = self._make_room(sum(batch_nbytes), overflow)
        handles = self._store_many(batch) if batch else []
        for block, nbytes, handle in zip(batch, batch_nbytes, handles):
            if handle is None:
                continue
            self._index[block.block_hash] = _Entry(block.parent_hash, block.token_ids, nbytes, block.expires_at_s,
                                                   handle)
            self.used_bytes += nbytes
            self.stats.add("offloaded_bytes", nbytes, tier=self.name)
            self.stats.add("offloaded_blocks", 1, tier=self.name)
        return [block.block_hash in self._index or block.block_hash in held_below for block in blocks]

    def get(self, block_hash: int) -> OffloadedBlock | None:
        """Return the stored block (now most recently used), or None when absent, expired or unreadable."""
        entry = self._index.get(block_hash)
        if entry is None:
            return None
        if entry.expires_at_s <= self.clock():
            self._remove(block_hash)
            return None
        loaded = self._load(entry)
        if loaded is None:
            self._remove(block_hash)
            return None
        parent_hash, token_ids, data = loaded
        self._index.move_to_end(block_hash)
        return OffloadedBlock(block_hash, parent_hash, token_ids, data, entry.expires_at_s)

    def touch(self, block_hash: int) -> None:
        """Mark a held block most recently used (no data moves); unknown hashes are ignored."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)

    def discard(self, block_hash: int) -> None:
        """Forget a block (no demotion); unknown hashes are ignored."""
        if block_hash in self._index:
            self._remove(block_hash)

    def close(self) -> None:
        """Release the tier's resources (files, connections); the tier is empty afterwards."""
        for block_hash in list(self._index):
            self._remove(block_hash)

    # ------------------------------------------------------------------ storage (subclasses)

    @abc.abstractmethod
    def _store(self, block: OffloadedBlock) -> object | None:
        """Copy the block's data into the tier's storage; return its handle, None on a storage error."""

    def _store_many(self, blocks: Sequence[OffloadedBlock]) -> list[object | None]:
        """Copy a batch of blocks into the tier's storage; per block its handle or None. One :meth:`_store` each
        unless the tier stores a batch at once."""
        return [self._store(block) for block in blocks]

    @abc.abstractmethod
    def _load(self, entry: _Entry) -> tuple[int | None, tuple[int, ...], torch.Tensor] | None:
        """Return ``(parent_hash, token_ids, data)`` as stored, None when the storage lost it."""

    @abc.abstractmethod
    def _drop(self, entry: _Entry) -> None:
        """Free the storage of one entry."""

    # ------------------------------------------------------------------ internals

    def _make_room(self, nbytes: int, passed_down: list[OffloadedBlock]) -> set[int]:
        """Push least recently used blocks out until ``nbytes`` more fit; unexpired ones go to ``lower`` as one
        batch with ``passed_down`` after them, handed over before their storage is freed (the lower tier copies
        them out of it). Returns the hashes of ``passed_down`` that ``lower`` stored."""
        victims: list[int] = []
        freed_bytes = 0
        for block_hash, entry in self._index.items():
            if self.used_bytes - freed_bytes + nbytes <= self.capacity_bytes:
                break
            victims.append(block_hash)
            freed_bytes += entry.nbytes
        held_below: set[int] = set()
        if self.lower is not None and (victims or passed_down):
            now_s = self.clock()
            demoted = []
            for block_hash in victims:
                entry = self._index[block_hash]
                loaded = self._load(entry) if entry.expires_at_s > now_s else None
                if loaded is not None:
                    parent_hash, token_ids, data = loaded
                    demoted.append(OffloadedBlock(block_hash, parent_hash, token_ids, data, entry.expires_at_s))
            demoted += passed_down
            stored = self.lower.put_many(demoted)
            held_below = {block.block_hash for block, ok in zip(passed_down, stored[len(stored) - len(passed_down):])
                          if ok}
        for block_hash in victims:
            self._remove(block_hash)
        if victims:
            self.stats.add("offload_evicted_blocks", len(victims), tier=self.name)
        return held_below

    def _remove(self, block_hash: int) -> None:
        entry = self._index.pop(block_hash)
        self._drop(entry)
        self.used_bytes -= entry.nbytes
