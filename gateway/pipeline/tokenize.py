"""Tokenization with the served model's tokenizer and chat template, off the event loop.

The tokenizer comes from the same path as the model: a GGUF file (``AutoTokenizer.from_pretrained(dir,
gguf_file=name)``) or a Hugging Face folder. The chat template is rendered to text and the text encoded with the
Rust ``tokenizers.Tokenizer`` (``add_special_tokens=False``, as ``apply_chat_template(tokenize=True)`` does);
encoding and decoding with it are thread-safe, unlike the Python wrapper's padding/truncation state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import re
from typing import Any

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


class Tokenizer:
    """The served model's tokenizer with async, thread-pooled encoding.

    Args:
        hf_tokenizer: a ``transformers`` tokenizer with a ``backend_tokenizer`` (fast tokenizer).
        num_threads: size of the encoding thread pool.
        generation_eos_ids: extra EOS ids from the model's generation config.

    Attributes:
        eos_token_ids: token ids that end an answer (tokenizer EOS + generation config EOS), sent to workers.
        vocab_size: number of token ids (valid ids are ``0 .. vocab_size - 1``).
    """

    def __init__(self, hf_tokenizer: Any, num_threads: int = 2, generation_eos_ids: list[int] | None = None) -> None:
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer
        eos = [] if hf_tokenizer.eos_token_id is None else [hf_tokenizer.eos_token_id]
        self.eos_token_ids = sorted(set(eos) | set(generation_eos_ids or []))
        self.vocab_size = len(hf_tokenizer)
        self._special_ids = frozenset(hf_tokenizer.all_special_ids)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, num_threads),
                                                               thread_name_prefix="tokenizer")

    @classmethod
    def from_model_path(cls, model_path: str, num_threads: int = 2) -> "Tokenizer":
        """Load the tokenizer that belongs to the model at ``model_path`` (GGUF file or folder)."""
        return cls(load_hf_tokenizer(model_path), num_threads, _generation_eos_ids(model_path))

    def close(self) -> None:
        """Stop the thread pool (pending encodes are cancelled)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ sync (run in the pool)

    def encode_chat_sync(self, messages: list[dict[str, str]]) -> list[int]:
        """Render the chat template with the generation prompt and encode it.

        Raises:
            SluiceError: the template refused the conversation (e.g. a role order it does not allow).
        """
        import jinja2

        try:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateError as exc:
            raise SluiceError(ErrorCode.INVALID_VALUE, f"the chat template rejected the messages: {exc}",
                              param="messages") from None
        return self.encode_text_sync(text)

    def encode_text_sync(self, text: str) -> list[int]:
        """Encode plain text without adding special tokens."""
        return self.backend.encode(text, add_special_tokens=False).ids

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

    def decode(self, token_ids: list[int]) -> str:
        """Decode token ids to text, skipping special tokens (EOS and chat markers)."""
        return self.backend.decode(token_ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ async

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Async :meth:`encode_chat_sync` in the tokenizer pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.encode_chat_sync, messages)

    async def encode_text(self, text: str) -> list[int]:
        """Async :meth:`encode_text_sync` in the tokenizer pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.encode_text_sync, text)
