"""Reference attention over the paged KV pool, in plain torch (CPU and GPU).

Pool layout (DESIGN.md): one layer's K (or V) pool is ``[num_blocks, num_kv_heads, block_size, head_dim]``; token
``t`` of sequence ``s`` lives in block ``block_tables[s, t // block_size]`` at offset ``t % block_size``::

    block_tables[s] = [7, 2, 5]        block_size = 4, context_len = 10
    tokens 0..3 -> block 7, tokens 4..7 -> block 2, tokens 8..9 -> block 5 (offsets 0, 1; offsets 2, 3 unused)

Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

Two paths:

- decode-only batches (one new token per sequence): :func:`paged_decode_attention_ref` gathers the pages of all
  sequences at once, padded to the longest context, and runs one masked softmax — the CPU decode hot path;
- prefill chunks (and mixed batches): per sequence, gather its context and run
  ``F.scaled_dot_product_attention`` with the causal offset mask (a query at absolute position ``p`` sees the
  positions ``<= p``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention import AttentionBackend
from worker.batch import ForwardBatch


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attend one query token per sequence over its paged context (the reference for the CUDA kernel).

    Every sequence's context is the first ``context_lens[s]`` tokens named by its block table (the new token's K/V
    must already be written). Pages of all sequences are gathered in one indexing op, padded to the longest
    context; positions past a sequence's length are masked out before the softmax. Softmax runs in fp32.

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` (fp32/bf16/fp16), same device as the pool.
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, one layer's K pool.
        v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, one layer's V pool.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32 block ids; entries past a sequence's last block
            may hold any valid block id (0 as padding).
        context_lens: ``[num_seqs]`` int32 tokens of context per sequence, each ``>= 1``.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: shapes that disagree (heads not a multiple of KV heads, head_dim mismatch, table too short).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, kv_head_dim = k_cache.shape
    if kv_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit the pool {tuple(k_cache.shape)} "
            "(head_dim must match, num_heads a multiple of num_kv_heads)"
        )
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)} "
            f"do not match num_seqs={num_seqs}"
        )
    lens = context_lens.to(torch.int64)
    max_len = int(lens.max().item()) if num_seqs else 0
    max_blocks = (max_len + block_size - 1) // block_size
    if max_blocks > block_tables.shape[1]:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns, contexts need {max_blocks}")
    group = num_heads // num_kv_heads
    tables = block_tables[:, :max_blocks].to(torch.int64)
    # [num_seqs, max_blocks, kv, bs, d] -> [num_seqs, kv, max_blocks * bs, d]
    k = k_cache[tables].permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, max_blocks * block_size, head_dim)
    v = v_cache[tables].permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, max_blocks * block_size, head_dim)
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    # [num_seqs, kv, group, ctx]
    scores = torch.matmul(qg.float(), k.float().transpose(-1, -2)) * scale
    pad = torch.arange(max_blocks * block_size, device=q.device)[None, :] >= lens[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float())
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def write_kv(layer_kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V into their slots of one layer's pool, in place.

    Args:
        layer_kv: ``[2, num_blocks, num_kv_heads, block_size, head_dim]``, contiguous.
        k, v: ``[num_tokens, num_kv_heads, head_dim]`` in the pool's dtype.
        slot_mapping: ``[num_tokens]`` int64 flat slots ``block_id * block_size + offset``.
    """
    block_size = layer_kv.shape[3]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - block_ids * block_size
    # Advanced indices split by a slice: the indexed view is [num_tokens, num_kv_heads, head_dim], like k and v.
    layer_kv[0][block_ids, :, offsets] = k
    layer_kv[1][block_ids, :, offsets] = v
