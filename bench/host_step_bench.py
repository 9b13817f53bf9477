"""Host time per engine step on the CPU: scheduling + batch building + sampling + bookkeeping, without the model.

The real :class:`worker.engine.Engine`, :class:`worker.scheduler.Scheduler`, KV cache manager and
:class:`worker.model_runner.ModelRunner` (batch building, greedy sampling over a 49152-token vocabulary), with a
model whose forward pass returns zero logits at once. ``R`` sequences (MT-Bench-sized prompts of 80 tokens) are
prefilled, then the median wall time of 200 decode steps at ``R`` running sequences is reported, for R = 1, 16, 32.
JSON to bench/results/host_step.json.

Run: ``.venv/bin/python -m bench.host_step_bench``.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import write_result
from shared.protocol import Generate, SamplingParams
from worker.engine import Engine
from worker.kv_cache.manager import KVCacheManager
from worker.model_runner import ModelRunner
from worker.scheduler import Scheduler

VOCAB = 49152
BLOCK_SIZE = 16
NUM_BLOCKS = 2048


class _InstantModel:
    """Stands in for the model: zero logits ``[num_logits, VOCAB]`` float32, no compute."""

    def forward(self, batch, kv_cache: torch.Tensor) -> torch.Tensor:
        return torch.zeros(batch.logits_indices.shape[0], VOCAB)


def host_ms_per_step(num_seqs: int, steps: int = 200) -> float:
    kv_cache = torch.zeros(1, 2, NUM_BLOCKS, 1, BLOCK_SIZE, 1)
    runner = ModelRunner(_InstantModel(), kv_cache, BLOCK_SIZE, torch.device("cpu"))
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
    engine = Engine(Scheduler(kv, 64, 4096, 4096), runner, [2])
    for i in range(num_seqs):
        prompt = [(i * 7919 + t) % VOCAB for t in range(80)]
        engine.add(f"r{i}", Generate(f"r{i}", prompt, SamplingParams(temperature=0.0), 1000, ignore_eos=True))
    engine.step()  # prefill all
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> dict:
    torch.set_num_threads(1)
    result = {"host_ms_per_step": {str(n): round(host_ms_per_step(n), 3) for n in (1, 16, 32)},
              "what": "median engine.step() with an instant model: scheduling + batch building + greedy sampling"}
    write_result("host_step", result)
    return result


if __name__ == "__main__":
    main()
