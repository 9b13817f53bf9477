"""Where a decode step of the synthetic Llama-3-8B spends its time on a GPU (diagnosis for ``bench.engine_bench``).

Three measurements, JSON to ``$OUT/decode_profile.json`` (else ``bench/results/gpu/decode_profile.json``):

1. ``linears``: each projection of a layer and the LM head alone, bf16, at 1, 8, 64 and 256 rows, called as the
   model calls it (:func:`worker.quant.padded_linear`, rows padded to a multiple of 8) and as a plain ``F.linear``:
   GPU time from CUDA-graph replays, weight bytes ÷ time in GB/s.
2. ``steps``: for 1 and 64 running sequences, an engine decode step's wall time split into its host phases
   (schedule; with graphs: rows loaded from the host or advanced on the device, the replay's launch; without: batch
   build, the eager forward's launches, sampling and waiting for the tokens; the scheduler update) and the GPU time
   of the decode graph replayed alone. With graphs, the step's time not in a phase is mostly the wait for its
   sampled tokens.
3. ``kernels``: torch.profiler's table of one eager decode step at 64 sequences (self CUDA time per kernel).

Usage: ``python -m bench.decode_profile [--out PATH] [--model llama-3-8b]``.
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
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.engine_bench import BLOCK_SIZE, WARMUP_DECODE_STEPS, decoding_engine, graph_replay_ms  # noqa: E402
from bench.kernel_bench import _time_graph_ms  # noqa: E402
from worker.cuda_graphs import DecodeGraphs  # noqa: E402
from worker.quant import padded_linear  # noqa: E402
from worker.synthetic import build_synthetic_model, synthetic_spec  # noqa: E402


def graph_ms(fn) -> float:
    """GPU milliseconds of one ``fn()`` from CUDA-graph replays (:func:`bench.kernel_bench._time_graph_ms`)."""
    return _time_graph_ms(fn, launches=20)["median_ms"]


def linears(spec) -> list[dict[str, Any]]:
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes = {"qkv": (q_size + 2 * kv_size, hidden), "o": (hidden, q_size), "gate_up": (2 * inter, hidden),
              "down": (hidden, inter), "lm_head": (spec.vocab_size, hidden)}
    rows_out = []
    for name, (out_f, in_f) in shapes.items():
        weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16)
        for rows in (1, 8, 64, 256):
            x = torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16)
            padded = graph_ms(lambda x=x, w=weight: padded_linear(x, w, None))
            plain = graph_ms(lambda x=x, w=weight: F.linear(x, w))
            gb = weight.numel() * 2 / 1e9
            rows_out.append({"linear": name, "rows": rows, "padded_ms": padded, "plain_ms": plain,
                             "padded_gb_s": gb / (padded * 1e-3), "plain_gb_s": gb / (plain * 1e-3)})
            print(json.dumps(rows_out[-1]), file=sys.stderr, flush=True)
        del weight
    return rows_out


class PhaseTimer:
    """Wraps the engine's phases with perf_counter; sums per phase (ms)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def wrap(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[label] = self.totals.get(label, 0.0) + (time.perf_counter() - start) * 1e3

        setattr(obj, name, timed)


def step_phases(model, kv_cache, graphs, num_seqs: int, steps: int, num_blocks: int) -> dict[str, Any]:
    engine, runner, _ = decoding_engine(model, kv_cache, graphs, num_seqs, 512, WARMUP_DECODE_STEPS + steps + 8,
                                        num_blocks)
    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "update_from_output", "update_from_output")
    timer.wrap(runner.batch_builder, "build", "batch_build")
    if graphs is not None:
        timer.wrap(graphs, "load_rows", "graph_load_rows")  # a step whose sequences changed
        timer.wrap(graphs, "advance", "graph_advance")  # a steady step: the rows advance on the device
        timer.wrap(graphs, "replay", "graph_replay_launch")  # the wait for its tokens shows in the step
    else:
        timer.wrap(model, "forward", "eager_forward_launch")
        timer.wrap(runner.sampler, "greedy", "sample_and_wait")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()  # the step the last one launched ahead counts: the warm-up's was done before start
    wall_ms = (time.perf_counter() - start) * 1e3
    result: dict[str, Any] = {"num_seqs": num_seqs, "cuda_graphs": graphs is not None, "step_ms": wall_ms / steps,
                              "phases_ms_per_step": {k: v / steps for k, v in timer.totals.items()}}
    if graphs is not None:
        result["graph_replay_gpu_ms"] = graph_replay_ms(graphs, num_seqs)
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def kernel_table(model, kv_cache, num_seqs: int, num_blocks: int) -> dict[str, Any]:
    engine, _, _ = decoding_engine(model, kv_cache, None, num_seqs, 512, 64, num_blocks)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
    averages = prof.key_averages()

    def device_us(event) -> float:
        return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))

    rows = sorted(averages, key=device_us, reverse=True)[:25]
    table = [{"name": e.key[:120], "calls_per_step": e.count / 3, "self_device_ms_per_step": device_us(e) / 3e3,
              "cpu_ms_per_step": e.cpu_time_total / 3e3} for e in rows]
    total = sum(device_us(e) for e in averages) / 3e3
    for row in table:
        print(json.dumps(row), file=sys.stderr)
    return {"num_seqs": num_seqs, "device_ms_per_step_total": total, "top": table}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args(argv)
    out_path = args.out or (Path(os.environ["OUT"]) / "decode_profile.json" if os.environ.get("OUT")
                            else REPO_ROOT / "bench" / "results" / "gpu" / "decode_profile.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    spec = synthetic_spec(args.model)
    report: dict[str, Any] = {"model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        report["linears"] = linears(spec)
    except Exception as exc:  # noqa: BLE001 - a diagnosis reports what failed and goes on
        report["linears"] = {"error": f"{type(exc).__name__}: {exc}"}
    model = build_synthetic_model(spec, "bfloat16", "cuda", attention_backend="cupy")
    blocks_per_seq = -(-(512 + WARMUP_DECODE_STEPS + args.steps + 96) // BLOCK_SIZE)
    num_blocks = 64 * blocks_per_seq + 8
    kv_cache = model.allocate_kv_cache(num_blocks + 1, BLOCK_SIZE)
    graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, 64, blocks_per_seq * BLOCK_SIZE, pad_block_id=num_blocks)
    graphs.capture()
    report["steps"] = []
    for n in (1, 64):
        for g in (graphs, None):
            try:
                report["steps"].append(step_phases(model, kv_cache, g, n, args.steps, num_blocks))
            except Exception as exc:  # noqa: BLE001
                report["steps"].append({"num_seqs": n, "error": f"{type(exc).__name__}: {exc}"})
    try:
        report["kernels"] = kernel_table(model, kv_cache, 64, num_blocks)
    except Exception as exc:  # noqa: BLE001
        report["kernels"] = {"error": f"{type(exc).__name__}: {exc}"}
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "kernels"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
