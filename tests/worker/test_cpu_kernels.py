"""Sluice's CPU kernels (:mod:`worker.cpu_kernels`) against torch references: the quantized matmuls, the paged
decode attention and the fused row-wise operations; each also batch invariant (a row's result is bit-identical
alone or beside others)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from worker import cpu_kernels
from worker.attention import make_attention_backend
from worker.attention.torch_ref import paged_decode_attention_ref
from worker.batch import ForwardBatch
from worker.layer_ops import FusedLayerOps, TorchLayerOps


def test_kernels_build_on_a_cpu_with_avx2():
    if not cpu_kernels.cpu_supports_kernels():
        pytest.skip(f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    assert cpu_kernels.load() is not None, "the C++ kernels failed to build: see cpu_kernels_unavailable in the log"


def test_a_build_killed_while_it_held_torchs_lock_does_not_hang_the_next_load():
    """A build stopped mid-way (the suite's run was killed while ``make install`` compiled) left torch's lock file
    in the build folder, and every later ``python -m worker.cpu_kernels`` waited for it for ever."""
    if not cpu_kernels.cpu_supports_kernels():
        pytest.skip(f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    assert cpu_kernels.load() is not None  # built: the next load is quick
    folder = cpu_kernels.build_directory()
    baton = os.path.join(folder, cpu_kernels.TORCH_BATON_NAME)
    with cpu_kernels.build_lock(folder):  # no load runs meanwhile; then the file is what a killed build leaves
        open(baton, "x").close()
    done = subprocess.run([sys.executable, "-m", "worker.cpu_kernels"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "built" in done.stdout, done.stdout + done.stderr
    assert "cpu_kernels_stale_lock_removed" in done.stdout + done.stderr and not os.path.exists(baton)


@pytest.fixture(scope="module")
def kernels():
    loaded = cpu_kernels.load()
    if loaded is None:
        pytest.skip("Sluice's CPU kernels do not run here")
    return loaded


def _quantized_x(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` as the kernels see it: int8 per group of 32, scale max|x| / 127, round half to even; fp64."""
    groups = x.double().view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(groups * inverse) * amax / 127).view_as(x)


def _pack_q4(codes: torch.Tensor) -> torch.Tensor:
    out_features, in_features = codes.shape
    groups = codes.view(out_features, -1, 32)
    return (groups[..., :16] | (groups[..., 16:] << 4)).reshape(out_features, in_features // 2).contiguous()


@pytest.mark.parametrize("rows,in_features,out_features", [(1, 576, 960), (3, 576, 577), (7, 1536, 576),
                                                           (32, 576, 3072), (5, 64, 33)])
def test_q4_linear_equals_the_exact_product_of_the_quantized_rows(kernels, rows, in_features, out_features):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features)
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    scale = torch.rand(out_features, in_features // 32) * 0.02
    zero = torch.randn(out_features, in_features // 32) * 0.01
    weight = ((codes.double().view(out_features, -1, 32) - 8) * scale.double()[..., None]
              + zero.double()[..., None]).view(out_features, in_features)
    out = kernels.q4_linear(x, _pack_q4(codes), scale, zero)
    torch.testing.assert_close(out.double(), _quantized_x(x) @ weight.T, rtol=0, atol=1e-5)
    alone = torch.cat([kernels.q4_linear(x[i : i + 1].contiguous(), _pack_q4(codes), scale, zero) for i in range(rows)])
    assert torch.equal(out, alone)


@pytest.mark.parametrize("rows", [1, 6, 17])
def test_q8_linear_equals_the_exact_product_including_code_minus_128(kernels, rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 576)
    codes = torch.randint(-128, 128, (300, 576), dtype=torch.int8)
    codes[0, :32] = -128
    scale = torch.rand(300, 18) * 0.01
    weight = (codes.double().view(300, -1, 32) * scale.double()[..., None]).view(300, 576)
    out = kernels.q8_linear(x, codes, scale)
    torch.testing.assert_close(out.double(), _quantized_x(x) @ weight.T, rtol=0, atol=2e-5)
    alone = torch.cat([kernels.q8_linear(x[i : i + 1].contiguous(), codes, scale) for i in range(rows)])
    assert torch.equal(out, alone)


def test_quantized_linear_rejects_bad_shapes_with_a_message(kernels):
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.q8_linear(torch.zeros(1, 40), torch.zeros(4, 40, dtype=torch.int8), torch.zeros(4, 1))
    with pytest.raises(RuntimeError, match="uint8"):
        kernels.q4_linear(torch.zeros(1, 32), torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1),
                          torch.zeros(4, 1))


def _paged(lens, num_kv_heads, head_dim, block_size, dtype, seed=0):
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    k_pool = torch.randn(num_blocks, num_kv_heads, block_size, head_dim).to(dtype)
    v_pool = torch.randn(num_blocks, num_kv_heads, block_size, head_dim).to(dtype)
    free = torch.randperm(num_blocks).tolist()  # shuffled block tables
    tables = torch.zeros(len(lens), max(-(-n // block_size) for n in lens), dtype=torch.int32)
    for s, n in enumerate(lens):
        for b in range(-(-n // block_size)):
            tables[s, b] = free.pop()
    return k_pool, v_pool, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("lens,heads,kv_heads,head_dim,dtype", [
    ([1], 9, 3, 64, torch.float32),
    ([17, 200, 5], 9, 3, 64, torch.float32),
    ([100, 1, 33, 512], 32, 8, 128, torch.float32),
    ([70, 300], 9, 3, 64, torch.bfloat16),
    ([9, 16], 4, 4, 64, torch.float32),
    ([4096], 8, 1, 64, torch.float32),
])
def test_paged_decode_attention_matches_the_reference_and_is_batch_invariant(kernels, lens, heads, kv_heads,
                                                                             head_dim, dtype):
    k_pool, v_pool, tables, context_lens = _paged(lens, kv_heads, head_dim, 16, dtype)
    q = torch.randn(len(lens), heads, head_dim)
    out = kernels.paged_decode_attention(q, k_pool, v_pool, tables, context_lens, head_dim**-0.5)
    want = paged_decode_attention_ref(q, k_pool, v_pool, tables, context_lens, head_dim**-0.5)
    torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-5)
    alone = torch.cat([kernels.paged_decode_attention(q[s : s + 1].contiguous(), k_pool, v_pool,
                                                      tables[s : s + 1].contiguous(), context_lens[s : s + 1],
                                                      head_dim**-0.5) for s in range(len(lens))])
    assert torch.equal(out, alone)


def test_paged_decode_attention_rejects_a_block_outside_the_pool(kernels):
    k_pool, v_pool, tables, context_lens = _paged([20], 3, 64, 16, torch.float32)
    tables[0, 1] = k_pool.shape[0]
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.paged_decode_attention(torch.randn(1, 9, 64), k_pool, v_pool, tables, context_lens, 0.125)


def test_cpu_backend_equals_the_torch_backend_on_a_mixed_step(kernels):
    """Two decode steps beside a prefill chunk after a cached prefix: same outputs, same pool writes."""
    torch.manual_seed(3)
    block_size, kv_heads, heads, head_dim = 16, 2, 4, 64
    pools = [torch.randn(2, 12, kv_heads, block_size, head_dim) for _ in range(2)]
    pools[1].copy_(pools[0])
    tables = [[0, 1], [2, 3, 4], [5, 6]]
    batch = ForwardBatch.build([[7], [8], [1, 2, 3, 4, 5]], [20, 40, 17], tables, block_size)
    batch.decode_seqs = [True, True, False]
    q = torch.randn(7, heads, head_dim)
    k, v = torch.randn(7, kv_heads, head_dim), torch.randn(7, kv_heads, head_dim)
    outs = []
    for name, pool in zip(("cpu", "torch"), pools):
        backend = make_attention_backend(name, "cpu")
        backend.begin_forward(batch)
        outs.append(backend.forward(q, k, v, pool, batch, head_dim**-0.5))
    assert torch.equal(pools[0], pools[1])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_fused_layer_ops_equal_torch_ops(kernels):
    torch.manual_seed(4)
    fused, plain = FusedLayerOps(kernels, 1e-5, 9, 3, 64), TorchLayerOps(torch.float32, 1e-5, 9, 3, 64)
    x, delta, weight = torch.randn(5, 576), torch.randn(5, 576), torch.randn(576)
    torch.testing.assert_close(fused.norm(x, weight), plain.norm(x, weight))
    x_fused, h_fused = fused.add_norm(x.clone(), delta, weight)
    x_plain, h_plain = plain.add_norm(x, delta, weight)
    assert torch.equal(x_fused, x_plain)
    torch.testing.assert_close(h_fused, h_plain)
    gate_up = torch.randn(5, 3072) * 4
    torch.testing.assert_close(fused.swiglu(gate_up), plain.swiglu(gate_up), rtol=1e-5, atol=1e-5)
    qkv = torch.randn(5, 15 * 64)
    cos, sin = torch.randn(5, 32), torch.randn(5, 32)
    for got, want in zip(fused.rope_qkv(qkv.clone(), cos, sin), plain.rope_qkv(qkv, cos, sin)):
        torch.testing.assert_close(got, want)
