"""Probe the decode step's alternatives on a GPU, one JSON line each: cuBLAS vs cuBLASLt and weight layouts for the
8B's projections at decode row counts, the attention kernel's split and occupancy at short contexts, greedy argmax
forms, and the engine's step with each BLAS backend.

Usage: ``python -m bench.decode_probe [--out PATH]``; JSON lines to stderr, a summary to PATH (default
``$OUT/decode_probe.json``).
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

from bench.kernel_bench import _time_graph_ms  # noqa: E402

RESULTS: dict[str, Any] = {}


def emit(section: str, record: dict[str, Any]) -> None:
    RESULTS.setdefault(section, []).append(record)
    print(json.dumps({"section": section, **record}), file=sys.stderr, flush=True)


def graph_ms(fn, launches: int = 1) -> float:
    return _time_graph_ms(fn, launches=launches)["median_ms"]


def matmuls() -> None:
    """32 layers' weights (cold in L2, as in the model): each projection over its 32 layers in one graph."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    for name, (out_f, in_f) in shapes.items():
        weights = [torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(32)]
        transposed = [w.t().contiguous() for w in weights]
        gb = 32 * out_f * in_f * 2 / 1e9
        for rows in (1, 64, 256):
            x = torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16)
            for backend in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(backend)
                for layout in ("W", "Wt"):
                    if layout == "W":
                        def fn(x=x, ws=weights):
                            for w in ws:
                                F.linear(x, w)
                    else:
                        def fn(x=x, ws=transposed):
                            for w in ws:
                                torch.mm(x, w)
                    try:
                        ms = graph_ms(fn)
                        emit("matmul", {"linear": name, "rows": rows, "blas": backend, "layout": layout,
                                        "us_per_layer": ms * 1e3 / 32, "gb_s": gb / (ms * 1e-3)})
                    except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
                        emit("matmul", {"linear": name, "rows": rows, "blas": backend, "layout": layout,
                                        "error": f"{type(exc).__name__}: {exc}"[:300]})
        torch.backends.cuda.preferred_blas_library("cublas")
        del weights, transposed
        torch.cuda.empty_cache()


def attention() -> None:
    """The kernel at the engine bench's contexts: planned, forced splits, and more CTAs per SM (registers capped)."""
    import cupy

    from worker.attention import cupy_paged as cp
    from worker.attention.partitioned_ref import PartitionPlan, plan_partitions

    source = cp._kernel_source()
    modules = {}
    for ctas in (3, 4):
        patched = source.replace("constexpr int kMinCtasPerSm = 2;", f"constexpr int kMinCtasPerSm = {ctas};")
        try:
            module = cupy.RawModule(code=patched, options=cp.compile_options("bf16", 128, 16))
            modules[ctas] = tuple(module.get_function(n) for n in cp.kernel_names("bf16", 128, 16, 4))
        except Exception as exc:  # noqa: BLE001
            emit("attention", {"min_ctas_per_sm": ctas, "error": f"{type(exc).__name__}: {exc}"[:300]})
    for batch, context in ((64, 539), (256, 539), (64, 4096), (1, 539)):
        blocks_per_seq = -(-context // 16)
        num_blocks = batch * blocks_per_seq
        gen = torch.Generator(device="cuda").manual_seed(batch + context)
        shape = (num_blocks, 8, 16, 128)
        k_cache = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(generator=gen)
        v_cache = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(generator=gen)
        tables = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32).view(batch, blocks_per_seq)
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn((batch, 32, 128), dtype=torch.bfloat16, device="cuda", generator=gen)
        moved = 2 * batch * context * 8 * 128 * 2 + 2 * batch * 32 * 128 * 2
        scale = 128**-0.5
        ref = cp.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, max_context_len=context)
        for tokens in (None, 288, 192, 144, 96):
            if tokens is not None and tokens >= context:
                continue
            def fn(tokens=tokens):
                return cp.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, max_context_len=context,
                                                 partition_tokens=tokens)
            ms = graph_ms(fn, launches=10)
            emit("attention", {"batch": batch, "context": context, "partition_tokens": tokens, "us": ms * 1e3,
                               "gb_s": moved / (ms * 1e-3) / 1e9})
        for ctas, (single, split, reduce) in modules.items():
            try:
                num_regs = int(single.num_regs)
                resident = 132 * max(1, min(16, 65536 // ((-(-num_regs * 32 // 256) * 256) * 4)))
                for tokens in (None, 288, 144):
                    if tokens is not None and tokens >= context:
                        continue
                    if tokens is None:
                        plan = plan_partitions(context, batch * 8, resident, 16)
                    else:
                        plan = PartitionPlan(-(-context // tokens), tokens)
                    out = torch.empty_like(q)
                    partial_out, partial_stats = cp.allocate_partials(q, plan)
                    launch = cp.build_launch(q, k_cache, v_cache, tables, lens, scale, plan, out, partial_out,
                                             partial_stats)

                    def fn(launch=launch):
                        with cp.external_stream(torch.cuda.current_stream().cuda_stream, 0):
                            if launch.reduce_grid is None:
                                single(launch.grid, launch.block, launch.decode_args)
                            else:
                                split(launch.grid, launch.block, launch.decode_args)
                                reduce(launch.reduce_grid, launch.block, launch.reduce_args)
                    fn()
                    torch.cuda.synchronize()
                    err = float(((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item())
                    ms = graph_ms(fn, launches=10)
                    emit("attention", {"batch": batch, "context": context, "min_ctas_per_sm": ctas,
                                       "num_regs": num_regs, "local_bytes": int(single.local_size_bytes),
                                       "partitions": plan.num_partitions, "us": ms * 1e3,
                                       "gb_s": moved / (ms * 1e-3) / 1e9, "max_rel_err": err})
            except Exception as exc:  # noqa: BLE001
                emit("attention", {"batch": batch, "context": context, "min_ctas_per_sm": ctas,
                                   "error": f"{type(exc).__name__}: {exc}"[:300]})


def argmax() -> None:
    vocab = 128256
    for rows in (1, 64, 256):
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.float32)
        logits16 = logits.to(torch.bfloat16)
        chunk = 501  # 128256 = 256 x 501

        def two_stage(lg=logits):
            values, idx = lg.view(lg.shape[0], -1, chunk).max(dim=2)
            best = values.max(dim=1).indices
            return best * chunk + idx.gather(1, best[:, None]).squeeze(1)

        variants = {
            "max_dim_f32": lambda: logits.max(dim=-1).indices,
            "argmax_f32": lambda: logits.argmax(dim=-1),
            "two_stage_f32": two_stage,
            "max_dim_bf16": lambda: logits16.max(dim=-1).indices,
            "cast_bf16_to_f32": lambda: logits16.float(),
        }
        ok = bool(torch.equal(two_stage(), logits.max(dim=-1).indices))
        for name, fn in variants.items():
            emit("argmax", {"rows": rows, "variant": name, "us": graph_ms(fn, launches=10) * 1e3,
                            "two_stage_equal": ok})


def engine() -> None:
    from bench.decode_profile import step_phases
    from bench.engine_bench import BLOCK_SIZE, measure_copy_gb_s
    from worker.cuda_graphs import DecodeGraphs
    from worker.synthetic import build_synthetic_model, synthetic_spec

    copy = measure_copy_gb_s()
    emit("engine", {"copy_gb_s": copy})
    model = build_synthetic_model(synthetic_spec("llama-3-8b"), "bfloat16", "cuda", attention_backend="cupy")
    blocks_per_seq = -(-(512 + 48 + 64) // BLOCK_SIZE)
    num_blocks = 256 * blocks_per_seq + 8
    kv_cache = model.allocate_kv_cache(num_blocks + 1, BLOCK_SIZE)
    for backend in ("cublas", "cublaslt", "cublas"):
        torch.backends.cuda.preferred_blas_library(backend)
        graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, 64, blocks_per_seq * BLOCK_SIZE, pad_block_id=num_blocks)
        graphs.capture()
        result = step_phases(model, kv_cache, graphs, 64, 48, num_blocks)
        emit("engine", {"blas": backend, **result})
        del graphs
        torch.cuda.empty_cache()


def ab() -> None:
    """In one process: the engine's decode step with cuBLAS and with cuBLASLt, the graph rows advanced on the device
    and loaded from the host every step, and eager steps (host-bound at small batches); the host cost of one
    ``DecodeGraphs.advance`` alone."""
    from bench.decode_profile import step_phases
    from bench.engine_bench import BLOCK_SIZE
    from worker import model_runner
    from worker.cuda_graphs import DecodeGraphs
    from worker.graph_decoder import GraphDecoder
    from worker.synthetic import build_synthetic_model, synthetic_spec

    class NotAheadDecoder(GraphDecoder):
        def _may_launch_ahead(self, step) -> bool:
            return False

    class RowsFromTheHostDecoder(NotAheadDecoder):
        def forward(self, out):
            self._last = None
            return super().forward(out)

    def runner_with(decoder_cls):
        class Runner(model_runner.ModelRunner):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                if self.graph_decoder is not None:
                    self.graph_decoder = decoder_cls(self.decode_graphs, self.batch_builder.decode_tables)
        return Runner

    model = build_synthetic_model(synthetic_spec("llama-3-8b"), "bfloat16", "cuda", attention_backend="cupy")
    blocks_per_seq = -(-(512 + 48 + 64) // BLOCK_SIZE)
    num_blocks = 256 * blocks_per_seq + 8
    kv_cache = model.allocate_kv_cache(num_blocks + 1, BLOCK_SIZE)
    real_runner = model_runner.ModelRunner
    runners = {"ahead": real_runner, "advanced": runner_with(NotAheadDecoder),
               "from_host": runner_with(RowsFromTheHostDecoder)}
    for backend in ("cublaslt", "cublas"):
        torch.backends.cuda.preferred_blas_library(backend)
        graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, 256, blocks_per_seq * BLOCK_SIZE, pad_block_id=num_blocks)
        graphs.capture()
        for rows, runner_cls in runners.items():
            import bench.engine_bench as eb
            eb.ModelRunner = runner_cls
            for n in (1, 64, 256) if backend == "cublaslt" else (1, 64):
                emit("ab", {"blas": backend, "rows": rows, **step_phases(model, kv_cache, graphs, n, 48, num_blocks)})
        eb.ModelRunner = real_runner
        for n in (1, 64):
            emit("ab", {"blas": backend, "rows": "eager", **step_phases(model, kv_cache, None, n, 16, num_blocks)})
        ids = torch.zeros(64, dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(200):
            graphs.advance(64, ids, [], [])
        emit("ab", {"blas": backend, "advance_host_us": (time.perf_counter() - started) / 200 * 1e6})
        started = time.perf_counter()
        for _ in range(200):
            graphs.positions[:64].add_(1)
        emit("ab", {"blas": backend, "one_add_host_us": (time.perf_counter() - started) / 200 * 1e6})
        torch.cuda.synchronize()
        del graphs
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", default="matmuls,attention,argmax,engine")
    args = parser.parse_args(argv)
    out = args.out or Path(os.environ.get("OUT", "bench/results/gpu")) / "decode_probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["torch"] = torch.__version__
    for name in args.only.split(","):
        started = time.perf_counter()
        try:
            globals()[name]()
        except Exception as exc:  # noqa: BLE001 - every section runs
            emit(name, {"error": f"{type(exc).__name__}: {exc}"[:500]})
        emit("timing", {"section": name, "s": time.perf_counter() - started})
        out.write_text(json.dumps(RESULTS, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
