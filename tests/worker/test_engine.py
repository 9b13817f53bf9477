"""Engine: memory stays flat over many requests (BC33), run on the sim backend (the roofline SIMULATOR, no model).

The simulator replaces only the model step (``worker.backends.sim.SimRunner`` with a tiny ``time_scale``); the
scheduler, KV cache manager, prefix cache and eviction policy are the real ones, which is what can leak.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from shared.config import KVConfig, SimConfig
from shared.protocol import Generate, SamplingParams
from worker.backends.sim import SimRunner
from worker.engine import Engine, StepAbandoned
from worker.kv_cache.manager import KVCacheManager
from worker.kv_cache.offload.chain import build_offload_chain
from worker.model_runner import KVBlockIO
from worker.scheduler import Scheduler

NUM_BLOCKS = 256
BS = 16


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("offload", [False, True])
def test_bc33_memory_flat_over_20000_requests_sim_backend(offload, tmp_path):
    """With ``offload``, evicted blocks also go through host RAM and disk tiers over a small KV tensor (1 KiB
    blocks) that the simulator never writes: the offload bookkeeping and files are what is checked, not values."""
    sim = SimConfig(time_scale=1e-9)  # the SIMULATOR's step time, scaled to nothing
    chain = None
    if offload:
        io = KVBlockIO(torch.zeros(1, 2, NUM_BLOCKS, 1, BS, 8))
        kv = KVConfig(host_cache_gib=128 * 1024 / 2**30, disk_cache_gib=256 * 1024 / 2**30,
                      disk_cache_dir=str(tmp_path), swap_space_gib=0)
        chain = build_offload_chain(kv, io, "sim", "float32")
        chain.cost.freeze(prefill_tokens_per_s=1.0)  # the simulator "prefills" in microseconds: force reloads
    manager = KVCacheManager(NUM_BLOCKS, BS, eviction_policy="sluice", config=KVConfig(), offload=chain)
    engine = Engine(Scheduler(manager, 64, 512, 4096), SimRunner(sim, list(range(100, 30000))), [2])
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 30000) for _ in range(48)] for _ in range(200)]  # 600 blocks > the pool
    start_free = manager.num_free_blocks
    rss_after_first_1000 = 0
    num_finished = 0
    num_tokens_out = 0
    for batch_start in range(0, 20_000, 100):
        for i in range(batch_start, batch_start + 100):
            prompt = rng.choice(prefixes)[:rng.randrange(16, 48)] + [rng.randrange(100, 30000) for _ in range(8)]
            msg = Generate(f"r{i}", prompt, SamplingParams(temperature=0.0, seed=i), rng.randrange(1, 6),
                           tier=rng.choice(["vip", "free"]), cache_ttl_s=rng.choice([0.0, 30.0]))
            engine.add(f"r{i}", msg, tier_priority=rng.randrange(4))
        while engine.has_work():
            for event in engine.step().events:
                assert event.error is None
                num_tokens_out += len(event.new_token_ids)
                num_finished += event.finish_reason is not None
        if batch_start + 100 == 1000:
            gc.collect()
            rss_after_first_1000 = rss_bytes()
    gc.collect()
    assert num_finished == 20_000 and num_tokens_out >= 20_000
    assert rss_bytes() <= 1.05 * rss_after_first_1000
    assert manager.num_used_blocks == 0 and manager.num_free_blocks == start_free == NUM_BLOCKS
    assert manager.pool.num_evictions > 0 and manager.prefix_hits_tokens > 0
    if offload:
        stats = manager.stats_snapshot()
        assert stats["reloaded_blocks{tier=host}"] > 0 and stats["offloaded_blocks{tier=disk}"] > 0
        disk = chain.tier("disk")
        assert disk.used_bytes <= disk.capacity_bytes and disk.flush(timeout_s=30)
        live_files = {entry.handle[0].path for entry in disk._index.values()}  # one file per demoted batch
        assert sorted(str(path) for path in tmp_path.glob("*/*.kv")) == sorted(live_files)  # none leaked


class LayeredRunner:
    """Stands for the model runner in the abandon decision: asks ``should_stop`` before each of its 4 layers, as
    ``LlamaModel.forward`` does, and calls ``on_layer`` after each (to abort while the step runs)."""

    def __init__(self) -> None:
        self.num_layers_run = 0
        self.on_layer = lambda layer: None
        self.step_logprobs = {}

    def run(self, out, should_stop=None) -> dict[str, int]:
        for layer in range(4):
            if should_stop is not None and should_stop():
                raise StepAbandoned(f"before layer {layer}")
            self.num_layers_run += 1
            self.on_layer(layer)
        return {item.seq.request_id: 7 for item in out.scheduled if item.sample}


def test_a_step_whose_every_sequence_is_aborted_stops_between_layers():
    manager = KVCacheManager(NUM_BLOCKS, BS, config=KVConfig())
    runner = LayeredRunner()
    engine = Engine(Scheduler(manager, 8, 512, 4096), runner, [2])
    free_at_start = manager.num_free_blocks
    for request_id in ("a", "b"):
        engine.add(request_id, Generate(request_id, list(range(100, 140)), SamplingParams(temperature=0.0), 4))
    # one of the two is aborted during the step: the step runs to its end for the other
    runner.on_layer = lambda layer: engine.request_abort("a") if layer == 0 else None
    assert {event.request_id for event in engine.step().events} == {"a", "b"} and runner.num_layers_run == 4
    engine.abort("a")
    # the last one is aborted during the next step: it stops after that layer and emits nothing
    runner.on_layer = lambda layer: engine.request_abort("b") if layer == 1 else None
    assert engine.step().events == [] and runner.num_layers_run == 4 + 2
    engine.abort("b")
    assert not engine.has_work() and manager.num_free_blocks == free_at_start
