"""Paged decode attention on CUDA: the CuPy launcher of ``kernels/paged_decode_attention.cu``.

One function, :func:`paged_decode_attention`, attends one query token per sequence over its paged K/V (the same
contract as :func:`worker.attention.torch_ref.paged_decode_attention_ref`). It shares torch's tensors with the
kernel without copies (raw ``data_ptr()`` pointers), launches on torch's current CUDA stream, and picks the
split along the context (flash-decoding) from the longest context and the GPU's multiprocessor count
(:func:`worker.attention.partitioned_ref.plan_partitions`). The module for each (dtype, head_dim, block_size) is
compiled once by NVRTC (CuPy ``RawModule``) and cached.

:class:`CupyAttentionBackend` is the ``cupy`` attention backend (``worker.attention_backend = "cupy"``, or ``auto``
on CUDA with CuPy installed): decode-only steps run the kernel; steps with prefill chunks run the torch reference.

CuPy is imported lazily: this module imports on a machine without CuPy or CUDA, and :func:`cupy_available` says
whether the kernel can run.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from worker.attention.partitioned_ref import (
    MAX_PARTITIONS,
    NUM_WARPS,
    WARP_SIZE,
    KernelGeometry,
    PartitionPlan,
    plan_partitions,
)
from worker.attention.torch_ref import TorchAttentionBackend
from worker.cuda_kernels import DTYPE_NAMES, cupy_available, external_stream, write_kv

if TYPE_CHECKING:
    from worker.batch import ForwardBatch

KERNEL_SOURCE_PATH = Path(__file__).with_name("kernels") / "paged_decode_attention.cu"
THREADS_PER_CTA = NUM_WARPS * WARP_SIZE
_MAX_GRID_Y = 65535
_REGISTERS_PER_SM = 65536
_MAX_CTAS_PER_SM = 16  # Hopper/Ampere limit on resident CTAs per SM (warps bound it first here: 64 / 4)


class KernelUnavailableError(RuntimeError):
    """CuPy or a CUDA device is missing, so the CuPy kernel cannot run."""


def kernel_names(dtype_name: str, head_dim: int, block_size: int, heads_per_cta: int) -> tuple[str, str, str]:
    """Return the extern "C" names (single pass, split, reduce) of one instance.

    Args:
        dtype_name: ``bf16`` or ``f16``.
        head_dim: 64 or 128.
        block_size: 16 or 32 tokens.
        heads_per_cta: 1, 2, 4 or 8.
    """
    suffix = f"{dtype_name}_d{head_dim}_b{block_size}_g{heads_per_cta}"
    return f"paged_decode_{suffix}", f"paged_decode_split_{suffix}", f"paged_decode_reduce_{dtype_name}_d{head_dim}"


def compile_options(dtype_name: str, head_dim: int, block_size: int) -> tuple[str, ...]:
    """Return the NVRTC/nvcc defines that compile only the kernels of one (dtype, head_dim, block_size)."""
    return (
        "-DSLUICE_SELECT",
        f"-DSLUICE_SELECT_{dtype_name}_d{head_dim}_b{block_size}",
        f"-DSLUICE_SELECT_REDUCE_{dtype_name}_d{head_dim}",
    )


@functools.lru_cache(maxsize=None)
def _cupy_installed() -> bool:
    return importlib.util.find_spec("cupy") is not None


@functools.lru_cache(maxsize=None)
def _kernel_source() -> str:
    return KERNEL_SOURCE_PATH.read_text()


@functools.lru_cache(maxsize=None)
def _module(dtype_name: str, head_dim: int, block_size: int) -> Any:
    """Build (once per process) the RawModule of one (dtype, head_dim, block_size); CuPy compiles per device."""
    import cupy

    return cupy.RawModule(code=_kernel_source(), options=compile_options(dtype_name, head_dim, block_size))


@functools.lru_cache(maxsize=None)
def _kernels(dtype_name: str, head_dim: int, block_size: int, heads_per_cta: int, device_index: int) -> tuple:
    """Return the (single pass, split, reduce) kernels of one instance, compiled for ``device_index``."""
    import cupy

    module = _module(dtype_name, head_dim, block_size)
    with cupy.cuda.Device(device_index):
        names = kernel_names(dtype_name, head_dim, block_size, heads_per_cta)
        return tuple(module.get_function(name) for name in names)


@functools.lru_cache(maxsize=None)
def _resident_ctas(kernel_key: tuple[str, int, int, int], device_index: int) -> int:
    """Return how many decode CTAs of one instance the whole GPU holds at once (SMs × CTAs per SM)."""
    single, _, _ = _kernels(*kernel_key, device_index)
    num_sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    regs_per_warp = -(-max(1, int(single.num_regs)) * WARP_SIZE // 256) * 256  # allocated in units of 256
    ctas_per_sm = max(1, min(_MAX_CTAS_PER_SM, _REGISTERS_PER_SM // (regs_per_warp * NUM_WARPS)))
    return num_sms * ctas_per_sm


def _check_pool_view(name: str, pool: torch.Tensor, head_dim: int) -> None:
    """Raise ValueError unless ``pool`` rows are contiguous and 16-byte aligned (the kernel's vector loads)."""
    if pool.stride(3) != 1 or pool.stride(2) != head_dim:
        raise ValueError(
            f"{name} must have contiguous [block_size, head_dim] tiles (strides (..., {head_dim}, 1)), "
            f"got strides {pool.stride()}"
        )
    if pool.stride(0) % 8 or pool.stride(1) % 8 or pool.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned with strides in multiples of 8 elements: {pool.stride()}")


def _validate(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """Check devices, dtypes, shapes and layouts against the kernel's assumptions (ValueError otherwise)."""
    if q.device.type != "cuda":
        raise ValueError(f"the CuPy kernel needs CUDA tensors, q is on {q.device}")
    others = {"k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "context_lens": context_lens}
    for name, t in others.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if q.dtype not in DTYPE_NAMES:
        raise ValueError(f"q dtype {q.dtype} unsupported; the kernel takes {sorted(map(str, DTYPE_NAMES))}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"expected q [num_seqs, num_heads, head_dim] and pools [num_blocks, num_kv_heads, block_size, "
            f"head_dim]; got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, _, kv_head_dim = k_cache.shape
    if kv_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit the pool {tuple(k_cache.shape)} "
            "(head_dim must match, num_heads a multiple of num_kv_heads)"
        )
    if q.stride(2) != 1 or q.stride(0) % 8 or q.stride(1) % 8 or q.data_ptr() % 16:
        raise ValueError(f"q rows must be contiguous and 16-byte aligned, got strides {q.stride()}")
    _check_pool_view("k_cache", k_cache, head_dim)
    _check_pool_view("v_cache", v_cache, head_dim)
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables must be int32 [num_seqs, max_blocks] with contiguous rows, got {block_tables.dtype} "
            f"{tuple(block_tables.shape)} strides {block_tables.stride()}"
        )
    if context_lens.dtype != torch.int32 or context_lens.dim() != 1 or not context_lens.is_contiguous():
        raise ValueError(
            f"context_lens must be contiguous int32 [num_seqs], got {context_lens.dtype} {tuple(context_lens.shape)}"
        )
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)} "
            f"do not match num_seqs={num_seqs}"
        )
    if num_seqs > _MAX_GRID_Y:
        raise ValueError(f"at most {_MAX_GRID_Y} sequences per launch, got {num_seqs}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    partition_tokens: int | None = None,
) -> torch.Tensor:
    """Attend one query token per sequence over its paged context with the CUDA kernel.

    Same contract as :func:`worker.attention.torch_ref.paged_decode_attention_ref`. Grouped-query attention:
    query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``. Runs on torch's current stream of
    ``q``'s device; nothing is copied and nothing synchronises with the host unless ``max_context_len`` is None.

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` bf16/fp16, cuda; rows contiguous (strides multiples of 8).
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, one layer's K pool (e.g.
            ``kv_cache[layer, 0]``), q's dtype; ``[block_size, head_dim]`` tiles contiguous.
        v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, one layer's V pool, same layout.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32, cuda; entries past a sequence's last block are
            never read.
        context_lens: ``[num_seqs]`` int32, cuda; tokens of context per sequence (>= 1; 0 gives a zero row).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        max_context_len: longest entry of ``context_lens`` in tokens, known on the host (no sync); None reads it
            from the device (one sync). It must not be smaller than the true maximum.
        partition_tokens: force the split size (a multiple of block_size, for tests); None = planned.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in q's dtype, on q's device.

    Raises:
        ValueError: wrong device, dtype, shape, layout, or a head_dim / block_size with no kernel instance.
        KernelUnavailableError: CuPy is not installed.
    """
    _validate(q, k_cache, v_cache, block_tables, context_lens)
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    geometry = KernelGeometry.for_shape(head_dim, block_size, group)
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max().item())
    if max_context_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns of {block_size} tokens, contexts need {max_context_len}"
        )
    if not _cupy_installed():
        raise KernelUnavailableError("CuPy is not installed: pip install 'sluice[cuda]' (cupy-cuda13x)")
    import cupy

    device_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    kernel_key = (DTYPE_NAMES[q.dtype], head_dim, block_size, geometry.heads_per_cta)
    single_kernel, split_kernel, reduce_kernel = _kernels(*kernel_key, device_index)
    if partition_tokens is None:
        num_base_ctas = num_seqs * num_kv_heads * -(-group // geometry.heads_per_cta)
        plan = plan_partitions(max_context_len, num_base_ctas, _resident_ctas(kernel_key, device_index), block_size)
    else:
        plan = forced_plan(max_context_len, block_size, partition_tokens)
    partial_out, partial_stats = allocate_partials(q, plan)
    launch = build_launch(q, k_cache, v_cache, block_tables, context_lens, scale, plan, out, partial_out, partial_stats)
    with cupy.cuda.Device(device_index):
        with external_stream(torch.cuda.current_stream(q.device).cuda_stream, device_index):
            if launch.reduce_grid is None:
                single_kernel(launch.grid, launch.block, launch.decode_args)
            else:
                split_kernel(launch.grid, launch.block, launch.decode_args)
                reduce_kernel(launch.reduce_grid, launch.block, launch.reduce_args)
    return out


def forced_plan(max_context_len: int, block_size: int, partition_tokens: int) -> PartitionPlan:
    """Return the plan for a forced partition size (tests, benchmarks).

    Raises:
        ValueError: not a positive multiple of block_size, or more partitions than the reduce kernel takes.
    """
    if partition_tokens <= 0 or partition_tokens % block_size:
        raise ValueError(f"partition_tokens {partition_tokens} is not a positive multiple of {block_size}")
    plan = PartitionPlan(max(1, -(-max_context_len // partition_tokens)), partition_tokens)
    if plan.num_partitions > MAX_PARTITIONS:
        raise ValueError(f"{plan.num_partitions} partitions exceed the reduce kernel's {MAX_PARTITIONS}")
    return plan


def allocate_partials(q: torch.Tensor, plan: PartitionPlan) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Allocate the split path's workspace on q's device (None, None for the single pass).

    Returns:
        ``partial_out [num_seqs, num_heads, num_partitions, head_dim]`` fp32 and ``partial_stats [2, num_seqs,
        num_heads, num_partitions]`` fp32 (running max in the log2 domain, then running sum).
    """
    if plan.num_partitions == 1:
        return None, None
    num_seqs, num_heads, head_dim = q.shape
    partial_out = torch.empty((num_seqs, num_heads, plan.num_partitions, head_dim), dtype=torch.float32,
                              device=q.device)
    partial_stats = torch.empty((2, num_seqs, num_heads, plan.num_partitions), dtype=torch.float32, device=q.device)
    return partial_out, partial_stats


@dataclass(frozen=True)
class Launch:
    """Grids and argument lists of one call, in the kernels' parameter order (numpy scalars, pointers as uint64).

    ``reduce_grid`` is None on the single-pass path (``decode_args`` then go to ``paged_decode_*``, else to
    ``paged_decode_split_*`` followed by ``paged_decode_reduce_*`` with ``reduce_args``).
    """

    grid: tuple[int, int, int]
    block: tuple[int]
    decode_args: tuple
    reduce_grid: tuple[int, int] | None
    reduce_args: tuple | None


def build_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: PartitionPlan,
    out: torch.Tensor,
    partial_out: torch.Tensor | None,
    partial_stats: torch.Tensor | None,
) -> Launch:
    """Lay out the grids and the raw arguments of the decode (and reduce) kernels; launches nothing.

    Pure: any device (the CPU emulation test uses it with host tensors). Inputs must have passed the launcher's
    checks; the grid is ``(num_kv_heads * head chunks, num_seqs, num_partitions)``.

    Raises:
        ValueError: k_cache and v_cache strides differ.
    """
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache and v_cache strides differ: {k_cache.stride()} vs {v_cache.stride()}")
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    heads_per_cta = KernelGeometry.for_shape(head_dim, block_size, group).heads_per_cta
    split = plan.num_partitions > 1
    if split and (partial_out is None or partial_stats is None):
        raise ValueError("a split plan needs partial_out and partial_stats (allocate_partials)")
    partial_ptrs = (
        (partial_out.data_ptr(), partial_stats[0].data_ptr(), partial_stats[1].data_ptr()) if split else (0, 0, 0)
    )
    decode_args = (
        np.uint64(out.data_ptr()),
        *(np.uint64(p) for p in partial_ptrs),
        np.uint64(q.data_ptr()),
        np.uint64(k_cache.data_ptr()),
        np.uint64(v_cache.data_ptr()),
        np.uint64(block_tables.data_ptr()),
        np.uint64(context_lens.data_ptr()),
        np.float32(scale),
        np.int32(num_heads),
        np.int32(num_kv_heads),
        np.int64(q.stride(0)),
        np.int64(q.stride(1)),
        np.int64(k_cache.stride(0)),
        np.int64(k_cache.stride(1)),
        np.int32(block_tables.stride(0)),
        np.int32(plan.partition_tokens),
    )
    grid = (num_kv_heads * -(-group // heads_per_cta), num_seqs, plan.num_partitions)
    if not split:
        return Launch(grid, (THREADS_PER_CTA,), decode_args, None, None)
    reduce_args = (
        np.uint64(out.data_ptr()),
        *(np.uint64(p) for p in partial_ptrs),
        np.uint64(context_lens.data_ptr()),
        np.int32(num_heads),
        np.int32(plan.num_partitions),
        np.int32(plan.partition_tokens),
    )
    return Launch(grid, (THREADS_PER_CTA,), decode_args, (num_heads, num_seqs), reduce_args)


class CupyAttentionBackend(TorchAttentionBackend):
    """The ``cupy`` backend: decode-only steps run the CUDA kernel; steps with prefill run the torch reference.

    Prefill (and mixed decode + prefill steps) keep torch's fused attention on the new tokens, which also writes
    them into their pages (``TorchAttentionBackend``).

    Args:
        device: a CUDA device.

    Raises:
        KernelUnavailableError: ``device`` is not CUDA, or CuPy / a CUDA device is missing.
    """

    name = "cupy"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        if self.device.type != "cuda":
            raise KernelUnavailableError(f"the cupy attention backend needs a CUDA device, got {self.device}")
        if not cupy_available():
            raise KernelUnavailableError("CuPy is not installed or sees no CUDA device: pip install 'sluice[cuda]'")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_kv: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        """Write K/V, then attend (see :meth:`worker.attention.AttentionBackend.forward`)."""
        if not batch.is_decode_only:
            return super().forward(q, k, v, layer_kv, batch, scale)
        write_kv(layer_kv, k, v, batch.slot_mapping)  # one CUDA kernel
        k_cache, v_cache = layer_kv[0], layer_kv[1]
        return paged_decode_attention(
            q, k_cache, v_cache, batch.block_tables, batch.context_lens, scale, max_context_len=batch.max_seq_len
        )
