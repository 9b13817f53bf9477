"""Decode CUDA graphs: buckets, static buffers and padding on the CPU (eager), capture and replay on CUDA.

Without CUDA, :class:`DecodeGraphs` runs the padded static batch eagerly: the same buffers, the same padding rows
and the same pad block as a replay, so the CPU tests pin the padding logic; the CUDA test (skipped cleanly without
CUDA and CuPy) compares graph replays with eager steps.
"""

from __future__ import annotations

import pytest
import torch

from worker.batch import ForwardBatch
from worker.cuda_graphs import DecodeGraphs, bucket_for, graph_batch_sizes
from worker.synthetic import build_synthetic_model, synthetic_spec

BLOCK_SIZE = 16
NUM_BLOCKS = 12  # + 1 pad block at id NUM_BLOCKS


def test_buckets_are_powers_of_two_to_8_then_every_16_up_to_max_num_seqs():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112]
    assert graph_batch_sizes(1) == [1, 2, 4, 8, 16]
    sizes = graph_batch_sizes(256)
    assert sizes[-1] == 256 and len(sizes) == 4 + 16
    assert [bucket_for(sizes, n) for n in (1, 3, 8, 9, 17, 255, 256, 257)] == [1, 4, 8, 16, 32, 256, 256, None]


def _model_and_pool(device: str, mode: str, attention: str):
    spec = synthetic_spec("llama-3-tiny", max_position_embeddings=256)
    model = build_synthetic_model(spec, mode, device, attention_backend=attention, seed=1)
    return model, model.allocate_kv_cache(NUM_BLOCKS + 1, BLOCK_SIZE)


def _prefill(model, kv_cache, prompts: list[list[int]], tables: list[list[int]]) -> None:
    model.forward(ForwardBatch.build(prompts, [0] * len(prompts), tables, BLOCK_SIZE, device=kv_cache.device),
                  kv_cache)


def _decode_batch(prompts, tables, tokens, device) -> ForwardBatch:
    return ForwardBatch.build([[t] for t in tokens], [len(p) for p in prompts], tables, BLOCK_SIZE, device=device)


PROMPTS = [[5, 6, 7], list(range(1, 20)), [9] * 33]
TABLES = [[3], [0, 7], [1, 2, 4]]
TOKENS = [11, 12, 13]


def test_a_padded_decode_step_equals_the_unpadded_one_and_writes_only_the_pad_block():
    model, kv_cache = _model_and_pool("cpu", "float32", "torch")
    _prefill(model, kv_cache, PROMPTS, TABLES)
    eager_pool = kv_cache.clone()
    eager = model.forward(_decode_batch(PROMPTS, TABLES, TOKENS, "cpu"), eager_pool)
    graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, max_num_seqs=8, max_model_len=256, pad_block_id=NUM_BLOCKS)
    padded = graphs.run(_decode_batch(PROMPTS, TABLES, TOKENS, "cpu"))
    assert not graphs.captured
    assert padded.shape == eager.shape == (3, model.spec.vocab_size)
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
    # the same K/V in every sequence block (up to the rounding of a 4-row vs a 3-row matmul); the pad row wrote
    # only into the pad block, which the unpadded step left as it was
    torch.testing.assert_close(kv_cache[:, :, :NUM_BLOCKS], eager_pool[:, :, :NUM_BLOCKS], rtol=1e-4, atol=1e-5)
    assert kv_cache[:, :, NUM_BLOCKS].abs().sum() > 0 and eager_pool[:, :, NUM_BLOCKS].abs().sum() == 0
    assert graphs.context_lens[:4].tolist() == [4, 20, 34, 1]  # bucket 4: one padding row over the pad block
    assert graphs.slot_mapping[3].item() == NUM_BLOCKS * BLOCK_SIZE


def test_a_smaller_step_after_a_larger_one_resets_the_padding_rows():
    model, kv_cache = _model_and_pool("cpu", "float32", "torch")
    graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, max_num_seqs=8, max_model_len=256, pad_block_id=NUM_BLOCKS)
    big = ForwardBatch.build([[1]] * 5, [40] * 5, [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [0, 1, 2]],
                             BLOCK_SIZE)
    assert graphs.load(big) == 8
    small = ForwardBatch.build([[2]], [3], [[6]], BLOCK_SIZE)
    assert graphs.load(small) == 1
    assert graphs.load(ForwardBatch.build([[2], [3]], [3, 4], [[6], [7]], BLOCK_SIZE)) == 2
    assert graphs.load(ForwardBatch.build([[2]] * 3, [3] * 3, [[6]] * 3, BLOCK_SIZE)) == 4
    assert graphs.context_lens[:8].tolist() == [4, 4, 4, 1, 41, 1, 1, 1]  # row 4: past bucket 4, not read
    assert graphs.block_tables[3, 0].item() == NUM_BLOCKS and graphs.positions[3].item() == 0


def test_prefill_mixed_and_oversized_steps_take_the_eager_path():
    model, kv_cache = _model_and_pool("cpu", "float32", "torch")
    graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, max_num_seqs=2, max_model_len=256, pad_block_id=NUM_BLOCKS)
    assert graphs.sizes == [1, 2, 4, 8, 16]
    assert graphs.run(ForwardBatch.build([[1, 2, 3]], [0], [[0]], BLOCK_SIZE)) is None
    assert graphs.run(ForwardBatch.build([[1, 2], [3]], [0, 5], [[0], [1]], BLOCK_SIZE)) is None
    assert graphs.run(ForwardBatch.build([[1]] * 17, [1] * 17, [[b % NUM_BLOCKS] for b in range(17)],
                                         BLOCK_SIZE)) is None


@pytest.mark.gpu
def test_graph_replays_equal_eager_decode_steps_on_cuda():
    pytest.importorskip("cupy", reason="CuPy is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, kv_cache = _model_and_pool("cuda", "bfloat16", "cupy")
    _prefill(model, kv_cache, PROMPTS, TABLES)
    eager_pool = kv_cache.clone()
    graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, max_num_seqs=8, max_model_len=256, pad_block_id=NUM_BLOCKS)
    report = graphs.capture()
    assert graphs.captured and report.sizes == (1, 2, 4, 8, 16)
    for step in range(3):  # the same graph replays with new inputs each step
        tokens = [t + step for t in TOKENS]
        prompts = [p + [0] * step for p in PROMPTS]
        eager = model.forward(_decode_batch(prompts, TABLES, tokens, "cuda"), eager_pool)
        replayed = graphs.run(_decode_batch(prompts, TABLES, tokens, "cuda"))
        assert replayed.shape == eager.shape
        # bf16: a 4-row bucket and 3 eager rows may take different matmul kernels; a wrong row or a stale input
        # would differ by the logits' whole scale
        assert (replayed - eager).abs().max() <= 0.05 * eager.abs().max()
    pool, eager_pool = kv_cache[:, :, :NUM_BLOCKS].float(), eager_pool[:, :, :NUM_BLOCKS].float()
    assert (pool - eager_pool).abs().max() <= 0.05 * eager_pool.abs().max()
