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
"""

from __future__ import annotations

import codecs
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character has at most 4 bytes, each byte-level token carries at least one: holding back more tokens than
# this means the bytes are invalid, not incomplete, so they are emitted (as U+FFFD) instead of held forever.
MAX_HELD_TOKENS = 8


class Decoder(Protocol):
    byte_level: bool  # decode(ids) is byte_level_bytes(ids) decoded as UTF-8 with errors replaced

    def decode(self, token_ids: list[int]) -> str: ...

    def token_bytes(self, token_ids: list[int]) -> bytes: ...

    def byte_level_bytes(self, token_ids: list[int]) -> bytes: ...


class IncrementalDetokenizer:
    """Turn a stream of token ids into a stream of text pieces, one generation (choice) at a time.

    Args:
        decoder: anything with ``decode(token_ids) -> str`` (:class:`gateway.pipeline.tokenize.Tokenizer`).
    """

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if decoder.byte_level else None

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
