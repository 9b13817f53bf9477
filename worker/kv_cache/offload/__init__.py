"""Offload tiers below the device KV pool: host RAM → local disk → Redis, and the swap space of preemption.

An evicted device block is demoted down the chain instead of dropped; a prefix miss on the device looks the chain
up and reloads a block when that is cheaper than recomputing it (:mod:`worker.kv_cache.offload.cost`).
"""
