"""The CUDA decode kernel's exact schedule, in NumPy: partitions, warps, tiles, online softmax, reductions.

``kernels/paged_decode_attention.cu`` splits each sequence's context into partitions (flash-decoding, Dao et al.
2023), gives each partition's blocks round-robin to the 4 warps of a CTA, walks each block in tiles with an online
softmax (Milakov & Gimelshein 2018), merges the warps, then (when split) merges the partitions in a second kernel.
This module runs the same steps in the same order on the CPU so that the math of the schedule is tested where no
GPU is (``tests/worker/test_partitioned_attention.py``); it also holds the geometry both share
(:class:`KernelGeometry`) and the partition planner (:func:`plan_partitions`). Scores live in the log2 domain
(``q`` pre-multiplied by ``scale * log2(e)``, exponentials are ``2**x``) as in the kernel.

Per warp, per tile ``T`` (running state ``m`` per head, ``l`` and ``o`` per head)::

    m' = max(m, max_T y)   a = 2**(m - m')   l' = a*l + sum_T 2**(y - m')   o' = a*o + sum_T 2**(y - m') V

Merging states over disjoint tokens (warps of a CTA, then partitions)::

    M = max_i m_i   w_i = 2**(m_i - M)   l = sum_i l_i w_i   o = sum_i o_i w_i   out = o / l
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

WARP_SIZE = 32
NUM_WARPS = 4
"""Warps per decode CTA (``kNumWarps``)."""
VEC_ELEMS = 8
"""16-bit elements per 16-byte load (``kVecElems``)."""
MAX_PARTITIONS = 512
"""Most partitions the reduce kernel combines (``kMaxPartitions``)."""
HEADS_PER_CTA_CHOICES = (1, 2, 4, 8)
"""Query heads one CTA serves (``kHeadsPerCta``): the instantiated values."""
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BLOCK_SIZES = (16, 32)
LOG2E = 1.4426950408889634
CTA_OVERHEAD_BLOCKS = 4
"""Fixed cost of one decode CTA (q load, warp merge, writes; a split's reduce), in KV blocks of work."""
SPLIT_MIN_GAIN = 0.05
"""A split must be this much cheaper than the single pass (by the cost model) to be taken."""


@dataclass(frozen=True)
class KernelGeometry:
    """Tile geometry of one kernel instance (mirrors ``Geometry<>`` in the ``.cu`` file).

    Attributes:
        head_dim: elements per head (64 or 128).
        block_size: tokens per KV block (16 or 32).
        heads_per_cta: query heads one CTA serves (1, 2, 4 or 8).
        lanes_per_token: lanes that read one K/V row, 16 bytes each.
        tokens_per_iter: rows one warp-wide load covers.
        tile_tokens: tokens per online-softmax step of a warp.
    """

    head_dim: int
    block_size: int
    heads_per_cta: int

    @property
    def lanes_per_token(self) -> int:
        return self.head_dim // VEC_ELEMS

    @property
    def tokens_per_iter(self) -> int:
        return WARP_SIZE // self.lanes_per_token

    @property
    def iters_per_tile(self) -> int:
        max_iters = 8 if self.heads_per_cta <= 4 else 4
        return min(max_iters, self.block_size // self.tokens_per_iter)

    @property
    def tile_tokens(self) -> int:
        return self.iters_per_tile * self.tokens_per_iter

    @classmethod
    def for_shape(cls, head_dim: int, block_size: int, group_size: int) -> KernelGeometry:
        """Pick the instance for a model: heads per CTA = the group size rounded up to a power of two, at most 8.

        Args:
            head_dim: elements per head.
            block_size: tokens per KV block.
            group_size: query heads per KV head (``num_heads // num_kv_heads``).

        Raises:
            ValueError: a head_dim or block_size with no kernel instance, or a group size < 1.
        """
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} has no kernel instance; supported: {SUPPORTED_HEAD_DIMS}")
        if block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size {block_size} has no kernel instance; supported: {SUPPORTED_BLOCK_SIZES}")
        if group_size < 1:
            raise ValueError(f"group size must be >= 1, got {group_size}")
        heads = next((h for h in HEADS_PER_CTA_CHOICES if h >= group_size), HEADS_PER_CTA_CHOICES[-1])
        return cls(head_dim, block_size, heads)


@dataclass(frozen=True)
class PartitionPlan:
    """How the context is split: ``num_partitions`` CTAs along it, each covering ``partition_tokens`` tokens.

    ``num_partitions == 1`` is the single-pass path (no reduce kernel).
    """

    num_partitions: int
    partition_tokens: int


@functools.lru_cache(maxsize=4096)
def plan_partitions(
    max_context_len: int,
    num_base_ctas: int,
    num_ctas_resident: int,
    block_size: int,
    min_partition_tokens: int = 256,
) -> PartitionPlan:
    """Choose the split along the context for one launch (flash-decoding's partition count).

    Without a split there are ``num_base_ctas`` CTAs (sequences × KV heads × head chunks). Splitting each context
    into ``p`` partitions multiplies the CTAs by ``p`` and divides each CTA's tokens by ``p``; it pays when the
    base grid leaves multiprocessors idle (small batches, long contexts) and costs a reduce kernel and partial
    outputs. The cost model: time ∝ waves(p) × (blocks per partition + a fixed per-CTA cost of
    ``CTA_OVERHEAD_BLOCKS``), waves(p) = ceil(num_base_ctas × p / num_ctas_resident); the cheapest p wins, and a
    split must beat the single pass by ``SPLIT_MIN_GAIN`` (a large batch keeps the single pass).

    Args:
        max_context_len: longest context in the batch, tokens.
        num_base_ctas: CTAs of the unsplit grid.
        num_ctas_resident: CTAs the whole GPU runs at once (multiprocessors × CTAs per multiprocessor).
        block_size: tokens per KV block; partitions are whole blocks.
        min_partition_tokens: shortest partition worth a CTA.

    Returns:
        The plan; one partition (covering the longest context) when splitting does not pay. Cached: every layer
        of a step asks with the same numbers.
    """
    blocks_total = max(1, math.ceil(max_context_len / block_size))
    single = PartitionPlan(1, blocks_total * block_size)
    min_blocks = max(1, math.ceil(min_partition_tokens / block_size))
    max_parts = min(MAX_PARTITIONS, blocks_total // min_blocks)
    if max_parts <= 1 or num_base_ctas <= 0 or num_ctas_resident <= 0:
        return single
    # Past two waves of CTAs a larger split only adds per-CTA overhead: no need to look further.
    max_parts = min(max_parts, max(2, math.ceil(2 * num_ctas_resident / num_base_ctas)))
    def cost(parts: int) -> tuple[float, PartitionPlan]:
        blocks_per_part = math.ceil(blocks_total / parts)
        parts_used = math.ceil(blocks_total / blocks_per_part)
        waves = math.ceil(num_base_ctas * parts_used / num_ctas_resident)
        return waves * (blocks_per_part + CTA_OVERHEAD_BLOCKS), PartitionPlan(parts_used, blocks_per_part * block_size)

    single_cost, _ = cost(1)
    best_cost, best = single_cost * (1.0 - SPLIT_MIN_GAIN), single
    for parts in range(2, max_parts + 1):
        split_cost, plan = cost(parts)
        if split_cost < best_cost:
            best_cost, best = split_cost, plan
    return best


def _online_tile(
    state: tuple[np.ndarray, np.ndarray, np.ndarray], y: np.ndarray, v: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One online-softmax step. ``y``: [kv, g, t] log2 scores (-inf masked); ``v``: [kv, t, d]."""
    m, l, o = state
    m_new = np.maximum(m, y.max(axis=-1))  # [kv, g]
    alpha = np.exp2(m - m_new)  # 0 where m = -inf
    p = np.exp2(y - m_new[..., None])  # [kv, g, t]
    l_new = alpha * l + p.sum(axis=-1)
    o_new = alpha[..., None] * o + np.einsum("kgt,ktd->kgd", p, v)
    return m_new, l_new, o_new


def _merge(states: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge partial states over disjoint tokens; a state with m = -inf (no tokens) weighs 0."""
    m_all = np.max(np.stack([m for m, _, _ in states]), axis=0)
    l_all = np.zeros_like(states[0][1])
    o_all = np.zeros_like(states[0][2])
    for m, l, o in states:
        weight = np.where(np.isneginf(m), 0.0, np.exp2(m - np.where(np.isneginf(m_all), 0.0, m_all)))
        l_all = l_all + l * weight
        o_all = o_all + o * weight[..., None]
    return m_all, l_all, o_all


def partitioned_decode_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    scale: float,
    partition_tokens: int | None = None,
    heads_per_cta: int | None = None,
    dtype: type = np.float64,
) -> np.ndarray:
    """Attend one query per sequence over its paged context with the kernel's schedule, on the CPU.

    Args:
        q: ``[num_seqs, num_heads, head_dim]``.
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, one layer's K pool.
        v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, one layer's V pool.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int block ids.
        context_lens: ``[num_seqs]`` int tokens of context, each >= 1.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        partition_tokens: tokens per partition (a multiple of block_size); None = one partition (single pass).
        heads_per_cta: the kernel instance's heads per CTA (only the tile size depends on it); None = chosen as
            the kernel chooses it.
        dtype: the arithmetic type (float64 to test the algorithm, float32 to mimic the kernel).

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``dtype``.

    Raises:
        ValueError: shapes that disagree, or a partition size that is not a whole number of blocks.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, kv_head_dim = k_cache.shape
    if kv_head_dim != head_dim or num_heads % num_kv_heads != 0 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {q.shape} does not fit the pools {k_cache.shape} / {v_cache.shape}")
    group = num_heads // num_kv_heads
    if heads_per_cta is None:
        heads_per_cta = KernelGeometry.for_shape(head_dim, block_size, group).heads_per_cta
    geometry = KernelGeometry(head_dim, block_size, heads_per_cta)
    tile_tokens = geometry.tile_tokens
    if partition_tokens is not None and (partition_tokens <= 0 or partition_tokens % block_size != 0):
        raise ValueError(f"partition_tokens {partition_tokens} is not a positive multiple of {block_size}")

    k_pool = np.asarray(k_cache, dtype=dtype)
    v_pool = np.asarray(v_cache, dtype=dtype)
    q_scaled = np.asarray(q, dtype=dtype) * dtype(scale * LOG2E)
    out = np.zeros((num_seqs, num_heads, head_dim), dtype=dtype)
    for seq in range(num_seqs):
        context_len = int(context_lens[seq])
        if context_len <= 0:
            continue  # the kernel writes zeros
        q_seq = q_scaled[seq].reshape(num_kv_heads, group, head_dim)
        part_tokens = partition_tokens or math.ceil(context_len / block_size) * block_size
        partitions = []
        for token_begin in range(0, context_len, part_tokens):
            token_end = min(context_len, token_begin + part_tokens)
            block_begin, block_end = token_begin // block_size, math.ceil(token_end / block_size)
            warps = []
            for warp in range(NUM_WARPS):
                state = (
                    np.full((num_kv_heads, group), -np.inf, dtype=dtype),
                    np.zeros((num_kv_heads, group), dtype=dtype),
                    np.zeros((num_kv_heads, group, head_dim), dtype=dtype),
                )
                for blk in range(block_begin + warp, block_end, NUM_WARPS):
                    block_id = int(block_tables[seq, blk])
                    for tile_start in range(0, block_size, tile_tokens):
                        first = blk * block_size + tile_start
                        if first >= token_end:
                            break
                        rows = slice(tile_start, tile_start + tile_tokens)
                        k_tile = k_pool[block_id, :, rows]  # [kv, t, d]
                        v_tile = v_pool[block_id, :, rows]
                        valid = first + np.arange(tile_tokens) < token_end
                        y = np.einsum("kgd,ktd->kgt", q_seq, k_tile)
                        y = np.where(valid, y, -np.inf)
                        v_tile = np.where(valid[None, :, None], v_tile, 0.0)
                        state = _online_tile(state, y, v_tile)
                warps.append(state)
            partitions.append(_merge(warps))
        if len(partitions) == 1:
            _, l_all, o_all = partitions[0]
        else:
            # Each partition stores o/l (normalised) with m and l; the reduce weighs o/l by l 2**(m - M).
            normalised = [(m, l, o / l[..., None]) for m, l, o in partitions]
            m_all = np.max(np.stack([m for m, _, _ in normalised]), axis=0)
            weights = [l * np.exp2(m - m_all) for m, l, _ in normalised]
            l_all = sum(weights)
            o_all = sum(w[..., None] * o for w, (_, _, o) in zip(weights, normalised, strict=True))
        out[seq] = (o_all / l_all[..., None]).reshape(num_heads, head_dim)
    return out


def plain_decode_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    scale: float,
) -> np.ndarray:
    """Textbook softmax attention over each sequence's gathered context, float64 (the ground truth).

    Args: as :func:`partitioned_decode_attention`.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` float64.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = np.zeros((num_seqs, num_heads, head_dim))
    for seq in range(num_seqs):
        n = int(context_lens[seq])
        positions = np.arange(n)
        block_ids = np.asarray(block_tables[seq])[positions // block_size]
        k = np.asarray(k_cache, dtype=np.float64)[block_ids, :, positions % block_size]  # [n, kv, d]
        v = np.asarray(v_cache, dtype=np.float64)[block_ids, :, positions % block_size]
        for head in range(num_heads):
            kv_head = head // group
            x = k[:, kv_head] @ np.asarray(q[seq, head], dtype=np.float64) * scale
            p = np.exp(x - x.max())
            out[seq, head] = (p / p.sum()) @ v[:, kv_head]
    return out
