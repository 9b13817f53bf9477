"""Our paged forward pass against transformers' own model, both loaded from the default GGUF in fp32.

The transformers model is loaded once per module; ours takes its weights (``LlamaModel.from_hf``), so both run
the same dequantized numbers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from shared.config import default_model_path
from worker.batch import ForwardBatch
from worker.model import LlamaModel, load_hf_model, load_model

BLOCK_SIZE = 16
NUM_BLOCKS = 96
FIXTURE_PROMPTS = Path(__file__).parent.parent / "fixtures" / "mt_bench_prompts.json"
SHARED_MT_BENCH = Path(__file__).parents[3] / "shared" / "data" / "mt_bench" / "question.jsonl"

LOGITS_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In a small village at the foot of the mountains, there lived an old clockmaker who",
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        return default_model_path()
    except Exception as exc:  # the model package is an install-time dependency; say what is missing
        pytest.skip(f"default model not installed: {exc}")


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    torch.manual_seed(0)
    model = load_hf_model(gguf_path, torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    from shared.model_files import load_tokenizer

    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def model(hf_model) -> LlamaModel:
    return LlamaModel.from_hf(hf_model, torch.float32, "cpu")


def _shuffled_block_ids(seed: int) -> list[int]:
    ids = list(range(1, NUM_BLOCKS))
    random.Random(seed).shuffle(ids)
    return ids


def _tables(lengths_tokens: list[int], seed: int) -> list[list[int]]:
    """Give each sequence enough blocks for its length, from a shuffled pool (non-contiguous, out of order)."""
    free = _shuffled_block_ids(seed)
    tables = []
    for length in lengths_tokens:
        num_blocks = (length + BLOCK_SIZE - 1) // BLOCK_SIZE
        tables.append([free.pop() for _ in range(num_blocks)])
    return tables


def _hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """All-position logits ``[len, vocab]`` of one unpadded sequence from transformers."""
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def _chat_prompt_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def _mt_bench_prompts() -> list[str]:
    """Five first turns of MT-Bench: from ../shared/data when present, else the fixture copy (same questions)."""
    fixture = json.loads(FIXTURE_PROMPTS.read_text())
    if SHARED_MT_BENCH.exists():
        by_id = {}
        for line in SHARED_MT_BENCH.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                by_id[row["question_id"]] = row["turns"][0]
        return [by_id.get(item["question_id"], item["prompt"]) for item in fixture]
    return [item["prompt"] for item in fixture]


def test_paged_prefill_and_decode_logits_match_transformers(model, hf_model, tokenizer):
    """3 prompts batched: prefill, then 8 batched decode steps, shuffled block tables; logits within 1e-3."""
    _check_logits_match_transformers(model, hf_model, tokenizer)


def test_gguf_read_directly_in_float32_matches_transformers(gguf_path, hf_model, tokenizer):
    """``model.weights = "float32"``: our own GGUF reader (exact dequantization, Q/K rows un-interleaved) gives
    transformers' logits within 1e-3, like the weights taken from transformers' model."""
    direct = load_model(gguf_path, torch.float32, "cpu", weights_mode="float32")
    assert direct.weights_mode == "float32" and direct.dtype == torch.float32
    _check_logits_match_transformers(direct, hf_model, tokenizer)


def _check_logits_match_transformers(model, hf_model, tokenizer):
    prompts = [tokenizer.encode(text) for text in LOGITS_PROMPTS]
    num_decode_steps = 8
    tables = _tables([len(p) + num_decode_steps for p in prompts], seed=1)
    kv_cache = model.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    sequences = [list(p) for p in prompts]
    ours: list[list[torch.Tensor]] = [[] for _ in prompts]

    batch = ForwardBatch.build(prompts, [0] * len(prompts), tables, BLOCK_SIZE)
    logits = model.forward(batch, kv_cache)
    for step in range(num_decode_steps + 1):
        if step > 0:
            batch = ForwardBatch.build(
                [[seq[-1]] for seq in sequences], [len(seq) - 1 for seq in sequences], tables, BLOCK_SIZE
            )
            assert batch.is_decode_only
            logits = model.forward(batch, kv_cache)
        assert logits.shape == (len(prompts), model.spec.vocab_size) and logits.dtype == torch.float32
        for s, seq in enumerate(sequences):
            ours[s].append(logits[s])
            seq.append(int(logits[s].argmax()))

    for s, prompt in enumerate(prompts):
        reference = _hf_logits(hf_model, sequences[s][:-1])  # positions whose logits we produced
        wanted = reference[len(prompt) - 1 :]
        got = torch.stack(ours[s])
        assert got.shape == wanted.shape
        max_abs = (got - wanted).abs().max().item()
        assert max_abs < 1e-3, f"prompt {s}: max abs logit difference {max_abs}"


def test_greedy_32_tokens_match_transformers_generate(model, hf_model, tokenizer):
    """5 chat-templated MT-Bench prompts, decoded together greedily, equal transformers' generate() token by token."""
    max_new_tokens = 32
    prompts = [_chat_prompt_ids(tokenizer, text) for text in _mt_bench_prompts()]
    expected = []
    for prompt in prompts:
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        expected.append(out[0, len(prompt) :].tolist())

    tables = _tables([len(p) + max_new_tokens for p in prompts], seed=2)
    kv_cache = model.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    outputs: list[list[int]] = [[] for _ in prompts]
    logits = model.forward(ForwardBatch.build(prompts, [0] * len(prompts), tables, BLOCK_SIZE), kv_cache)
    for step in range(max_new_tokens):
        for s, token in enumerate(logits.argmax(dim=-1).tolist()):
            outputs[s].append(token)
        if step + 1 == max_new_tokens:
            break
        batch = ForwardBatch.build(
            [[out[-1]] for out in outputs],
            [len(p) + len(out) - 1 for p, out in zip(prompts, outputs)],
            tables,
            BLOCK_SIZE,
        )
        logits = model.forward(batch, kv_cache)

    eos = set(model.spec.eos_token_ids)
    for s, want in enumerate(expected):
        got = outputs[s][: len(want)]
        assert got == want, f"prompt {s}: ours {got} vs transformers {want}"
        if len(want) < max_new_tokens:  # transformers stopped at EOS; so must our sequence
            assert want[-1] in eos


def test_chunked_prefill_equals_one_shot_prefill(model, tokenizer):
    """A prompt prefilled over 3 chunks (with shuffled blocks) gives the one-shot logits."""
    prompt = _chat_prompt_ids(tokenizer, _mt_bench_prompts()[2])
    table_a, table_b = _tables([len(prompt)] * 2, seed=3)
    one_shot_cache = model.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    one_shot = model.forward(ForwardBatch.build([prompt], [0], [table_a], BLOCK_SIZE), one_shot_cache)

    chunked_cache = model.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    cuts = [0, 13, 40, len(prompt)]  # chunk edges inside and across block boundaries
    for start, end in zip(cuts, cuts[1:]):
        last = end == len(prompt)
        batch = ForwardBatch.build([prompt[start:end]], [start], [table_b], BLOCK_SIZE, sample=[last])
        logits = model.forward(batch, chunked_cache)
        assert logits.shape[0] == int(last)
    assert (logits - one_shot).abs().max().item() < 1e-4
    # The chunks wrote the same K/V as the one-shot prefill, slot for slot (up to matmul rounding).
    for t in range(len(prompt)):
        slot_a = (table_a[t // BLOCK_SIZE], t % BLOCK_SIZE)
        slot_b = (table_b[t // BLOCK_SIZE], t % BLOCK_SIZE)
        torch.testing.assert_close(
            chunked_cache[:, :, slot_b[0], :, slot_b[1]],
            one_shot_cache[:, :, slot_a[0], :, slot_a[1]],
            atol=1e-4,
            rtol=1e-4,
        )


def test_mixed_decode_and_prefill_batch_is_invisible(model, tokenizer):
    """Two decoding seqs + one prefill chunk in one step give the same per-seq logits as each run alone."""
    texts = _mt_bench_prompts()
    prompts = [_chat_prompt_ids(tokenizer, t) for t in texts[:3]]
    decode_tokens = [tokenizer.encode(" Hello")[0], tokenizer.encode(" The")[0]]
    chunk_start, chunk_end = 20, len(prompts[2])
    tables = _tables([len(prompts[0]) + 1, len(prompts[1]) + 1, len(prompts[2])], seed=4)

    def prepare(kv_cache: torch.Tensor) -> None:
        """Prefill seq 0 and seq 1 fully and seq 2's first chunk."""
        batch = ForwardBatch.build(
            [prompts[0], prompts[1], prompts[2][:chunk_start]], [0, 0, 0], tables, BLOCK_SIZE, sample=[False] * 3
        )
        model.forward(batch, kv_cache)

    mixed_cache = model.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    prepare(mixed_cache)
    mixed = ForwardBatch.build(
        [[decode_tokens[0]], prompts[2][chunk_start:chunk_end], [decode_tokens[1]]],
        [len(prompts[0]), chunk_start, len(prompts[1])],
        [tables[0], tables[2], tables[1]],
        BLOCK_SIZE,
    )
    assert not mixed.is_decode_only
    mixed_logits = model.forward(mixed, mixed_cache)

    alone_cache = model.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    prepare(alone_cache)
    alone = [
        model.forward(
            ForwardBatch.build([[decode_tokens[0]]], [len(prompts[0])], [tables[0]], BLOCK_SIZE), alone_cache
        ),
        model.forward(
            ForwardBatch.build([prompts[2][chunk_start:chunk_end]], [chunk_start], [tables[2]], BLOCK_SIZE),
            alone_cache,
        ),
        model.forward(
            ForwardBatch.build([[decode_tokens[1]]], [len(prompts[1])], [tables[1]], BLOCK_SIZE), alone_cache
        ),
    ]
    for s in range(3):
        max_abs = (mixed_logits[s] - alone[s][0]).abs().max().item()
        assert max_abs < 1e-4, f"seq {s}: batched vs alone max abs difference {max_abs}"
    torch.testing.assert_close(mixed_cache, alone_cache, atol=1e-4, rtol=1e-4)


def test_spec_and_kv_pool_shape(model):
    spec = model.spec
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert (spec.hidden_size, spec.vocab_size, spec.rope_theta) == (576, 49152, 100000.0)
    assert spec.eos_token_ids == [2]
    kv_cache = model.allocate_kv_cache(4, BLOCK_SIZE)
    assert kv_cache.shape == (30, 2, 4, 3, BLOCK_SIZE, 64) and kv_cache.is_contiguous()
    assert model.kv_cache_bytes_per_block(BLOCK_SIZE, torch.float32) == kv_cache[:, :, 0].numel() * 4
    assert model.kv_cache_bytes_per_block(BLOCK_SIZE, torch.bfloat16) == kv_cache[:, :, 0].numel() * 2


def test_load_model_missing_path_raises():
    with pytest.raises(FileNotFoundError):
        load_model("/nonexistent/model.gguf", torch.float32, "cpu")
