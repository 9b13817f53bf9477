"""Reference attention over the paged KV pool, in plain torch (CPU and GPU).

Pool layout (DESIGN.md): one layer's K (or V) pool is ``[num_blocks, num_kv_heads, block_size, head_dim]``; token
``t`` of sequence ``s`` lives in block ``block_tables[s, t // block_size]`` at offset ``t % block_size``::

    block_tables[s] = [7, 2, 5]        block_size = 4, context_len = 10
    tokens 0..3 -> block 7, tokens 4..7 -> block 2, tokens 8..9 -> block 5 (offsets 0, 1; offsets 2, 3 unused)

Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

Two paths:

- decode steps (one generated token per sequence, ``ForwardBatch.decode_seqs``): :func:`paged_decode_attention_ref`
  gathers the pages of all sequences at once, padded to the longest context, and runs one masked softmax — the
  CPU decode hot path;
- prefill chunks (of any length, one token included) and mixed batches: per sequence, gather its context and run
  ``F.scaled_dot_product_attention`` with the causal offset mask (a query at absolute position ``p`` sees the
  positions ``<= p``).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    must already be written). Pages are gathered with one ``index_select`` per pool (per chunk of sequences on the
    CPU, see :class:`DecodeMeta`), padded to the longest context; positions past a sequence's length are masked
    out before the softmax. All arithmetic runs in fp32. Reads ``context_lens`` on the host (one sync).

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
    lens_host = [int(n) for n in context_lens.tolist()]
    max_blocks = (max(lens_host, default=0) + block_size - 1) // block_size
    if max_blocks > block_tables.shape[1]:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns, contexts need {max_blocks}")
    if num_seqs == 0:
        return torch.empty_like(q)
    meta = DecodeMeta.build(block_tables, context_lens, lens_host, k_cache)
    return paged_decode_attention_with_meta(q, k_cache, v_cache, meta, scale)


# Gathered K+V bytes per chunk of sequences on the CPU: small enough to stay in the last-level cache between the
# gather and the two products. Measured on a 2-core EPYC (32 MiB L3), 32 seqs x 1024 tokens: attention alone 1.7x
# faster than one chunk, the whole SmolLM2-135M decode step 584 -> 197 ms.
CPU_DECODE_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass
class _DecodeChunk:
    """Consecutive sequences ``[row_start, row_end)`` decoded together, padded to their longest context.

    Attributes:
        flat_block_ids: ``[(row_end - row_start) * max_blocks]`` int64, each row's first ``max_blocks`` block ids.
        pad_mask: ``[row_end - row_start, 1, 1, max_blocks * block_size]`` bool, True past the row's context.
    """

    row_start: int
    row_end: int
    max_blocks: int
    flat_block_ids: torch.Tensor
    pad_mask: torch.Tensor
    keep_mask: torch.Tensor | None = None


class DecodeMeta:
    """Per-step decode metadata shared by all layers (built once per step; no host sync per layer).

    On the CPU the sequences are split into chunks whose gathered K/V fit ``CPU_DECODE_CHUNK_BYTES``, each padded
    to its own longest context; on a GPU there is one chunk.

    Attributes:
        num_seqs: sequences in the step.
        chunks: the chunks, in row order, covering all sequences.
    """

    def __init__(self, num_seqs: int, chunks: list[_DecodeChunk]) -> None:
        self.num_seqs = num_seqs
        self.chunks = chunks

    @classmethod
    def build(
        cls, block_tables: torch.Tensor, context_lens: torch.Tensor, lens_host: list[int], pool: torch.Tensor
    ) -> DecodeMeta:
        """Build the chunks.

        Args:
            block_tables: ``[num_seqs, >= max_blocks]`` int32.
            context_lens: ``[num_seqs]`` int32, on the pool's device.
            lens_host: the same lengths as host ints.
            pool: one layer's K pool ``[num_blocks, num_kv_heads, block_size, head_dim]`` (for sizes and device).
        """
        num_seqs = len(lens_host)
        block_size = pool.shape[2]
        block_kv_bytes = 2 * pool[0].numel() * pool.element_size()
        budget_bytes = CPU_DECODE_CHUNK_BYTES if pool.device.type == "cpu" else None
        blocks_per_seq = [(n + block_size - 1) // block_size for n in lens_host]
        bounds: list[tuple[int, int, int]] = []
        row_start, chunk_blocks = 0, 0
        for row, num_blocks in enumerate(blocks_per_seq):
            grown = max(chunk_blocks, num_blocks)
            too_big = budget_bytes is not None and (row - row_start + 1) * grown * block_kv_bytes > budget_bytes
            if row > row_start and too_big:
                bounds.append((row_start, row, chunk_blocks))
                row_start, grown = row, num_blocks
            chunk_blocks = grown
        bounds.append((row_start, num_seqs, chunk_blocks))
        lens = context_lens.to(torch.int64)
        chunks = []
        for start, end, max_blocks in bounds:
            flat = block_tables[start:end, :max_blocks].reshape(-1).to(torch.int64)
            positions = torch.arange(max_blocks * block_size, device=block_tables.device)
            pad = positions[None, :] >= lens[start:end, None]
            chunks.append(_DecodeChunk(start, end, max_blocks, flat, pad[:, None, None, :]))
        return cls(num_seqs, chunks)


def _decode_chunk(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: _DecodeChunk, scale: float
) -> torch.Tensor:
    """Decode attention of ``q [num_chunk_seqs, num_heads, head_dim]`` over one chunk's gathered blocks."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_blocks = chunk.max_blocks
    gathered_shape = (num_seqs, max_blocks, num_kv_heads, block_size, head_dim)
    k = k_cache.index_select(0, chunk.flat_block_ids).view(gathered_shape).float()
    v = v_cache.index_select(0, chunk.flat_block_ids).view(gathered_shape).float()
    qg = (q.float() * scale).view(num_seqs, 1, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2))  # [num_seqs, max_blocks, kv, group, bs]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group, max_blocks * block_size)
    scores.masked_fill_(chunk.pad_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = probs.view(num_seqs, num_kv_heads, group, max_blocks, block_size).permute(0, 3, 1, 2, 4)
    out = torch.matmul(probs, v).sum(dim=1)  # [num_seqs, kv, group, d]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_decode_attention_with_meta(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMeta, scale: float
) -> torch.Tensor:
    """Decode attention with prebuilt :class:`DecodeMeta` (the body of :func:`paged_decode_attention_ref`).

    Per chunk, gathers whole blocks with one ``index_select`` per pool (contiguous ``[kv, bs, d]`` pages, no
    permute copy) and keeps the block axis through the QK and PV products::

        k: [num_seqs, max_blocks, kv, bs, d]   q: [num_seqs, 1, kv, group, d]
        scores = q @ k^T -> [num_seqs, max_blocks, kv, group, bs] -> softmax over (max_blocks, bs)
        out = sum over max_blocks of (probs @ v) -> [num_seqs, kv, group, d]
    """
    if len(meta.chunks) == 1:
        return _decode_chunk(q, k_cache, v_cache, meta.chunks[0], scale)
    out = torch.empty_like(q)
    for chunk in meta.chunks:
        out[chunk.row_start : chunk.row_end] = _decode_chunk(
            q[chunk.row_start : chunk.row_end], k_cache, v_cache, chunk, scale
        )
    return out


def sdpa_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMeta, scale: float
) -> torch.Tensor:
    """Decode attention in the pool's dtype through ``F.scaled_dot_product_attention`` (torch's fused CPU
    kernel: fp32 accumulation, no fp32 copy of the gathered K/V), the CPU decode path of
    :class:`TorchAttentionBackend`. Same contract as :func:`paged_decode_attention_with_meta`; per chunk of
    sequences, whole blocks are gathered with one ``index_select`` per pool and laid out ``[seqs, kv, L, d]``::

        q: [seqs, heads, 1, d]   k, v: [seqs, kv, max_blocks * block_size, d]   mask: [seqs, 1, 1, L] (True = keep)

    Measured against the fp32 reference on a 2-core EPYC, bf16 pool, one thread: 45 us vs 234 us at 1 sequence
    (200 tokens), 5.3 ms vs 9.1 ms at 32 sequences (250 tokens).
    """
    num_kv_heads, block_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_heads = q.shape[1]

    def run(q_rows: torch.Tensor, chunk: _DecodeChunk) -> torch.Tensor:
        n = q_rows.shape[0]
        length = chunk.max_blocks * block_size
        shape = (n, chunk.max_blocks, num_kv_heads, block_size, head_dim)
        k = k_cache.index_select(0, chunk.flat_block_ids).view(shape).transpose(1, 2).reshape(n, num_kv_heads,
                                                                                           length, head_dim)
        v = v_cache.index_select(0, chunk.flat_block_ids).view(shape).transpose(1, 2).reshape(n, num_kv_heads,
                                                                                           length, head_dim)
        if chunk.keep_mask is None:
            chunk.keep_mask = ~chunk.pad_mask
        out = F.scaled_dot_product_attention(q_rows.view(n, num_heads, 1, head_dim), k, v, attn_mask=chunk.keep_mask,
                                             scale=scale, enable_gqa=num_heads != num_kv_heads)
        return out.view(n, num_heads, head_dim)

    if len(meta.chunks) == 1:
        return run(q, meta.chunks[0])
    out = torch.empty_like(q)
    for chunk in meta.chunks:
        out[chunk.row_start : chunk.row_end] = run(q[chunk.row_start : chunk.row_end], chunk)
    return out


def pool_rows(slot_mapping: torch.Tensor, num_kv_heads: int, block_size: int) -> torch.Tensor:
    """Rows of one layer's K (or V) pool seen as ``[num_blocks * num_kv_heads * block_size, head_dim]`` where the
    tokens of ``slot_mapping [num_tokens]`` (int64 ``block_id * block_size + offset``) go: ``[num_tokens *
    num_kv_heads]`` int64, token-major (as ``k.reshape(-1, head_dim)`` lays a step's K out)."""
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    heads = torch.arange(num_kv_heads, device=slot_mapping.device)
    offsets = slot_mapping - block_ids * block_size
    return ((block_ids[:, None] * num_kv_heads + heads[None, :]) * block_size + offsets[:, None]).reshape(-1)


def write_kv(layer_kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             kv_rows: torch.Tensor | None = None) -> None:
    """Write this step's K/V into their slots of one layer's pool, in place.

    Args:
        layer_kv: ``[2, num_blocks, num_kv_heads, block_size, head_dim]``, contiguous.
        k, v: ``[num_tokens, num_kv_heads, head_dim]`` in the pool's dtype.
        slot_mapping: ``[num_tokens]`` int64 flat slots ``block_id * block_size + offset``.
        kv_rows: :func:`pool_rows` of ``slot_mapping`` (``_StepPlan.kv_rows``, once per step; computed here when
            None).
    """
    head_dim = layer_kv.shape[4]
    if kv_rows is None:
        kv_rows = pool_rows(slot_mapping, layer_kv.shape[2], layer_kv.shape[3])
    layer_kv[0].view(-1, head_dim).index_copy_(0, kv_rows, k.reshape(-1, head_dim))
    layer_kv[1].view(-1, head_dim).index_copy_(0, kv_rows, v.reshape(-1, head_dim))


def _causal_offset_mask(num_new: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Return ``[num_new, context_len]`` bool: query ``i`` (position ``context_len - num_new + i``) sees ``j <= p``."""
    query_pos = torch.arange(context_len - num_new, context_len, device=device)
    return torch.arange(context_len, device=device)[None, :] <= query_pos[:, None]


class _StepPlan:
    """Per-step metadata shared by all layers: which rows decode (one vectorised call), which are prefill chunks.

    Attributes:
        all_decode: every sequence is a decode step (``forward`` returns the decode output directly).
        decode_rows: ``[num_decode]`` int64 token rows of the decode steps, or None when all or none are.
        decode_tables, decode_lens: ``[num_decode, max_blocks]`` int32 block tables and ``[num_decode]`` int32
            context lengths of the decode steps, or None when there are none; ``decode_lens_host`` the same as ints.
        decode_meta: :class:`DecodeMeta` of the decode steps (built at first use), or None when there are none.
        kv_rows: :func:`pool_rows` of the step's slots, where :func:`write_kv` puts its K/V.
        prefills: per prefill chunk ``(first row, end row, context_len, block ids [num_ctx_blocks] int64,
            causal offset mask [n, context_len] bool or None when the chunk is the whole context)``.
    """

    def __init__(self, batch: ForwardBatch, pool: torch.Tensor) -> None:
        block_size = pool.shape[2]
        self.kv_rows = pool_rows(batch.slot_mapping, pool.shape[1], block_size)
        self._pool = pool
        qsl = batch.query_start_loc
        device = batch.block_tables.device
        decode_seqs = [s for s, is_decode in enumerate(batch.decode_seqs) if is_decode]
        self.all_decode = len(decode_seqs) == batch.num_seqs
        self.decode_rows: torch.Tensor | None = None
        self.decode_tables: torch.Tensor | None = None
        self.decode_lens: torch.Tensor | None = None
        self.decode_lens_host: list[int] = []
        if self.all_decode:
            self.decode_tables, self.decode_lens = batch.block_tables, batch.context_lens
            self.decode_lens_host = batch.seq_lens
        elif decode_seqs:
            index = torch.tensor(decode_seqs, dtype=torch.int64, device=device)
            self.decode_rows = torch.tensor([qsl[s] for s in decode_seqs], dtype=torch.int64, device=device)
            self.decode_tables = batch.block_tables.index_select(0, index)
            self.decode_lens = batch.context_lens.index_select(0, index)
            self.decode_lens_host = [batch.seq_lens[s] for s in decode_seqs]
        self.prefills: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]] = []
        for s in range(batch.num_seqs):
            start, end = qsl[s], qsl[s + 1]
            if batch.decode_seqs[s]:
                continue
            context_len = batch.seq_lens[s]
            num_blocks = (context_len + block_size - 1) // block_size
            blocks = batch.block_tables[s, :num_blocks].to(torch.int64)
            mask = None if end - start == context_len else _causal_offset_mask(end - start, context_len, device)
            self.prefills.append((start, end, context_len, blocks, mask))
        self._decode_meta: DecodeMeta | None = None

    @property
    def decode_meta(self) -> DecodeMeta | None:
        if self._decode_meta is None and self.decode_tables is not None:
            self._decode_meta = DecodeMeta.build(self.decode_tables, self.decode_lens, self.decode_lens_host,
                                                 self._pool)
        return self._decode_meta


def _gather_context(pool: torch.Tensor, blocks: torch.Tensor, context_len: int) -> torch.Tensor:
    """Return ``[num_kv_heads, context_len, head_dim]`` of one sequence from ``pool [num_blocks, kv, bs, d]``."""
    num_kv_heads, head_dim = pool.shape[1], pool.shape[3]
    pages = pool.index_select(0, blocks)  # [num_ctx_blocks, kv, bs, d]
    return pages.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :context_len]


#: query rows of a CPU prefill chunk are padded to a multiple of this (see :func:`prefill_attention_over_pool`)
PREFILL_QUERY_ROWS_MULTIPLE = 8


def prefill_attention_over_pool(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                                context_len: int, scale: float) -> torch.Tensor:
    """Attend a prefill chunk's queries over their sequence's context read back from the pool (the CPU path).

    Every query's output is bit-identical however its prompt was chunked, whether its prefix came from the
    prefix cache, and whichever sequences share the step: the context is always read from the pool in whole blocks,
    the query rows are padded to a multiple of ``PREFILL_QUERY_ROWS_MULTIPLE`` (MKL's GEMM rounds a row the same
    way on such shapes, see :meth:`worker.quant._SplitLinear._prefill`) and positions past a query are masked to
    probability 0 (exact zeros in the sums)::

        q: [n, heads, d] -> [kv, group * n_pad, d]      k, v: [kv, num_blocks * block_size, d]
        scores = q k^T * scale, masked (key j > query position) -> softmax -> @ v -> [n, heads, d]

    Args:
        q: ``[n, num_heads, head_dim]``, the chunk's queries (positions ``context_len - n .. context_len - 1``).
        k_cache, v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]`` (the chunk's K/V already written).
        blocks: ``[num_ctx_blocks]`` int64, the sequence's blocks covering ``context_len`` tokens.
        context_len: tokens of context including the chunk.
        scale: softmax scale.

    Returns:
        ``[n, num_heads, head_dim]`` in ``q``'s dtype.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    n_pad = n + (-n % PREFILL_QUERY_ROWS_MULTIPLE)
    k = k_cache.index_select(0, blocks).transpose(0, 1).reshape(num_kv_heads, -1, head_dim)  # [kv, L, d]
    v = v_cache.index_select(0, blocks).transpose(0, 1).reshape(num_kv_heads, -1, head_dim)
    length = k.shape[1]
    qg = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kv, group, n, d]
    qg = F.pad(qg, (0, 0, 0, n_pad - n)).reshape(num_kv_heads, group * n_pad, head_dim)
    scores = torch.matmul(qg, k.transpose(1, 2)).view(num_kv_heads, group, n_pad, length)
    query_pos = torch.arange(context_len - n, context_len - n + n_pad, device=q.device)
    hidden = torch.arange(length, device=q.device)[None, :] > query_pos[:, None]  # [n_pad, L]
    probs = torch.softmax((scores * scale).masked_fill_(hidden, float("-inf")), dim=-1)
    out = torch.matmul(probs.view(num_kv_heads, group * n_pad, length), v)  # [kv, group * n_pad, d]
    return out.view(num_kv_heads, group, n_pad, head_dim)[:, :, :n].permute(2, 0, 1, 3).reshape(n, num_heads,
                                                                                              head_dim)


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention in torch: vectorised decode, per-sequence SDPA for prefill chunks.

    A chunk that is its sequence's whole context (no cached prefix) attends over its own ``k``/``v`` with
    ``is_causal``; a chunk after a cached prefix gathers the context from the pool and uses the causal offset mask.
    """

    name = "torch"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._plan: _StepPlan | None = None
        self._plan_batch: ForwardBatch | None = None

    def begin_forward(self, batch: ForwardBatch) -> None:
        """Forget the previous step's plan; the new one is built at the first layer (it needs the pool's sizes)."""
        self._plan = None
        self._plan_batch = batch

    def _plan_for(self, batch: ForwardBatch, pool: torch.Tensor) -> _StepPlan:
        if self._plan is None or self._plan_batch is not batch:
            self._plan = _StepPlan(batch, pool)
            self._plan_batch = batch
        return self._plan

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _StepPlan,
                scale: float) -> torch.Tensor:
        """Decode attention of the decode steps' queries ``q [num_decode, num_heads, head_dim]``."""
        decode = sdpa_decode_attention if k_cache.device.type == "cpu" else paged_decode_attention_with_meta
        return decode(q, k_cache, v_cache, plan.decode_meta, scale)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_kv: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        """Write K/V, then attend (see :meth:`AttentionBackend.forward`)."""
        num_kv_heads = layer_kv.shape[2]
        k_cache, v_cache = layer_kv[0], layer_kv[1]
        plan = self._plan_for(batch, k_cache)
        write_kv(layer_kv, k, v, batch.slot_mapping, plan.kv_rows)
        if plan.all_decode:
            return self._decode(q, k_cache, v_cache, plan, scale)
        out = torch.empty_like(q)
        if plan.decode_tables is not None:
            q_decode = q.index_select(0, plan.decode_rows)
            out.index_copy_(0, plan.decode_rows, self._decode(q_decode, k_cache, v_cache, plan, scale))
        group = q.shape[1] // num_kv_heads
        for start, end, context_len, blocks, mask in plan.prefills:
            if k_cache.device.type == "cpu":
                out[start:end] = prefill_attention_over_pool(q[start:end], k_cache, v_cache, blocks, context_len,
                                                             scale)
                continue
            if mask is None:
                k_ctx, v_ctx = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            else:
                k_ctx = _gather_context(k_cache, blocks, context_len)
                v_ctx = _gather_context(v_cache, blocks, context_len)
            if group > 1:
                k_ctx = k_ctx.repeat_interleave(group, dim=0)
                v_ctx = v_ctx.repeat_interleave(group, dim=0)
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k_ctx, v_ctx, attn_mask=mask, is_causal=mask is None, scale=scale
            )  # [num_heads, n, d]
            out[start:end] = o.transpose(0, 1)
        return out
