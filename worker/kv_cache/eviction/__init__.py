"""Eviction policies of the prefix cache: which cached, unreferenced KV block to reuse next.

A block is *evictable* when the prefix cache holds it (it has a hash) and no running sequence references it
(ref count 0). The :class:`~worker.kv_cache.block_pool.BlockPool` hands every evictable block to the policy
with :meth:`EvictionPolicy.insert`, takes it back with :meth:`EvictionPolicy.remove` when a new request reuses it,
and asks :meth:`EvictionPolicy.pop_victim` for the block to evict when the free list is empty.

Policies are small classes chosen by name in config (``worker.eviction_policy``); :func:`make_policy` builds one and
names the valid choices on an unknown name.
"""

from __future__ import annotations

from typing import Callable

from shared.config import RetentionConfig, RetentionSettings  # noqa: F401  (defined with the config; re-exported)
from worker.kv_cache.eviction.adaptive import AdaptivePolicy, ShadowCache
from worker.kv_cache.eviction.base import BlockMeta, EvictionPolicy
from worker.kv_cache.eviction.chain import ChainPolicy
from worker.kv_cache.eviction.classic import LFUPolicy, LRUPolicy, TierPolicy, TTLPolicy
from worker.kv_cache.eviction.retention import (
    PRESSURE_LEVELS,
    block_expiry_s,
    caches_new_request,
    retention_for_pressure,
)
from worker.kv_cache.eviction.sluice import SluicePolicy

__all__ = [
    "PRESSURE_LEVELS", "AdaptivePolicy", "BlockMeta", "ChainPolicy", "EvictionPolicy", "LFUPolicy", "LRUPolicy",
    "RetentionConfig", "RetentionSettings", "ShadowCache", "SluicePolicy", "TTLPolicy", "TierPolicy",
    "block_expiry_s", "caches_new_request", "make_policy", "policy_names", "register_policy",
    "retention_for_pressure",
]

_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "ttl": TTLPolicy,
    "tier": TierPolicy,
    "sluice": SluicePolicy,
    "chain": ChainPolicy,
    "adaptive": AdaptivePolicy,
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
