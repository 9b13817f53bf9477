"""Log-probabilities of generated tokens in OpenAI's shapes (chat ``logprobs.content``, completions ``logprobs``).

The numbers come from the worker (``TokenDelta.logprobs``): the natural log of each sampled token's probability
under the model's raw distribution, before temperature, top-k and top-p (vLLM's default ``raw_logprobs``), and the
most likely alternatives at each position. The gateway only names the tokens::

    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
                  "refusal": null}
    completions: {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{token: logprob}] | null,
                  "text_offset": [int]}

One entry per token whose text starts inside the answer's text: tokens whose text a stop string cut away, and EOS
(which has no text), have none. ``text_offset`` counts characters from the beginning of the prompt's text, as the
OpenAI reference defines it; a completions ``top_logprobs`` map always holds the sampled token too (so up to
``logprobs + 1`` keys), as OpenAI's does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token and its log-probabilities.

    Attributes:
        token_id: the sampled token.
        logprob: its natural-log probability, ``<= 0``.
        top_token_ids: the most likely tokens at its position, most likely first.
        top_logprobs: their log-probabilities, same order.
        text_offset: characters of the answer's text before this token's text starts.
    """

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    text_offset: int


class TokenNamer(Protocol):
    def token_text_and_bytes(self, token_id: int) -> tuple[str, bytes]: ...


class LogprobFormatter:
    """Turn :class:`TokenLogprob` entries into OpenAI's logprobs objects, naming each token once.

    Args:
        namer: the served model's tokenizer (:meth:`gateway.pipeline.tokenize.Tokenizer.token_text_and_bytes`).
    """

    def __init__(self, namer: TokenNamer) -> None:
        self._namer = namer
        self._names: dict[int, tuple[str, list[int]]] = {}

    def _name(self, token_id: int) -> tuple[str, list[int]]:
        name = self._names.get(token_id)
        if name is None:
            text, raw = self._namer.token_text_and_bytes(token_id)
            name = self._names[token_id] = (text, list(raw))
        return name

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        text, raw = self._name(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    def chat(self, entries: list[TokenLogprob]) -> dict:
        """Return a chat choice's ``logprobs`` object for ``entries`` (a whole answer or one chunk's tokens)."""
        content = []
        for entry in entries:
            item = self._chat_token(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._chat_token(t, lp) for t, lp in zip(entry.top_token_ids, entry.top_logprobs)]
            content.append(item)
        return {"content": content, "refusal": None}

    def completion(self, entries: list[TokenLogprob], prompt_chars: int) -> dict:
        """Return a completions choice's ``logprobs`` object for ``entries``.

        Args:
            entries: the tokens (a whole answer or one chunk's).
            prompt_chars: characters of the prompt's text (``text_offset`` counts from the prompt's beginning).
        """
        tokens, top = [], []
        for entry in entries:
            tokens.append(self._name(entry.token_id)[0])
            alternatives = {self._name(t)[0]: lp for t, lp in zip(entry.top_token_ids, entry.top_logprobs)}
            alternatives.setdefault(tokens[-1], entry.logprob)
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top,
                "text_offset": [prompt_chars + e.text_offset for e in entries]}


class LogprobLedger:
    """One choice's token log-probabilities, each held until the text its token starts has been emitted.

    Offsets are characters of the detokenized text (before stop strings): a token starts where the text of the
    tokens before it ends. An entry is released once the emitted text reaches past its start; entries whose start
    the emitted text never reaches (EOS, tokens cut away by a stop string) are never released.
    """

    def __init__(self) -> None:
        self.released: list[TokenLogprob] = []
        self._pending: list[TokenLogprob] = []
        self._num_detokenized_chars = 0
        self._num_emitted_chars = 0

    def add(self, token_id: int, logprob: float, top_token_ids: list[int], top_logprobs: list[float],
            text: str) -> None:
        """Note one token, in order, with ``text`` the text its detokenization released (maybe "")."""
        self._pending.append(TokenLogprob(token_id, logprob, top_token_ids, top_logprobs,
                                          self._num_detokenized_chars))
        self._num_detokenized_chars += len(text)

    def emit(self, text: str) -> list[TokenLogprob]:
        """Note that ``text`` was emitted; return the entries released by it (also appended to ``released``)."""
        self._num_emitted_chars += len(text)
        pending = self._pending
        num = 0
        while num < len(pending) and pending[num].text_offset < self._num_emitted_chars:
            num += 1
        if num == 0:
            return []
        out, self._pending = pending[:num], pending[num:]
        self.released.extend(out)
        return out
