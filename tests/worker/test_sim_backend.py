"""The simulator's tokenizer facts: read from the real tokenizer once, then from a small cache file."""

from __future__ import annotations

import json

from shared.config import Config, resolve_model_path
from worker.backends import sim


def test_tokenizer_facts_are_the_real_tokenizers_and_cached(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = resolve_model_path(Config().model)
    vocab_size, special_ids, eos_ids = sim.tokenizer_facts(path)
    tokenizer = tokenizer.hf  # the gateway's (transformers) tokenizer of the same default model, loaded once
    assert vocab_size == len(tokenizer)
    assert special_ids == sorted(set(tokenizer.all_special_ids))
    assert eos_ids == [tokenizer.eos_token_id]
    [cache_file] = (tmp_path / "sluice" / "sim").glob("*.json")
    assert json.loads(cache_file.read_text())["vocab_size"] == vocab_size

    # the second call reads the file: prove it by editing the file and seeing the edit come back
    facts = json.loads(cache_file.read_text())
    cache_file.write_text(json.dumps({**facts, "eos_ids": [12345]}))
    assert sim.tokenizer_facts(path) == (vocab_size, special_ids, [12345])
    # a corrupt cache is ignored and rewritten from the tokenizer
    cache_file.write_text("{not json")
    assert sim.tokenizer_facts(path) == (vocab_size, special_ids, eos_ids)
    assert json.loads(cache_file.read_text())["eos_ids"] == eos_ids
