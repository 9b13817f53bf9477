"""Compile every instance of the CuPy paged decode kernel, and the layer operations, at once, one process per module
(GPU only).

``worker/attention/kernels/paged_decode_attention.cu`` is built by NVRTC per (dtype, head_dim, block_size) the
first time a process needs it (:func:`worker.attention.cupy_paged._module`); CuPy keeps the cubin in its disk
cache (``~/.cupy/kernel_cache``, or ``$CUPY_CACHE_DIR``), so a later process loads it instead of compiling. On a
fresh machine the GPU check would otherwise compile the 8 modules one after another inside its time-limited stages;
this compiles them (and ``worker/cuda_kernels/layer_ops.cu``) in parallel first, and reports what each kernel
costs the SM: registers per thread, local memory (spills) and static shared memory per CTA, read back from the
loaded function (``cuFuncGetAttribute``).

Usage: ``python -m bench.kernel_compile [--out PATH] [--dry-run]``; JSON to PATH (default ``$OUT/kernel_compile.json``,
else ``bench/results/kernel_compile.json``). Exit 1 when any module fails to compile; spills are reported
(``spilled``), not failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Iterable

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from worker.attention.cupy_paged import kernel_names  # noqa: E402
from worker.attention.partitioned_ref import (  # noqa: E402
    HEADS_PER_CTA_CHOICES,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_DIMS,
)
from worker.cuda_kernels import DTYPE_NAMES  # noqa: E402

MODULES = [(dtype, head_dim, block_size) for dtype in DTYPE_NAMES.values() for head_dim in SUPPORTED_HEAD_DIMS
           for block_size in SUPPORTED_BLOCK_SIZES]


def _resource_record(module: str, load: Callable[[], Iterable[tuple[str, Any]]]) -> dict[str, Any]:
    """Run ``load`` (compile or load from CuPy's cache on device 0, yielding (kernel name, CuPy function)); return
    the module's seconds, each kernel's registers per thread, local (spill) and static shared bytes, or the error.

    Runs in a child process: CUDA is initialised there, never in the parent.
    """
    started = time.perf_counter()
    record: dict[str, Any] = {"module": module, "kernels": {}}
    try:
        for name, function in load():
            record["kernels"][name] = {"registers": int(function.num_regs),
                                       "local_bytes": int(function.local_size_bytes),
                                       "shared_bytes": int(function.shared_size_bytes)}
    except Exception as exc:  # noqa: BLE001 - reported per module; the exit code says that one failed
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["seconds"] = time.perf_counter() - started
    return record


def compile_module(dtype_name: str, head_dim: int, block_size: int) -> dict[str, Any]:
    """One attention module (:func:`worker.attention.cupy_paged._kernels`, every heads-per-CTA instance)."""
    from worker.attention.cupy_paged import _kernels

    def load() -> Iterable[tuple[str, Any]]:
        for heads in HEADS_PER_CTA_CHOICES:
            yield from zip(kernel_names(dtype_name, head_dim, block_size, heads),
                           _kernels(dtype_name, head_dim, block_size, heads, 0), strict=True)

    return _resource_record(f"{dtype_name}_d{head_dim}_b{block_size}", load)


def compile_layer_ops() -> dict[str, Any]:
    """``worker/cuda_kernels/layer_ops.cu``, every kernel :mod:`worker.cuda_kernels` launches."""
    from worker.cuda_kernels import LAYER_OPS_KERNELS, _function

    return _resource_record("layer_ops", lambda: ((name, _function(name, 0)) for name in LAYER_OPS_KERNELS))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="import and check, touch no GPU")
    args = parser.parse_args(argv)
    out_path = args.out or (Path(os.environ["OUT"]) / "kernel_compile.json" if os.environ.get("OUT")
                            else REPO_ROOT / "bench" / "results" / "kernel_compile.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        report: dict[str, Any] = {"skipped": "no GPU (dry run)", "modules": [m[0] + str(m[1:]) for m in MODULES]}
        out_path.write_text(json.dumps(report) + "\n")
        print(json.dumps(report))
        return 0
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=len(MODULES) + 1, mp_context=get_context("spawn")) as pool:
        layer_ops = pool.submit(compile_layer_ops)
        records = list(pool.map(compile_module, *zip(*MODULES, strict=True))) + [layer_ops.result()]
    failed = [r["module"] for r in records if "error" in r]
    spilled = [name for r in records for name, k in r["kernels"].items() if k["local_bytes"] > 0]
    report = {"modules": records, "failed": failed, "spilled": spilled, "wall_s": time.perf_counter() - started,
              "cache_dir": os.environ.get("CUPY_CACHE_DIR", "~/.cupy/kernel_cache")}
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "modules"}))
    for r in records:
        regs = {name.split("_", 2)[-1]: k["registers"] for name, k in r["kernels"].items()}
        print(f"{r['module']}: {r['seconds']:.1f} s {r.get('error', '')} registers {regs}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
