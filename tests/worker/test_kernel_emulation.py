"""Run the CUDA decode kernels on the CPU, lane by lane, and check them against plain softmax attention.

No GPU needed: the ``.cu`` file is compiled by the host C++ compiler with ``SLUICE_HOST_EMULATION`` (its five
inline-PTX helpers take plain C++ forms) and a prelude that supplies CUDA's built-ins: ``blockIdx``/``threadIdx``,
``__shfl_sync``/``__shfl_xor_sync`` (a per-warp exchange buffer and barrier), ``__syncthreads`` and ``__shared__``.
Each CTA runs as 128 cooperative fibers (ucontext) on one thread, switching at every barrier, so the lanes of a
warp meet at each shuffle exactly as in lockstep. The arguments come from the real launcher
(:func:`worker.attention.cupy_paged.build_launch`) with host tensors, so the kernels' parameter order, the grid
mapping, the workspace layout and the partition plan are tested too. What it cannot show: timing, memory
coalescing, or the PTX-only paths (ex2.approx, cvt, ld.global.nc), which tests/gpu covers on a GPU.
"""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from worker.attention.cupy_paged import (
    KERNEL_SOURCE_PATH,
    allocate_partials,
    build_launch,
    compile_options,
    forced_plan,
    kernel_names,
)
from worker.attention.partitioned_ref import KernelGeometry, plain_decode_attention

CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++)")

PRELUDE = r"""
#include <math.h>
#include <string.h>
#include <ucontext.h>
#include <stdlib.h>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static

struct uint4 { unsigned int x, y, z, w; };
struct float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
struct uint3_emu { unsigned int x, y, z; };
static uint3_emu blockIdx, gridDim, blockDim;
static int emu_current = 0;         // the fiber (CTA thread) running now
static uint3_emu emu_thread_idx[128];
#define threadIdx (emu_thread_idx[emu_current])

inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned int i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int i; memcpy(&i, &f, 4); return i; }
inline float host_f16_to_float(unsigned short h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
inline unsigned short host_float_to_f16(float f) {
  _Float16 x = (_Float16)f;
  unsigned short h;
  memcpy(&h, &x, 2);
  return h;
}

// Cooperative fibers: one per thread of the CTA; a barrier yields until every member has arrived.
namespace emu {
constexpr int kThreads = 128;
static ucontext_t scheduler;
static ucontext_t fibers[kThreads];
static bool done[kThreads];
struct Barrier { int size = 0, arrived = 0; long phase = 0; };
static Barrier warp_barrier[kThreads / 32];
static Barrier cta_barrier;
static float warp_f[kThreads / 32][32];
static int warp_i[kThreads / 32][32];

inline void yield() { swapcontext(&fibers[emu_current], &scheduler); }
inline void wait(Barrier& b) {
  const long phase = b.phase;
  if (++b.arrived == b.size) { b.arrived = 0; ++b.phase; return; }
  while (b.phase == phase) yield();
}
}  // namespace emu

inline void __syncthreads() { emu::wait(emu::cta_barrier); }
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  emu::warp_f[w][lane] = v; emu::wait(emu::warp_barrier[w]);
  const float r = emu::warp_f[w][lane ^ mask]; emu::wait(emu::warp_barrier[w]);
  return r;
}
inline int __shfl_sync(unsigned, int v, int src) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  emu::warp_i[w][lane] = v; emu::wait(emu::warp_barrier[w]);
  const int r = emu::warp_i[w][src]; emu::wait(emu::warp_barrier[w]);
  return r;
}
"""

LAUNCHER = r"""
namespace emu {
template <class Fn>
struct Launch { Fn fn; };
static void (*cta_body)(void) = nullptr;
static void trampoline(int tid) {
  cta_body();
  done[tid] = true;
  swapcontext(&fibers[tid], &scheduler);
}
static void run_grid(unsigned gx, unsigned gy, unsigned gz, void (*body)(void)) {
  static std::vector<char> stacks(kThreads * 256 * 1024);
  cta_body = body;
  gridDim = uint3_emu{gx, gy, gz};
  blockDim = uint3_emu{kThreads, 1, 1};
  for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
    blockIdx = uint3_emu{x, y, z};
    cta_barrier = Barrier{kThreads, 0, 0};
    for (int w = 0; w < kThreads / 32; ++w) warp_barrier[w] = Barrier{32, 0, 0};
    for (int t = 0; t < kThreads; ++t) {
      done[t] = false;
      emu_thread_idx[t] = uint3_emu{(unsigned)t, 0, 0};
      getcontext(&fibers[t]);
      fibers[t].uc_stack.ss_sp = stacks.data() + (size_t)t * 256 * 1024;
      fibers[t].uc_stack.ss_size = 256 * 1024;
      fibers[t].uc_link = &scheduler;
      makecontext(&fibers[t], (void (*)())trampoline, 1, t);
    }
    bool all_done = false;
    while (!all_done) {
      all_done = true;
      for (int t = 0; t < kThreads; ++t) {
        if (done[t]) continue;
        all_done = false;
        emu_current = t;
        swapcontext(&scheduler, &fibers[t]);
      }
    }
  }
}

typedef void (*DecodeFn)(void*, float*, float*, float*, const void*, const void*, const void*, const int*,
                         const int*, float, int, int, long long, long long, long long, long long, int, int);
typedef void (*ReduceFn)(void*, const float*, const float*, const float*, const int*, int, int, int);
static DecodeFn decode_fn; static ReduceFn reduce_fn;
static void* a_out; static float *a_po, *a_pm, *a_ps; static const void *a_q, *a_k, *a_v;
static const int *a_bt, *a_cl; static float a_scale; static int a_nh, a_nkv, a_bts, a_pt, a_np;
static long long a_qs, a_qh, a_kb, a_kh;
static void decode_body() {
  decode_fn(a_out, a_po, a_pm, a_ps, a_q, a_k, a_v, a_bt, a_cl, a_scale, a_nh, a_nkv, a_qs, a_qh, a_kb, a_kh,
            a_bts, a_pt);
}
static void reduce_body() { reduce_fn(a_out, a_po, a_pm, a_ps, a_cl, a_nh, a_np, a_pt); }
}  // namespace emu

extern "C" void emulate_decode(void* fn, unsigned gx, unsigned gy, unsigned gz, void* out, float* po, float* pm,
                               float* ps, const void* q, const void* k, const void* v, const int* bt, const int* cl,
                               float scale, int nh, int nkv, long long qs, long long qh, long long kb, long long kh,
                               int bts, int pt) {
  using namespace emu;
  decode_fn = (DecodeFn)fn; a_out = out; a_po = po; a_pm = pm; a_ps = ps; a_q = q; a_k = k; a_v = v; a_bt = bt;
  a_cl = cl; a_scale = scale; a_nh = nh; a_nkv = nkv; a_qs = qs; a_qh = qh; a_kb = kb; a_kh = kh; a_bts = bts;
  a_pt = pt;
  run_grid(gx, gy, gz, decode_body);
}

extern "C" void emulate_reduce(void* fn, unsigned gx, unsigned gy, void* out, const float* po, const float* pm,
                               const float* ps, const int* cl, int nh, int np, int pt) {
  using namespace emu;
  reduce_fn = (ReduceFn)fn; a_out = out; a_po = (float*)po; a_pm = (float*)pm; a_ps = (float*)ps; a_cl = cl;
  a_nh = nh; a_np = np; a_pt = pt;
  run_grid(gx, gy, 1, reduce_body);
}
"""

_CTYPES = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.int32: ctypes.c_int32, np.float32: ctypes.c_float}


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernel_emulation")


_LIBS: dict[tuple[str, int, int], ctypes.CDLL] = {}


def _library(build_dir: Path, dtype_name: str, head_dim: int, block_size: int) -> ctypes.CDLL:
    """Compile (once) the host emulation of one (dtype, head_dim, block_size) module."""
    key = (dtype_name, head_dim, block_size)
    if key not in _LIBS:
        prelude = build_dir / "prelude.h"
        prelude.write_text(PRELUDE)
        source = build_dir / f"emu_{dtype_name}_{head_dim}_{block_size}.cpp"
        source.write_text(f'#include "{KERNEL_SOURCE_PATH}"\n{LAUNCHER}')
        lib_path = source.with_suffix(".so")
        proc = subprocess.run(
            [CXX, "-std=c++17", "-O2", "-shared", "-fPIC", "-w", "-DSLUICE_HOST_EMULATION",
             *compile_options(dtype_name, head_dim, block_size), "-include", str(prelude), "-o", str(lib_path),
             str(source)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        _LIBS[key] = ctypes.CDLL(str(lib_path))
    return _LIBS[key]


def _ctypes_args(args: tuple) -> list:
    return [_CTYPES[type(a)](a.item()) for a in args]


def _emulated_attention(
    build_dir: Path,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    partition_tokens: int,
) -> torch.Tensor:
    """Launch the emulated kernels with the real launcher's grid and arguments; return out (q's dtype)."""
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "f16"}[q.dtype]
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    heads = KernelGeometry.for_shape(head_dim, block_size, num_heads // num_kv_heads).heads_per_cta
    lib = _library(build_dir, dtype_name, head_dim, block_size)
    plan = forced_plan(int(context_lens.max()), block_size, partition_tokens)
    out = torch.full((num_seqs, num_heads, head_dim), float("nan"), dtype=q.dtype)
    partial_out, partial_stats = allocate_partials(q, plan)
    launch = build_launch(q, k_cache, v_cache, block_tables, context_lens, scale, plan, out, partial_out,
                          partial_stats)
    single, split, reduce = kernel_names(dtype_name, head_dim, block_size, heads)
    decode_name = single if launch.reduce_grid is None else split
    decode_fn = ctypes.cast(getattr(lib, decode_name), ctypes.c_void_p)
    lib.emulate_decode(decode_fn, *(ctypes.c_uint(g) for g in launch.grid), *_ctypes_args(launch.decode_args))
    if launch.reduce_grid is not None:
        reduce_fn = ctypes.cast(getattr(lib, reduce), ctypes.c_void_p)
        lib.emulate_reduce(reduce_fn, *(ctypes.c_uint(g) for g in launch.reduce_grid),
                           *_ctypes_args(launch.reduce_args))
    return out


def _case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, lens: list[int],
          dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks) + 2
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros((len(lens), max(blocks) + 1), dtype=torch.int32)
    start = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = ids[start:start + n]
        start += n
    q = torch.randn((len(lens), num_heads, head_dim), generator=gen).to(dtype)
    k = torch.randn((num_blocks, num_kv_heads, block_size, head_dim), generator=gen).to(dtype)
    v = torch.randn((num_blocks, num_kv_heads, block_size, head_dim), generator=gen).to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "num_heads", "num_kv_heads", "partition_tokens"),
    [
        (torch.bfloat16, 128, 16, 8, 2, 1024),  # group 4, single pass
        (torch.bfloat16, 128, 16, 8, 2, 32),  # group 4, split into 2-block partitions
        (torch.float16, 128, 32, 6, 2, 64),  # group 3 (H=4, one idle head), two tiles per block
        (torch.bfloat16, 64, 16, 9, 3, 16),  # SmolLM2's group 3, one block per partition
        (torch.float16, 64, 32, 4, 4, 1024),  # group 1
        (torch.bfloat16, 128, 16, 16, 1, 48),  # group 16: two chunks of 8 heads per KV head, 8-token tiles
        (torch.float16, 64, 16, 4, 2, 160),  # group 2, partitions of 10 blocks
    ],
)
def test_emulated_kernel_matches_plain_attention(
    build_dir: Path, dtype: torch.dtype, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int,
    partition_tokens: int,
) -> None:
    lens = [1, block_size + 3, 5 * block_size, 333]
    q, k, v, tables, context_lens = _case(num_heads, num_kv_heads, head_dim, block_size, lens, dtype, seed=head_dim)
    scale = head_dim**-0.5
    out = _emulated_attention(build_dir, q, k, v, tables, context_lens, scale, partition_tokens)
    expected = plain_decode_attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), tables.numpy(),
                                      context_lens.numpy(), scale)
    got = out.double().numpy()
    assert np.isfinite(got).all()
    err = np.abs(got - expected).max()
    assert err <= TOLERANCE[dtype] * np.abs(expected).max(), f"max abs err {err:.3e}"


def test_emulated_kernel_reads_strided_views(build_dir: Path) -> None:
    """q sliced out of a fused qkv row and K/V as views of a [layers, 2, ...] pool, as the model passes them."""
    q, k, v, tables, context_lens = _case(8, 2, 64, 16, [70, 5], torch.bfloat16, seed=7)
    qkv = torch.zeros((2, (8 + 4) * 64), dtype=torch.bfloat16)
    qkv[:, : 8 * 64] = q.reshape(2, -1)
    pool = torch.zeros((2, 2, *k.shape), dtype=torch.bfloat16)
    pool[1, 0], pool[1, 1] = k, v
    q_view = qkv[:, : 8 * 64].view(2, 8, 64)
    out = _emulated_attention(build_dir, q_view, pool[1, 0], pool[1, 1], tables, context_lens, 0.125, 32)
    expected = _emulated_attention(build_dir, q, k, v, tables, context_lens, 0.125, 32)
    assert torch.equal(out, expected)


def test_emulated_empty_context_gives_zeros(build_dir: Path) -> None:
    q, k, v, tables, _ = _case(4, 2, 64, 16, [20, 3], torch.float16, seed=8)
    lens = torch.tensor([20, 0], dtype=torch.int32)
    for partition_tokens in (1024, 16):
        out = _emulated_attention(build_dir, q, k, v, tables, lens, 0.1, partition_tokens)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.isfinite(out[0]).all()
