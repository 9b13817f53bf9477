"""The decoder layer's row-wise operations and the K/V write as CUDA kernels: the CuPy launcher of ``layer_ops.cu``.

:class:`CudaLayerOps` is :class:`worker.layer_ops.TorchLayerOps` with each operation one kernel (RMSNorm with the
residual add, RoPE in place, SwiGLU) for bf16 / fp16 activations on CUDA; :func:`write_kv` writes a step's K/V into
one layer's pool in one kernel (torch: 8). :func:`worker.layer_ops.layer_ops` picks them on CUDA where CuPy imports.
They run on torch's current stream, allocate their outputs with torch (so CUDA-graph capture records them), and
never synchronise with the host.

The module is compiled once per process by NVRTC (CuPy ``RawModule``, kept in CuPy's disk cache) at first use.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch

SOURCE_PATH = Path(__file__).with_name("layer_ops.cu")
MAX_THREADS = 1024
MAX_NORM_VECS_PER_THREAD = 4  # layer_ops.cu kMaxVecsPerThread: rows up to 4 * 4 * 1024 = 16384 wide
SILU_THREADS = 256  # 8 columns each
MAX_GRID_Y = 65535
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16"}  # the kernels' 16-bit dtypes, by entry-point suffix
_OPS = ("rms_norm", "add_rms_norm", "rope", "silu_mul")
LAYER_OPS_KERNELS = tuple(f"{op}_{dtype}" for op in _OPS for dtype in DTYPE_NAMES.values()) + ("write_kv_16",)


def cupy_available() -> bool:
    """Return True when CuPy imports and sees at least one CUDA device (never raises)."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken CuPy/driver install means "not available"
        return False


@functools.lru_cache(maxsize=64)
def external_stream(stream_ptr: int, device_index: int) -> Any:
    """CuPy's view of a torch stream (cached: one per stream; torch keeps its streams alive)."""
    import cupy

    return cupy.cuda.ExternalStream(stream_ptr, device_index)


@functools.lru_cache(maxsize=None)
def _module() -> Any:
    import cupy

    return cupy.RawModule(code=SOURCE_PATH.read_text())


@functools.lru_cache(maxsize=None)
def _function(name: str, device_index: int) -> Any:
    import cupy

    with cupy.cuda.Device(device_index):
        return _module().get_function(name)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _launch(name: str, device: torch.device, grid: tuple[int, ...], block: tuple[int], args: tuple) -> None:
    """Launch kernel ``name`` on torch's current stream of ``device``."""
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel = _function(name, index)
    with cupy.cuda.Device(index), external_stream(torch.cuda.current_stream(device).cuda_stream, index):
        kernel(grid, block, args)


def supported(act_dtype: torch.dtype, device: torch.device, head_dim: int, hidden_size: int) -> bool:
    """Whether :class:`CudaLayerOps` runs here for a model of this shape: a CUDA device, CuPy that sees it, bf16
    or fp16 activations, an even ``head_dim`` up to 2048 and a ``hidden_size`` its norms take."""
    return (device.type == "cuda" and act_dtype in DTYPE_NAMES and head_dim % 2 == 0
            and head_dim <= 2 * MAX_THREADS and supports_hidden_size(hidden_size) and cupy_available())


def _check_rows(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dim() != 2 or t.dtype != dtype or not t.is_contiguous() or t.device.type != "cuda":
        raise ValueError(f"{name} must be a contiguous [rows, columns] {dtype} CUDA tensor, got {t.dtype} "
                         f"{tuple(t.shape)} strides {t.stride()} on {t.device}")


def _threads(count: int) -> int:
    """Threads of a CTA that gives each of ``count`` work items its own thread, up to MAX_THREADS (warps)."""
    return min(MAX_THREADS, max(32, -(-count // 32) * 32))


def _aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor starts on 16 bytes and every stride but the last is a multiple of 16 bytes (the kernels'
    vector loads)."""
    return all(t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
               for t in tensors)


def write_kv(layer_kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V into their slots of one layer's pool, in place, in one kernel (16-byte copies; a
    layout the kernel cannot take vector-wise, such as a head_dim that is not a multiple of 8, goes through torch's
    :func:`worker.attention.torch_ref.write_kv`).

    Args:
        layer_kv: ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` bf16/fp16 on CUDA, each
            ``[block_size, head_dim]`` tile contiguous.
        k, v: ``[num_tokens, num_kv_heads, head_dim]`` in the pool's dtype; views with contiguous heads (e.g.
            slices of the qkv projection), any row and head strides.
        slot_mapping: ``[num_tokens]`` int64 ``block_id * block_size + offset``; the kernel skips a negative slot
            (the torch fallback takes valid slots only).

    Raises:
        ValueError: dtypes, devices or layouts the kernel does not take.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    _, _, pool_heads, block_size, pool_dim = layer_kv.shape
    if v.shape != k.shape or (pool_heads, pool_dim) != (num_kv_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the pool {tuple(layer_kv.shape)}")
    if k.dtype != layer_kv.dtype or v.dtype != layer_kv.dtype or layer_kv.dtype not in DTYPE_NAMES:
        raise ValueError(f"k {k.dtype}, v {v.dtype} and the pool {layer_kv.dtype} must share a 16-bit dtype")
    if k.stride(2) != 1 or v.stride(2) != 1 or layer_kv.stride(4) != 1 or layer_kv.stride(3) != head_dim:
        raise ValueError("k, v and the pool's tiles must be contiguous along head_dim")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,) or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping must be contiguous int64 [{num_tokens}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    k_cache, v_cache = layer_kv[0], layer_kv[1]
    if head_dim % 8 or not _aligned(k, v, k_cache, v_cache):
        from worker.attention.torch_ref import write_kv as torch_write_kv

        torch_write_kv(layer_kv, k.contiguous(), v.contiguous(), slot_mapping)
        return
    args = (_ptr(k_cache), _ptr(v_cache), _ptr(k), _ptr(v), np.int64(k.stride(0)), np.int64(k.stride(1)),
            np.int64(v.stride(0)), np.int64(v.stride(1)), _ptr(slot_mapping), np.int32(num_kv_heads),
            np.int32(block_size), np.int32(head_dim), np.int64(k_cache.stride(0)), np.int64(k_cache.stride(1)))
    _launch("write_kv_16", k.device, (num_tokens,), (_threads(num_kv_heads * head_dim // 8),), args)


class CudaLayerOps:
    """:class:`worker.layer_ops.TorchLayerOps`'s operations, one CUDA kernel each (see the module docstring).

    ``add_norm`` adds in place into ``x`` (the forward pass owns its residual stream); ``rope_qkv`` rotates q and k
    in place inside ``qkv``.

    Args:
        act_dtype: bf16 or fp16 (the matmuls' dtype); the residual stream and norm weights are fp32.
        eps: RMSNorm's epsilon.
        num_heads, num_kv_heads, head_dim: the attention's shape (head_dim even).

    The norms take rows of a multiple of 4 elements, at most 16384 (:func:`supports_hidden_size`).

    Raises:
        ValueError: another dtype, or an odd head_dim, or one over 2048.
    """

    def __init__(self, act_dtype: torch.dtype, eps: float, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if act_dtype not in DTYPE_NAMES or head_dim % 2 or head_dim > 2 * MAX_THREADS:
            raise ValueError(f"CudaLayerOps takes bf16/fp16 activations and an even head_dim up to {2 * MAX_THREADS}, "
                             f"got {act_dtype}, {head_dim}")
        self.act_dtype = act_dtype
        self.eps = eps
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._names = {op: f"{op}_{DTYPE_NAMES[act_dtype]}" for op in _OPS}

    def _norm_threads(self, x: torch.Tensor, weight: torch.Tensor) -> int:
        hidden = x.shape[1]
        if not supports_hidden_size(hidden) or not _aligned(x, weight):
            raise ValueError(f"the CUDA RMSNorm takes 16-byte aligned rows of a multiple of 4 elements up to "
                             f"{4 * MAX_NORM_VECS_PER_THREAD * MAX_THREADS}, got {tuple(x.shape)}")
        return _threads(hidden // 4)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``x [n, hidden]`` fp32 by ``weight [hidden]`` fp32, in the activations' dtype."""
        _check_rows("x", x, torch.float32)
        rows, hidden = x.shape
        threads = self._norm_threads(x, weight)
        out = torch.empty((rows, hidden), dtype=self.act_dtype, device=x.device)
        if rows:
            _launch(self._names["rms_norm"], x.device, (rows,), (threads,),
                    (_ptr(out), _ptr(x), _ptr(weight), np.int32(hidden), np.float32(self.eps)))
        return out

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(x + delta, norm(x + delta))``; ``x`` (fp32) is updated in place."""
        _check_rows("x", x, torch.float32)
        delta = delta.contiguous()
        _check_rows("delta", delta, self.act_dtype)
        rows, hidden = x.shape
        if delta.shape != x.shape:
            raise ValueError(f"delta {tuple(delta.shape)} does not match x {tuple(x.shape)}")
        threads = self._norm_threads(x, weight)
        out = torch.empty((rows, hidden), dtype=self.act_dtype, device=x.device)
        if rows:
            _launch(self._names["add_rms_norm"], x.device, (rows,), (threads,),
                    (_ptr(out), _ptr(x), _ptr(delta), _ptr(weight), np.int32(hidden), np.float32(self.eps)))
        return x, out

    def rope_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotate q and k inside ``qkv [n, (heads + 2 kv_heads) * d]`` by ``cos``/``sin [n, d // 2]`` (the
        activations' dtype); return the views q ``[n, heads, d]``, k and v ``[n, kv_heads, d]``."""
        _check_rows("qkv", qkv, self.act_dtype)
        cos, sin = cos.contiguous(), sin.contiguous()
        _check_rows("cos", cos, self.act_dtype)
        _check_rows("sin", sin, self.act_dtype)
        n, d = qkv.shape[0], self.head_dim
        if n:
            _launch(self._names["rope"], qkv.device, (n, self.num_heads + self.num_kv_heads), (d // 2,),
                    (_ptr(qkv), np.int64(qkv.stride(0)), np.int32(d), _ptr(cos), _ptr(sin)))
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        return (qkv[:, :q_size].view(n, self.num_heads, d), qkv[:, q_size : q_size + kv_size].view(n, -1, d),
                qkv[:, q_size + kv_size :].view(n, self.num_kv_heads, d))

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [n, 2 intermediate]``."""
        gate_up = gate_up.contiguous()
        _check_rows("gate_up", gate_up, self.act_dtype)
        rows, width = gate_up.shape
        inter = width // 2
        out = torch.empty((rows, inter), dtype=self.act_dtype, device=gate_up.device)
        if inter % 8 == 0 and not _aligned(gate_up, out):
            raise ValueError(f"gate_up must start on 16 bytes, got {gate_up.data_ptr():#x}")
        col_ctas = -(-inter // (8 * SILU_THREADS))
        for first in range(0, rows, MAX_GRID_Y):  # the grid's y holds at most MAX_GRID_Y rows
            chunk = min(MAX_GRID_Y, rows - first)
            _launch(self._names["silu_mul"], gate_up.device, (col_ctas, chunk), (SILU_THREADS,),
                    (_ptr(out[first:]), _ptr(gate_up[first:]), np.int32(inter)))
        return out


def supports_hidden_size(hidden: int) -> bool:
    """Whether :class:`CudaLayerOps`' norms take rows of ``hidden`` elements (a multiple of 4, at most 16384)."""
    return hidden % 4 == 0 and hidden // 4 <= MAX_NORM_VECS_PER_THREAD * MAX_THREADS
