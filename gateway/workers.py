"""Connections to workers: one multiplexed connection per worker, demultiplexed by request id.

::

    WorkerPool ── choose() ──▶ WorkerClient ── Generate/Abort frames ──▶ worker
                                   │ reader task: Hello, Capacity, TokenDelta, Finished, Failed
                                   ▼
                   RequestStream (one per request id; coalesces token ids, bounded by max_tokens)

A :class:`WorkerClient` keeps reconnecting to its address (a restarted local worker reappears on the same socket
path). A connection that dies fails every request in flight on it with ``worker_failed``. A malformed frame closes
that connection with a logged error, never the process.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import msgspec
import structlog

from shared.errors import ErrorCode, SluiceError
from shared.protocol import (
    Abort,
    Capacity,
    Failed,
    Finished,
    Generate,
    Hello,
    Pong,
    ProtocolError,
    TokenDelta,
    gateway_codec,
)

log = structlog.get_logger("sluice.gateway")

RECONNECT_INTERVAL_S = 0.2
CONNECT_TIMEOUT_S = 5.0


def _error_code(code: str) -> ErrorCode:
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

    def _push(self, delta: TokenDelta) -> None:
        self._token_ids.extend(delta.token_ids)
        if delta.first_token_latency_ms is not None:
            self._first_token_latency_ms = delta.first_token_latency_ms
        self._event.set()

    def _finish(self, finished: Finished) -> None:
        self._finished = finished
        self.done = True
        self._event.set()

    def _fail(self, error: SluiceError) -> None:
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


class WorkerClient:
    """One multiplexed connection to one worker, reconnected whenever it drops.

    Args:
        address: ``HOST:PORT`` or ``unix:PATH``.
        name: label for logs, metrics and ``/status``.
        on_capacity: called with (name, Capacity) on every capacity report.
    """

    def __init__(self, address: str, name: str,
                 on_capacity: Callable[[str, Capacity], None] | None = None) -> None:
        self.address = address
        self.name = name
        self.hello: Hello | None = None
        self.capacity: Capacity | None = None
        self.capacity_at_s = 0.0
        self.connected_at_s = 0.0
        self.num_connections = 0
        self._on_capacity = on_capacity
        self._writer: asyncio.StreamWriter | None = None
        self._codec = gateway_codec()
        self._streams: dict[str, RequestStream] = {}
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.pending_demand_blocks = 0  # KV demand dispatched since the last capacity report

    @property
    def ready(self) -> bool:
        """Connected and said Hello, and not draining."""
        draining = self.capacity is not None and self.capacity.draining
        return self._writer is not None and self.hello is not None and not draining

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        """Start the connect / read / reconnect loop (owned by this client; :meth:`close` cancels it)."""
        if self._task is None:
            self._task = asyncio.create_task(self._maintain(), name=f"worker-client-{self.name}")

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the worker said Hello; return whether it did within ``timeout_s``."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Close the connection and stop reconnecting; requests in flight fail."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._disconnect("gateway shutting down")

    # ------------------------------------------------------------------ requests

    def demand_blocks(self, demand_tokens: int) -> int:
        """Return the KV blocks ``demand_tokens`` tokens occupy on this worker."""
        block_size = self.hello.block_size_tokens if self.hello is not None else 16
        return -(-demand_tokens // block_size)

    def start_request(self, message: Generate, demand_tokens: int = 0) -> RequestStream:
        """Register a stream for ``message.request_id`` and send the ``Generate`` frame.

        Args:
            message: the request.
            demand_tokens: prompt + output budget in tokens, counted against the worker's free KV until its next
                capacity report.

        Raises:
            SluiceError: ``no_worker_available`` when the connection is down.
        """
        if self._writer is None or self.hello is None:
            raise SluiceError(ErrorCode.NO_WORKER, f"worker {self.name} is not connected", retry_after_s=1)
        stream = RequestStream(message.request_id, self)
        self._streams[message.request_id] = stream
        self.pending_demand_blocks += self.demand_blocks(demand_tokens)
        self._writer.write(self._codec.encode(message))
        return stream

    def abort(self, request_id: str) -> None:
        """Send ``Abort`` for a request that has not ended, and forget it (synchronous: safe in ``finally``)."""
        stream = self._streams.pop(request_id, None)
        if stream is None or stream.done:
            return
        stream.done = True
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(self._codec.encode(Abort(request_id)))

    # ------------------------------------------------------------------ connection

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.address.startswith("unix:"):
            return await asyncio.open_unix_connection(self.address[len("unix:"):])
        host, _, port = self.address.rpartition(":")
        return await asyncio.open_connection(host or "127.0.0.1", int(port))

    async def _maintain(self) -> None:
        failures = 0
        while not self._closing:
            try:
                reader, writer = await asyncio.wait_for(self._open(), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as exc:
                failures += 1
                if failures in (1, 50) or failures % 300 == 0:
                    log.info("worker_connect_retry", worker=self.name, address=self.address, error=str(exc))
                await asyncio.sleep(RECONNECT_INTERVAL_S)
                continue
            failures = 0
            self._codec = gateway_codec()
            self._writer = writer
            self.num_connections += 1
            self.connected_at_s = time.time()
            reason = await self._read_loop(reader)
            self._disconnect(reason)
            if not self._closing:
                await asyncio.sleep(RECONNECT_INTERVAL_S)

    async def _read_loop(self, reader: asyncio.StreamReader) -> str:
        try:
            while True:
                message = await self._codec.read(reader)
                if message is None:
                    return "worker closed the connection"
                self._on_message(message)
        except ProtocolError as exc:
            log.error("worker_malformed_frame", worker=self.name, error=str(exc))
            return f"malformed frame from worker: {exc}"
        except (ConnectionError, OSError) as exc:
            return f"connection to worker lost: {exc}"

    def _on_message(self, message: msgspec.Struct) -> None:
        match message:
            case TokenDelta(request_id=request_id):
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream._push(message)
            case Finished(request_id=request_id):
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream._finish(message)
            case Failed(request_id=request_id, code=code, message=text):
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream._fail(SluiceError(_error_code(code), f"worker {self.name}: {text}"))
            case Capacity():
                self.capacity = message
                self.capacity_at_s = time.time()
                self.pending_demand_blocks = 0
                if self._on_capacity is not None:
                    self._on_capacity(self.name, message)
            case Hello():
                self.hello = message
                self._ready.set()
                log.info("worker_ready", worker=self.name, worker_id=message.worker_id, model=message.model_id,
                         backend=message.backend, device=message.device, kv_blocks=message.num_kv_blocks)
            case Pong():
                pass

    def _disconnect(self, reason: str) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            log.warning("worker_disconnected", worker=self.name, reason=reason, in_flight=len(self._streams))
        self.hello = None
        self.capacity = None
        self._ready.clear()
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._fail(SluiceError(ErrorCode.WORKER_FAILED, f"worker {self.name} failed: {reason}"))


class WorkerPool:
    """The workers this gateway serves from, and the choice of one per request.

    Routing (for now): among ready workers, the one with the most free KV blocks after subtracting the demand sent
    since its last capacity report; ties go to the one with fewer requests in flight.
    """

    def __init__(self, clients: list[WorkerClient]) -> None:
        self.clients = clients

    def ready_clients(self) -> list[WorkerClient]:
        return [c for c in self.clients if c.ready]

    @property
    def is_ready(self) -> bool:
        return any(c.ready for c in self.clients)

    def max_model_len_tokens(self, configured_tokens: int) -> int:
        """Return the context length: the config's, lowered to what the ready workers announce."""
        lengths = [c.hello.max_model_len_tokens for c in self.ready_clients() if c.hello is not None]
        return min([configured_tokens, *lengths])

    def choose(self, demand_tokens: int = 0) -> WorkerClient:
        """Pick the worker for a request needing ``demand_tokens`` tokens of KV (prompt + output budget).

        Raises:
            SluiceError: ``no_worker_available`` (503, Retry-After) when no worker is ready.
        """
        best: WorkerClient | None = None
        best_key: tuple[int, int] | None = None
        for client in self.ready_clients():
            free = client.capacity.free_kv_blocks if client.capacity else client.hello.num_kv_blocks
            key = (free - client.pending_demand_blocks - client.demand_blocks(demand_tokens), -client.num_in_flight)
            if best_key is None or key > best_key:
                best, best_key = client, key
        if best is None:
            raise SluiceError(ErrorCode.NO_WORKER, "no worker is ready to serve this request", retry_after_s=1)
        return best

    def start(self) -> None:
        for client in self.clients:
            client.start()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    def status(self) -> list[dict]:
        """Return a JSON-ready snapshot of every worker (for ``/status``)."""
        now_s = time.time()
        return [
            {
                "name": c.name,
                "address": c.address,
                "ready": c.ready,
                "in_flight": c.num_in_flight,
                "connections": c.num_connections,
                "hello": msgspec.structs.asdict(c.hello) if c.hello else None,
                "capacity": msgspec.structs.asdict(c.capacity) if c.capacity else None,
                "capacity_age_s": round(now_s - c.capacity_at_s, 3) if c.capacity else None,
            }
            for c in self.clients
        ]
