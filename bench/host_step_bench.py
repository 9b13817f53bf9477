"""Host time per decode step: scheduling, batch building, sampling and emitting deltas, with a null model.

The GPU hides about a millisecond of host work per step behind the device (vLLM's async scheduling); what the
host spends beyond that is lost GPU time. This bench measures that host work on the CPU, with the model step
taken out: a :class:`NullModel` whose forward pass returns preallocated logits at once. Everything else is the
real path of a worker:

    WorkerServer._apply_pending -> Engine.step (Scheduler.schedule, KV block allocation, BatchBuilder.build,
    NullModel.forward, Sampler.sample, Scheduler.update_from_output, prefix caching of full blocks)
    -> WorkerServer._dispatch (one msgpack TokenDelta frame per sequence, written to a connection)

``N`` sequences (80-token prompts, ``ignore_eos``) are prefilled, then the median time of ``--steps`` decode
steps at ``N`` running sequences is reported for N = 1, 64, 256, with greedy sampling and with temperature / top-p
sampling, as the thread's CPU time (``cpu_ms``: the host's cost, also on a shared machine) and as wall time
(``wall_ms``: adds the time other processes held the core). The logits have ``--vocab`` columns (default 1024): on
a GPU the arithmetic of sampling over the full vocabulary runs on the device, so the host figure uses a small
vocabulary; the greedy figure at the Llama-3 vocabulary (128256, all on the CPU) is reported beside it as
``cpu_full_vocab``.

Target: at most 1 ms per step at N = 256 (the CPU time, the figure a GPU step must hide). JSON to
bench/results/host_step.json.

Run: ``.venv/bin/python -m bench.host_step_bench [--steps 200]``.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time

import torch

from bench.common import write_result
from shared.protocol import FrameCodec, Generate, GatewayMessage, Hello, SamplingParams
from worker.engine import Engine
from worker.kv_cache.manager import KVCacheManager
from worker.model_runner import ModelRunner
from worker.scheduler import Scheduler
from worker.server import WorkerServer, _Connection

NUM_SEQS = (1, 64, 256)
PROMPT_TOKENS = 80
BLOCK_SIZE = 16
LLAMA3_VOCAB = 128256
TARGET_MS_AT_256 = 1.0


class NullModel:
    """A model step that costs nothing: returns rows of one fixed ``[max_rows, vocab]`` float32 logits tensor.

    Row ``r`` peaks at token ``r % vocab``, so greedy sampling picks different tokens for different rows.
    """

    def __init__(self, vocab_size: int, max_rows: int = 512) -> None:
        self.logits = torch.zeros(max_rows, vocab_size)
        self.logits[torch.arange(max_rows), torch.arange(max_rows) % vocab_size] = 1.0

    def forward(self, batch, kv_cache: torch.Tensor, should_stop=None) -> torch.Tensor:
        return self.logits[: batch.logits_indices.shape[0]]


class _DiscardWriter:
    """The write end of a connection that drops what it is given (counts bytes)."""

    def __init__(self) -> None:
        self.num_bytes = 0

    def write(self, data: bytes) -> None:
        self.num_bytes += len(data)


def host_ms_per_step(num_seqs: int, vocab_size: int, sampling: SamplingParams, steps: int) -> dict[str, float]:
    """Median ms of one decode step at ``num_seqs`` running sequences (server dispatch included): ``wall_ms``,
    and ``cpu_ms``, the thread's CPU time (what the step costs the host even when a busy machine deschedules it)."""
    num_blocks = num_seqs * (PROMPT_TOKENS + steps + 2 * BLOCK_SIZE) // BLOCK_SIZE + 64
    kv_cache = torch.zeros(1, 2, num_blocks, 1, BLOCK_SIZE, 1)
    runner = ModelRunner(NullModel(vocab_size), kv_cache, BLOCK_SIZE, torch.device("cpu"))
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    engine = Engine(Scheduler(kv, max(num_seqs, 1), 1 << 20, 1 << 16), runner, [2])
    hello = Hello(worker_id="bench", model_id="null", backend="cpu", device="cpu", block_size_tokens=BLOCK_SIZE,
                  num_kv_blocks=num_blocks, kv_capacity_tokens=num_blocks * BLOCK_SIZE, max_num_seqs=num_seqs,
                  max_model_len_tokens=1 << 16)
    server = WorkerServer(engine, hello, lambda: None, 1 << 16)
    writer = _DiscardWriter()
    conn = _Connection(1, writer, FrameCodec(GatewayMessage))
    for i in range(num_seqs):
        prompt = [(i * 7919 + t) % vocab_size for t in range(PROMPT_TOKENS)]
        server._on_generate(conn, Generate(f"r{i}", prompt, sampling, 1 << 15, ignore_eos=True))
    server._apply_pending()
    server._dispatch(engine.step())  # prefill of all
    wall_s, cpu_s = [], []
    for _ in range(steps):
        start_s, start_cpu_s = time.perf_counter(), time.thread_time()
        server._apply_pending()
        result = engine.step()
        server._dispatch(result)
        cpu_s.append(time.thread_time() - start_cpu_s)
        wall_s.append(time.perf_counter() - start_s)
        if len(result.events) != num_seqs:
            raise RuntimeError(f"{len(result.events)} events at {num_seqs} running sequences")
    server._executor.shutdown()
    return {"wall_ms": round(statistics.median(wall_s) * 1000, 3), "cpu_ms": round(statistics.median(cpu_s) * 1000, 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    asyncio.set_event_loop(asyncio.new_event_loop())
    greedy = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
    result = {
        "what": "median ms of one decode step with a null model (scheduler, KV allocation, batch building, "
                "sampling, TokenDelta frames), one CPU thread; cpu_ms = the thread's CPU time, wall_ms = wall time",
        "vocab_size": args.vocab,
        "steps": args.steps,
        "host_ms_per_step_greedy": {str(n): host_ms_per_step(n, args.vocab, greedy, args.steps) for n in NUM_SEQS},
        "host_ms_per_step_top_p": {str(n): host_ms_per_step(n, args.vocab, sampled, args.steps) for n in NUM_SEQS},
        "cpu_full_vocab_ms_per_step_greedy": {
            str(n): host_ms_per_step(n, LLAMA3_VOCAB, greedy, max(20, args.steps // 10)) for n in NUM_SEQS},
        "target_ms_at_256": TARGET_MS_AT_256,
        "machine": f"{platform.processor() or platform.machine()}, load {open('/proc/loadavg').read().split()[0]}",
        "torch": torch.__version__,
        "command": "python -m bench.host_step_bench",
    }
    result["meets_target"] = result["host_ms_per_step_greedy"]["256"]["cpu_ms"] <= TARGET_MS_AT_256
    write_result("host_step", result)
    return result


if __name__ == "__main__":
    main()
