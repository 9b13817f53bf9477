"""Tokenization with the served model's tokenizer and chat template, off the event loop.

The tokenizer comes from the same path as the model: a GGUF file (``AutoTokenizer.from_pretrained(dir,
gguf_file=name)``) or a Hugging Face folder. The chat template is rendered to text and the text encoded with the
Rust ``tokenizers.Tokenizer`` (``add_special_tokens=False``, as ``apply_chat_template(tokenize=True)`` does);
encoding and decoding with it are thread-safe, unlike the Python wrapper's padding/truncation state.

Repeated input is tokenized once. Two LRU caches, each bounded by the number of token ids it holds:

- conversations: the messages (roles and contents) → prompt ids; a hit is answered on the event loop, with no
  template rendering, no encoding and no hop to the thread pool;
- segments: the rendered text is cut at every added token (``<|im_start|>``, ``<|im_end|>`` …) and each piece
  between two of them is encoded once, so a system prompt or an earlier turn that repeats inside a new
  conversation is not encoded again. The tokenizer itself splits the text at added tokens before normalizing,
  pre-tokenizing and running the model on each piece, so the ids are the same as encoding the whole text; the cut
  is used only when no added token strips neighbouring whitespace, matches single words or is normalized
  (otherwise the whole text is encoded).

A prompt far past the context costs little: given ``max_tokens``, a text longer than ``max_tokens`` ×
:data:`PROBE_CHARS_PER_TOKEN` characters is first probed — its leading part, cut at a space, is encoded alone —
and when that part already holds more than ``max_tokens`` tokens (less :data:`PROBE_MARGIN_TOKENS` for the cut) the
encode stops there with :class:`PromptTooLong`. Only a text sparse in tokens (long tokens: code indentation, rules
of dashes) is encoded whole, and the caller's byte bound (:attr:`Tokenizer.max_token_bytes`) caps its length.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import os
import re
import threading
from collections.abc import Hashable
from typing import Any

from shared.config import ModelConfig, resolve_model_path
from shared.errors import ErrorCode, SluiceError


def load_hf_tokenizer(model_path: str) -> Any:
    """Load the ``transformers`` tokenizer of a GGUF file (converted once, see :mod:`shared.model_files`) or a
    Hugging Face checkpoint folder."""
    from shared.model_files import load_tokenizer

    return load_tokenizer(model_path)


def _generation_eos_ids(model_path: str) -> list[int]:
    """Return the ``eos_token_id`` list of a folder's ``generation_config.json`` (empty for GGUF files)."""
    if not os.path.isdir(model_path) or not os.path.exists(os.path.join(model_path, "generation_config.json")):
        return []
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _byte_level_char_to_byte() -> dict[str, int]:
    """Invert GPT-2's ``bytes_to_unicode`` table (byte-level BPE spells every byte as one printable char)."""
    byte_values = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    char_codes = byte_values[:]
    extra = 0
    for byte in range(256):
        if byte not in byte_values:
            byte_values.append(byte)
            char_codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(byte_values, char_codes)}


# The probe of a long text: its leading max_tokens × PROBE_CHARS_PER_TOKEN characters (at least MIN_PROBE_CHARS),
# about twice the characters per token of English prose, so a dense text shows its excess within the probe.
PROBE_CHARS_PER_TOKEN = 8
MIN_PROBE_CHARS = 16384
# Tokens the probe may count beyond the whole text's tokens near its cut (a word or an added token cut in two).
PROBE_MARGIN_TOKENS = 32


class PromptTooLong(Exception):
    """The text has more than the allowed tokens, found by encoding part of it.

    Attributes:
        num_tokens_at_least: a lower bound of the whole text's tokens (more than the limit).
    """

    def __init__(self, num_tokens_at_least: int) -> None:
        super().__init__(f"at least {num_tokens_at_least} tokens")
        self.num_tokens_at_least = num_tokens_at_least


def _vocab_bytes(backend: Any, byte_level: bool, skipped_ids: frozenset[int]) -> tuple[list[bytes], int]:
    """Return, from one pass over ``backend``'s vocabulary and added tokens, each token id's bytes as a byte-level
    decoder produces them (:meth:`Tokenizer.byte_level_bytes`; ``skipped_ids`` give b"", ids the vocabulary skips
    too) and the most bytes of input text that one token stands for: a text of B bytes has at least B ÷ that many
    tokens. Byte-level BPE spells each byte as one char; other tokenizers are bounded by their pieces' UTF-8 length
    (``▁`` and ``<0xF0>`` stand for fewer bytes)."""
    vocab = backend.get_vocab(with_added_tokens=True)
    pieces = [b""] * (max(vocab.values(), default=-1) + 1)
    longest = 1
    for piece, token_id in vocab.items():
        raw = _piece_bytes(piece) if byte_level else piece.encode()
        longest = max(longest, len(raw))
        if token_id not in skipped_ids:
            pieces[token_id] = raw
    return pieces, longest


def _piece_bytes(piece: str) -> bytes:
    """Return the bytes of a byte-level BPE piece: each char mapped back to its byte, or, when one does not map (an
    added token's text), the piece's UTF-8 encoding, as ``tokenizers``' ``ByteLevel`` decoder does."""
    char_to_byte = _byte_level_char_to_byte()
    if all(ch in char_to_byte for ch in piece):
        return bytes(char_to_byte[ch] for ch in piece)
    return piece.encode()


# Bounds of the caches, in token ids held (about 40 bytes each with the key text): a few MB.
CONVERSATION_CACHE_TOKENS = 262144
SEGMENT_CACHE_TOKENS = 262144


class TokenIdsCache:
    """A least-recently-used map of hashable keys to token ids, bounded by the total number of ids it holds.

    Safe to share between the tokenizer threads and the event loop (one short lock per call).

    Args:
        max_token_ids: most token ids held over all entries; an entry longer than this is not cached.
    """

    def __init__(self, max_token_ids: int) -> None:
        self.max_token_ids = max_token_ids
        self.num_token_ids = 0
        self._entries: collections.OrderedDict[Hashable, tuple[int, ...]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> tuple[int, ...] | None:
        """Return the ids cached for ``key`` (marking them recently used), or None."""
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
            return ids

    def put(self, key: Hashable, ids: tuple[int, ...]) -> None:
        """Cache ``ids`` under ``key``, evicting the least recently used entries beyond ``max_token_ids``."""
        if len(ids) > self.max_token_ids:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_token_ids -= len(old)
            self._entries[key] = ids
            self.num_token_ids += len(ids)
            while self.num_token_ids > self.max_token_ids:
                _, evicted = self._entries.popitem(last=False)
                self.num_token_ids -= len(evicted)


def _added_token_splitter(backend: Any) -> re.Pattern[str] | None:
    """Return a pattern matching the backend's added tokens (longest first, as the tokenizer matches them), or
    None when cutting the text at them could change the ids (an added token that strips whitespace, matches single
    words only or is matched after normalization)."""
    added = backend.get_added_tokens_decoder().values()
    if not added:
        return None
    if any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added):
        return None
    contents = sorted({t.content for t in added}, key=len, reverse=True)
    return re.compile("|".join(re.escape(c) for c in contents))


def _conversation_key(messages: list[dict[str, str]]) -> tuple:
    return tuple(tuple(m.items()) for m in messages)


class Tokenizer:
    """The served model's tokenizer with async, thread-pooled encoding and caches of repeated input.

    Args:
        hf_tokenizer: a ``transformers`` tokenizer with a ``backend_tokenizer`` (fast tokenizer).
        num_threads: size of the encoding thread pool.
        generation_eos_ids: extra EOS ids from the model's generation config.
        conversation_cache_tokens: bound of the conversation cache in token ids (0 = off).
        segment_cache_tokens: bound of the segment cache in token ids (0 = off).

    Attributes:
        eos_token_ids: token ids that end an answer (tokenizer EOS + generation config EOS), sent to workers.
        vocab_size: number of token ids (valid ids are ``0 .. vocab_size - 1``).
        byte_level: whether the decoder is byte-level BPE (GPT-2, Llama 3, SmolLM): then :meth:`decode` is the
            UTF-8 decoding (errors replaced) of :meth:`byte_level_bytes`.
        max_token_bytes: the most bytes of input text one token stands for (81 for SmolLM2): a prompt of B bytes
            has at least B ÷ this many tokens, known before encoding it.
    """

    def __init__(self, hf_tokenizer: Any, num_threads: int = 2, generation_eos_ids: list[int] | None = None,
                 conversation_cache_tokens: int = CONVERSATION_CACHE_TOKENS,
                 segment_cache_tokens: int = SEGMENT_CACHE_TOKENS) -> None:
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer
        eos = [] if hf_tokenizer.eos_token_id is None else [hf_tokenizer.eos_token_id]
        self.eos_token_ids = sorted(set(eos) | set(generation_eos_ids or []))
        self.vocab_size = len(hf_tokenizer)
        self._special_ids = frozenset(hf_tokenizer.all_special_ids)
        self.conversation_cache = TokenIdsCache(conversation_cache_tokens)
        self.segment_cache = TokenIdsCache(segment_cache_tokens)
        added_tokens = self.backend.get_added_tokens_decoder()
        self._added_token_ids = {t.content: i for i, t in added_tokens.items()}
        # the ids decode() skips (skip_special_tokens): added tokens marked special
        self._decode_skipped_ids = frozenset(i for i, t in added_tokens.items() if t.special)
        self.byte_level = type(self.backend.decoder).__name__ == "ByteLevel"
        # token id → its bytes (byte_level_bytes), built with the vocabulary's longest piece in one pass
        self._piece_bytes, self.max_token_bytes = _vocab_bytes(self.backend, self.byte_level, self._decode_skipped_ids)
        self._splitter = _added_token_splitter(self.backend) if segment_cache_tokens > 0 else None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, num_threads),
                                                               thread_name_prefix="tokenizer")

    @classmethod
    def from_model_path(cls, model_path: str, num_threads: int = 2) -> "Tokenizer":
        """Load the tokenizer that belongs to the model at ``model_path`` (GGUF file or folder)."""
        return cls(load_hf_tokenizer(model_path), num_threads, _generation_eos_ids(model_path))

    @classmethod
    def for_model(cls, model: ModelConfig, num_threads: int = 2, model_path: str = "") -> "Tokenizer":
        """Load the tokenizer of the served model: the one at ``model_path`` when given (an upstream pool's,
        ``shared.config.tokenizer_model_path``), else ``model.path`` (or the default GGUF); for a synthetic model the
        word-per-id tokenizer of :func:`shared.model_files.synthetic_tokenizer`."""
        if model.synthetic:
            from shared.model_files import synthetic_tokenizer
            from shared.synthetic_models import synthetic_shape

            shape = synthetic_shape(model.synthetic)
            return cls(synthetic_tokenizer(shape["vocab_size"], shape["eos_token_ids"]), num_threads)
        return cls.from_model_path(model_path or resolve_model_path(model), num_threads)

    def close(self) -> None:
        """Stop the thread pool (pending encodes are cancelled)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ sync (run in the pool)

    def encode_chat_sync(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> list[int]:
        """Render the chat template with the generation prompt and encode it.

        Args:
            messages: the conversation.
            max_tokens: stop early (see the module docstring) when the prompt has more tokens; None = no bound.

        Raises:
            SluiceError: the template refused the conversation (e.g. a role order it does not allow).
            PromptTooLong: the prompt has more than ``max_tokens`` tokens.
        """
        import jinja2

        try:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateError as exc:
            raise SluiceError(ErrorCode.INVALID_VALUE, f"the chat template rejected the messages: {exc}",
                              param="messages") from None
        self._probe(text, max_tokens)
        return self.encode_segments_sync(text)

    def encode_prompt_sync(self, text: str, max_tokens: int | None = None) -> list[int]:
        """:meth:`encode_text_sync` of a prompt that may not pass ``max_tokens`` tokens.

        Raises:
            PromptTooLong: the prompt has more than ``max_tokens`` tokens (found without encoding all of it).
        """
        self._probe(text, max_tokens)
        return self.encode_text_sync(text)

    def _probe(self, text: str, max_tokens: int | None) -> None:
        """Raise :class:`PromptTooLong` when the leading part of a long ``text`` has more than ``max_tokens``
        tokens (the module docstring); return when ``text`` is short or the part has fewer."""
        if max_tokens is None:
            return
        probe_chars = max(MIN_PROBE_CHARS, max_tokens * PROBE_CHARS_PER_TOKEN)
        if len(text) <= probe_chars:
            return
        cut = text.rfind(" ", probe_chars // 2, probe_chars)
        probe = text[:cut if cut > 0 else probe_chars]
        num_tokens = len(self.backend.encode_batch_fast([probe], add_special_tokens=False)[0].ids)
        if num_tokens - PROBE_MARGIN_TOKENS > max_tokens:
            raise PromptTooLong(num_tokens - PROBE_MARGIN_TOKENS)

    def encode_segments_sync(self, text: str) -> list[int]:
        """Encode ``text`` without adding special tokens, piece by piece between added tokens, each piece through
        the segment cache (the same ids as :meth:`encode_text_sync`; see the module docstring). The pieces not
        cached are encoded together, in one call."""
        if self._splitter is None:
            return self.encode_text_sync(text)
        parts: list[str | int] = []  # text pieces and added-token ids, in order
        start = 0
        for match in self._splitter.finditer(text):
            if match.start() > start:
                parts.append(text[start:match.start()])
            parts.append(self._added_token_ids[match.group()])
            start = match.end()
        if start < len(text):
            parts.append(text[start:])
        cached = {part: self.segment_cache.get(part) for part in parts if isinstance(part, str)}
        missing = [part for part, ids in cached.items() if ids is None]
        if missing:
            for part, encoding in zip(missing, self.backend.encode_batch_fast(missing, add_special_tokens=False)):
                cached[part] = tuple(encoding.ids)
                self.segment_cache.put(part, cached[part])
        ids: list[int] = []
        for part in parts:
            if isinstance(part, str):
                ids.extend(cached[part])
            else:
                ids.append(part)
        return ids

    def encode_text_sync(self, text: str) -> list[int]:
        """Encode plain text without adding special tokens.

        ``encode_batch_fast`` lets go of the GIL while it encodes (``encode`` holds it: the event loop would stall
        for the whole encode) and computes no offsets.
        """
        return self.backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def token_bytes(self, token_ids: list[int]) -> bytes:
        """Return the raw bytes that ``token_ids`` spell (special tokens contribute nothing).

        Byte-level BPE (GPT-2, Llama 3, SmolLM) maps each char back to its byte; SentencePiece byte-fallback tokens
        ``<0xHH>`` are one byte; other pieces are their UTF-8 text with ``▁`` as a space.
        """
        byte_level = type(self.backend.decoder).__name__ == "ByteLevel"
        table = _byte_level_char_to_byte()
        out = bytearray()
        for token_id in token_ids:
            if token_id in self._special_ids:
                continue
            piece = self.backend.id_to_token(token_id) or ""
            if byte_level:
                for ch in piece:
                    if ch in table:
                        out.append(table[ch])
                    else:
                        out.extend(ch.encode())
                continue
            match = _BYTE_FALLBACK_RE.match(piece)
            out.extend(bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode())
        return bytes(out)

    def byte_level_bytes(self, token_ids: list[int]) -> bytes:
        """Return the bytes a byte-level decoder turns ``token_ids`` into before it decodes them as UTF-8 (special
        tokens skipped, as :meth:`decode` does), from the table of every token's bytes built at start.

        As ``tokenizers``' ``ByteLevel`` decoder: every char of the piece maps back to its byte, or, when one does
        not, the piece is taken as UTF-8 text whole. Only meaningful when :attr:`byte_level` is true.
        """
        table = self._piece_bytes
        try:
            return b"".join([table[token_id] for token_id in token_ids])
        except IndexError:  # an id past the vocabulary (a model's padded embedding rows): its piece, if any
            return b"".join(table[i] if 0 <= i < len(table) else self._byte_level_piece(i) for i in token_ids)

    def _byte_level_piece(self, token_id: int) -> bytes:
        if token_id in self._decode_skipped_ids:
            return b""
        return _piece_bytes(self.backend.id_to_token(token_id) or "")

    def token_text_and_bytes(self, token_id: int) -> tuple[str, bytes]:
        """Return one token as logprobs show it: its text and its bytes.

        An ordinary token is its raw bytes (:meth:`token_bytes`) and their UTF-8 decoding with the bytes of an
        incomplete character written as ``\\xHH`` escapes (as OpenAI shows byte tokens); a special token (EOS, chat
        markers) is its literal text, e.g. ``<|im_end|>``, and that text's UTF-8 bytes.
        """
        if token_id in self._special_ids or token_id in self._decode_skipped_ids:
            text = self.backend.id_to_token(token_id) or ""
            return text, text.encode()
        raw = self.token_bytes([token_id])
        return raw.decode("utf-8", errors="backslashreplace"), raw

    def decode(self, token_ids: list[int]) -> str:
        """Decode token ids to text, skipping special tokens (EOS and chat markers)."""
        return self.backend.decode(token_ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ async

    async def encode_chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> list[int]:
        """Async :meth:`encode_chat_sync` in the tokenizer pool; a conversation seen before is answered from the
        conversation cache without leaving the event loop.

        Returns:
            The prompt ids: a new list the caller may keep or change.

        Raises:
            SluiceError, PromptTooLong: as :meth:`encode_chat_sync`.
        """
        key = _conversation_key(messages)
        ids = self.conversation_cache.get(key)
        if ids is None:
            loop = asyncio.get_running_loop()
            ids = tuple(await loop.run_in_executor(self._executor, self.encode_chat_sync, messages, max_tokens))
            self.conversation_cache.put(key, ids)
        return list(ids)

    async def encode_text(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Async :meth:`encode_prompt_sync` in the tokenizer pool.

        Raises:
            PromptTooLong: the prompt has more than ``max_tokens`` tokens.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.encode_prompt_sync, text, max_tokens)
