"""Incremental detokenization that never emits a broken UTF-8 character.

The prefix/read-offset scheme of vLLM's ``detokenize_incrementally`` and TGI's ``decode_token``::

    token ids:  ... [prefix_offset ........ read_offset) [read_offset ...... end)
                    └ context, already emitted ┘          └ new, not yet emitted ┘

    new_text = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

Decoding with a few tokens of context keeps tokenizers that attach spaces or merge bytes across tokens exact. While
the decoded text ends with U+FFFD (an incomplete multi-byte character), the text up to the last whole character is
released and the tokens after it are held back. At the end of the generation whatever is still held back is flushed:
a character cut short by the end is dropped, genuinely invalid bytes become U+FFFD; never a crash.

A byte-level BPE tokenizer (``decoder.byte_level``) decodes a text as the UTF-8 decoding of its tokens' bytes, so
its stream needs no re-decoding: each token's bytes go through one incremental UTF-8 decoder (errors replaced),
which releases every whole character, holds the bytes of an incomplete one and turns invalid bytes into U+FFFD at
once — the same text as above, for one byte lookup per token instead of two decodes per step.

A generation continues its prompt, and a prompt may end inside a character (token ids ending in the first bytes of
an emoji, or a chat template cut mid-character): the detokenizer starts from the prompt's last tokens, so the
character that the first generated tokens complete is emitted whole, as the first text of the generation::

    prompt ids: ... "Hello world " [F0 9F]   generated: [8C 9F] "!"   →   text: "🌟!"

Only a valid but incomplete character at the prompt's end carries over; the prompt's complete text never reappears.
"""

from __future__ import annotations

import codecs
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character has at most 4 bytes, each byte-level token carries at least one: holding back more tokens than
# this means the bytes are invalid, not incomplete, so they are emitted (as U+FFFD) instead of held forever.
MAX_HELD_TOKENS = 8
# Prompt tokens the decode-and-diff path keeps as context before the generation (vLLM keeps 5).
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    byte_level: bool  # decode(ids) is byte_level_bytes(ids) decoded as UTF-8 with errors replaced

    def decode(self, token_ids: list[int]) -> str: ...

    def token_bytes(self, token_ids: list[int]) -> bytes: ...

    def byte_level_bytes(self, token_ids: list[int]) -> bytes: ...


class IncrementalDetokenizer:
    """Turn a stream of token ids into a stream of text pieces, one generation (choice) at a time.

    Args:
        decoder: anything with ``decode(token_ids) -> str`` (:class:`gateway.pipeline.tokenize.Tokenizer`).
        prompt_token_ids: the prompt the generation continues; its last tokens are the starting context (see the
            module docstring), and a character left incomplete at its end is completed by the first tokens pushed.
    """

    def __init__(self, decoder: Decoder, prompt_token_ids: list[int] | None = None) -> None:
        self._decoder = decoder
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if decoder.byte_level else None
        if prompt_token_ids:
            self._start_from_prompt(prompt_token_ids[-MAX_HELD_TOKENS:])

    def _start_from_prompt(self, tail_ids: list[int]) -> None:
        """Take ``tail_ids`` (the prompt's last tokens) as already read, except the tokens of an incomplete
        character at their end, which stay unread so that the generation's first text completes it."""
        if self._utf8 is not None:
            self._utf8.decode(self._decoder.byte_level_bytes(tail_ids))  # keeps only an incomplete last character
            return
        num_incomplete = _num_incomplete_tail_tokens(self._decoder, tail_ids)
        self.token_ids = list(tail_ids)
        self._read_offset = len(tail_ids) - num_incomplete
        self._prefix_offset = max(0, self._read_offset - PROMPT_CONTEXT_TOKENS)

    def push(self, token_ids: list[int]) -> str:
        """Add new token ids and return the text that became final ("" while a character is incomplete)."""
        self.token_ids.extend(token_ids)
        if self._utf8 is not None:
            return self._utf8.decode(self._decoder.byte_level_bytes(token_ids))
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever is still held back; call once when the generation ends.

        A last character cut short by the end of the generation (a valid but incomplete UTF-8 prefix, e.g. when
        ``max_tokens`` ends the answer inside an emoji) is dropped; bytes that are invalid become U+FFFD.
        """
        if self._utf8 is not None:
            return ""  # the byte-level decoder holds only the bytes of an incomplete last character: dropped
        text = self._advance(final=False)
        if self._read_offset >= len(self.token_ids):
            return text
        tail_ids = self.token_ids[self._read_offset:]
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        try:
            tail_text = decoder.decode(self._decoder.token_bytes(tail_ids), final=False)
        except UnicodeDecodeError:
            return text + self._advance(final=True)
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return text + tail_text

    def _advance(self, final: bool) -> str:
        if self._read_offset >= len(self.token_ids):
            return ""
        prefix_text = self._decoder.decode(self.token_ids[self._prefix_offset:self._read_offset])
        end = len(self.token_ids)
        full_text = self._decoder.decode(self.token_ids[self._prefix_offset:end])
        if not final and full_text.endswith(REPLACEMENT_CHAR):
            clean = self._last_clean_end()
            if clean is None:
                return ""
            end, full_text = clean
        new_text = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = end
        return new_text

    def _last_clean_end(self) -> tuple[int, str] | None:
        """Find the longest prefix of the unread tokens whose text ends on a whole character.

        Returns (end token index, decoded text from ``prefix_offset`` to it); None to hold everything back (a
        character is still incomplete); or all tokens when more than :data:`MAX_HELD_TOKENS` trailing tokens
        stay invalid (the bytes are broken, not incomplete, so they are emitted as U+FFFD).
        """
        num_tokens = len(self.token_ids)
        lowest_end = max(self._read_offset + 1, num_tokens - MAX_HELD_TOKENS)
        for end in range(num_tokens - 1, lowest_end - 1, -1):
            text = self._decoder.decode(self.token_ids[self._prefix_offset:end])
            if not text.endswith(REPLACEMENT_CHAR):
                return end, text
        if num_tokens - self._read_offset <= MAX_HELD_TOKENS:
            return None
        return num_tokens, self._decoder.decode(self.token_ids[self._prefix_offset:])


def _incomplete_utf8_tail_len(data: bytes) -> int:
    """Return the number of bytes at the end of ``data`` that start a UTF-8 character without finishing it (0
    when ``data`` ends on a whole character or with invalid bytes)."""
    for num_bytes in range(1, min(len(data), 3) + 1):
        byte = data[-num_bytes]
        if byte & 0xC0 == 0x80:
            continue  # a continuation byte: the lead byte is further back
        expected = 2 if 0xC2 <= byte <= 0xDF else 3 if 0xE0 <= byte <= 0xEF else 4 if 0xF0 <= byte <= 0xF4 else 0
        if num_bytes >= expected:
            return 0
        try:
            codecs.getincrementaldecoder("utf-8")("strict").decode(data[-num_bytes:], final=False)
        except UnicodeDecodeError:
            return 0  # e.g. an overlong or surrogate prefix
        return num_bytes
    return 0


def _num_incomplete_tail_tokens(decoder: Decoder, token_ids: list[int]) -> int:
    """Return how many trailing tokens of ``token_ids`` spell exactly the bytes of an incomplete last UTF-8
    character (byte-fallback tokens ``<0xF0>``); 0 when the text ends on a whole character, with invalid bytes, or
    when the character starts inside a token that also spells text of the prompt."""
    num_bytes = _incomplete_utf8_tail_len(decoder.token_bytes(token_ids[-4:]))
    if num_bytes == 0:
        return 0
    for num_tokens in range(1, min(len(token_ids), num_bytes) + 1):
        tail_len = len(decoder.token_bytes(token_ids[-num_tokens:]))
        if tail_len >= num_bytes:
            return num_tokens if tail_len == num_bytes else 0
    return 0
