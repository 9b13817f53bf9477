"""The decode kernel's schedule (partitions, warps, tiles, online softmax, reductions) vs plain softmax attention.

Runs on the CPU: ``worker.attention.partitioned_ref`` executes the exact steps of
``worker/attention/kernels/paged_decode_attention.cu``; float64 arithmetic lets the tolerance be tight, so any
mistake in the schedule's math (a wrong rescale, a dropped tile, a bad merge weight) shows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from worker.attention.partitioned_ref import (
    MAX_PARTITIONS,
    KernelGeometry,
    PartitionPlan,
    partitioned_decode_attention,
    plain_decode_attention,
    plan_partitions,
)


def _random_paged_case(
    rng: np.random.Generator,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    context_lens: list[int],
    spare_blocks: int = 3,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Random q and pools; every sequence gets its own blocks in shuffled pool order (plus unused spare blocks)."""
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq) + 2
    ids = rng.permutation(num_blocks)
    tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = ids[start : start + n]
        start += n
    q = rng.standard_normal((num_seqs, num_heads, head_dim))
    k = rng.standard_normal((num_blocks, num_kv_heads, block_size, head_dim))
    v = rng.standard_normal((num_blocks, num_kv_heads, block_size, head_dim))
    return q, k, v, tables, np.asarray(context_lens, dtype=np.int32)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"),
    [(4, 4), (6, 2), (8, 2), (9, 3), (16, 2), (24, 2)],  # groups 1, 3, 4, 3, 8, 12 (12 > 8: two head chunks)
)
def test_schedule_matches_plain_softmax(head_dim: int, block_size: int, num_heads: int, num_kv_heads: int) -> None:
    rng = np.random.default_rng(head_dim * 1000 + block_size * 10 + num_heads)
    lens = [1, block_size, block_size + 1, 5 * block_size - 3, 300]
    q, k, v, tables, context_lens = _random_paged_case(
        rng, len(lens), num_heads, num_kv_heads, head_dim, block_size, lens
    )
    scale = head_dim**-0.5
    expected = plain_decode_attention(q, k, v, tables, context_lens, scale)
    for partition_tokens in (None, block_size, 2 * block_size, 4 * block_size, 256):
        got = partitioned_decode_attention(q, k, v, tables, context_lens, scale, partition_tokens=partition_tokens)
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12, err_msg=f"partition={partition_tokens}")


@pytest.mark.parametrize("heads_per_cta", [1, 2, 4, 8])
def test_every_tile_size_matches_plain_softmax(heads_per_cta: int) -> None:
    """The tile size depends on heads per CTA; each instance's tiling must give the same result."""
    rng = np.random.default_rng(heads_per_cta)
    lens = [37, 129, 64]
    q, k, v, tables, context_lens = _random_paged_case(rng, 3, 8, 2, 128, 16, lens)
    expected = plain_decode_attention(q, k, v, tables, context_lens, 0.1)
    got = partitioned_decode_attention(
        q, k, v, tables, context_lens, 0.1, partition_tokens=32, heads_per_cta=heads_per_cta
    )
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_context_of_one_token_returns_its_value_row() -> None:
    rng = np.random.default_rng(1)
    q, k, v, tables, context_lens = _random_paged_case(rng, 2, 8, 2, 64, 16, [1, 1])
    got = partitioned_decode_attention(q, k, v, tables, context_lens, 0.125, partition_tokens=16)
    for s in range(2):
        block = tables[s, 0]
        np.testing.assert_allclose(got[s], np.repeat(v[block, :, 0], 4, axis=0), rtol=1e-12)


def test_large_scores_do_not_overflow() -> None:
    """Scores of ±1e4 would overflow exp() without the running max; the online softmax keeps them finite."""
    rng = np.random.default_rng(2)
    q, k, v, tables, context_lens = _random_paged_case(rng, 2, 4, 1, 64, 16, [100, 257])
    q = q * 300.0
    got = partitioned_decode_attention(q, k, v, tables, context_lens, 1.0, partition_tokens=32)
    expected = plain_decode_attention(q, k, v, tables, context_lens, 1.0)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9)


def test_float32_schedule_is_close_to_float64() -> None:
    """In fp32 (the kernel's accumulation type) the schedule stays within fp32 rounding of the exact result."""
    rng = np.random.default_rng(3)
    q, k, v, tables, context_lens = _random_paged_case(rng, 3, 32, 8, 128, 16, [1000, 4099, 17])
    expected = plain_decode_attention(q, k, v, tables, context_lens, 128**-0.5)
    got = partitioned_decode_attention(
        q, k, v, tables, context_lens, 128**-0.5, partition_tokens=512, dtype=np.float32
    )
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_matches_the_torch_reference_backend() -> None:
    """Same inputs through ``torch_ref.paged_decode_attention_ref`` (fp32): the two references agree."""
    from worker.attention.torch_ref import paged_decode_attention_ref

    rng = np.random.default_rng(4)
    q, k, v, tables, context_lens = _random_paged_case(rng, 4, 12, 4, 64, 16, [3, 70, 16, 200])
    got = partitioned_decode_attention(q, k, v, tables, context_lens, 0.125, partition_tokens=64)
    ref = paged_decode_attention_ref(
        torch.from_numpy(q).float(),
        torch.from_numpy(k).float(),
        torch.from_numpy(v).float(),
        torch.from_numpy(tables),
        torch.from_numpy(context_lens),
        0.125,
    )
    np.testing.assert_allclose(got, ref.double().numpy(), rtol=1e-4, atol=1e-5)


def test_partition_size_must_be_whole_blocks() -> None:
    rng = np.random.default_rng(5)
    q, k, v, tables, context_lens = _random_paged_case(rng, 1, 2, 1, 64, 16, [40])
    with pytest.raises(ValueError, match="multiple of 16"):
        partitioned_decode_attention(q, k, v, tables, context_lens, 0.1, partition_tokens=24)


@pytest.mark.parametrize(
    ("head_dim", "block_size", "group", "heads", "tile_tokens"),
    [
        (128, 16, 4, 4, 16),
        (128, 32, 4, 4, 16),
        (128, 16, 8, 8, 8),
        (64, 16, 3, 4, 16),
        (64, 32, 1, 1, 32),
        (64, 32, 12, 8, 16),
    ],
)
def test_geometry_for_shape(head_dim: int, block_size: int, group: int, heads: int, tile_tokens: int) -> None:
    geometry = KernelGeometry.for_shape(head_dim, block_size, group)
    assert geometry.heads_per_cta == heads
    assert geometry.tile_tokens == tile_tokens
    assert block_size % geometry.tile_tokens == 0


def test_geometry_rejects_shapes_without_an_instance() -> None:
    with pytest.raises(ValueError, match="head_dim 96"):
        KernelGeometry.for_shape(96, 16, 4)
    with pytest.raises(ValueError, match="block_size 8"):
        KernelGeometry.for_shape(128, 8, 4)


class TestPlanPartitions:
    """The split heuristic: big grids run single-pass, small grids with long contexts split."""

    RESIDENT = 132 * 2  # H200: 132 SMs × 2 decode CTAs each

    def test_short_context_is_single_pass(self) -> None:
        assert plan_partitions(200, 8, self.RESIDENT, 16) == PartitionPlan(1, 208)

    def test_batch_one_long_context_splits_to_fill_the_gpu(self) -> None:
        plan = plan_partitions(32768, 8, self.RESIDENT, 16)
        assert plan.num_partitions >= 16
        assert plan.partition_tokens % 16 == 0
        assert plan.num_partitions * plan.partition_tokens >= 32768
        assert (plan.num_partitions - 1) * plan.partition_tokens < 32768

    def test_large_batch_long_context_needs_no_split(self) -> None:
        assert plan_partitions(32768, 256 * 8, self.RESIDENT, 16).num_partitions == 1

    def test_partitions_never_exceed_the_reduce_limit(self) -> None:
        plan = plan_partitions(131072, 1, 10_000, 16, min_partition_tokens=16)
        assert 1 < plan.num_partitions <= MAX_PARTITIONS
        assert plan.num_partitions * plan.partition_tokens >= 131072

    @pytest.mark.parametrize("context", [1, 17, 512, 4096, 32768, 131072])
    @pytest.mark.parametrize("batch", [1, 16, 64, 256])
    def test_plan_covers_the_context_exactly(self, context: int, batch: int) -> None:
        plan = plan_partitions(context, batch * 8, self.RESIDENT, 16)
        assert plan.partition_tokens % 16 == 0
        assert plan.num_partitions * plan.partition_tokens >= context
        assert (plan.num_partitions - 1) * plan.partition_tokens < context
        assert plan.num_partitions == 1 or plan.partition_tokens >= 256
