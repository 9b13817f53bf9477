"""The chain of offload tiers below the device pool and the data movement between them and the pool.

::

    device pool ──evict──▶ host RAM ──evict──▶ local disk ──evict──▶ Redis ──evict/TTL──▶ dropped
         ▲                     │                   │                   │
         └──────── reload (bytes ÷ bandwidth < tokens ÷ prefill rate) ─┘

A tier of size 0 is left out of the chain. Blocks move between the pool and a tier through the model runner's
:class:`~worker.model_runner.KVBlockIO`; the chain times every reload to keep the cost model's bandwidths current.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence

import torch

from shared.config import ConfigError, KVConfig
from worker.kv_cache.offload.base import OffloadedBlock, OffloadTier
from worker.kv_cache.offload.cost import GB, CostModel
from worker.kv_cache.offload.disk import DiskTier
from worker.kv_cache.offload.host import HostTier
from worker.kv_cache.offload.swap import SwapSpace
from worker.kv_cache.stats import KVStats

GIB = 1024**3


class OffloadChain:
    """Host → disk → Redis for one worker, with its swap space and cost model.

    Args:
        tiers: the enabled tiers, top first, each linked to the next by ``lower``.
        io: :class:`~worker.model_runner.KVBlockIO` over the device pool.
        cost: the cost model.
        swap: swap space for preemption, None = always recompute.
        stats: counters shared with the manager.
    """

    def __init__(self, tiers: Sequence[OffloadTier], io, cost: CostModel, swap: SwapSpace | None = None,
                 stats: KVStats | None = None) -> None:
        self.tiers = list(tiers)
        self.io = io
        self.cost = cost
        self.swap = swap
        self.stats = stats if stats is not None else KVStats()
        self.block_bytes: int = io.block_bytes
        self._by_name = {tier.name: tier for tier in self.tiers}
        self._local = [tier for tier in self.tiers if tier.name != "redis"]
        self._remote = self._by_name.get("redis")
        # [num_rows, block_bytes] uint8, CPU: demoted blocks on their way into the top tier, which copies them
        self._staging = torch.empty((0, self.block_bytes), dtype=torch.uint8)

    def tier(self, name: str) -> OffloadTier:
        return self._by_name[name]

    def demote(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
               expires_at_s: float) -> bool:
        """Copy an evicted device block into the top tier (before the pool reuses it); True when stored."""
        return self.demote_many([(block_id, block_hash, parent_hash, token_ids, expires_at_s)])[0]

    def demote_many(self, evicted: Sequence[tuple[int, int, int | None, Sequence[int], float]]) -> list[bool]:
        """Copy a batch of evicted device blocks into the top tier before the pool reuses them; per block, True when
        stored.

        A host RAM tier on a CPU pool takes each block straight into its slot (:meth:`HostTier.put_from_pool`);
        otherwise the batch is read out of the pool in one copy (one transfer from a GPU) into a staging buffer kept
        across calls (fresh memory would cost page faults on every step), and the top tier copies it from there.

        Args:
            evicted: ``(block_id, block_hash, parent_hash, token_ids, expires_at_s)`` per block.
        """
        if not self.tiers or not evicted:
            return [False] * len(evicted)
        top = self.tiers[0]
        stored = [False] * len(evicted)
        to_copy = []
        for pos, (_, block_hash, _, _, _) in enumerate(evicted):
            if top.contains(block_hash):
                top.touch(block_hash)  # the bytes are already there (reloaded from it earlier)
                stored[pos] = True
            else:
                to_copy.append(pos)
        if not to_copy:
            return stored
        if isinstance(top, HostTier) and not self.io.kv_cache.is_cuda and len(to_copy) <= top.slab.shape[0]:
            for pos, ok in zip(to_copy, top.put_from_pool(self.io, [evicted[pos] for pos in to_copy])):
                stored[pos] = ok
            return stored
        if self._staging.shape[0] < len(to_copy):  # grow-only
            num_rows = max(len(to_copy), 2 * self._staging.shape[0])
            self._staging = torch.empty((num_rows, self.block_bytes), dtype=torch.uint8, pin_memory=self.io.pin_memory)
        data = self.io.read_blocks([evicted[pos][0] for pos in to_copy], out=self._staging)
        blocks = [OffloadedBlock(evicted[pos][1], evicted[pos][2], tuple(evicted[pos][3]), data[row], evicted[pos][4])
                  for row, pos in enumerate(to_copy)]
        for pos, ok in zip(to_copy, top.put_many(blocks)):
            stored[pos] = ok
        return stored

    def find(self, block_hashes: Sequence[int], start: int) -> list[str]:
        """Return the tier name of each block of the leading run ``block_hashes[start:]`` held by some tier.

        Local tiers are asked block by block (in-memory indexes); where they stop, Redis is asked for all the
        remaining blocks in one round trip.
        """
        run: list[str] = []
        idx = start
        while idx < len(block_hashes):
            tier = next((t for t in self._local if t.contains(block_hashes[idx])), None)
            if tier is None:
                break
            run.append(tier.name)
            idx += 1
        if self._remote is not None and idx < len(block_hashes):
            for found in self._remote.contains_many(block_hashes[idx:]):
                if not found:
                    break
                run.append(self._remote.name)
        return run

    def load(self, tier_name: str, block_id: int, block_hash: int, parent_hash: int | None,
             token_ids: Sequence[int]) -> bool:
        """Copy one block from ``tier_name`` into pool block ``block_id`` after checking its content.

        The block may have moved down since :meth:`find` (allocating the reload's blocks demotes device blocks,
        which can push it out of its tier): the tiers below ``tier_name`` are asked too.

        Returns:
            False (nothing written) when no tier has it any more or its stored token ids differ.
        """
        start_s = time.perf_counter()
        block = None
        for tier in self.tiers[self.tiers.index(self._by_name[tier_name]):]:
            block = tier.get(block_hash)
            if block is not None:
                break
        if block is None:
            return False
        tier_name = tier.name
        if not block.matches(parent_hash, token_ids):
            self.stats.add("reload_verify_failures_total")
            tier.discard(block_hash)
            return False
        self.io.write_block(block_id, block.data)
        self.cost.observe_transfer(tier_name, self.block_bytes, time.perf_counter() - start_s)
        self.stats.add("reloaded_bytes", self.block_bytes, tier=tier_name)
        self.stats.add("reloaded_blocks", 1, tier=tier_name)
        return True

    def publish_gauges(self) -> None:
        """Refresh the occupancy and cost-model gauges in :attr:`stats`."""
        for tier in self.tiers:
            self.stats.set_gauge("tier_used_bytes", tier.used_bytes, tier=tier.name)
            self.stats.set_gauge("tier_capacity_bytes", tier.capacity_bytes, tier=tier.name)
            self.stats.set_gauge("measured_bandwidth_bytes_per_s", self.cost.bandwidth_bytes_per_s(tier.name),
                                 tier=tier.name)
        if self.swap is not None:
            self.stats.set_gauge("tier_used_bytes", self.swap.used_bytes, tier="swap")
            self.stats.set_gauge("tier_capacity_bytes", self.swap.capacity_bytes, tier="swap")
        self.stats.set_gauge("measured_prefill_tokens_per_s", self.cost.prefill_tokens_per_s)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


def build_offload_chain(config: KVConfig, io, model_id: str, dtype_name: str, stats: KVStats | None = None,
                        clock: Callable[[], float] = time.monotonic) -> OffloadChain:
    """Build the tiers ``config`` enables (size > 0; Redis when ``redis_url`` is set), linked top to bottom.

    Args:
        config: the ``[kv]`` section.
        io: :class:`~worker.model_runner.KVBlockIO` over the device pool.
        model_id: the served model and weights (``worker.__main__.kv_model_id``; namespaces Redis keys).
        dtype_name: the KV dtype, e.g. ``float32`` (namespaces Redis keys).
        stats: counters shared with the manager.
        clock: the manager's clock (block expiry deadlines are on it).

    Raises:
        ConfigError: ``kv.redis_url`` is no Redis URL, or the disk tier's folder cannot be made in
            ``kv.disk_cache_dir``; the message names the key. (A Redis that is down is no error: the tier recomputes.)
    """
    stats = stats if stats is not None else KVStats()
    tiers: list[OffloadTier] = []
    if config.redis_url and config.redis_cache_gib > 0:
        from worker.kv_cache.offload.redis_tier import RedisTier

        try:
            tiers.append(RedisTier(config.redis_url, model_id, dtype_name, io.block_bytes,
                                   int(config.redis_cache_gib * GIB), ttl_s=config.redis_ttl_s,
                                   timeout_s=config.redis_timeout_s, retry_s=config.redis_retry_s, stats=stats,
                                   clock=clock))
        except ValueError as exc:  # redis.Redis.from_url: a scheme or port it does not take
            raise ConfigError(f"kv.redis_url: {config.redis_url!r}: {exc}") from exc
    if config.disk_cache_gib > 0:
        try:
            disk = DiskTier(int(config.disk_cache_gib * GIB), config.disk_cache_dir, stats=stats,
                            lower=tiers[0] if tiers else None, clock=clock)
        except OSError as exc:
            for tier in tiers:
                tier.close()
            raise ConfigError(f"kv.disk_cache_dir: {config.disk_cache_dir or tempfile.gettempdir()!r}: cannot make "
                              f"the disk tier's folder ({exc}); set a folder the worker may create, or "
                              "kv.disk_cache_gib = 0 (no disk tier)") from exc
        tiers.insert(0, disk)
    if config.host_cache_gib > 0:
        tiers.insert(0, HostTier(int(config.host_cache_gib * GIB), io.block_bytes, pin_memory=io.pin_memory,
                                 stats=stats, lower=tiers[0] if tiers else None, clock=clock))
    cost = CostModel({"host": config.host_bandwidth_gb_s * GB, "disk": config.disk_bandwidth_gb_s * GB,
                      "redis": config.redis_bandwidth_gb_s * GB}, config.prefill_tokens_per_s)
    swap = SwapSpace(int(config.swap_space_gib * GIB), io, stats) if config.swap_space_gib > 0 else None
    return OffloadChain(tiers, io, cost, swap, stats)
