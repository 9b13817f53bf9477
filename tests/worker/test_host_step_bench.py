"""bench/host_step_bench.py runs against the engine and server as they are (a README command: it broke once when the
model runner's call grew an argument and nothing ran it)."""

from __future__ import annotations

from bench.host_step_bench import host_ms_per_step
from shared.protocol import SamplingParams


def test_host_step_bench_measures_greedy_and_sampled_steps_of_the_real_engine():
    greedy = host_ms_per_step(4, 64, SamplingParams(temperature=0.0), steps=3)
    sampled = host_ms_per_step(4, 64, SamplingParams(temperature=0.7, top_p=0.9, seed=1), steps=3)
    for result in (greedy, sampled):
        assert set(result) == {"wall_ms", "cpu_ms"} and result["wall_ms"] > 0 and result["cpu_ms"] > 0
