"""OpenAI response shapes: SSE chunks (``chat.completion.chunk`` / ``text_completion``) and whole responses.

SSE exactly as OpenAI sends it::

    data: {chunk: choices[i].delta = {"role": "assistant", "content": ""}}     first chunk of every chat choice
    data: {chunk: delta {"content": "..."}, finish_reason null}                 ...
    data: {chunk: delta {}, finish_reason "stop" | "length"}                     last chunk of each choice
    data: {chunk: choices [], usage {...}}                                       only with include_usage
    data: [DONE]

An error after the first byte goes in-band as ``data: {"error": {...}}`` followed by ``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.errors import SluiceError

DONE_EVENT = b"data: [DONE]\n\n"
_json_encoder = msgspec.json.Encoder()


def sse_event(payload: Any) -> bytes:
    """Return one SSE ``data:`` event with ``payload`` as compact JSON (non-ASCII kept as UTF-8)."""
    return b"data: " + _json_encoder.encode(payload) + b"\n\n"


def sse_error_event(error: SluiceError) -> bytes:
    """Return the in-band error event sent when a stream fails after its first byte."""
    return sse_event(error.envelope())


class ChunkFactory:
    """Build the stream chunks of one request (all share ``id``, ``created`` and ``model``).

    Args:
        kind: ``chat`` or ``completion``.
        response_id: ``chatcmpl-…`` / ``cmpl-…``.
        created_s: Unix time in seconds.
        model: the served model's name.
    """

    def __init__(self, kind: str, response_id: str, created_s: int, model: str) -> None:
        self.kind = kind
        self.response_id = response_id
        self.created_s = created_s
        self.model = model
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.response_id, "object": self.object, "created": self.created_s, "model": self.model,
                "choices": choices}

    def role(self, index: int) -> bytes:
        """Return the first chunk of a chat choice: the assistant role with empty content."""
        return sse_event(self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]))

    def text(self, index: int, text: str) -> bytes:
        """Return a chunk carrying new text of one choice (finish_reason null)."""
        if self.kind == "chat":
            choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
        return sse_event(self._chunk([choice]))

    def finish(self, index: int, finish_reason: str) -> bytes:
        """Return the last chunk of a choice: no new text, its finish_reason."""
        if self.kind == "chat":
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason}
        return sse_event(self._chunk([choice]))

    def usage(self, usage: dict) -> bytes:
        """Return the usage chunk (``choices: []``), sent once before ``[DONE]`` when include_usage is set."""
        chunk = self._chunk([])
        chunk["usage"] = usage
        return sse_event(chunk)


def chat_completion(response_id: str, created_s: int, model: str, texts: list[str], finish_reasons: list[str],
                    usage: dict) -> dict:
    """Return a non-streamed ``chat.completion`` object."""
    choices = [
        {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
         "finish_reason": reason}
        for i, (text, reason) in enumerate(zip(texts, finish_reasons))
    ]
    return {"id": response_id, "object": "chat.completion", "created": created_s, "model": model,
            "choices": choices, "usage": usage}


def text_completion(response_id: str, created_s: int, model: str, texts: list[str], finish_reasons: list[str],
                    usage: dict) -> dict:
    """Return a non-streamed ``text_completion`` object."""
    choices = [
        {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
        for i, (text, reason) in enumerate(zip(texts, finish_reasons))
    ]
    return {"id": response_id, "object": "text_completion", "created": created_s, "model": model,
            "choices": choices, "usage": usage}
