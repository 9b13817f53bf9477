"""The floor under the gateway's CPU per request: a bare aiohttp + uvloop server streaming the same answer shape.

It parses the JSON body of a chat completion and streams what Sluice streams for 8 output tokens: the role with
the first token, seven more tokens each in its own write after :data:`TOKEN_INTERVAL_S` (a decode step), then the
finish chunk, the usage chunk and ``[DONE]`` with the end of the body. No tokenizer, no admission, no worker: what
is left is HTTP parsing, SSE writing and the event loop's wake-ups, on this machine. ``bench.gateway_bench`` runs it
under the same client and load as Sluice, so ``gateway_cpu_ms_per_request`` has its machine's floor beside it.

Run: ``python -m bench.bare_sse_server PORT``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid

from aiohttp import web

OUTPUT_TOKENS = 8
TOKEN_INTERVAL_S = 0.002


def _chunk(response_id: str, created: int, model: str, delta: dict, finish_reason: str | None = None) -> bytes:
    body = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = json.loads(await request.read())
    response_id, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.get("model", "")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", "x-request-id": uuid.uuid4().hex})
    await response.prepare(request)
    await response.write(_chunk(response_id, created, model, {"role": "assistant", "content": ""})
                         + _chunk(response_id, created, model, {"content": " token"}))
    for _ in range(OUTPUT_TOKENS - 1):
        await asyncio.sleep(TOKEN_INTERVAL_S)
        await response.write(_chunk(response_id, created, model, {"content": " token"}))
    usage = {"prompt_tokens": 40, "completion_tokens": OUTPUT_TOKENS, "total_tokens": 40 + OUTPUT_TOKENS}
    usage_chunk = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": usage}
    await response.write_eof(_chunk(response_id, created, model, {}, "length")
                             + b"data: " + json.dumps(usage_chunk).encode() + b"\n\n" + b"data: [DONE]\n\n")
    return response


def main() -> None:
    import uvloop

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat_completions)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None,
                loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
