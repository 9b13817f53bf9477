"""The CPU weights modes against the fp32 path, on the default GGUF (SmolLM2-135M-Instruct, Q4_1 layers, Q8_0
embedding).

The reference is the same file dequantized exactly to fp32 (``model.weights = "float32"``, itself checked
against transformers in ``test_model.py``).

Logit bound of the int4 path. Its weights are the file's own 4-bit codes with their fp32 group scales and mins;
what differs from the fp32 reference is the rounding of every matmul input to int8 per group of 32 (Sluice's CPU
kernels, as llama.cpp does): an error of at most ``u = 1/254`` of the group's largest magnitude per element, on the
four matmul inputs of each layer (the normed hidden state twice, the attention output, the MLP product) and the LM
head's, ``n = 4 * 30 + 1 = 121`` roundings; everything else is fp32. Independent roundings add up like a random
walk, so the logits carry a relative error of about ``sqrt(n) u = 11 u`` of their scale; the bound is
``11 u max|logit|`` (about 1.5 for these prompts, whose largest logit is about 34-37; measured: 1.11 max). Where
the kernels do not run the layers compute over the dequantized weights in fp32 or bf16: a smaller error.
"""

from __future__ import annotations

import math

import pytest
import torch

from shared.protocol import Generate, SamplingParams
from tests.worker.quant_helpers import perplexity, prefill_then_decode, reference_pairs
from worker.batch import ForwardBatch
from worker.model import load_model
from worker.quant import DenseLinear, InputMajorLinear

LOGITS_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In a small village at the foot of the mountains, there lived an old clockmaker who",
]
INT8_ACTIVATION_ROUNDOFF = 1 / 254
ROUNDINGS_PER_FORWARD = 4 * 30 + 1


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these tests run beside others on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from shared.config import default_model_path

    try:
        return default_model_path()
    except Exception as exc:  # the model package is an install-time dependency
        pytest.skip(f"default model not installed: {exc}")


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    from shared.model_files import load_tokenizer

    return load_tokenizer(gguf_path)


_MODELS: dict[str, object] = {}


def _model(gguf_path: str, mode: str):
    if mode not in _MODELS:
        _MODELS[mode] = load_model(gguf_path, torch.float32, "cpu", weights_mode=mode)
    return _MODELS[mode]


@pytest.fixture(scope="module")
def reference(gguf_path):
    return _model(gguf_path, "float32")


@pytest.fixture(scope="module")
def int4(gguf_path):
    return _model(gguf_path, "int4")


def test_auto_weights_follow_the_file(gguf_path):
    from worker.gguf_weights import auto_weights_mode

    assert _model(gguf_path, "int4").weights_mode == "int4"
    assert load_model(gguf_path, torch.float32, "cpu", weights_mode="auto").weights_mode == "int4"
    assert [auto_weights_mode(t) for t in ("Q4_0", "Q4_1", "Q4_K", "Q5_1", "Q6_K", "Q8_0", "F16", "F32")] == [
        "int4", "int4", "int4", "int8", "int8", "int8", "float32", "float32"]


def test_int4_logits_within_int8_activation_rounding_bound_of_fp32_reference(reference, int4, tokenizer):
    """Prefill + 8 decode steps on 3 prompts: max |logit difference| <= 11 u max|logit| (module docstring)."""
    worst = 0.0
    for prompt in LOGITS_PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        ref_logits, fed = prefill_then_decode(reference, ids, 8)
        our_logits, _ = prefill_then_decode(int4, ids, 8, forced=fed)
        scale = max(row.abs().max().item() for row in ref_logits)
        bound = math.ceil(math.sqrt(ROUNDINGS_PER_FORWARD)) * INT8_ACTIVATION_ROUNDOFF * scale  # 11 u max|logit|
        err = max((a - b).abs().max().item() for a, b in zip(ref_logits, our_logits))
        worst = max(worst, err)
        assert err <= bound, f"{prompt!r}: max |logit error| {err:.3f} > bound {bound:.3f}"
    print(f"int4 vs fp32 max |logit error| {worst:.3f}")


def test_int4_perplexity_within_3_percent_of_fp32(reference, int4, tokenizer):
    """Teacher-forced in one prefill per answer (the prefill rows take the same int4 kernel as decode rows)."""
    pairs = reference_pairs(tokenizer, 20)
    assert len(pairs) == 20
    ppl_ref = perplexity(reference, pairs)
    ppl_int4 = perplexity(int4, pairs)
    print(f"perplexity on 20 MT-Bench reference answers: fp32 {ppl_ref:.4f}, int4 {ppl_int4:.4f}")
    assert abs(ppl_int4 / ppl_ref - 1) <= 0.03


def test_int4_greedy_tokens_agree_with_fp32_on_90_percent(reference, int4, tokenizer):
    """Along the fp32 path's greedy continuation (32 tokens after each of 10 prompts), the int4 path picks the
    same token at >= 90% of the positions."""
    agree = total = 0
    for prompt, _ in reference_pairs(tokenizer, 10):
        ref_logits, fed = prefill_then_decode(reference, prompt, 32)
        our_logits, _ = prefill_then_decode(int4, prompt, 32, forced=fed)
        agree += sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(ref_logits[:-1], our_logits[:-1]))
        total += len(fed)
    print(f"int4 greedy agreement with fp32: {agree}/{total} = {agree / total:.3f}")
    assert agree / total >= 0.90


def _engine(model, prefix_caching: bool = False):
    from worker.engine import Engine
    from worker.kv_cache.manager import KVCacheManager
    from worker.model_runner import ModelRunner
    from worker.scheduler import Scheduler

    block_size, num_blocks = 16, 160
    kv_cache = model.allocate_kv_cache(num_blocks, block_size)
    runner = ModelRunner(model, kv_cache, block_size, torch.device("cpu"))
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching,
                        block_copier=runner.block_io.copy_block_prefix)
    return Engine(Scheduler(kv, 16, 512, 2048), runner, model.spec.eos_token_ids)


def _generate(model, prompts: list[list[int]], max_tokens: int, engine=None,
              cached_tokens: list[int] | None = None) -> list[list[int]]:
    """Greedy answers of ``prompts`` run together; ``cached_tokens`` (when given) receives each one's cache hit."""
    engine = engine if engine is not None else _engine(model)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", Generate(f"r{i}", prompt, SamplingParams(temperature=0.0), max_tokens, ignore_eos=True))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    cached = dict.fromkeys(tokens, 0)
    while engine.has_work():
        for event in engine.step().events:
            tokens[event.request_id].extend(event.new_token_ids)
            cached[event.request_id] = event.cached_tokens
    if cached_tokens is not None:
        cached_tokens.extend(cached.values())
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_prefix_hits_with_partial_block_copies_answer_as_a_cold_cache_does(gguf_path, tokenizer):
    """A repeated prompt reuses every token but its last (whole blocks, then rows copied out of the block that
    held the prompt's tail and the first answer's tokens); a prompt that shares a prefix ending mid-block reuses
    up to that token. The answers equal those of an engine without a prefix cache. 16 answer tokens fill the block
    that holds a prompt's tail (only full blocks are cached)."""
    model = _model(gguf_path, "int4")
    prompts = [p for p, _ in reference_pairs(tokenizer, 3)]
    assert all(len(p) % 16 for p in prompts), "a prompt on a block boundary would test only the back-off"
    branched = prompts[0][:len(prompts[0]) - 3] + [28, 29, 30, 31, 32]  # agrees up to mid-block, then differs
    assert branched[len(prompts[0]) - 3] != prompts[0][-3]
    cold = _generate(model, prompts + [branched], 16)
    engine = _engine(model, prefix_caching=True)
    first_cached: list[int] = []
    assert _generate(model, prompts, 16, engine, first_cached) == cold[:3]
    again_cached: list[int] = []
    assert _generate(model, prompts, 16, engine, again_cached) == cold[:3]
    branched_cached: list[int] = []
    assert _generate(model, [branched], 16, engine, branched_cached) == cold[3:]
    assert first_cached == [0, 0, 0]
    assert again_cached == [len(p) - 1 for p in prompts]
    assert branched_cached == [len(prompts[0]) - 3]
    assert engine.scheduler.kv.stats.snapshot()["partial_block_hit_tokens"] == sum(
        (len(p) - 1) % 16 for p in prompts) + (len(prompts[0]) - 3) % 16
    # a short answer leaves the last block partly filled: it is cached at release, and lends its rows too
    short = [9906, 28, 1030, 30, 2]
    cold_short = _generate(model, [short], 2)
    short_cached: list[int] = []
    assert _generate(model, [short], 2, engine) == cold_short
    assert _generate(model, [short], 2, engine, short_cached) == cold_short and short_cached == [len(short) - 1]


@pytest.mark.parametrize("mode", ["float32", "bfloat16", "int8", "int4"])
def test_eight_concurrent_greedy_requests_equal_each_alone(gguf_path, tokenizer, mode):
    model = _model(gguf_path, mode)
    prompts = [p for p, _ in reference_pairs(tokenizer, 8)]
    together = _generate(model, prompts, 12)
    alone = [_generate(model, [p], 12)[0] for p in prompts]
    assert together == alone


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_prompt_logits_and_kv_bit_identical_however_chunked_or_cached(gguf_path, mode):
    """A prompt computed whole, in chunks of 1 to 64 tokens, or after a cached prefix (its last chunk alone) gives
    bit-identical K/V and last-token logits: the same greedy or seeded answer with or without a prefix-cache hit."""
    model = _model(gguf_path, mode)
    generator = torch.Generator().manual_seed(0)
    block_size = 16
    for num_tokens, splits in ((66, [64]), (66, [65]), (100, [1, 48, 99]), (37, [5, 6, 7])):
        ids = torch.randint(10, 40000, (num_tokens,), generator=generator).tolist()
        table = list(range((num_tokens + block_size - 1) // block_size))
        whole_kv = model.allocate_kv_cache(len(table), block_size)
        whole = model.forward(ForwardBatch.build([ids], [0], [table], block_size, decode=[False]), whole_kv)
        chunked_kv = model.allocate_kv_cache(len(table), block_size)
        bounds = [0, *splits, num_tokens]
        for start, end in zip(bounds, bounds[1:]):
            chunk = ForwardBatch.build([ids[start:end]], [start], [table], block_size, decode=[False])
            chunked = model.forward(chunk, chunked_kv)
        assert torch.equal(whole, chunked), f"{num_tokens} tokens split at {splits}"
        assert torch.equal(whole_kv, chunked_kv), f"{num_tokens} tokens split at {splits}"


def test_an_input_major_linear_computes_the_dense_layer_and_gives_back_its_weight():
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(5, 32, generator=gen)
    for b in (None, bias):
        dense = DenseLinear(weight, b)
        layer = InputMajorLinear.from_dense(dense)
        assert layer.weight_t.shape == (32, 48) and layer.weight_t.is_contiguous()
        assert (layer.in_features, layer.out_features) == (32, 48)
        torch.testing.assert_close(layer.forward(x), dense.forward(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(layer.tensors()["weight"], weight)
        assert ("bias" in layer.tensors()) == (b is not None)
