"""The per-request side of a worker connection: the queue of one request's token ids and its end.

The connection's reader task (:class:`~gateway.workers.client.WorkerClient`) pushes ``TokenDelta``, ``Finished`` and
``Failed`` frames into the :class:`RequestStream` of their request id; the request's pipeline reads them with
:meth:`RequestStream.next`, coalesced (bounded by ``max_tokens``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import msgspec

from shared.errors import ErrorCode, SluiceError
from shared.protocol import Finished, TokenDelta

if TYPE_CHECKING:
    from gateway.workers.client import WorkerClient
    from gateway.workers.reservation import Reservation


def error_code(code: str) -> ErrorCode:
    try:
        return ErrorCode(code)
    except ValueError:
        return ErrorCode.WORKER_FAILED


class StreamUpdate(msgspec.Struct, frozen=True):
    """What arrived for one request since the consumer last looked.

    Attributes:
        token_ids: new output token ids, in order.
        first_token_latency_ms: the worker's time to first token, on the update that carries the first token.
        finished: the worker's final report, or None while the request runs.
    """

    token_ids: list[int]
    first_token_latency_ms: float | None = None
    finished: Finished | None = None


class RequestStream:
    """The replies of one request on one worker, coalesced until the consumer takes them.

    Token ids accumulate in a list (bounded by the request's ``max_tokens``), so a slow client never blocks the
    connection's reader task.
    """

    def __init__(self, request_id: str, worker: "WorkerClient") -> None:
        self.request_id = request_id
        self.worker = worker
        self._token_ids: list[int] = []
        self._first_token_latency_ms: float | None = None
        self._finished: Finished | None = None
        self._error: SluiceError | None = None
        self._event = asyncio.Event()
        self.done = False  # the worker will send nothing more (finished, failed or aborted)
        self.reservation: Reservation | None = None  # set by start_request: its prefill backlog entry

    def _started(self) -> None:
        if self.reservation is not None:
            self.worker.prefill_started(self.reservation)

    def _push(self, delta: TokenDelta) -> None:
        self._started()
        self._token_ids.extend(delta.token_ids)
        if delta.first_token_latency_ms is not None:
            self._first_token_latency_ms = delta.first_token_latency_ms
        self._event.set()

    def _finish(self, finished: Finished) -> None:
        self._started()
        self._finished = finished
        self.done = True
        self._event.set()

    def _fail(self, error: SluiceError) -> None:
        self._started()
        self._error = error
        self.done = True
        self._event.set()

    async def next_update(self, timeout_s: float) -> StreamUpdate:
        """Wait for new tokens or the end of the request.

        Raises:
            SluiceError: the worker failed the request or its connection died (``worker_failed`` or the worker's
                code), or nothing arrived within ``timeout_s`` (``worker_timeout``).
        """
        if not self._event.is_set():
            try:
                await asyncio.wait_for(self._event.wait(), timeout_s)
            except TimeoutError:
                raise SluiceError(ErrorCode.WORKER_TIMEOUT,
                                  f"the worker sent no token for {timeout_s:g} s") from None
        self._event.clear()
        token_ids, self._token_ids = self._token_ids, []
        latency_ms, self._first_token_latency_ms = self._first_token_latency_ms, None
        if token_ids or self._finished is not None:
            return StreamUpdate(token_ids, latency_ms, self._finished)
        if self._error is not None:
            raise self._error
        return StreamUpdate([], latency_ms, None)
