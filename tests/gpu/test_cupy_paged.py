"""The CuPy decode kernel against the torch reference on a GPU (skipped cleanly without CUDA or CuPy).

Tolerance (issue 5): max |kernel - reference| <= 2e-2 (bf16) / 2e-3 (fp16) times the output scale max |reference|.
Shapes cover every instance (dtype × head_dim × block_size × heads per CTA), context 1, lengths that are not a
multiple of the block size, block tables in random pool order, forced single-pass and split paths, 128k tokens,
strided q and pool views, a side stream, and the ``cupy`` backend in a model step.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("cupy", reason="CuPy is not installed (pip install 'sluice[cuda]')")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from worker.attention.cupy_paged import CupyAttentionBackend, cupy_available, paged_decode_attention  # noqa: E402
from worker.attention.torch_ref import TorchAttentionBackend, paged_decode_attention_ref  # noqa: E402
from worker.batch import ForwardBatch  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3}
DEVICE = torch.device("cuda")


def _case(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    context_lens: list[int],
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q and pools on the GPU; each sequence's blocks are a random subset of the pool, in random order."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    max_blocks = max(blocks_per_seq) + 1
    tables = torch.zeros((len(context_lens), max_blocks), dtype=torch.int32)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = ids[start : start + n]
        start += n
    cuda_gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn((len(context_lens), num_heads, head_dim), generator=cuda_gen, device=DEVICE, dtype=dtype)
    pool_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k = torch.randn(pool_shape, generator=cuda_gen, device=DEVICE, dtype=dtype)
    v = torch.randn(pool_shape, generator=cuda_gen, device=DEVICE, dtype=dtype)
    return q, k, v, tables.to(DEVICE), torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    scale = ref.float().abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, f"max abs err {err:.3e} > {TOLERANCE[dtype]:.0e} × {scale:.3e}"


def test_cupy_is_available() -> None:
    assert cupy_available()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 4), (9, 3), (32, 8), (16, 2), (24, 2)])
def test_kernel_matches_reference(
    dtype: torch.dtype, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int
) -> None:
    lens = [1, block_size - 1, block_size, 3 * block_size + 5, 1000, 2049]
    q, k, v, tables, context_lens = _case(num_heads, num_kv_heads, head_dim, block_size, lens, dtype)
    scale = head_dim**-0.5
    ref = paged_decode_attention_ref(q, k, v, tables, context_lens, scale)
    for partition_tokens in (None, block_size, 4 * block_size, 256):
        out = paged_decode_attention(q, k, v, tables, context_lens, scale, partition_tokens=partition_tokens)
        _assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_context_of_one_token_is_its_value(dtype: torch.dtype) -> None:
    q, k, v, tables, context_lens = _case(32, 8, 128, 16, [1, 1, 1], dtype, seed=1)
    out = paged_decode_attention(q, k, v, tables, context_lens, 128**-0.5, max_context_len=1)
    for s in range(3):
        expected = v[tables[s, 0].long(), :, 0].repeat_interleave(4, dim=0)
        torch.testing.assert_close(out[s], expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_128k_context(dtype: torch.dtype) -> None:
    lens = [131072, 131072 - 7, 3000]
    q, k, v, tables, context_lens = _case(32, 8, 128, 16, lens, dtype, seed=2)
    ref = paged_decode_attention_ref(q, k, v, tables, context_lens, 128**-0.5)
    out = paged_decode_attention(q, k, v, tables, context_lens, 128**-0.5, max_context_len=max(lens))
    _assert_close(out, ref, dtype)
    single = paged_decode_attention(q, k, v, tables, context_lens, 128**-0.5, partition_tokens=131072)
    _assert_close(single, ref, dtype)


def test_many_sequences_of_mixed_lengths() -> None:
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 5000, (256,), generator=gen).tolist()
    q, k, v, tables, context_lens = _case(32, 8, 128, 16, lens, torch.bfloat16, seed=3)
    ref = paged_decode_attention_ref(q, k, v, tables, context_lens, 128**-0.5)
    _assert_close(paged_decode_attention(q, k, v, tables, context_lens, 128**-0.5), ref, torch.bfloat16)


def test_strided_q_and_layer_views_of_the_pool() -> None:
    """q sliced from a fused qkv projection and K/V views of a [layers, 2, ...] pool: no copies needed."""
    dtype, num_heads, num_kv_heads, head_dim, block_size = torch.bfloat16, 32, 8, 128, 16
    lens = [77, 300, 16]
    q, k, v, tables, context_lens = _case(num_heads, num_kv_heads, head_dim, block_size, lens, dtype, seed=4)
    qkv = torch.zeros((3, (num_heads + 2 * num_kv_heads) * head_dim), dtype=dtype, device=DEVICE)
    qkv[:, : num_heads * head_dim] = q.reshape(3, -1)
    q_view = qkv[:, : num_heads * head_dim].view(3, num_heads, head_dim)
    assert not q_view.is_contiguous()
    pool = torch.zeros((3, 2, *k.shape), dtype=dtype, device=DEVICE)
    pool[1, 0], pool[1, 1] = k, v
    ref = paged_decode_attention_ref(q, k, v, tables, context_lens, 0.1)
    out = paged_decode_attention(q_view, pool[1, 0], pool[1, 1], tables, context_lens, 0.1)
    _assert_close(out, ref, dtype)


def test_runs_on_torchs_current_stream() -> None:
    q, k, v, tables, context_lens = _case(32, 8, 128, 16, [4000, 50], torch.float16, seed=5)
    ref = paged_decode_attention_ref(q, k, v, tables, context_lens, 0.1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = paged_decode_attention(q, k, v, tables, context_lens, 0.1, max_context_len=4000)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    _assert_close(out, ref, torch.float16)


def test_rejects_bad_inputs() -> None:
    q, k, v, tables, context_lens = _case(8, 2, 64, 16, [20], torch.bfloat16)
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_decode_attention(q.half(), k, v, tables, context_lens, 0.1)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, k, v, tables.long(), context_lens, 0.1)
    with pytest.raises(ValueError, match="head_dim 48"):
        paged_decode_attention(q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous(),
                               tables, context_lens, 0.1)
    with pytest.raises(ValueError, match="columns"):
        paged_decode_attention(q, k, v, tables, context_lens, 0.1, max_context_len=10_000)


def test_cupy_backend_decode_step_matches_torch_backend() -> None:
    """A decode-only ForwardBatch through both backends: same K/V writes, same attention output."""
    dtype, num_heads, num_kv_heads, head_dim, block_size = torch.bfloat16, 9, 3, 64, 16
    gen = torch.Generator().manual_seed(6)
    num_blocks = 64
    layer_kv = torch.randn((2, num_blocks, num_kv_heads, block_size, head_dim), generator=gen).to(DEVICE, dtype)
    computed = [0, 40, 200]
    tables = [[5], [9, 3, 17], [int(b) for b in torch.randperm(num_blocks, generator=gen)[:13]]]
    batch = ForwardBatch.build([[1], [2], [3]], computed, tables, block_size, device=DEVICE)
    assert batch.is_decode_only
    q = torch.randn((3, num_heads, head_dim), generator=gen).to(DEVICE, dtype)
    k_new = torch.randn((3, num_kv_heads, head_dim), generator=gen).to(DEVICE, dtype)
    v_new = torch.randn((3, num_kv_heads, head_dim), generator=gen).to(DEVICE, dtype)
    kv_torch, kv_cupy = layer_kv.clone(), layer_kv.clone()
    torch_backend, cupy_backend = TorchAttentionBackend(DEVICE), CupyAttentionBackend(DEVICE)
    for backend in (torch_backend, cupy_backend):
        backend.begin_forward(batch)
    ref = torch_backend.forward(q, k_new, v_new, kv_torch, batch, 0.125)
    out = cupy_backend.forward(q, k_new, v_new, kv_cupy, batch, 0.125)
    assert torch.equal(kv_torch, kv_cupy)
    _assert_close(out, ref, dtype)
