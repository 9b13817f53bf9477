"""Incremental detokenization with the real SmolLM2 tokenizer (BC11, BC12)."""

from __future__ import annotations

import random

from gateway.pipeline.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer

MIXED_TEXT = "Repeat: 霓虹灯 🌶️ 🐱 👨‍👩‍👧 ďábelské Ελληνικά 日本語テキスト, done."


def _stream(tokenizer, token_ids: list[int], step: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(token_ids[i:i + step]) for i in range(0, len(token_ids), step)]
    pieces.append(detok.flush())
    return pieces


def test_bc11_multibyte_characters_split_across_tokens_never_emit_replacement(tokenizer):
    token_ids = tokenizer.encode_text_sync(MIXED_TEXT)
    # the premise of BC11: 霓 alone spans several byte-level tokens, each invalid UTF-8 on its own
    ni_ids = tokenizer.encode_text_sync("霓")
    assert len(ni_ids) > 1 and REPLACEMENT_CHAR in tokenizer.decode(ni_ids[:1])
    pieces = _stream(tokenizer, token_ids)
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)
    assert "".join(pieces) == MIXED_TEXT


def test_bc11_streamed_equals_whole_decode_for_any_chunking(tokenizer):
    token_ids = tokenizer.encode_text_sync(MIXED_TEXT * 3)
    for step in (1, 2, 3, 7):
        assert "".join(_stream(tokenizer, token_ids, step)) == tokenizer.decode(token_ids)


def test_bc11_character_cut_short_by_the_end_is_dropped_not_replaced(tokenizer):
    ni_ids = tokenizer.encode_text_sync("ok 霓")
    truncated = ni_ids[:-1]  # max_tokens ended the answer before the character's last byte
    detok = IncrementalDetokenizer(tokenizer)
    held = detok.push(truncated)
    assert held + detok.flush() == "ok "


def test_bc12_invalid_bytes_at_end_are_flushed_as_replacement_not_crash(tokenizer):
    lead_byte = tokenizer.encode_text_sync("霓")[0]  # a UTF-8 lead byte ...
    space = tokenizer.encode_text_sync(" ")  # ... followed by ASCII: invalid, not incomplete
    token_ids = tokenizer.encode_text_sync("ok") + [lead_byte] + space + [lead_byte, lead_byte]
    detok = IncrementalDetokenizer(tokenizer)
    text = detok.push(token_ids) + detok.flush()
    assert text.startswith("ok\ufffd ") and text.endswith(REPLACEMENT_CHAR)


def test_bc12_random_token_soup_never_crashes_and_matches_decode(tokenizer):
    rng = random.Random(0)
    # byte-fallback tokens (ids 0..255 region holds single bytes for a byte-level BPE) mixed with words
    for _ in range(20):
        token_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        pieces = _stream(tokenizer, token_ids, rng.choice((1, 2, 5)))
        whole = tokenizer.decode(token_ids)
        # equal, except that a character cut short at the very end is dropped rather than replaced
        assert whole.startswith("".join(pieces)) and len(whole) - len("".join(pieces)) <= 1


def test_special_tokens_are_skipped(tokenizer):
    token_ids = tokenizer.encode_text_sync("Hello there") + tokenizer.eos_token_ids
    assert "".join(_stream(tokenizer, token_ids)) == "Hello there"


class _GenericDecoder:
    """The real tokenizer seen as a decoder that is not byte-level: the detokenizer's decode-and-diff path."""

    byte_level = False

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)

    def token_bytes(self, token_ids: list[int]) -> bytes:
        return self._tokenizer.token_bytes(token_ids)

    def byte_level_bytes(self, token_ids: list[int]) -> bytes:
        raise AssertionError("not a byte-level decoder")


def test_byte_level_bytes_decoded_as_utf8_equal_decode(tokenizer):
    assert tokenizer.byte_level
    rng = random.Random(1)
    special = list(tokenizer.eos_token_ids) + tokenizer.encode_text_sync("<|im_start|>user<|im_end|>")
    for _ in range(200):
        token_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 30))]
        token_ids.insert(rng.randrange(len(token_ids) + 1), rng.choice(special))
        assert tokenizer.byte_level_bytes(token_ids).decode("utf-8", "replace") == tokenizer.decode(token_ids)


def test_byte_level_bytes_of_an_id_past_the_vocabulary_is_empty(tokenizer):
    """A model whose embedding has padded rows can sample an id the tokenizer lacks: it spells nothing (as
    ``decode`` skips it) and the tokens around it keep their bytes."""
    hello = tokenizer.encode_text_sync("Hello")
    past = tokenizer.vocab_size + 7
    assert tokenizer.byte_level_bytes([*hello, past, *hello]) == b"HelloHello"


def test_decode_and_diff_path_streams_the_same_text(tokenizer):
    token_ids = tokenizer.encode_text_sync(MIXED_TEXT * 2) + tokenizer.eos_token_ids
    for step in (1, 2, 5):
        generic = _stream(_GenericDecoder(tokenizer), token_ids, step)
        assert all(REPLACEMENT_CHAR not in piece for piece in generic)
        assert "".join(generic) == "".join(_stream(tokenizer, token_ids, step)) == MIXED_TEXT * 2
    truncated = tokenizer.encode_text_sync("ok 霓")[:-1]
    for decoder in (_GenericDecoder(tokenizer), tokenizer):
        assert "".join(_stream(decoder, truncated)) == "ok "


# "Hello world " then a token of the bytes F0 9F (the first half of an emoji): the prompt ends inside a character
PROMPT_ENDING_MID_CHARACTER = [19556, 905, 216, 10813]


def test_generation_completes_the_character_its_prompt_ends_inside(tokenizer):
    prompt = PROMPT_ENDING_MID_CHARACTER
    assert tokenizer.byte_level_bytes(prompt) == b"Hello world \xf0\x9f"  # the premise
    generated = tokenizer.encode_text_sync("Hello world 🌟 shines")[3:]  # the bytes 8C, 9F, then " shines"
    assert tokenizer.decode(prompt + generated) == "Hello world 🌟 shines"
    for decoder in (tokenizer, _GenericDecoder(tokenizer)):
        for step in (1, 2):
            detok = IncrementalDetokenizer(decoder, prompt)
            pieces = [detok.push(generated[i:i + step]) for i in range(0, len(generated), step)] + [detok.flush()]
            assert "".join(pieces) == "🌟 shines", (decoder, step, pieces)
            assert all(REPLACEMENT_CHAR not in piece for piece in pieces)


def test_prompt_that_ends_inside_a_token_of_text_and_half_a_character(tokenizer):
    prompt = tokenizer.encode_text_sync("Hello world 🌟")[:3]  # the last token is " " + F0 9F
    assert tokenizer.byte_level_bytes(prompt[-1:]) == b" \xf0\x9f"
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.push(tokenizer.encode_text_sync("Hello world 🌟!")[3:]) + detok.flush() == "🌟!"


def test_prompt_text_never_reappears_and_invalid_prompt_bytes_stay_behind(tokenizer):
    for decoder in (tokenizer, _GenericDecoder(tokenizer)):
        whole = IncrementalDetokenizer(decoder, tokenizer.encode_text_sync("Say ok 霓"))
        assert whole.push(tokenizer.encode_text_sync(" ok")) + whole.flush() == " ok"
        lead_byte = tokenizer.encode_text_sync("霓")[0]
        broken = IncrementalDetokenizer(decoder, tokenizer.encode_text_sync("Say ok") + [lead_byte] +
                                        tokenizer.encode_text_sync(" x"))
        assert broken.push(tokenizer.encode_text_sync(" ok")) + broken.flush() == " ok"
        # the generation does not complete the prompt's character: its bytes are invalid, one U+FFFD
        cut = IncrementalDetokenizer(decoder, PROMPT_ENDING_MID_CHARACTER)
        assert cut.push(tokenizer.encode_text_sync(" ok")) + cut.flush() == REPLACEMENT_CHAR + " ok"
