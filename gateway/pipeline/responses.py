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

    Every chunk is a byte template filled in: the fields shared by the request's chunks are encoded once, at
    construction, and per chunk only the text (a JSON string, ``msgspec``) and the choice index are encoded. The
    bytes are those of encoding the whole chunk object with ``msgspec.json`` (compact, keys in this order)::

        data: {"id":…,"object":…,"created":…,"model":…,"choices":[{"index":i,"delta":{"content":"…"},
               "logprobs":null,"finish_reason":null}]}\n\n

    Args:
        kind: ``chat`` or ``completion``.
        response_id: ``chatcmpl-…`` / ``cmpl-…``.
        created_s: Unix time in seconds.
        model: the served model's name.
        include_usage: the request's ``stream_options.include_usage``: every chunk but the usage chunk then carries
            ``"usage":null``, as OpenAI's do.
    """

    def __init__(self, kind: str, response_id: str, created_s: int, model: str, include_usage: bool = False) -> None:
        self.kind = kind
        self.response_id = response_id
        self.created_s = created_s
        self.model = model
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        encode = _json_encoder.encode
        self._head = (b'data: {"id":' + encode(response_id) + b',"object":' + encode(self.object)
                      + b',"created":' + encode(created_s) + b',"model":' + encode(model) + b',"choices":[')
        self._text_field = b',"delta":{"content":' if kind == "chat" else b',"text":'
        self._close = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"  # after the choices
        self._text_tail = ((b'},"logprobs":null,"finish_reason":null}' if kind == "chat"
                            else b',"logprobs":null,"finish_reason":null}') + self._close)
        self._text_heads: dict[int, bytes] = {}

    def _choice_head(self, index: int) -> bytes:
        return self._head + b'{"index":' + str(index).encode()

    def role(self, index: int) -> bytes:
        """Return the first chunk of a chat choice: the assistant role with empty content."""
        return (self._choice_head(index)
                + b',"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}' + self._close)

    def text(self, index: int, text: str, logprobs: dict | None = None) -> bytes:
        """Return a chunk carrying new text of one choice (finish_reason null), and its tokens' ``logprobs``
        object when the request asked for them."""
        head = self._text_heads.get(index)
        if head is None:
            head = self._text_heads[index] = self._choice_head(index) + self._text_field
        if logprobs is None:
            return head + _json_encoder.encode(text) + self._text_tail
        return (head + _json_encoder.encode(text) + (b'},"logprobs":' if self.kind == "chat" else b',"logprobs":')
                + _json_encoder.encode(logprobs) + b',"finish_reason":null}' + self._close)

    def finish(self, index: int, finish_reason: str) -> bytes:
        """Return the last chunk of a choice: no new text, its finish_reason."""
        empty = b',"delta":{}' if self.kind == "chat" else b',"text":""'
        return (self._choice_head(index) + empty + b',"logprobs":null,"finish_reason":'
                + _json_encoder.encode(finish_reason) + b"}" + self._close)

    def usage(self, usage: dict) -> bytes:
        """Return the usage chunk (``choices: []``), sent once before ``[DONE]`` when include_usage is set."""
        return self._head + b'],"usage":' + _json_encoder.encode(usage) + b"}\n\n"


def chat_completion(response_id: str, created_s: int, model: str, texts: list[str], finish_reasons: list[str],
                    usage: dict, logprobs: list[dict | None] | None = None) -> dict:
    """Return a non-streamed ``chat.completion`` object (``logprobs``: each choice's object, or None)."""
    logprobs = logprobs or [None] * len(texts)
    choices = [
        {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": reason}
        for i, (text, reason, lp) in enumerate(zip(texts, finish_reasons, logprobs))
    ]
    return {"id": response_id, "object": "chat.completion", "created": created_s, "model": model,
            "choices": choices, "usage": usage}


def text_completion(response_id: str, created_s: int, model: str, texts: list[str], finish_reasons: list[str],
                    usage: dict, logprobs: list[dict | None] | None = None) -> dict:
    """Return a non-streamed ``text_completion`` object (``logprobs``: each choice's object, or None)."""
    logprobs = logprobs or [None] * len(texts)
    choices = [
        {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
        for i, (text, reason, lp) in enumerate(zip(texts, finish_reasons, logprobs))
    ]
    return {"id": response_id, "object": "text_completion", "created": created_s, "model": model,
            "choices": choices, "usage": usage}
