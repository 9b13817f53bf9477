"""Synthetic models (``model.synthetic``): real shapes, random weights, the real runner; the word-per-id tokenizer."""

from __future__ import annotations

import pytest
import torch

from shared.config import ConfigError, load_config
from shared.model_files import synthetic_tokenizer
from shared.synthetic_models import LLAMA3_VOCAB_SIZE, num_parameters, synthetic_shape
from worker.batch import ForwardBatch
from worker.synthetic import build_synthetic_model, synthetic_spec


def test_the_8b_and_1b_shapes_are_llama_3s():
    spec = synthetic_spec("llama-3-8b")
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 32, 8, 128)
    assert (spec.hidden_size, spec.intermediate_size, spec.vocab_size) == (4096, 14336, LLAMA3_VOCAB_SIZE)
    assert 8.0e9 < num_parameters("llama-3-8b") < 8.1e9  # Llama-3.1-8B: 8.03 B
    small = synthetic_spec("llama-3-1b")
    assert (small.num_layers, small.num_heads, small.num_kv_heads, small.head_dim) == (16, 32, 8, 64)
    assert 1.2e9 < num_parameters("llama-3-1b") < 1.3e9  # Llama-3.2-1B: 1.24 B
    with pytest.raises(ValueError, match="valid: llama-3-8b"):
        synthetic_shape("llama-9")


def _step(model, kv_cache, chunks, computed, tables, block_size=16) -> torch.Tensor:
    batch = ForwardBatch.build(chunks, computed, tables, block_size)
    return model.forward(batch, kv_cache)


def test_a_tiny_synthetic_model_runs_prefill_and_decode_on_the_cpu_reproducibly():
    spec = synthetic_spec("llama-3-tiny", max_position_embeddings=512)
    outputs = []
    for _ in range(2):
        model = build_synthetic_model(spec, "float32", "cpu", attention_backend="torch", seed=3)
        kv_cache = model.allocate_kv_cache(8, 16)
        prompt = [1, 17, 90211, 128000, 5]
        logits = _step(model, kv_cache, [prompt], [0], [[2]])
        token = int(logits.argmax())
        logits = _step(model, kv_cache, [[token]], [len(prompt)], [[2]])
        outputs.append((token, logits))
    assert outputs[0][1].shape == (1, LLAMA3_VOCAB_SIZE)
    assert torch.isfinite(outputs[0][1]).all()
    assert outputs[0][0] == outputs[1][0] and torch.equal(outputs[0][1], outputs[1][1])


def test_int8_and_int4_synthetic_models_run_on_the_cpu():
    spec = synthetic_spec("llama-3-tiny", max_position_embeddings=512)
    for mode in ("int8", "int4"):
        model = build_synthetic_model(spec, mode, "cpu", attention_backend="torch")
        assert model.layers[0].qkv.kind == mode
        logits = _step(model, model.allocate_kv_cache(4, 16), [[3, 4, 5]], [0], [[1]])
        assert torch.isfinite(logits).all()


def test_config_takes_the_synthetic_names_and_names_the_key_of_a_wrong_one(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[model]\nsynthetic = "llama-3-8b"\n')
    assert load_config(str(path)).model.synthetic == "llama-3-8b"
    path.write_text('[model]\nsynthetic = "llama-3-70b"\n')
    with pytest.raises(ConfigError, match="synthetic"):
        load_config(str(path))


def test_the_synthetic_tokenizer_round_trips_token_ids_as_words():
    tokenizer = synthetic_tokenizer(1000, [999])
    assert tokenizer.decode([5, 17, 999]) == "<5> <17> <999>"
    assert tokenizer("<5> <17>", add_special_tokens=False)["input_ids"] == [5, 17]
    assert tokenizer.eos_token_id == 999
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "<3> <4>"}], tokenize=False)
    assert tokenizer(rendered, add_special_tokens=False)["input_ids"] == [3, 4]
