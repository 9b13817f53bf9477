"""SSE framing and response shapes (BC06, BC07, BC36)."""

from __future__ import annotations

import json

import msgspec
import pytest

from gateway.pipeline.responses import DONE_EVENT, ChunkFactory, chat_completion, sse_error_event
from shared.errors import ErrorCode, SluiceError


def _data(event: bytes) -> dict:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    return json.loads(event[len(b"data: "):])


def test_bc36_first_chat_chunk_carries_the_role():
    chunks = ChunkFactory("chat", "chatcmpl-1", 1, "m")
    first = _data(chunks.role(1))
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    later = _data(chunks.text(1, "hé 霓"))
    assert "role" not in later["choices"][0]["delta"] and later["choices"][0]["finish_reason"] is None
    assert later["choices"][0]["delta"]["content"] == "hé 霓"


def test_bc07_usage_chunk_has_empty_choices_and_other_chunks_no_usage():
    chunks = ChunkFactory("completion", "cmpl-1", 1, "m")
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 0}}
    assert _data(chunks.usage(usage)) == {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                                          "choices": [], "usage": usage}
    assert "usage" not in _data(chunks.text(0, "x"))
    assert _data(chunks.finish(0, "length"))["choices"][0]["finish_reason"] == "length"


def test_bc06_done_and_in_band_error_events():
    assert DONE_EVENT == b"data: [DONE]\n\n"
    error = _data(sse_error_event(SluiceError(ErrorCode.WORKER_FAILED, "worker died")))
    assert error == {"error": {"message": "worker died", "type": "server_error", "param": None,
                               "code": "worker_failed"}}


def test_chat_completion_object():
    body = chat_completion("chatcmpl-1", 1, "m", ["a", "b"], ["stop", "length"], {"prompt_tokens": 1})
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][1] == {"index": 1, "message": {"role": "assistant", "content": "b"}, "logprobs": None,
                                  "finish_reason": "length"}


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_chunk_templates_equal_encoding_the_chunk_objects(kind, include_usage):
    """With include_usage, every chunk but the usage one has ``"usage": null`` (OpenAI's stream_options docs)."""
    chunks = ChunkFactory(kind, 'chatcmpl-"quoted"\\id', 1712345678, 'mödel "x"', include_usage)
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def encoded(choices: list[dict], **extra) -> bytes:
        chunk = {"id": 'chatcmpl-"quoted"\\id', "object": obj, "created": 1712345678, "model": 'mödel "x"',
                 "choices": choices, **({"usage": None} if include_usage else {}), **extra}
        return b"data: " + msgspec.json.encode(chunk) + b"\n\n"

    for index in (0, 3, 12):
        for text in ("hello", " \"quote\" \\ back\nnew line\t", "héllo 霓 🙂", "\u2028\x00\x1f"):
            choice = ({"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
                      if kind == "chat" else
                      {"index": index, "text": text, "logprobs": None, "finish_reason": None})
            assert chunks.text(index, text) == encoded([choice])
        for reason in ("stop", "length"):
            choice = ({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason} if kind == "chat"
                      else {"index": index, "text": "", "logprobs": None, "finish_reason": reason})
            assert chunks.finish(index, reason) == encoded([choice])
        if kind == "chat":
            assert chunks.role(index) == encoded([{"index": index, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}])
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 1}}
    assert chunks.usage(usage) == encoded([], usage=usage)
