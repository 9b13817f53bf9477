"""A deadline on receiving a request body, and a bound on the bodies being received at once (slow-body defence).

aiohttp calls a handler as soon as a request's headers are parsed; the body arrives while the handler reads it,
and nothing bounds how long that takes: a chunked body that never ends, or a ``Content-Length`` larger than what is
sent, would hold the connection and its handler forever (slowloris). This middleware watches every request whose
body has not fully arrived when its handler starts:

- the whole body must arrive within ``gateway.body_read_timeout_s`` of the handler's start, else the handler is
  cancelled and the client gets 408 ``request_timeout`` (OpenAI envelope); aiohttp then closes the connection
  after reading and discarding what more comes for at most its lingering time (10 s);
- at most ``gateway.max_unfinished_bodies`` bodies are being received at once; one more gets 503
  ``server_overloaded`` at once, before its body is read.

The deadline ends when the last byte of the body arrives (the stream's end-of-body callback), so the work the
handler does afterwards (tokenizing, queueing, generating) is never cut short by it. A body that is already whole
when the handler starts (the common case: small bodies arrive with their headers) costs one check.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from aiohttp import web

from gateway.state import METRICS
from shared.errors import ErrorCode, SluiceError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OVERLOADED_RETRY_AFTER_S = 1


class BodyDeadline:
    """The middleware's state: the limits and the number of bodies being received now.

    Args:
        timeout_s: seconds a body may take to arrive, from the start of its handler.
        max_unfinished: most bodies being received at once.
    """

    def __init__(self, timeout_s: float, max_unfinished: int) -> None:
        self.timeout_s = timeout_s
        self.max_unfinished = max_unfinished
        self.num_unfinished = 0

    @web.middleware
    def middleware(self, request: web.Request, handler: Handler) -> Awaitable[web.StreamResponse]:
        """Run ``handler`` under the body deadline when the body has not fully arrived yet; a whole body's request
        is the handler's own coroutine, with no frame of this middleware around it (resumed on every token).

        Raises (when awaited):
            SluiceError: 408 ``request_timeout`` when the body did not arrive in time; 503 ``server_overloaded``
                when ``max_unfinished`` bodies are being received already.
        """
        if request.content.is_eof():
            return handler(request)
        return self._receive_under_deadline(request, handler)

    async def _receive_under_deadline(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        body = request.content
        if self.num_unfinished >= self.max_unfinished:
            raise SluiceError(ErrorCode.SERVER_OVERLOADED, f"the gateway is receiving {self.num_unfinished} request "
                              "bodies already; retry shortly", retry_after_s=OVERLOADED_RETRY_AFTER_S)
        gauge = request.app[METRICS].unfinished_request_bodies
        self.num_unfinished += 1
        gauge.set(self.num_unfinished)
        receiving = True

        def body_arrived() -> None:
            nonlocal receiving
            if receiving:
                receiving = False
                self.num_unfinished -= 1
                gauge.set(self.num_unfinished)
                deadline.reschedule(None)

        try:
            async with asyncio.timeout(self.timeout_s) as deadline:
                body.on_eof(body_arrived)
                return await handler(request)
        except TimeoutError:
            if not deadline.expired() or not receiving:
                raise
            raise SluiceError(ErrorCode.REQUEST_TIMEOUT, f"the request body did not arrive within "
                              f"{self.timeout_s:g} s (gateway.body_read_timeout_s)") from None
        finally:
            if receiving:
                receiving = False
                self.num_unfinished -= 1
                gauge.set(self.num_unfinished)
