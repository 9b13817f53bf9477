"""One multiplexed connection per worker, demultiplexed by request id.

::

    AdmissionController ── try_reserve() ──▶ WorkerPool ──▶ Reservation(worker) ──▶ WorkerClient ── frames ──▶ worker
                                                                                     │ reader task: Hello, Capacity,
                                                                                     ▼ TokenDelta, Finished, Failed
                                RequestStream (one per request id; coalesces token ids, bounded by max_tokens)

A :class:`WorkerClient` keeps reconnecting to its address through a
:class:`~gateway.workers.connector.WorkerConnector` (a restarted local worker reappears on the same socket path;
with a shared secret the connection is authenticated both ways before the worker's Hello). A connection that dies
fails every request in flight on it with ``worker_failed``.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, Callable

import msgspec
import structlog

from gateway.aio import wait_event
from gateway.workers.breaker import CircuitBreaker
from gateway.workers.connector import WorkerConnector
from gateway.workers.kv_booking import KvBooking
from gateway.workers.prefill_backlog import PrefillBacklog, prefill_budget_tokens
from gateway.workers.prefix_memory import PrefixMemory
from gateway.workers.stream import RequestStream, error_code
from shared.errors import ErrorCode, SluiceError
from shared.protocol import (
    Abort,
    Capacity,
    Drain,
    Failed,
    Finished,
    FrameCodec,
    Generate,
    Hello,
    Pong,
    TokenDelta,
    gateway_codec,
)

if TYPE_CHECKING:
    from gateway.upstream.request_body import UpstreamPrompt
    from gateway.workers.reservation import Reservation

log = structlog.get_logger("sluice.gateway")


class WorkerClient:
    """One multiplexed connection to one worker, reconnected whenever it drops.

    Class attributes ``preemptible_by_gateway`` (the gateway may stop a running request here for a higher tier's:
    False, our worker preempts by tier itself) and ``resumes_from_token_ids`` (a stopped request's answer so far
    can be continued here from token ids) are what :mod:`gateway.admission.preemption` asks.

    Args:
        address: ``HOST:PORT`` or ``unix:PATH``.
        name: label for logs, metrics and ``/status``.
        on_capacity: called with (name, Capacity) on every capacity report.
        breaker: this worker's circuit breaker; None = a closed one with the default settings.
        first_connect_interval_s: retry interval until the first connection succeeds (a local worker just
            spawned: :data:`~gateway.workers.connector.FIRST_CONNECT_INTERVAL_S`); None = the reconnect interval.
        secret: the shared secret this gateway proves and requires of the worker (``shared.auth``); None = accept
            only a worker without one.
    """

    preemptible_by_gateway = False
    resumes_from_token_ids = False

    def __init__(self, address: str, name: str,
                 on_capacity: Callable[[str, Capacity], None] | None = None,
                 breaker: CircuitBreaker | None = None, first_connect_interval_s: float | None = None,
                 secret: bytes | None = None) -> None:
        self.address = address
        self.name = name
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.on_change: Callable[[], None] | None = None  # set by the pool: capacity, status or request end
        self.num_reserved = 0  # reservations (dispatched or about to be) of this gateway on this worker
        self.kv_booking = KvBooking()  # their KV demand in blocks, shared prompt blocks counted once
        self.prefix_memory = PrefixMemory()  # prompt blocks sent here lately (prefix-aware routing)
        self.prefill = PrefillBacklog()  # reservations whose prompt has not started on the worker
        self.hello: Hello | None = None
        self.capacity: Capacity | None = None
        self.capacity_at_s = 0.0
        self.last_token_at_s = -math.inf  # time.monotonic() of the last token of any request (deep readiness)
        self.connected_at_s = 0.0
        self.num_connections = 0
        self.last_disconnect: str | None = None  # why the last connection ended, until the next Hello
        self._on_capacity = on_capacity
        self._writer: asyncio.StreamWriter | None = None
        self._outbox: list[bytes] = []  # frames queued in this event-loop iteration (see _send)
        self._loop: asyncio.AbstractEventLoop | None = None  # the connection's loop, from its first open
        self._codec = gateway_codec()
        self._streams: dict[str, RequestStream] = {}
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self._connector = WorkerConnector(address, name, secret=secret,
                                          first_connect_interval_s=first_connect_interval_s, on_open=self._on_open,
                                          on_message=self._on_message, on_close=self._disconnect,
                                          is_closing=lambda: self._closing)
        self.draining = False  # the gateway takes no new request to it (a scale-down): see mark_draining()

    @property
    def ready(self) -> bool:
        """Connected and said Hello, and not draining."""
        draining = self.draining or (self.capacity is not None and self.capacity.draining)
        return self._writer is not None and self.hello is not None and not draining

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def backend(self) -> str:
        """The worker's backend from its Hello (``sim`` names the roofline simulator), or "" before Hello."""
        return self.hello.backend if self.hello is not None else ""

    @property
    def block_size_tokens(self) -> int:
        return self.hello.block_size_tokens if self.hello is not None else 16

    @property
    def total_kv_blocks(self) -> int:
        """KV blocks of the worker's pool (0 before Hello)."""
        if self.capacity is not None:
            return self.capacity.total_kv_blocks
        return self.hello.num_kv_blocks if self.hello is not None else 0

    @property
    def reserved_blocks(self) -> int:
        """KV blocks booked by this gateway's reservations (:class:`~gateway.workers.kv_booking.KvBooking`)."""
        return self.kv_booking.num_blocks

    @property
    def committed_kv_blocks(self) -> int:
        """KV blocks promised or in use: this gateway's reservations, or the worker's used blocks when more."""
        used = self.capacity.used_kv_blocks if self.capacity is not None else 0
        return max(self.kv_booking.num_blocks, used)

    @property
    def prefill_tokens_per_s(self) -> float:
        """The worker's measured prefill rate, tokens/s of busy time (its last capacity report); 0.0 = none yet."""
        return self.capacity.prefill_tokens_per_s if self.capacity is not None else 0.0

    def prefill_budget_tokens(self, prefill_queue_s: float, fallback_rate_tokens_per_s: float = 0.0) -> float:
        """Return how many not-yet-started prompt tokens the worker may hold
        (:func:`~gateway.workers.prefill_backlog.prefill_budget_tokens` at its measured prefill rate). A worker that
        has measured none yet (just started) is taken to prefill at ``fallback_rate_tokens_per_s`` (its pool's:
        :meth:`WorkerPool.known_prefill_tokens_per_s`)."""
        return prefill_budget_tokens(self.prefill_tokens_per_s or fallback_rate_tokens_per_s, prefill_queue_s)

    def can_take(self, demand_blocks: int, prefill_tokens: int = 0, prefill_queue_s: float = 0.0,
                 priority: int = 0, fallback_prefill_tokens_per_s: float = 0.0, group: object | None = None) -> bool:
        """Return whether a request may be sent now (breaker, sequence slots, KV, prefill backlog).

        Args:
            demand_blocks: its KV demand in blocks (prompt + capped output).
            prefill_tokens: its prompt tokens the worker will have to prefill (uncached).
            prefill_queue_s: most seconds of not-yet-started prefill work (of its tier or higher) the worker may
                hold; 0 = no limit.
            priority: its tier's priority (the worker prefills higher ones first).
            fallback_prefill_tokens_per_s: the prefill rate, tokens/s, to assume while the worker has measured
                none (see :meth:`prefill_budget_tokens`).
            group: the request whose choices are reserved together (not used here: our workers order prefills
                by tier themselves).
        """
        if not self.ready or not self.breaker.available() or self.hello is None:
            return False
        if self.num_reserved >= self.hello.max_num_seqs:
            return False
        if prefill_queue_s > 0:
            num_ahead, tokens_ahead = self.prefill.ahead(priority)
            budget_tokens = self.prefill_budget_tokens(prefill_queue_s, fallback_prefill_tokens_per_s)
            if num_ahead > 0 and tokens_ahead + prefill_tokens > budget_tokens:
                return False
        return self.total_kv_blocks - self.committed_kv_blocks >= demand_blocks

    def hold_prefill(self, reservation: "Reservation") -> None:
        """A reservation was made here: its prompt is in the prefill backlog until :meth:`prefill_started`."""
        self.prefill.hold(reservation)

    def prefill_started(self, reservation: "Reservation") -> None:
        """The reservation's prompt started on the worker (first token, end, failure or release): it leaves the
        prefill backlog, and the pool hears of the room. Idempotent."""
        if self.prefill.started(reservation):
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def start(self) -> None:
        """Start the connect / read / reconnect loop (owned by this client; :meth:`close` cancels it)."""
        if self._task is None:
            self._task = asyncio.create_task(self._connector.run(), name=f"worker-client-{self.name}")

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the worker said Hello; return whether it did within ``timeout_s``."""
        return await wait_event(self._ready, timeout_s)

    def expect_exit(self) -> None:
        """The worker is being stopped: its disconnect is expected (logged at info, not as a warning) and the
        client does not reconnect to it."""
        self._closing = True

    async def close(self, reason: str = "gateway shutting down") -> None:
        """Close the connection and stop reconnecting; requests in flight fail with ``reason`` (also logged)."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._disconnect(reason)

    # ------------------------------------------------------------------ requests

    def start_request(self, message: Generate, reservation: "Reservation | None" = None,
                      prompt: "UpstreamPrompt | None" = None) -> RequestStream:
        """Register a stream for ``message.request_id`` and send the ``Generate`` frame.

        Args:
            message: the request.
            reservation: its reservation on this worker; its prefill backlog entry ends with the first token.
            prompt: the client's messages or prompt, for an upstream (``gateway.upstream``); a worker reads the
                token ids of ``message`` only.

        Raises:
            SluiceError: ``worker_failed`` when the connection is down (the request may be retried elsewhere).
        """
        if self._writer is None or self.hello is None:
            raise SluiceError(ErrorCode.WORKER_FAILED, f"worker {self.name} is not connected")
        frame = self._codec.encode(message)  # first: a message that cannot be encoded leaves no stream behind
        stream = RequestStream(message.request_id, self)
        stream.reservation = reservation
        self._streams[message.request_id] = stream
        self._send(frame)
        return stream

    def not_ready_reason(self) -> str | None:
        """Return why this worker takes no request now (``/readyz``), or None when it can."""
        if self.ready:
            return None
        if self.draining or (self.capacity is not None and self.capacity.draining):
            return f"worker {self.name}: draining"
        where = f"worker {self.name} at {self.address}: "
        if self._connector.last_handshake_failure is not None:
            return where + self._connector.last_handshake_failure
        if self._writer is None:
            return where + ("not connected" if self.last_disconnect is None else f"down ({self.last_disconnect})")
        return where + "no Hello yet"

    def mark_draining(self) -> None:
        """Send no new request to this worker from now on (``ready`` turns False); the running ones go on."""
        self.draining = True
        self._changed()

    async def wait_idle(self, poll_s: float) -> None:
        """Return once this gateway holds no reservation and runs no request on the worker (checked every
        ``poll_s`` seconds): a worker being drained or leaving the registry."""
        while self.num_reserved > 0 or self.num_in_flight > 0:
            await asyncio.sleep(poll_s)

    def resume_routing(self) -> None:
        """Undo :meth:`mark_draining`: the worker takes new requests again once ready (a registry worker that left
        and came back while its requests still ran: ``gateway.fleet.registry_members``)."""
        self.draining = False
        self._changed()

    def send_drain(self) -> None:
        """Send the protocol's ``Drain``: the worker finishes what it runs and refuses new requests."""
        if self._writer is not None and not self._writer.is_closing():
            self._send(self._codec.encode(Drain()))

    def abort(self, request_id: str) -> None:
        """Send ``Abort`` for a request that has not ended, and forget it (synchronous: safe in ``finally``)."""
        stream = self._streams.pop(request_id, None)
        if stream is None or stream.done:
            return
        stream.end()
        if self._writer is not None and not self._writer.is_closing():
            self._send(self._codec.encode(Abort(request_id)))

    def fail_requests(self, error: SluiceError) -> int:
        """End every request in flight here with ``error`` (its reader raises it: an in-band error once its stream
        has a byte out, else the plain JSON error or a retry) and abort it on the worker; return how many. The
        gateway's drain calls it when ``gateway.drain_timeout_s`` ran out, so that nothing it cancels next is cut off
        without an ending."""
        streams = [stream for stream in self._streams.values() if not stream.done]
        for stream in streams:
            self.abort(stream.request_id)
            stream._fail(error)
        return len(streams)

    def _send(self, frame: bytes) -> None:
        """Queue one encoded frame for the worker. The frames queued in one event-loop iteration leave together,
        in order, in one write at the end of it (one system call for a burst of dispatches and aborts instead of
        one each); without a running loop (shutdown) the frame is written at once."""
        loop = self._loop
        if loop is None or not loop.is_running():
            self._write([frame])
            return
        self._outbox.append(frame)
        if len(self._outbox) == 1:
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        frames, self._outbox = self._outbox, []
        if frames:
            self._write(frames)

    def _write(self, frames: list[bytes]) -> None:
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.write(frames[0] if len(frames) == 1 else b"".join(frames))

    # ------------------------------------------------------------------ connection

    def _on_open(self, writer: asyncio.StreamWriter, codec: FrameCodec, hello: Hello) -> None:
        self._loop = asyncio.get_running_loop()  # kept: asking for it per frame costs a getpid call on Python 3.11
        self._codec = codec
        self._writer = writer
        self.num_connections += 1
        self.connected_at_s = time.time()
        self._on_message(hello)

    def _on_message(self, message: msgspec.Struct) -> None:
        match message:
            case TokenDelta(request_id=request_id):
                self.last_token_at_s = time.monotonic()
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
                    stream._fail(SluiceError(error_code(code), f"worker {self.name}: {text}"))
            case Capacity():
                self.capacity = message
                self.capacity_at_s = time.time()
                if self._on_capacity is not None:
                    self._on_capacity(self.name, message)
                self._changed()
            case Hello():
                self.hello = message
                self.last_disconnect = None
                self._ready.set()
                log.info("worker_ready", worker=self.name, worker_id=message.worker_id, model=message.model_id,
                         backend=message.backend, device=message.device, kv_blocks=message.num_kv_blocks,
                         simulator=message.backend == "sim")
                self._changed()
            case Pong():
                pass

    def _disconnect(self, reason: str) -> None:
        writer, self._writer = self._writer, None
        self._outbox.clear()  # frames for the lost connection; their streams fail below
        if writer is not None:
            writer.close()
            (log.info if self._closing else log.warning)(
                "worker_disconnected", worker=self.name, reason=reason, in_flight=len(self._streams))
        self.hello = None
        self.capacity = None
        self.last_disconnect = reason
        self._ready.clear()
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._fail(SluiceError(ErrorCode.WORKER_FAILED, f"worker {self.name} failed: {reason}"))
        self.prefix_memory.clear()  # a new process has an empty prefix cache
        self._changed()
