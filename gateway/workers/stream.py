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
        logprobs: per token of ``token_ids``, its log-probability (requests that asked for them; else empty).
        top_token_ids, top_logprobs: per token of ``token_ids``, the most likely alternatives and their
            log-probabilities (same condition).
        text, num_text_tokens: new output text and its token count, from an upstream that streams text instead
            of token ids (``gateway.upstream``); then ``token_ids`` is empty.
    """

    token_ids: list[int]
    first_token_latency_ms: float | None = None
    finished: Finished | None = None
    logprobs: list[float] = []
    top_token_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    text: str = ""
    num_text_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """New output tokens: the token ids, or as many as the upstream's text chunks carried."""
        return len(self.token_ids) + self.num_text_tokens


class RequestStream:
    """The replies of one request on one worker, coalesced until the consumer takes them.

    Token ids accumulate in a list (bounded by the request's ``max_tokens``), so a slow client never blocks the
    connection's reader task.
    """

    def __init__(self, request_id: str, worker: "WorkerClient") -> None:
        self.request_id = request_id
        self.worker = worker
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._top_token_ids: list[list[int]] = []
        self._top_logprobs: list[list[float]] = []
        self._text_parts: list[str] = []  # from an upstream that streams text (gateway.upstream)
        self._num_text_tokens = 0
        self._first_token_latency_ms: float | None = None
        self._finished: Finished | None = None
        self._error: SluiceError | None = None
        self._has_update = False  # a reply arrived that next_update has not returned yet
        self._waiter: asyncio.Future[None] | None = None  # next_update is waiting on it
        self._deadline_s = 0.0  # loop.time() when the current wait times out
        self._timer: asyncio.TimerHandle | None = None  # fires at or before _deadline_s (see next_update)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the first wait
        self.done = False  # the worker will send nothing more (finished, failed or aborted)
        self.reservation: Reservation | None = None  # set by start_request: its prefill backlog entry

    @property
    def has_unread(self) -> bool:
        """Replies arrived that :meth:`next_update` has not returned yet."""
        return self._has_update

    @property
    def failed(self) -> bool:
        """The worker failed the request (or it was preempted); :meth:`next_update` raises it once the tokens before
        it were returned."""
        return self._error is not None

    def _started(self) -> None:
        reservation = self.reservation
        if reservation is not None and reservation.prefill_pending:  # once per request, not per reply
            self.worker.prefill_started(reservation)

    def _push(self, delta: TokenDelta) -> None:
        self._started()
        self._token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self._logprobs.extend(delta.logprobs)
            self._top_token_ids.extend(delta.top_token_ids or [[] for _ in delta.logprobs])
            self._top_logprobs.extend(delta.top_logprobs or [[] for _ in delta.logprobs])
        if delta.first_token_latency_ms is not None:
            self._first_token_latency_ms = delta.first_token_latency_ms
        self._wake()

    def _push_text(self, text: str, num_tokens: int, first_token_latency_ms: float | None = None) -> None:
        """Add output text of ``num_tokens`` tokens (an upstream's SSE chunk)."""
        self._started()
        self._text_parts.append(text)
        self._num_text_tokens += num_tokens
        if first_token_latency_ms is not None:
            self._first_token_latency_ms = first_token_latency_ms
        self._wake()

    def _finish(self, finished: Finished) -> None:
        self._started()
        self._finished = finished
        self.end()
        self._wake()

    def _fail(self, error: SluiceError) -> None:
        self._started()
        self._error = error
        self.end()
        self._wake()

    def end(self) -> None:
        """Mark the stream over (finished, failed or aborted: nothing more comes) and stop its wait timer."""
        self.done = True
        self.stop_timer()

    def _wake(self) -> None:
        self._has_update = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_update(self, timeout_s: float) -> StreamUpdate:
        """Wait for new tokens or the end of the request, at most ``timeout_s`` seconds, and return them.

        One future per wait and one timer per stream, not one per wait: a timer that fires before the current
        deadline (set by an earlier, shorter wait) re-arms itself for the rest, and one set further out is re-armed
        only when a wait's deadline is nearer. A stream waits once per token, so this saves a timer's start and
        stop per token (``asyncio.wait_for`` would add a task per wait too). The wait is written out here, not in a
        helper coroutine: every coroutine between the handler and this future is resumed once per token.

        Raises:
            SluiceError: the worker failed the request or its connection died (``worker_failed`` or the worker's
                code), or nothing arrived within ``timeout_s`` (``worker_timeout``).
        """
        if not self._has_update:
            if timeout_s > 0:
                loop = self._loop  # kept: asking for the running loop costs a getpid system call on Python 3.11
                if loop is None or not loop.is_running():
                    loop = self._loop = asyncio.get_running_loop()
                self._deadline_s = loop.time() + timeout_s
                timer = self._timer
                if timer is None or timer.when() > self._deadline_s:
                    if timer is not None:
                        timer.cancel()
                    self._timer = loop.call_at(self._deadline_s, self._on_timer)
                waiter = self._waiter = loop.create_future()
                try:
                    await waiter
                finally:
                    self._waiter = None
            if not self._has_update:
                self.stop_timer()
                raise SluiceError(ErrorCode.WORKER_TIMEOUT, f"the worker sent no token for {timeout_s:g} s")
        return self.take_update()

    def take_update(self) -> StreamUpdate:
        """Return what arrived since the last look, without waiting (an empty update when nothing did).

        Raises:
            SluiceError: the worker's failure, once every token that came before it was returned.
        """
        self._has_update = False
        token_ids, self._token_ids = self._token_ids, []
        latency_ms, self._first_token_latency_ms = self._first_token_latency_ms, None
        text, self._text_parts = "".join(self._text_parts), []
        num_text_tokens, self._num_text_tokens = self._num_text_tokens, 0
        if token_ids or text or self._finished is not None:
            # A failure that came with these tokens is reported by the next call, at once rather than after a wait.
            self._has_update = self._error is not None
            if not self._logprobs:
                return StreamUpdate(token_ids, latency_ms, self._finished, text=text, num_text_tokens=num_text_tokens)
            logprobs, self._logprobs = self._logprobs, []
            top_ids, self._top_token_ids = self._top_token_ids, []
            top_logprobs, self._top_logprobs = self._top_logprobs, []
            return StreamUpdate(token_ids, latency_ms, self._finished, logprobs, top_ids, top_logprobs)
        if self._error is not None:
            raise self._error
        return StreamUpdate([], latency_ms, None)

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # no wait in progress: the next one arms a timer again
        loop = waiter.get_loop()
        if loop.time() < self._deadline_s:
            self._timer = loop.call_at(self._deadline_s, self._on_timer)
        else:
            waiter.set_result(None)

    def stop_timer(self) -> None:
        """Cancel the wait timer (the stream has ended, or its reader stops reading)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
