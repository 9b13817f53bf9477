"""The tokenizer's caches: the segment cut gives the ids of encoding the whole text, and repeated conversations
come from the conversation cache."""

from __future__ import annotations

import asyncio

import pytest

from gateway.pipeline.tokenize import PromptTooLong, TokenIdsCache, Tokenizer

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly and precisely."}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}],
    [SYSTEM, {"role": "user", "content": "  leading and trailing spaces  \n\n"}],
    [SYSTEM, {"role": "user", "content": "héllo wörld — 日本語 🙂🙂 \t tabs"},
     {"role": "assistant", "content": "Bonjour 👋"}, {"role": "user", "content": "again\r\n"}],
    [{"role": "user", "content": "a literal <|im_end|> and <|im_start|>assistant inside the text"}],
    [{"role": "user", "content": "<|im_start|><|im_end|><|endoftext|>"}],
    [{"role": "user", "content": "x" * 3000 + " y"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_segment_encoding_equals_whole_text_encoding(tokenizer: Tokenizer, messages):
    text = tokenizer.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = tokenizer.backend.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode_text_sync(text) == expected
    assert tokenizer.encode_segments_sync(text) == expected
    assert tokenizer.encode_segments_sync(text) == expected  # the second time from the segment cache
    assert tokenizer.encode_chat_sync(messages) == expected


def test_the_segment_cache_holds_a_repeated_system_prompt(tokenizer: Tokenizer):
    tokenizer.encode_chat_sync([SYSTEM, {"role": "user", "content": "first question"}])
    system_segment = "system\n" + SYSTEM["content"]
    assert tokenizer.segment_cache.get(system_segment) == tuple(tokenizer.encode_text_sync(system_segment))


def test_a_repeated_conversation_comes_from_the_conversation_cache(tokenizer: Tokenizer):
    messages = [SYSTEM, {"role": "user", "content": "a question asked twice"}]

    async def twice() -> tuple[list[int], list[int]]:
        first = await tokenizer.encode_chat(messages)
        first.append(-1)  # the caller owns its list
        return first, await tokenizer.encode_chat([dict(m) for m in messages])

    first, second = asyncio.run(twice())
    assert first[:-1] == second == tokenizer.encode_chat_sync(messages)
    assert tokenizer.conversation_cache.get(tuple(tuple(m.items()) for m in messages)) == tuple(second)


def test_token_ids_cache_evicts_the_least_recently_used_beyond_its_bound():
    cache = TokenIdsCache(max_token_ids=5)
    cache.put("a", (1, 2))
    cache.put("b", (3, 4))
    assert cache.get("a") == (1, 2)  # "b" is now the least recently used
    cache.put("c", (5, 6))
    assert cache.get("b") is None and cache.get("a") == (1, 2) and cache.get("c") == (5, 6)
    assert cache.num_token_ids == 4
    cache.put("long", tuple(range(6)))  # longer than the bound: not cached
    assert cache.get("long") is None and len(cache) == 2


PROSE = "The river bends past the mill and the baker waves to the miller's children. "


def test_max_token_bytes_bounds_the_bytes_every_token_stands_for(tokenizer: Tokenizer):
    assert tokenizer.max_token_bytes == 81  # SmolLM2's longest token: a newline and 80 spaces
    longest = max(range(tokenizer.vocab_size), key=lambda i: len(tokenizer.byte_level_bytes([i])))
    assert len(tokenizer.byte_level_bytes([longest])) == tokenizer.max_token_bytes


def test_a_dense_prompt_past_the_bound_stops_after_encoding_a_probe_of_it(tokenizer: Tokenizer):
    text = PROSE * 2000  # 154 KB, 30,000 tokens
    num_tokens = len(tokenizer.encode_text_sync(text))
    with pytest.raises(PromptTooLong) as raised:
        tokenizer.encode_prompt_sync(text, max_tokens=2047)
    # a true lower bound, counted on the probe alone: far fewer tokens than the whole text has
    assert 2047 < raised.value.num_tokens_at_least < num_tokens // 4
    with pytest.raises(PromptTooLong):
        tokenizer.encode_chat_sync([{"role": "user", "content": text}], max_tokens=2047)


def test_the_probe_never_refuses_a_long_prompt_within_the_bound(tokenizer: Tokenizer):
    # long texts in few tokens (rules of '#' and of '-'): probed, then encoded whole
    for text in (("#" * 80) * 1000, ("-" * 64 + "\n") * 1000):
        ids = tokenizer.encode_text_sync(text)
        assert len(ids) <= 2047 and len(text) > 8 * 2047  # the premise: within the bound, and probed
        assert tokenizer.encode_prompt_sync(text, max_tokens=2047) == ids
        assert tokenizer.encode_prompt_sync(text, max_tokens=len(ids)) == ids
