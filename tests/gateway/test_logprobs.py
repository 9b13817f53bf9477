"""Log-probabilities: the per-choice ledger on its own, then OpenAI's shapes through the real SDK against a real
``sluice serve`` (CPU worker, float32 weights), checked against transformers' own logits of the same GGUF."""

from __future__ import annotations

import math
from collections.abc import Iterator

import openai
import pytest
import torch

from gateway.pipeline.logprobs import LogprobFormatter, LogprobLedger, TokenLogprob
from tests.conftest import TEST_CONFIG, sluice_serve

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


def test_ledger_releases_a_token_with_the_text_it_starts_and_never_one_cut_away():
    ledger = LogprobLedger()
    ledger.add(1, -0.1, [], [], "")      # first bytes of a character: no text yet, starts at 0
    ledger.add(2, -0.2, [], [], "é")     # completes it
    ledger.add(3, -0.3, [], [], " ab")   # " a" emitted, "b" held back (a stop string may start there)
    ledger.add(4, -0.4, [], [], "cd")    # the stop string "bcd" matches: nothing more is emitted
    ledger.add(5, -0.5, [], [], "")      # EOS
    assert [e.token_id for e in ledger.emit("é")] == [1, 2]
    assert [e.token_id for e in ledger.emit(" a")] == [3]
    assert ledger.emit("") == []
    assert [(e.token_id, e.text_offset) for e in ledger.released] == [(1, 0), (2, 0), (3, 1)]


def test_formatter_names_tokens_in_openai_shapes():
    class Names:
        def token_text_and_bytes(self, token_id: int) -> tuple[str, bytes]:
            return {7: ("a", b"a"), 8: ("\\xf0\\x9f", b"\xf0\x9f")}[token_id]

    entries = [TokenLogprob(8, -1.5, [7, 8], [-0.5, -1.5], 0), TokenLogprob(7, -0.25, [], [], 1)]
    formatter = LogprobFormatter(Names())
    assert formatter.chat(entries) == {"refusal": None, "content": [
        {"token": "\\xf0\\x9f", "logprob": -1.5, "bytes": [240, 159], "top_logprobs": [
            {"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "\\xf0\\x9f", "logprob": -1.5,
                                                             "bytes": [240, 159]}]},
        {"token": "a", "logprob": -0.25, "bytes": [97], "top_logprobs": []}]}
    assert formatter.completion(entries, prompt_chars=10) == {
        "tokens": ["\\xf0\\x9f", "a"], "token_logprobs": [-1.5, -0.25],
        "top_logprobs": [{"a": -0.5, "\\xf0\\x9f": -1.5}, {"a": -0.25}], "text_offset": [10, 11]}


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    """The SDK against a server of its own holding float32 weights: the shared test server serves the default
    weights (int4 for the Q4_1 file), whose logits differ from transformers' fp32 ones by more than 2e-3."""
    config = TEST_CONFIG.replace("[model]\n", '[model]\nweights = "float32"\n', 1)
    assert 'weights = "float32"' in config
    with sluice_serve(tmp_path_factory.mktemp("logprobs_float32"), config) as server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="test", max_retries=0, timeout=600)


@pytest.mark.slow
def test_completions_logprobs_match_transformers_for_the_greedy_tokens(client, tokenizer):
    from shared.config import default_model_path
    from worker.model import load_hf_model

    prompt_ids = tokenizer.encode_text_sync(PROMPT)
    whole = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=4, temperature=0, logprobs=5)
    stream = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=4, temperature=0, logprobs=5,
                                       stream=True)
    streamed = [chunk.choices[0].logprobs for chunk in stream if chunk.choices and chunk.choices[0].logprobs]
    logprobs = whole.choices[0].logprobs
    assert "".join(logprobs.tokens) == whole.choices[0].text
    assert logprobs.text_offset[0] == len(PROMPT)
    assert [t for lp in streamed for t in lp.token_logprobs] == pytest.approx(logprobs.token_logprobs, abs=1e-5)
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    hf_model = load_hf_model(default_model_path(), torch.float32).eval()
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt_ids) - 1], dim=-1)
    top = expected.topk(5)
    greedy_id = int(top.indices[0])
    assert logprobs.token_logprobs[0] == pytest.approx(expected[greedy_id].item(), abs=2e-3)
    assert list(logprobs.top_logprobs[0].values()) == pytest.approx(top.values.tolist(), abs=2e-3)
    assert list(logprobs.top_logprobs[0]) == [tokenizer.token_text_and_bytes(int(t))[0] for t in top.indices]
    assert logprobs.tokens[0] == tokenizer.token_text_and_bytes(greedy_id)[0]


@pytest.mark.slow
def test_chat_logprobs_streamed_and_not_in_openai_shapes(client):
    messages = [{"role": "user", "content": "Name one fruit."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.7, seed=3,
                                           logprobs=True, top_logprobs=3)
    choice = whole.choices[0]
    content = choice.logprobs.content
    assert content and len(content) <= whole.usage.completion_tokens
    assert b"".join(bytes(item.bytes) for item in content).decode() == choice.message.content
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-6
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.7, seed=3,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [item for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert [(i.token, i.bytes) for i in streamed] == [(i.token, i.bytes) for i in content]
    assert [i.logprob for i in streamed] == pytest.approx([i.logprob for i in content], abs=1e-5)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert plain.choices[0].logprobs is None
    assert all(math.isfinite(i.logprob) for i in content)
