"""Engine: memory stays flat over many requests (BC33), run on the sim backend (the roofline SIMULATOR, no model).

The simulator replaces only the model step (``worker.backends.sim.SimRunner`` with a tiny ``time_scale``); the
scheduler, KV cache manager, prefix cache and eviction policy are the real ones, which is what can leak.
"""

from __future__ import annotations

import gc
import random

from shared.config import KVConfig, SimConfig
from shared.protocol import Generate, SamplingParams
from worker.backends.sim import SimRunner
from worker.engine import Engine
from worker.kv_cache.manager import KVCacheManager
from worker.scheduler import Scheduler

NUM_BLOCKS = 256
BS = 16


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_bc33_memory_flat_over_20000_requests_sim_backend():
    sim = SimConfig(time_scale=1e-9)  # the SIMULATOR's step time, scaled to nothing
    manager = KVCacheManager(NUM_BLOCKS, BS, eviction_policy="sluice", config=KVConfig())
    engine = Engine(Scheduler(manager, 64, 512, 4096), SimRunner(sim, list(range(100, 30000))), [2])
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 30000) for _ in range(48)] for _ in range(20)]
    start_free = manager.num_free_blocks
    rss_after_first_1000 = 0
    num_finished = 0
    for batch_start in range(0, 20_000, 100):
        for i in range(batch_start, batch_start + 100):
            prompt = rng.choice(prefixes)[:rng.randrange(16, 48)] + [rng.randrange(100, 30000) for _ in range(8)]
            msg = Generate(f"r{i}", prompt, SamplingParams(temperature=0.0, seed=i), rng.randrange(1, 6),
                           tier=rng.choice(["vip", "free"]), cache_ttl_s=rng.choice([0.0, 30.0]))
            engine.add(f"r{i}", msg, tier_priority=rng.randrange(4))
        while engine.has_work():
            num_finished += sum(1 for e in engine.step().events if e.finish_reason is not None)
        if batch_start + 100 == 1000:
            gc.collect()
            rss_after_first_1000 = rss_bytes()
    gc.collect()
    assert num_finished == 20_000
    assert rss_bytes() <= 1.05 * rss_after_first_1000
    assert manager.num_used_blocks == 0 and manager.num_free_blocks == start_free == NUM_BLOCKS
    assert manager.pool.num_evictions > 0 and manager.prefix_hits_tokens > 0
