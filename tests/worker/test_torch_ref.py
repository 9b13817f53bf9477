"""The torch reference attention over the paged pool against dense attention on the same numbers."""

from __future__ import annotations

import math
import random

import pytest
import torch

from worker.attention import AttentionBackend, make_attention_backend, torch_ref
from worker.attention.torch_ref import TorchAttentionBackend, paged_decode_attention_ref, write_kv
from worker.batch import ForwardBatch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 40


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: list[int]) -> torch.Tensor:
    """Naive causal GQA attention in float64: q [n, H, d], k/v [L, KV, d], query i sees keys ``<= query_pos[i]``."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, pos in enumerate(query_pos):
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k[: pos + 1]) / math.sqrt(q.shape[-1])
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v[: pos + 1])
    return out


def _random_tables(lengths: list[int], seed: int) -> list[list[int]]:
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range((n + BLOCK_SIZE - 1) // BLOCK_SIZE)] for n in lengths]


def _fill_pool(k_ctx: list[torch.Tensor], v_ctx: list[torch.Tensor], tables: list[list[int]]) -> torch.Tensor:
    """Return a layer pool ``[2, NUM_BLOCKS, KV, BLOCK_SIZE, d]`` (garbage elsewhere) holding each context."""
    pool = torch.randn(2, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM) * 100
    for k, v, table in zip(k_ctx, v_ctx, tables):
        for t in range(k.shape[0]):
            pool[0, table[t // BLOCK_SIZE], :, t % BLOCK_SIZE] = k[t]
            pool[1, table[t // BLOCK_SIZE], :, t % BLOCK_SIZE] = v[t]
    return pool


@pytest.mark.parametrize("chunk_bytes", [torch_ref.CPU_DECODE_CHUNK_BYTES, 1])
def test_paged_decode_attention_ref_matches_dense(monkeypatch, chunk_bytes):
    """One gather for all sequences, and one chunk per sequence (the CPU cache-sized chunking), both exact."""
    monkeypatch.setattr(torch_ref, "CPU_DECODE_CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(0)
    lengths = [1, 4, 5, 17, 33]  # one token, exactly one block, block + 1, several blocks
    tables = _random_tables(lengths, seed=0)
    k_ctx = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in lengths]
    v_ctx = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in lengths]
    pool = _fill_pool(k_ctx, v_ctx, tables)
    q = torch.randn(len(lengths), NUM_HEADS, HEAD_DIM)
    max_blocks = max(len(t) for t in tables) + 2  # extra padding columns must be ignored
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    context_lens = torch.tensor(lengths, dtype=torch.int32)

    out = paged_decode_attention_ref(q, pool[0], pool[1], block_tables, context_lens, HEAD_DIM**-0.5)

    assert out.shape == q.shape and out.dtype == q.dtype
    for s, n in enumerate(lengths):
        want = _dense_attention(q[s : s + 1], k_ctx[s], v_ctx[s], [n - 1])[0]
        torch.testing.assert_close(out[s].double(), want, atol=1e-5, rtol=1e-5)


def test_paged_decode_attention_ref_rejects_mismatched_shapes():
    pool = torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError):
        paged_decode_attention_ref(torch.zeros(1, 5, HEAD_DIM), pool, pool, tables, lens, 1.0)  # 5 % 2 != 0
    with pytest.raises(ValueError):
        paged_decode_attention_ref(torch.zeros(1, NUM_HEADS, 8), pool, pool, tables, lens, 1.0)
    with pytest.raises(ValueError):  # 9 tokens need 3 blocks, the table has 2
        paged_decode_attention_ref(
            torch.zeros(1, NUM_HEADS, HEAD_DIM), pool, pool, tables, torch.tensor([9], dtype=torch.int32), 1.0
        )


def test_write_kv_puts_each_token_in_its_slot():
    pool = torch.zeros(2, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    slots = torch.tensor([7 * BLOCK_SIZE + 3, 2 * BLOCK_SIZE, 39 * BLOCK_SIZE + 1])
    k = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    write_kv(pool, k, v, slots)
    for i, (block_id, offset) in enumerate([(7, 3), (2, 0), (39, 1)]):
        assert torch.equal(pool[0, block_id, :, offset], k[i])
        assert torch.equal(pool[1, block_id, :, offset], v[i])
    assert int((pool != 0).any(dim=-1).sum()) == 2 * 3 * NUM_KV_HEADS  # nothing else touched


def test_backend_mixed_batch_matches_dense_causal_attention():
    """Decode seqs and prefill chunks (fresh and with a cached prefix) in one step, against dense attention."""
    torch.manual_seed(1)
    # (tokens already cached, new tokens this step)
    plan = [(9, 1), (0, 7), (5, 6), (20, 1), (3, 1)]
    lengths = [c + n for c, n in plan]
    tables = _random_tables(lengths, seed=1)
    k_all = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in lengths]
    v_all = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in lengths]
    # The pool holds only the cached prefix; the backend must write the new tokens itself.
    pool = _fill_pool([k[:c] for k, (c, _) in zip(k_all, plan)], [v[:c] for v, (c, _) in zip(v_all, plan)], tables)
    chunks = [[0] * n for _, n in plan]
    batch = ForwardBatch.build(chunks, [c for c, _ in plan], tables, BLOCK_SIZE)
    q_per_seq = [torch.randn(n, NUM_HEADS, HEAD_DIM) for _, n in plan]
    q = torch.cat(q_per_seq)
    k_new = torch.cat([k[c:] for k, (c, _) in zip(k_all, plan)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(v_all, plan)])

    backend = make_attention_backend("torch", "cpu")
    assert isinstance(backend, TorchAttentionBackend) and isinstance(backend, AttentionBackend)
    backend.begin_forward(batch)
    out = backend.forward(q, k_new, v_new, pool, batch, HEAD_DIM**-0.5)

    assert out.shape == q.shape
    for s, (cached, new) in enumerate(plan):
        start = batch.query_start_loc[s]
        want = _dense_attention(q_per_seq[s], k_all[s], v_all[s], list(range(cached, cached + new)))
        torch.testing.assert_close(out[start : start + new].double(), want, atol=1e-5, rtol=1e-5)


def test_backend_decode_only_batch_matches_reference_function():
    torch.manual_seed(2)
    lengths = [6, 13, 2]
    tables = _random_tables(lengths, seed=2)
    pool = _fill_pool(
        [torch.randn(n - 1, NUM_KV_HEADS, HEAD_DIM) for n in lengths],
        [torch.randn(n - 1, NUM_KV_HEADS, HEAD_DIM) for n in lengths],
        tables,
    )
    batch = ForwardBatch.build([[0]] * 3, [n - 1 for n in lengths], tables, BLOCK_SIZE)
    q = torch.randn(3, NUM_HEADS, HEAD_DIM)
    k = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    backend = make_attention_backend("torch", "cpu")
    backend.begin_forward(batch)
    out = backend.forward(q, k, v, pool, batch, 0.25)
    want = paged_decode_attention_ref(q, pool[0], pool[1], batch.block_tables, batch.context_lens, 0.25)
    torch.testing.assert_close(out, want)
    assert torch.equal(pool[0, tables[1][12 // BLOCK_SIZE], :, 12 % BLOCK_SIZE], k[1])


def test_make_attention_backend_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="torch"):
        make_attention_backend("flash", "cpu")
    assert make_attention_backend("torch", "cpu").name == "torch"
