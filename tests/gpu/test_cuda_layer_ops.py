"""The CUDA layer operations (:mod:`worker.cuda_kernels`) against torch's on a GPU (skipped without CUDA or CuPy).

Each kernel rounds once where torch rounds after every operator, so bf16 results may differ by a unit or two in the
last place: max |kernel - torch| <= 2e-2 (bf16) / 4e-3 (fp16) times max |torch|. The K/V write is a copy and must be
exact. Row counts 1, 3 and 64 (a decode step, an odd step, a bucket), Llama-3-8B and SmolLM2-135M widths.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cupy", reason="CuPy is not installed (pip install 'sluice[cuda]')")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from worker.attention.torch_ref import write_kv as torch_write_kv  # noqa: E402
from worker.cuda_kernels import CudaLayerOps, write_kv  # noqa: E402
from worker.layer_ops import TorchLayerOps, layer_ops  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
DEVICE = torch.device("cuda")
SHAPES = [(32, 8, 128, 4096, 14336), (9, 3, 64, 576, 1536)]  # heads, kv heads, head_dim, hidden, intermediate
EPS = 1e-5


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    scale = ref.float().abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, f"max abs err {err:.3e} > {TOLERANCE[dtype]:.0e} x {scale:.3e}"


def _ops(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[CudaLayerOps, TorchLayerOps]:
    heads, kv_heads, head_dim = shape[:3]
    return (CudaLayerOps(dtype, EPS, heads, kv_heads, head_dim), TorchLayerOps(dtype, EPS, heads, kv_heads, head_dim))


def test_layer_ops_picks_the_cuda_kernels_for_bf16_on_cuda() -> None:
    assert isinstance(layer_ops(torch.bfloat16, DEVICE, EPS, 32, 8, 128), CudaLayerOps)
    assert isinstance(layer_ops(torch.float32, DEVICE, EPS, 32, 8, 128), TorchLayerOps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_norms_match_torch(dtype: torch.dtype, shape: tuple[int, ...], rows: int) -> None:
    cuda_ops, torch_ops = _ops(dtype, shape)
    hidden = shape[3]
    gen = torch.Generator(device=DEVICE).manual_seed(rows * 7 + hidden)
    x = torch.randn(rows, hidden, generator=gen, device=DEVICE) * 3
    w = torch.rand(hidden, generator=gen, device=DEVICE) + 0.5
    delta = torch.randn(rows, hidden, generator=gen, device=DEVICE).to(dtype)
    _assert_close(cuda_ops.norm(x, w), torch_ops.norm(x, w), dtype)
    x_cuda = x.clone()
    x_cuda_out, h_cuda = cuda_ops.add_norm(x_cuda, delta, w)
    x_torch, h_torch = torch_ops.add_norm(x.clone(), delta, w)
    assert x_cuda_out.data_ptr() == x_cuda.data_ptr()  # in place
    torch.testing.assert_close(x_cuda, x_torch, rtol=0, atol=0)  # one fp32 add either way
    _assert_close(h_cuda, h_torch, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_rope_and_swiglu_match_torch(dtype: torch.dtype, shape: tuple[int, ...], rows: int) -> None:
    cuda_ops, torch_ops = _ops(dtype, shape)
    heads, kv_heads, head_dim, _, inter = shape
    gen = torch.Generator(device=DEVICE).manual_seed(rows * 11 + head_dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen, device=DEVICE).to(dtype)
    angles = torch.rand(rows, head_dim // 2, generator=gen, device=DEVICE) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_ref, k_ref, v_ref = torch_ops.rope_qkv(qkv.clone(), cos, sin)
    q, k, v = cuda_ops.rope_qkv(qkv, cos, sin)
    assert q.data_ptr() == qkv.data_ptr()  # rotated in place, views of qkv
    _assert_close(q, q_ref.contiguous(), dtype)
    _assert_close(k, k_ref.contiguous(), dtype)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)  # v is not rotated
    gate_up = torch.randn(rows, 2 * inter, generator=gen, device=DEVICE).to(dtype) * 4
    _assert_close(cuda_ops.swiglu(gate_up), torch_ops.swiglu(gate_up), dtype)


@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_copies_exactly_what_torch_writes_and_skips_negative_slots(block_size: int) -> None:
    heads, kv_heads, head_dim, num_blocks, tokens = 32, 8, 128, 12, 37
    gen = torch.Generator(device=DEVICE).manual_seed(block_size)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen, device=DEVICE).to(torch.bfloat16)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)  # strided views, as the model has them
    v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:tokens]
    pool = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, generator=gen, device=DEVICE).to(torch.bfloat16)
    expected = pool.clone()
    torch_write_kv(expected, k.contiguous(), v.contiguous(), slots)
    write_kv(pool, k, v, slots)
    torch.testing.assert_close(pool, expected, rtol=0, atol=0)
    before = pool.clone()
    skipped = torch.full((tokens,), -1, dtype=torch.int64, device=DEVICE)
    write_kv(pool, k * 2, v * 2, skipped)
    torch.testing.assert_close(pool, before, rtol=0, atol=0)


@pytest.mark.parametrize("hidden", [12, 16384])  # one partial warp; four vectors per thread of 1024
def test_norm_of_the_narrowest_and_widest_rows(hidden: int) -> None:
    cuda_ops, torch_ops = _ops(torch.bfloat16, (32, 8, 128))
    gen = torch.Generator(device=DEVICE).manual_seed(hidden)
    x = torch.randn(5, hidden, generator=gen, device=DEVICE)
    w = torch.rand(hidden, generator=gen, device=DEVICE) + 0.5
    _assert_close(cuda_ops.norm(x, w), torch_ops.norm(x, w), torch.bfloat16)


def test_swiglu_of_a_width_that_is_not_a_multiple_of_8() -> None:
    cuda_ops, torch_ops = _ops(torch.bfloat16, (32, 8, 128))
    gate_up = torch.randn(7, 2 * 1540 + 6, device=DEVICE).to(torch.bfloat16)[:, :2 * 1541]  # element-wise path
    _assert_close(cuda_ops.swiglu(gate_up), torch_ops.swiglu(gate_up), torch.bfloat16)


def test_write_kv_of_unaligned_views_falls_back_to_torch() -> None:
    kv_heads, head_dim, block_size, tokens = 2, 64, 16, 5
    buf = torch.randn(tokens, 2 * kv_heads * head_dim + 4, device=DEVICE).to(torch.bfloat16)
    k = buf[:, 4 : 4 + kv_heads * head_dim].view(tokens, kv_heads, head_dim)  # 8 bytes past a 16-byte boundary
    v = buf[:, 4 + kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([0, 17, 5, 40, 33], dtype=torch.int64, device=DEVICE)
    pool = torch.zeros(2, 4, kv_heads, block_size, head_dim, device=DEVICE, dtype=torch.bfloat16)
    expected = pool.clone()
    torch_write_kv(expected, k.contiguous(), v.contiguous(), slots)
    write_kv(pool, k, v, slots)
    torch.testing.assert_close(pool, expected, rtol=0, atol=0)
