"""Real prompt text for load tests: Arena-Hard questions and MT-Bench two-turn conversations.

Traces give lengths, not text (Azure and Mooncake publish no prompts), so the replayer builds each prompt from
real user text (Arena-Hard, cycled) cut to about the trace's input length in tokens of the served tokenizer.
The copies under ``loadtest/data`` (see its ``LICENSE-NOTE.md``) are used, so nothing here needs ``../shared``.

Token counts: :class:`PromptBuilder` tokenizes the corpus once with the served model's tokenizer and decodes
slices of it, so a prompt of ``n`` tokens re-encodes to about ``n`` tokens (BPE round trips shift a boundary token
now and then). Without ``transformers`` (or with ``tokenizer=None``) it falls back to words, at
:data:`FALLBACK_TOKENS_PER_WORD` tokens per word.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
ARENA_HARD_FILE = DATA_DIR / "arena_hard_prompts.jsonl"
MT_BENCH_FILE = DATA_DIR / "mt_bench_questions.jsonl"
# Tokens per whitespace word of the Arena-Hard copy under SmolLM2's tokenizer (measured once: 1.77 on this corpus,
# which mixes prose and code).
FALLBACK_TOKENS_PER_WORD = 1.77
# Tokens of the SmolLM2 chat template around one user message (system prompt + role markers), measured once;
# used only without a tokenizer.
FALLBACK_TEMPLATE_TOKENS = 30


@cache
def arena_hard_prompts() -> tuple[str, ...]:
    """Return the Arena-Hard prompt texts of ``loadtest/data`` (125 real user questions)."""
    with open(ARENA_HARD_FILE) as file:
        return tuple(json.loads(line)["prompt"] for line in file if line.strip())


@cache
def mt_bench_conversations() -> tuple[tuple[str, ...], ...]:
    """Return the MT-Bench questions of ``loadtest/data`` as tuples of user turns (80 two-turn conversations)."""
    with open(MT_BENCH_FILE) as file:
        return tuple(tuple(json.loads(line)["turns"]) for line in file if line.strip())


def load_tokenizer(model_path: str | None = None) -> Any | None:
    """Return the served model's ``transformers`` tokenizer, or None when it cannot be loaded.

    Args:
        model_path: a GGUF file or HF folder; None = :func:`shared.config.default_model_path`.
    """
    try:
        from shared.model_files import load_tokenizer as load_model_tokenizer

        if model_path is None:
            from shared.config import default_model_path

            model_path = default_model_path()
        return load_model_tokenizer(str(model_path))
    except Exception:  # noqa: BLE001 — any failure means "count words instead"
        return None


class PromptBuilder:
    """Build chat prompts of a given length in tokens from real text.

    Args:
        tokenizer: the served model's ``transformers`` tokenizer, or None to count words.
        texts: the corpus (default: Arena-Hard prompts), joined with blank lines and cycled.

    A prompt of ``input_tokens`` is a request tag (so two requests never share a cached prefix by accident)
    followed by corpus text starting at a per-request offset. With ``hash_ids`` (Mooncake), the text is the
    concatenation of one fixed block per hash id, so requests that share hash ids share a prefix as in the trace.
    The chat template's own tokens are subtracted, so the gateway's ``prompt_tokens`` come out near the target.
    """

    def __init__(self, tokenizer: Any | None = None, texts: tuple[str, ...] | None = None) -> None:
        corpus = "\n\n".join(texts if texts is not None else arena_hard_prompts())
        self.tokenizer = tokenizer
        if tokenizer is not None:
            self._ids: list[int] = tokenizer.encode(corpus, add_special_tokens=False)
            self.template_tokens = self._measure_template_tokens(tokenizer)
        else:
            self._words = corpus.split()
            self.template_tokens = FALLBACK_TEMPLATE_TOKENS

    @staticmethod
    def _measure_template_tokens(tokenizer: Any) -> int:
        try:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=True,
                                                add_generation_prompt=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return len(ids)
        except Exception:  # noqa: BLE001 — a tokenizer without a chat template
            return 0

    @property
    def corpus_tokens(self) -> int:
        """Length of the corpus in tokens (estimated without a tokenizer)."""
        if self.tokenizer is not None:
            return len(self._ids)
        return int(len(self._words) * FALLBACK_TOKENS_PER_WORD)

    def _slice_text(self, start: int, num_tokens: int) -> str:
        """Return corpus text of about ``num_tokens`` tokens from token (or word) offset ``start``, cycling."""
        if num_tokens <= 0:
            return ""
        if self.tokenizer is not None:
            n = len(self._ids)
            ids = [self._ids[(start + k) % n] for k in range(num_tokens)]
            return self.tokenizer.decode(ids)
        num_words = max(1, round(num_tokens / FALLBACK_TOKENS_PER_WORD))
        n = len(self._words)
        return " ".join(self._words[(start + k) % n] for k in range(num_words))

    def user_text(self, input_tokens: int, request_index: int, hash_ids: tuple[int, ...] | None = None,
                  block_tokens: int = 512) -> str:
        """Return the user message for a request whose whole prompt should be about ``input_tokens`` tokens.

        Args:
            input_tokens: target prompt length including the chat template, tokens.
            request_index: distinct per request; picks the tag and the corpus offset.
            hash_ids: Mooncake prefix block ids, or None.
            block_tokens: tokens per hash id block (Mooncake: 512).
        """
        budget = max(1, input_tokens - self.template_tokens)
        if hash_ids:
            parts = [self._slice_text((h * 7919) % max(1, self.corpus_tokens), block_tokens) for h in hash_ids]
            text = "".join(parts)
            if self.tokenizer is not None:
                ids = self.tokenizer.encode(text, add_special_tokens=False)[:budget]
                return self.tokenizer.decode(ids)
            return " ".join(text.split()[: max(1, round(budget / FALLBACK_TOKENS_PER_WORD))])
        tag = f"[{request_index}] "
        tag_tokens = 4
        start = (request_index * 7919) % max(1, self.corpus_tokens)
        return tag + self._slice_text(start, max(1, budget - tag_tokens))
