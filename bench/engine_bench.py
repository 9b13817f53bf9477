"""Decode tokens/s of the real engine on a synthetic Llama-3-8B (GPU), CUDA graphs on and off, against its roofline.

The worker's own parts: :func:`worker.synthetic.build_synthetic_model` (bf16 random weights, the real shapes), the
CuPy attention backend, the KV pool, :class:`worker.scheduler.Scheduler`, :class:`worker.engine.Engine` and
:class:`worker.model_runner.ModelRunner` with or without :class:`worker.cuda_graphs.DecodeGraphs`. For each number
of running sequences N in {1, 64, 256}: N prompts of ``--prompt-tokens`` random token ids are prefilled, then
``--steps`` decode steps are timed (each step ends with its sampled tokens on the host; a step the runner launched
ahead of the scheduler counts in the window where it runs: the warm-up's finishes before the clock starts, the last
step's before it stops). Per point:

- ``decode_tokens_per_s``: N × steps ÷ wall time;
- roofline: a decode step must read every weight once (embedding rows aside) and the K/V of every sequence's
  context; ``roofline_step_ms`` = (weight bytes + KV bytes of the mean context) ÷ the device-to-device copy
  bandwidth measured in the same run (bytes read + written ÷ time), and ``fraction_of_roofline`` = the roofline's
  step time ÷ the measured one. Target: ≥ 0.7 at N = 64 with CUDA graphs;
- ``graph_replay_gpu_ms`` (CUDA graphs on): the decode graph replayed alone, timed with CUDA events: the step's GPU
  time; ``step_ms`` minus it is the host's share of the step.

Usage: ``python -m bench.engine_bench [--out PATH] [--model llama-3-8b] [--steps 48]``; ``--dry-run`` imports
everything, checks the arguments and writes ``{"skipped": ...}`` without touching a GPU. JSON to PATH (default
``$OUT/engine_bench.json``, else ``bench/results/engine_bench.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from shared.protocol import Generate, SamplingParams  # noqa: E402
from shared.synthetic_models import num_parameters  # noqa: E402
from worker.cuda_graphs import DecodeGraphs, bucket_for  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.graph_decoder import MIN_STEADY_STEPS  # noqa: E402
from worker.kv_cache.manager import KVCacheManager  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402
from worker.scheduler import Scheduler  # noqa: E402
from worker.synthetic import build_synthetic_model, synthetic_spec  # noqa: E402

NUM_SEQS = (1, 64, 256)
BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 8192
TARGET_FRACTION_AT_64 = 0.7
COPY_BYTES = 2 << 30
# decode steps before the clock starts: the first steps of a size are slow, and the runner launches steps ahead only
# after MIN_STEADY_STEPS steady ones
WARMUP_DECODE_STEPS = MIN_STEADY_STEPS + 4


def measure_copy_gb_s() -> float:
    """Device-to-device copy bandwidth, GB/s counting bytes read + written (median of 10 after 3 warm-ups)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * COPY_BYTES / sorted(times)[len(times) // 2] / 1e9


def decoding_engine(model, kv_cache, graphs: DecodeGraphs | None, num_seqs: int, prompt_tokens: int,
                    max_tokens: int, num_blocks: int) -> tuple[Engine, ModelRunner, float]:
    """An engine over the model's pool with ``num_seqs`` greedy sequences of ``prompt_tokens`` random token ids
    (seeded by ``num_seqs``, ``ignore_eos``, ``max_tokens`` each), prefilled and :data:`WARMUP_DECODE_STEPS` decode
    steps in.

    Returns:
        The engine, its model runner and the seconds the prefill took.
    """
    runner = ModelRunner(model, kv_cache, BLOCK_SIZE, kv_cache.device, graphs)
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    engine = Engine(Scheduler(kv, max(num_seqs, 1), MAX_BATCHED_TOKENS, 1 << 17), runner, [])
    vocab = model.spec.vocab_size
    gen = torch.Generator().manual_seed(num_seqs)
    for i in range(num_seqs):
        prompt = torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist()
        engine.add(f"r{i}", Generate(f"r{i}", prompt, SamplingParams(temperature=0.0), max_tokens, ignore_eos=True))
    prefill_start = time.perf_counter()
    while len(engine.scheduler.running) < num_seqs or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
    prefill_s = time.perf_counter() - prefill_start
    for _ in range(WARMUP_DECODE_STEPS):
        engine.step()
    torch.cuda.synchronize()
    return engine, runner, prefill_s


def decode_run(model, kv_cache, graphs: DecodeGraphs | None, num_seqs: int, prompt_tokens: int, steps: int,
               num_blocks: int) -> dict[str, Any]:
    """Prefill ``num_seqs`` prompts, then time ``steps`` decode steps; return the measured rates."""
    engine, _, prefill_s = decoding_engine(model, kv_cache, graphs, num_seqs, prompt_tokens,
                                           WARMUP_DECODE_STEPS + steps + 8, num_blocks)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()  # the step the last one launched ahead counts: the warm-up's was done before start
    wall_s = time.perf_counter() - start
    mean_context = prompt_tokens + WARMUP_DECODE_STEPS + steps / 2
    result = {"num_seqs": num_seqs, "steps": steps, "wall_s": wall_s, "prefill_s": prefill_s,
              "step_ms": wall_s / steps * 1e3, "decode_tokens_per_s": num_seqs * steps / wall_s,
              "mean_context_tokens": mean_context}
    if graphs is not None:  # the step's GPU time alone: its graph replayed (the last step's inputs), no host work
        result["graph_replay_gpu_ms"] = graph_replay_ms(graphs, num_seqs)
    return result


def graph_replay_ms(graphs: DecodeGraphs, num_seqs: int, replays: int = 11) -> float:
    """Median GPU milliseconds of one replay of the decode graph that serves ``num_seqs`` sequences."""
    graph = graphs._graphs[bucket_for(graphs.sizes, num_seqs)]
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return sorted(samples)[len(samples) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--num-seqs", default=",".join(map(str, NUM_SEQS)))
    parser.add_argument("--dry-run", action="store_true", help="import and check, touch no GPU")
    args = parser.parse_args(argv)
    out_path = args.out or (Path(os.environ["OUT"]) / "engine_bench.json" if os.environ.get("OUT")
                            else REPO_ROOT / "bench" / "results" / "engine_bench.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    spec = synthetic_spec(args.model)
    sizes = [int(n) for n in args.num_seqs.split(",")]
    if args.dry_run or not torch.cuda.is_available():
        import worker.attention.cupy_paged  # noqa: F401 - the import a GPU run needs

        report: dict[str, Any] = {"skipped": "no GPU" + (" (dry run)" if args.dry_run else ""),
                                  "model": args.model, "num_seqs": sizes}
        out_path.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report))
        return 0 if args.dry_run else 2
    started = time.perf_counter()
    copy_gb_s = measure_copy_gb_s()
    build_start = time.perf_counter()
    model = build_synthetic_model(spec, "bfloat16", "cuda", attention_backend="cupy")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - build_start
    blocks_per_seq = -(-(args.prompt_tokens + WARMUP_DECODE_STEPS + args.steps + 16) // BLOCK_SIZE)
    num_blocks = max(sizes) * blocks_per_seq + 8
    kv_cache = model.allocate_kv_cache(num_blocks + 1, BLOCK_SIZE)  # + the pad block of the graphs
    max_model_len = blocks_per_seq * BLOCK_SIZE
    graphs: DecodeGraphs | None = DecodeGraphs(model, kv_cache, BLOCK_SIZE, max(sizes), max_model_len,
                                               pad_block_id=num_blocks)
    try:
        report_capture = graphs.capture()
        capture: dict[str, Any] = {"buckets": list(report_capture.sizes), "capture_s": report_capture.capture_s,
                                   "memory_mib": report_capture.memory_bytes / 2**20}
    except Exception as exc:  # noqa: BLE001 - the eager runs still measure; the report says why graphs are absent
        capture = {"error": f"{type(exc).__name__}: {exc}"}
        graphs = None
        print(f"engine_bench: CUDA graph capture failed: {capture['error']}", file=sys.stderr, flush=True)
    weight_bytes = (num_parameters(args.model) - spec.vocab_size * spec.hidden_size
                    * (0 if spec.tie_word_embeddings else 1)) * 2
    kv_bytes_per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2
    runs = []
    for use_graphs in (True, False) if graphs is not None else (False,):
        for n in sizes:
            run = decode_run(model, kv_cache, graphs if use_graphs else None, n, args.prompt_tokens, args.steps,
                             num_blocks)
            roofline_ms = (weight_bytes + n * run["mean_context_tokens"] * kv_bytes_per_token) / (copy_gb_s * 1e9) * 1e3
            run.update(cuda_graphs=use_graphs, roofline_step_ms=roofline_ms,
                       roofline_tokens_per_s=n / roofline_ms * 1e3, fraction_of_roofline=roofline_ms / run["step_ms"])
            print(json.dumps(run), file=sys.stderr, flush=True)
            runs.append(run)
    at_64 = [r for r in runs if r["cuda_graphs"] and r["num_seqs"] == 64]
    report = {
        "model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "weights": "bfloat16 (random, real shapes)", "attention_backend": "cupy", "block_size": BLOCK_SIZE,
        "prompt_tokens": args.prompt_tokens, "copy_gb_s": copy_gb_s, "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token, "model_build_s": build_s,
        "cuda_graphs_capture": capture,
        "roofline_definition": "(weight bytes + KV bytes of the mean context of every sequence) ÷ d2d copy GB/s",
        "runs": runs,
        "target": {"fraction_of_roofline_at_64_with_graphs": TARGET_FRACTION_AT_64,
                   "value": at_64[0]["fraction_of_roofline"] if at_64 else None},
        "wall_s": time.perf_counter() - started,
    }
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
