"""One multiplexed connection per worker, demultiplexed by request id.

::

    AdmissionController ── try_reserve() ──▶ WorkerPool ──▶ Reservation(worker) ──▶ WorkerClient ── frames ──▶ worker
                                                                                     │ reader task: Hello, Capacity,
                                                                                     ▼ TokenDelta, Finished, Failed
                                RequestStream (one per request id; coalesces token ids, bounded by max_tokens)

A :class:`WorkerClient` keeps reconnecting to its address (a restarted local worker reappears on the same socket
path). A connection that dies fails every request in flight on it with ``worker_failed``. A malformed frame closes
that connection with a logged error, never the process. With a shared secret the connection is authenticated both
ways before the worker's Hello (``shared.auth``); a worker that fails is logged (``worker_auth_failed``), closed,
and tried again every :data:`AUTH_RETRY_INTERVAL_S`.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from typing import TYPE_CHECKING, Callable

import msgspec
import structlog

from gateway.workers.breaker import CircuitBreaker
from gateway.workers.kv_booking import KvBooking
from gateway.workers.stream import RequestStream, error_code
from shared.auth import HANDSHAKE_TIMEOUT_S, AuthError, authenticate_worker
from shared.errors import ErrorCode, SluiceError
from shared.protocol import (
    Abort,
    Capacity,
    Drain,
    Failed,
    Finished,
    Generate,
    Hello,
    Pong,
    ProtocolError,
    TokenDelta,
    gateway_codec,
)

if TYPE_CHECKING:
    from gateway.upstream.request_body import UpstreamPrompt
    from gateway.workers.reservation import Reservation

log = structlog.get_logger("sluice.gateway")

RECONNECT_INTERVAL_S = 0.2
# Retry interval, seconds, before the first connection to a local worker the gateway just spawned: a forked worker
# listens about 50 ms after its spawn, and every 0.2 s of polling beyond that is cold start a request waits through.
# A connect to a Unix socket that is not there yet fails at once (ENOENT) and costs microseconds.
FIRST_CONNECT_INTERVAL_S = 0.01
CONNECT_TIMEOUT_S = 5.0
# Seconds before connecting again to a worker that failed authentication (a configuration error, not a blip).
AUTH_RETRY_INTERVAL_S = 5.0
# Prompt-block hashes remembered per worker for prefix-aware routing (about 64 K tokens of 16-token blocks per
# 4096 entries; oldest forgotten first, like the worker's own LRU prefix cache).
MAX_PREFIX_HASHES_PER_WORKER = 4096
# Floor of a worker's prefill backlog budget, tokens: one default engine step (worker.max_num_batched_tokens), so
# short prompts batch into one step even when the measured rate is low (a mostly-decoding worker).
MIN_PREFILL_BUDGET_TOKENS = 512



class WorkerClient:
    """One multiplexed connection to one worker, reconnected whenever it drops.

    Args:
        address: ``HOST:PORT`` or ``unix:PATH``.
        name: label for logs, metrics and ``/status``.
        on_capacity: called with (name, Capacity) on every capacity report.
        breaker: this worker's circuit breaker; None = a closed one with the default settings.
        first_connect_interval_s: retry interval until the first connection succeeds (a local worker just
            spawned: :data:`FIRST_CONNECT_INTERVAL_S`); None = :data:`RECONNECT_INTERVAL_S` throughout.
        secret: the shared secret this gateway proves and requires of the worker (``shared.auth``); None = accept
            only a worker without one.
    """

    def __init__(self, address: str, name: str,
                 on_capacity: Callable[[str, Capacity], None] | None = None,
                 breaker: CircuitBreaker | None = None, first_connect_interval_s: float | None = None,
                 secret: bytes | None = None) -> None:
        self.address = address
        self._secret = secret
        self.num_auth_failures = 0
        self.name = name
        self._first_connect_interval_s = first_connect_interval_s
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.on_change: Callable[[], None] | None = None  # set by the pool: capacity, status or request end
        self.num_reserved = 0  # reservations (dispatched or about to be) of this gateway on this worker
        self.kv_booking = KvBooking()  # their KV demand in blocks, shared prompt blocks counted once
        self.prefix_hashes: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hello: Hello | None = None
        self.capacity: Capacity | None = None
        self.capacity_at_s = 0.0
        self.last_token_at_s = -math.inf  # time.monotonic() of the last token of any request (deep readiness)
        self.connected_at_s = 0.0
        self.num_connections = 0
        self._on_capacity = on_capacity
        self._writer: asyncio.StreamWriter | None = None
        self._outbox: list[bytes] = []  # frames queued in this event-loop iteration (see _send)
        self._codec = gateway_codec()
        self._streams: dict[str, RequestStream] = {}
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.draining = False  # the gateway takes no new request to it (a scale-down): see mark_draining()
        # reservations whose prompt has not started on the worker (no first token), per tier priority:
        # priority → [reservations, their uncached prompt tokens]
        self.pending_prefill_by_priority: dict[int, list[int]] = {}

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
        """Return how many not-yet-started prompt tokens the worker may hold: ``prefill_queue_s`` seconds at its
        measured prefill rate (tokens/s of busy time, from capacity reports), at least
        :data:`MIN_PREFILL_BUDGET_TOKENS`. A worker that has measured none yet (just started) is taken to
        prefill at ``fallback_rate_tokens_per_s`` (its pool's: :meth:`WorkerPool.known_prefill_tokens_per_s`).
        Infinite when no rate is known at all or ``prefill_queue_s`` is 0 (no limit)."""
        rate = self.prefill_tokens_per_s or fallback_rate_tokens_per_s
        if prefill_queue_s <= 0 or rate <= 0:
            return float("inf")
        return max(MIN_PREFILL_BUDGET_TOKENS, rate * prefill_queue_s)

    @property
    def num_pending_prefill(self) -> int:
        """Reservations whose prompt has not started on the worker, all tiers."""
        return sum(count for count, _ in self.pending_prefill_by_priority.values())

    @property
    def pending_prefill_tokens(self) -> int:
        """Their uncached prompt tokens."""
        return sum(tokens for _, tokens in self.pending_prefill_by_priority.values())

    def pending_prefill_ahead(self, priority: int) -> tuple[int, int]:
        """Return (reservations, tokens) of not-yet-started prompts of tier priority ≥ ``priority``."""
        num, tokens = 0, 0
        for pending_priority, (count, pending_tokens) in self.pending_prefill_by_priority.items():
            if pending_priority >= priority:
                num += count
                tokens += pending_tokens
        return num, tokens

    def can_take(self, demand_blocks: int, prefill_tokens: int = 0, prefill_queue_s: float = 0.0,
                 priority: int = 0, fallback_prefill_tokens_per_s: float = 0.0) -> bool:
        """Return whether a request may be sent now (breaker, sequence slots, KV, prefill backlog).

        Args:
            demand_blocks: its KV demand in blocks (prompt + capped output).
            prefill_tokens: its prompt tokens the worker will have to prefill (uncached).
            prefill_queue_s: most seconds of not-yet-started prefill work (of its tier or higher) the worker may
                hold; 0 = no limit.
            priority: its tier's priority (the worker prefills higher ones first).
            fallback_prefill_tokens_per_s: the prefill rate, tokens/s, to assume while the worker has measured
                none (see :meth:`prefill_budget_tokens`).
        """
        if not self.ready or not self.breaker.available() or self.hello is None:
            return False
        if self.num_reserved >= self.hello.max_num_seqs:
            return False
        if prefill_queue_s > 0:
            num_ahead, tokens_ahead = self.pending_prefill_ahead(priority)
            budget_tokens = self.prefill_budget_tokens(prefill_queue_s, fallback_prefill_tokens_per_s)
            if num_ahead > 0 and tokens_ahead + prefill_tokens > budget_tokens:
                return False
        return self.total_kv_blocks - self.committed_kv_blocks >= demand_blocks

    def hold_prefill(self, reservation: "Reservation") -> None:
        """Count the reservation's prompt in the worker's prefill backlog until :meth:`prefill_started`."""
        entry = self.pending_prefill_by_priority.setdefault(reservation.priority, [0, 0])
        entry[0] += 1
        entry[1] += reservation.prefill_tokens

    def prefill_started(self, reservation: "Reservation") -> None:
        """The reservation's prompt started on the worker (first token, end, failure or release): it no longer
        counts in the worker's prefill backlog. Idempotent."""
        if not reservation.prefill_pending:
            return
        reservation.prefill_pending = False
        entry = self.pending_prefill_by_priority[reservation.priority]
        entry[0] -= 1
        entry[1] -= reservation.prefill_tokens
        if entry[0] == 0:
            del self.pending_prefill_by_priority[reservation.priority]
        self._changed()

    def cached_prefix_blocks(self, block_hashes: list[int]) -> int:
        """Return how many leading prompt blocks were recently sent to this worker (likely in its prefix cache)."""
        num_blocks = 0
        for block_hash in block_hashes:
            if block_hash not in self.prefix_hashes:
                break
            num_blocks += 1
        return num_blocks

    def remember_prefix(self, block_hashes: list[int]) -> None:
        """Record the prompt blocks sent to this worker (most recent last; the oldest are forgotten)."""
        for block_hash in block_hashes:
            self.prefix_hashes[block_hash] = None
            self.prefix_hashes.move_to_end(block_hash)
        while len(self.prefix_hashes) > MAX_PREFIX_HASHES_PER_WORKER:
            self.prefix_hashes.popitem(last=False)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

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

    def expect_exit(self) -> None:
        """The worker is being stopped: its disconnect is expected (logged at info, not as a warning) and the
        client does not reconnect to it."""
        self._closing = True

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
        stream = RequestStream(message.request_id, self)
        stream.reservation = reservation
        self._streams[message.request_id] = stream
        self._send(self._codec.encode(message))
        return stream

    def not_ready_reason(self) -> str | None:
        """Return why this worker takes no request now (``/readyz``), or None when it can."""
        if self.ready:
            return None
        if self.draining or (self.capacity is not None and self.capacity.draining):
            return f"worker {self.name}: draining"
        return f"worker {self.name} at {self.address}: " + ("not connected" if self._writer is None else "no Hello yet")

    def mark_draining(self) -> None:
        """Send no new request to this worker from now on (``ready`` turns False); the running ones go on."""
        self.draining = True
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
        stream.done = True
        if self._writer is not None and not self._writer.is_closing():
            self._send(self._codec.encode(Abort(request_id)))

    def _send(self, frame: bytes) -> None:
        """Queue one encoded frame for the worker. The frames queued in one event-loop iteration leave together,
        in order, in one write at the end of it (one system call for a burst of dispatches and aborts instead of
        one each); without a running loop (shutdown) the frame is written at once."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
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
                first = self.num_connections == 0 and self._first_connect_interval_s is not None
                await asyncio.sleep(self._first_connect_interval_s if first else RECONNECT_INTERVAL_S)
                continue
            failures = 0
            self._codec = gateway_codec()
            try:
                hello = await self._handshake(reader, writer)
            except asyncio.CancelledError:
                writer.close()
                raise
            if hello is None:
                writer.close()
                await asyncio.sleep(AUTH_RETRY_INTERVAL_S if self.num_auth_failures else RECONNECT_INTERVAL_S)
                continue
            self.num_auth_failures = 0
            self._writer = writer
            self.num_connections += 1
            self.connected_at_s = time.time()
            self._on_message(hello)
            reason = await self._read_loop(reader)
            self._disconnect(reason)
            if not self._closing:
                await asyncio.sleep(RECONNECT_INTERVAL_S)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Hello | None:
        """Authenticate a new connection (``shared.auth``) and return the worker's Hello; None when it failed
        (logged; ``num_auth_failures`` counts refusals in a row)."""
        try:
            return await asyncio.wait_for(authenticate_worker(reader, writer, self._codec, self._secret),
                                          HANDSHAKE_TIMEOUT_S)
        except AuthError as exc:
            self.num_auth_failures += 1
            if self.num_auth_failures in (1, 10) or self.num_auth_failures % 100 == 0:
                log.error("worker_auth_failed", worker=self.name, address=self.address, reason=str(exc),
                          attempts=self.num_auth_failures)
        except ProtocolError as exc:
            log.error("worker_malformed_frame", worker=self.name, error=str(exc))
        except TimeoutError:
            log.warning("worker_handshake_timeout", worker=self.name, timeout_s=HANDSHAKE_TIMEOUT_S)
        except (ConnectionError, OSError) as exc:
            log.info("worker_connect_retry", worker=self.name, address=self.address, error=str(exc))
        return None

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
        self._ready.clear()
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._fail(SluiceError(ErrorCode.WORKER_FAILED, f"worker {self.name} failed: {reason}"))
        self.prefix_hashes.clear()  # a new process has an empty prefix cache
        self._changed()
