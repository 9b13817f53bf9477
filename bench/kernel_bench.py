"""Benchmark the CuPy paged decode attention kernel against the torch reference and the copy roofline (GPU only).

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16, block size 16) at batch
{1, 16, 64, 256} × context {512, 4096, 32768}, every sequence at the full context, block tables in random pool
order. For each point: kernel time (CUDA events, median of many launches; GPU time from CUDA-graph replays, and
eager Python launches with their host overhead) and achieved bandwidth = bytes of K, V, Q and output moved ÷
time; the same for ``torch_ref.paged_decode_attention_ref`` where its gathered copies fit in
free GPU memory (else ``skipped`` with the reason); and, measured in the same run, a device-to-device copy's
bandwidth (bytes read + written ÷ time) as the roofline. Issue 5's targets are evaluated at the end.

Usage: ``python -m bench.kernel_bench [--out PATH] [--quick] [--dry-run]``. Writes JSON to PATH (default
``$OUT/kernel_bench.json`` when ``$OUT`` is set, else ``bench/results/kernel_bench.json``) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 32768)
COPY_BYTES = 4 << 30
MIN_MEASURE_S = 0.25
MAX_ITERS = 200
MIN_ITERS = 5
REF_MEMORY_MARGIN = 1.25
TARGET_COPY_FRACTION = 0.80
TARGET_SPEEDUP_VS_TORCH = 3.0


def _time_ms(fn: Callable[[], Any], min_iters: int = MIN_ITERS) -> dict[str, float]:
    """Median / min / max milliseconds of ``fn`` over CUDA-event-timed launches, after two warm-up calls."""
    fn()
    fn()
    torch.cuda.synchronize()
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < MAX_ITERS and (len(samples) < min_iters or time.perf_counter() - started < MIN_MEASURE_S):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples),
            "iters": len(samples)}


def _time_graph_ms(fn: Callable[[], Any], launches: int = 10) -> dict[str, Any]:
    """GPU time of one ``fn`` call without host launch overhead: ``launches`` calls captured in a CUDA graph,
    replays timed with CUDA events, divided by ``launches``. Falls back to eager timing when capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(launches):
                fn()
        timing = _time_ms(graph.replay)
    except Exception as exc:  # noqa: BLE001 - capture is an optimisation of the measurement, not a requirement
        return {**_time_ms(fn), "method": f"eager (graph capture failed: {type(exc).__name__}: {exc})"}
    per_launch = {key: value / launches for key, value in timing.items() if key.endswith("_ms")}
    return {**per_launch, "iters": timing["iters"] * launches, "method": f"cuda graph of {launches} launches"}


def measure_copy_bandwidth() -> dict[str, float]:
    """Device-to-device copy of COPY_BYTES: GB/s counting bytes read and written (the roofline)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    timing = _time_ms(lambda: dst.copy_(src), min_iters=20)
    return {"bytes": COPY_BYTES, **timing, "gb_s": 2 * COPY_BYTES / (timing["median_ms"] * 1e-3) / 1e9}


def _bytes_moved(batch: int, context: int) -> int:
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    q_and_out = 2 * batch * NUM_HEADS * HEAD_DIM * DTYPE.itemsize
    return kv + q_and_out


def _ref_memory_bytes(batch: int, context: int) -> int:
    """Peak extra memory of the torch reference: gathered K/V (bf16) and their fp32 copies, plus scores."""
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    scores = 3 * batch * NUM_HEADS * context * 4
    return kv + 2 * kv + scores


def bench_point(batch: int, context: int, with_reference: bool) -> dict[str, Any]:
    """Time the kernel (and the reference, where it fits) at one (batch, context)."""
    from worker.attention.cupy_paged import paged_decode_attention
    from worker.attention.torch_ref import paged_decode_attention_ref

    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device="cuda").manual_seed(batch * 100_003 + context)
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=DTYPE, device="cuda").normal_(generator=gen)
    v_cache = torch.empty(shape, dtype=DTYPE, device="cuda").normal_(generator=gen)
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32).view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, NUM_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda", generator=gen)
    scale = HEAD_DIM**-0.5
    moved = _bytes_moved(batch, context)

    def run_kernel() -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale, max_context_len=context)

    kernel = _time_graph_ms(run_kernel)
    eager = _time_ms(run_kernel)
    result: dict[str, Any] = {
        "batch": batch,
        "context": context,
        "bytes_moved": moved,
        "kernel": {**kernel, "gb_s": moved / (kernel["median_ms"] * 1e-3) / 1e9},
        "kernel_eager": {**eager, "gb_s": moved / (eager["median_ms"] * 1e-3) / 1e9,
                         "note": "one launch at a time from Python, host overhead included"},
    }
    free_bytes, _ = torch.cuda.mem_get_info()
    need = _ref_memory_bytes(batch, context)
    if not with_reference:
        result["torch_ref"] = {"skipped": "--no-reference"}
    elif need * REF_MEMORY_MARGIN > free_bytes:
        result["torch_ref"] = {
            "skipped": f"would need ~{need / 2**30:.1f} GiB for its gathered K/V copies, {free_bytes / 2**30:.1f} "
            "GiB free"
        }
    else:
        out = run_kernel()
        ref_out = paged_decode_attention_ref(q, k_cache, v_cache, tables, context_lens, scale)
        err = (out.float() - ref_out.float()).abs().max().item() / ref_out.float().abs().max().item()
        del ref_out
        ref = _time_ms(lambda: paged_decode_attention_ref(q, k_cache, v_cache, tables, context_lens, scale), 3)
        result["torch_ref"] = {**ref, "gb_s": moved / (ref["median_ms"] * 1e-3) / 1e9}
        result["speedup_vs_torch"] = ref["median_ms"] / eager["median_ms"]  # both eager: conservative
        result["speedup_vs_torch_gpu_time"] = ref["median_ms"] / kernel["median_ms"]
        result["max_rel_err_vs_torch"] = err
    return result


def evaluate_targets(points: list[dict[str, Any]], copy_gb_s: float) -> dict[str, Any]:
    """Issue 5's acceptance: >= 80% of copy bandwidth at 64×4096 and 256×32768, >= 3× torch at 64×4096."""
    by_shape = {(p["batch"], p["context"]): p for p in points if "error" not in p}
    targets: dict[str, Any] = {}
    for batch, context in ((64, 4096), (256, 32768)):
        point = by_shape.get((batch, context))
        if point is None:
            continue
        fraction = point["kernel"]["gb_s"] / copy_gb_s
        targets[f"copy_fraction_b{batch}_c{context}"] = {
            "value": fraction, "target": TARGET_COPY_FRACTION, "met": fraction >= TARGET_COPY_FRACTION
        }
    point = by_shape.get((64, 4096))
    if point is not None and "speedup_vs_torch" in point:
        speedup = point["speedup_vs_torch"]
        targets["speedup_vs_torch_b64_c4096"] = {
            "value": speedup, "target": TARGET_SPEEDUP_VS_TORCH, "met": speedup >= TARGET_SPEEDUP_VS_TORCH
        }
    return targets


def _default_out_path() -> Path:
    out_dir = os.environ.get("OUT")
    if out_dir:
        return Path(out_dir) / "kernel_bench.json"
    return Path(__file__).resolve().parent / "results" / "kernel_bench.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON output path")
    parser.add_argument("--quick", action="store_true", help="only batch 64 × context 4096 (a smoke run)")
    parser.add_argument("--no-reference", action="store_true", help="skip the torch reference timings")
    parser.add_argument("--dry-run", action="store_true", help="import and check, touch no GPU")
    args = parser.parse_args(argv)
    if args.dry_run:
        from worker.attention.cupy_paged import paged_decode_attention  # noqa: F401 - what a GPU run imports
        from worker.attention.torch_ref import paged_decode_attention_ref  # noqa: F401

        out_path = args.out or _default_out_path()
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"skipped": "no GPU (dry run)"}) + "\n")
        print(json.dumps({"skipped": "no GPU (dry run)"}))
        return 0
    if not torch.cuda.is_available():
        print("kernel_bench: no CUDA device", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    started = time.perf_counter()
    copy = measure_copy_bandwidth()
    torch.cuda.empty_cache()
    shapes = [(64, 4096)] if args.quick else [(b, c) for c in CONTEXTS for b in BATCHES]
    points = []
    for batch, context in shapes:
        try:
            point = bench_point(batch, context, with_reference=not args.no_reference)
        except Exception as exc:  # noqa: BLE001 - one shape's failure is reported; the others still run
            point = {"batch": batch, "context": context, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(point), file=sys.stderr, flush=True)
            points.append(point)
            continue
        finally:
            torch.cuda.empty_cache()  # the point's pools are garbage now
        point["kernel"]["fraction_of_copy"] = point["kernel"]["gb_s"] / copy["gb_s"]
        print(json.dumps(point), file=sys.stderr, flush=True)
        points.append(point)
    report = {
        "device": props.name,
        "num_sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "block_size": BLOCK_SIZE, "dtype": "bfloat16", "block_order": "random permutation"},
        "bandwidth_definition": "bytes of K, V (context tokens), Q and output ÷ median kernel time (kernel: GPU "
        "time from CUDA-graph replays; kernel_eager: Python launches); GB = 1e9 B; copy: bytes read + written",
        "speedup_definition": "torch reference eager median ÷ kernel eager median",
        "copy_roofline": copy,
        "points": points,
        "targets": evaluate_targets(points, copy["gb_s"]),
        "wall_s": time.perf_counter() - started,
    }
    try:
        import cupy

        report["cupy"] = cupy.__version__
    except ImportError:
        report["cupy"] = None
    out_path = args.out or _default_out_path()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 1 if any("error" in p for p in points) else 0


if __name__ == "__main__":
    sys.exit(main())
