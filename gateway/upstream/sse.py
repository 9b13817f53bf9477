"""Read an upstream's OpenAI SSE stream into :class:`UpstreamDelta` values.

Engines differ in details the client must not see: some send the role in a chunk of its own, an empty ``content``,
``finish_reason`` together with the last text or in a chunk of its own, the usage in the last choice chunk or in a
separate one with empty ``choices``, ``[DONE]`` or not. This module keeps only text, the finish reason, the usage
and an in-band error; the gateway then writes its own contract (``gateway.pipeline`` and ``gateway.http``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

# Longest SSE line accepted from an upstream, bytes (aiohttp's StreamReader limit is per line read).
MAX_LINE_BYTES = 1 << 20


@dataclass(frozen=True)
class UpstreamDelta:
    """What one SSE event of an upstream carried (every field optional).

    Attributes:
        text: new output text of the choice ("" when none).
        finish_reason: the upstream's finish reason once it ends (``stop``, ``length``, …), else None.
        prompt_tokens, completion_tokens, cached_tokens: the usage the upstream reports, else None.
        error: an in-band error message, else None.
    """

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None


class SSEFormatError(ValueError):
    """An SSE data line that is not JSON."""


async def sse_data(lines: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Yield the ``data:`` payloads of an SSE byte stream (one per event; comments and other fields skipped),
    up to ``[DONE]`` or the end of the stream."""
    async for raw in lines:
        line = raw.rstrip(b"\r\n")
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip().decode("utf-8", errors="replace")
        if data == "[DONE]":
            return
        if data:
            yield data


def decode_event(data: str) -> UpstreamDelta:
    """Decode one chat.completion.chunk or text_completion chunk.

    Raises:
        SSEFormatError: ``data`` is not a JSON object.
    """
    try:
        event = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise SSEFormatError(f"upstream sent a data line that is not JSON: {data[:200]!r}") from exc
    if not isinstance(event, dict):
        raise SSEFormatError(f"upstream sent a data line that is not a JSON object: {data[:200]!r}")
    error = event.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, dict) else str(error)
        return UpstreamDelta(error=str(message or "upstream error"))
    text, finish_reason = "", None
    for choice in event.get("choices") or []:
        delta = choice.get("delta")
        piece = (delta or {}).get("content") if delta is not None else choice.get("text")
        text += piece or ""
        finish_reason = choice.get("finish_reason") or finish_reason
    usage = event.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return UpstreamDelta(text, finish_reason, usage.get("prompt_tokens"), usage.get("completion_tokens"),
                         details.get("cached_tokens"))
