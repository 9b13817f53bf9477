"""Decode CUDA graphs: buckets, static buffers and padding on the CPU (eager), capture and replay on CUDA.

Without CUDA, :class:`DecodeGraphs` runs the padded static batch eagerly: the same buffers, the same padding rows
and the same pad block as a replay, so the CPU tests pin the padding logic; the CUDA test (skipped cleanly without
CUDA and CuPy) compares graph replays with eager steps.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from shared.protocol import Generate, SamplingParams
from worker.batch import ForwardBatch
from worker.cuda_graphs import DecodeGraphs, bucket_for, graph_batch_sizes
from worker.engine import Engine
from worker.graph_decoder import MIN_STEADY_STEPS, GraphDecoder
from worker.kv_cache.manager import KVCacheManager
from worker.model_runner import ModelRunner
from worker.scheduler import Scheduler
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


def _load_rows(graphs: DecodeGraphs, prompts, tables, tokens) -> int | None:
    """Load a decode step (token ``tokens[i]`` after ``prompts[i]``) into the graphs' rows from host arrays."""
    width = max(map(len, tables))
    padded = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64)
    return graphs.load_rows(np.array(tokens, dtype=np.int64), np.array([len(p) for p in prompts], dtype=np.int64),
                            padded)


def test_a_padded_decode_step_equals_the_unpadded_one_and_writes_only_the_pad_block():
    model, kv_cache = _model_and_pool("cpu", "float32", "torch")
    _prefill(model, kv_cache, PROMPTS, TABLES)
    eager_pool = kv_cache.clone()
    eager = model.forward(_decode_batch(PROMPTS, TABLES, TOKENS, "cpu"), eager_pool)
    graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, max_num_seqs=8, max_model_len=256, pad_block_id=NUM_BLOCKS)
    bucket = _load_rows(graphs, PROMPTS, TABLES, TOKENS)
    padded = graphs.replay(bucket, len(TOKENS))
    assert bucket == 4 and not graphs.captured
    assert padded.shape == eager.shape == (3, model.spec.vocab_size)
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
    # the same K/V in every sequence block (up to the rounding of a 4-row vs a 3-row matmul); the pad row wrote
    # only into the pad block, which the unpadded step left as it was
    torch.testing.assert_close(kv_cache[:, :, :NUM_BLOCKS], eager_pool[:, :, :NUM_BLOCKS], rtol=1e-4, atol=1e-5)
    assert kv_cache[:, :, NUM_BLOCKS].abs().sum() > 0 and eager_pool[:, :, NUM_BLOCKS].abs().sum() == 0
    # derived from positions and block tables: bucket 4, one padding row over the pad block
    assert graphs.context_lens[:4].tolist() == [4, 20, 34, 1]
    assert graphs.slot_mapping[:4].tolist() == [3 * BLOCK_SIZE + 3, 7 * BLOCK_SIZE + 3, 4 * BLOCK_SIZE + 1,
                                                NUM_BLOCKS * BLOCK_SIZE]


def test_a_smaller_step_after_a_larger_one_resets_the_padding_rows():
    model, kv_cache = _model_and_pool("cpu", "float32", "torch")
    graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, max_num_seqs=8, max_model_len=256, pad_block_id=NUM_BLOCKS)
    big = _load_rows(graphs, [[0] * 40] * 5, [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [0, 1, 2]], [1] * 5)
    assert big == 8
    assert _load_rows(graphs, [[0] * 3], [[6]], [2]) == 1
    assert _load_rows(graphs, [[0] * 3, [0] * 4], [[6], [7]], [2, 3]) == 2
    assert _load_rows(graphs, [[0] * 3] * 3, [[6]] * 3, [2] * 3) == 4
    assert graphs.positions[:8].tolist() == [3, 3, 3, 0, 40, 0, 0, 0]  # row 4: past bucket 4, not read
    assert graphs.input_ids[:4].tolist() == [2, 2, 2, 0]
    assert graphs.block_tables[3, 0].item() == NUM_BLOCKS


def test_a_step_larger_than_the_largest_bucket_takes_the_eager_path():
    model, kv_cache = _model_and_pool("cpu", "float32", "torch")
    graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, max_num_seqs=2, max_model_len=256, pad_block_id=NUM_BLOCKS)
    assert graphs.sizes == [1, 2, 4, 8, 16]
    assert _load_rows(graphs, [[0]] * 17, [[b % NUM_BLOCKS] for b in range(17)], [1] * 17) is None
    assert _load_rows(graphs, [[0]] * 16, [[b % NUM_BLOCKS] for b in range(16)], [1] * 16) == 16


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
        replayed = graphs.replay(_load_rows(graphs, prompts, TABLES, tokens), len(tokens))
        assert replayed.shape == eager.shape
        # bf16: a 4-row bucket and 3 eager rows may take different matmul kernels; a wrong row or a stale input
        # would differ by the logits' whole scale
        assert (replayed - eager).abs().max() <= 0.05 * eager.abs().max()
    pool, eager_pool = kv_cache[:, :, :NUM_BLOCKS].float(), eager_pool[:, :, :NUM_BLOCKS].float()
    assert (pool - eager_pool).abs().max() <= 0.05 * eager_pool.abs().max()


class _RowsFromTheHost(GraphDecoder):
    """A decoder that never advances the static rows on the device nor launches a step ahead: every graph step
    loads its rows from the host after the scheduler decided it."""

    def forward(self, out):
        self._last = None
        return super().forward(out)

    def _may_launch_ahead(self, step) -> bool:
        return False


def _serve(decoder_cls, workload, device: str = "cpu", num_blocks: int = 40, min_steady_steps: int = 0
           ) -> tuple[dict, dict, list[int], list[list[float]], int]:
    """Run ``workload`` (arrivals and aborts per step) through an engine whose runner decodes through graphs
    (captured on CUDA; on the CPU the static batch runs eagerly) with a ``decoder_cls`` (launching steps ahead
    after ``min_steady_steps`` steady ones); return each request's tokens, finish reasons, per step advanced on the
    device the number of table rows it rewrote, per graph step a fingerprint of each row's logits, and how many
    steps took the logits of a step launched ahead."""
    # an untied head: with tied embeddings a random model's greedy token repeats its input token
    spec = synthetic_spec("llama-3-tiny", max_position_embeddings=256, tie_word_embeddings=False)
    mode, attention = ("float32", "torch") if device == "cpu" else ("bfloat16", "cupy")
    model = build_synthetic_model(spec, mode, device, attention_backend=attention, seed=1)
    kv_cache = model.allocate_kv_cache(num_blocks + 1, BLOCK_SIZE)
    graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, max_num_seqs=8, max_model_len=256, pad_block_id=num_blocks)
    if device == "cuda":
        graphs.capture()
    runner = ModelRunner(model, kv_cache, BLOCK_SIZE, torch.device(device), graphs)
    decoder = runner.graph_decoder = decoder_cls(graphs, runner.batch_builder.decode_tables, min_steady_steps)
    advanced: list[int] = []
    advance = graphs.advance

    def counted(num_seqs, input_ids, rows, row_tables):
        advanced.append(len(rows))
        return advance(num_seqs, input_ids, rows, row_tables)

    graphs.advance = counted
    forward = decoder.forward
    probe = torch.randn(model.spec.vocab_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    probe = probe.to(device)
    fingerprints: list[list[float]] = []
    ahead_taken = 0

    def fingerprinted(out):  # one number per row of a graph step's logits, to compare the steps exactly
        nonlocal ahead_taken
        ahead = decoder._ahead
        logits = forward(out)
        if logits is not None:
            fingerprints.append((logits.double() @ probe).tolist())
            ahead_taken += ahead is not None and logits is ahead.logits
        return logits

    decoder.forward = fingerprinted
    engine = Engine(Scheduler(KVCacheManager(num_blocks, BLOCK_SIZE), 8, 64, 256), runner, [])
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for arrivals, aborts in workload:
        for msg in arrivals:
            engine.add(msg.request_id, msg)
        for request_id in aborts:
            engine.abort(request_id)
        for event in engine.step().events:
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.finish_reason is not None:
                reasons[event.request_id] = event.finish_reason
    while engine.has_work():
        for event in engine.step().events:
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.finish_reason is not None:
                reasons[event.request_id] = event.finish_reason
    return tokens, reasons, advanced, fingerprints, ahead_taken


def _workload(rng: random.Random) -> list:
    """160 steps' arrivals (greedy and seeded sampling, up to 40 prompt and 60 output tokens) and aborts."""
    stop_ids = rng.sample(range(128256), 2000)  # about one token in 64 ends its request
    workload = []
    for step in range(160):
        arrivals = []
        if step < 100 and rng.random() < 0.12:
            sampling = SamplingParams(temperature=0.0) if rng.random() < 0.6 else SamplingParams(temperature=0.9,
                                                                                               seed=step)
            arrivals.append(Generate(f"r{step}", [rng.randrange(1, 128256) for _ in range(rng.randrange(1, 40))],
                                     sampling, rng.randrange(1, 60), stop_token_ids=stop_ids))
        aborts = [f"r{step - 30}"] if step >= 30 and rng.random() < 0.05 else []
        workload.append((arrivals, aborts))
    return workload


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_steps_advanced_on_the_device_equal_steps_loaded_from_the_host(device):
    """Greedy and seeded sampling, arrivals, stop tokens, length limits, aborts and tables growing a block every 16
    tokens: steps launched ahead of the scheduler's decision and rows advanced on the device (positions + 1, the
    sampled ids, the grown table rows) give the same logits, bit for bit, and tokens as rows written from the host
    after each decision."""
    if device == "cuda":
        pytest.importorskip("cupy", reason="CuPy is not installed")
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
    workload = _workload(random.Random(3))
    advanced_tokens, advanced_reasons, num_advanced, advanced_logits, num_ahead = _serve(GraphDecoder, workload,
                                                                                         device)
    loaded_tokens, loaded_reasons, num_loaded_advanced, loaded_logits, no_ahead = _serve(_RowsFromTheHost,
                                                                                         workload, device)
    # the steady steps took the device paths: launched ahead, else advanced (some growing a table)
    assert advanced_logits == loaded_logits  # bit for bit: the same rows, however they were written
    assert not num_loaded_advanced and not no_ahead
    assert num_ahead >= 15 and len(num_advanced) >= 40
    assert sum(1 for rows in num_advanced if rows) >= 3
    assert advanced_tokens == loaded_tokens
    assert advanced_reasons == loaded_reasons
    assert {"stop", "length"} <= set(advanced_reasons.values())


def test_steps_are_launched_ahead_only_after_a_run_of_steady_steps():
    """A step launched ahead and dropped costs a whole step: under churn (an arrival every few steps) none is
    launched; in a steady batch they are, after MIN_STEADY_STEPS steps that continued the one before."""
    churn = [([Generate(f"c{step}", [5 + step, 6, 7], SamplingParams(temperature=0.0), 12)] if step % 3 == 0 else [],
              []) for step in range(60)]
    *_, taken = _serve(GraphDecoder, churn, min_steady_steps=MIN_STEADY_STEPS)
    assert taken == 0
    steady = [([Generate(f"s{i}", [9, 8, 7 + i], SamplingParams(temperature=0.0), 60, ignore_eos=True)
                for i in range(4)], [])]
    tokens, reasons, _, logits, taken = _serve(GraphDecoder, steady, min_steady_steps=MIN_STEADY_STEPS)
    decode_steps = len(logits)  # graph steps: every step after the prompts' prefill
    assert set(reasons.values()) == {"length"} and all(len(t) == 60 for t in tokens.values())
    # launched ahead from the first step after MIN_STEADY_STEPS steady ones, but not across the 3 block boundaries
    assert decode_steps - MIN_STEADY_STEPS - 8 <= taken <= decode_steps - MIN_STEADY_STEPS
