"""Connections to workers: one multiplexed connection per worker, demultiplexed by request id.

::

    AdmissionController ── try_reserve() ──▶ WorkerPool ──▶ Reservation(worker) ──▶ WorkerClient ── frames ──▶ worker
                                                                                     │ reader task: Hello, Capacity,
                                                                                     ▼ TokenDelta, Finished, Failed
                                RequestStream (one per request id; coalesces token ids, bounded by max_tokens)

A :class:`WorkerClient` keeps reconnecting to its address (a restarted local worker reappears on the same socket
path). A connection that dies fails every request in flight on it with ``worker_failed``. A malformed frame closes
that connection with a logged error, never the process.

:class:`WorkerPool` is the admission controller's :class:`~gateway.admission.CapacityView` (DESIGN.md, step 6):
a worker may take a request when it is connected, not draining, its circuit breaker lets a request through, it
runs fewer than ``max_num_seqs`` of this gateway's requests and the KV blocks not yet promised to requests cover
the new one's demand (prompt + capped output). Among those, the one holding the longest cached prefix of the
prompt wins (a gateway-side index of the prompt blocks recently sent to each worker; session affinity falls out of
it), then the one with the most free KV.

A worker also takes no new request while the prompts already sent to it and not yet started (no first token), of
the request's tier or a higher one, hold more than ``prefill_queue_s`` seconds of prefill work at its measured
prefill rate (one such prompt is always allowed). Lower tiers' prompts do not count: the worker's scheduler
prefills higher tiers first (``worker.scheduler``), so a vip request overtakes them there. The backlog then waits in the gateway's tier queues, where priority, deadlines and early rejection act,
instead of in the worker's FIFO, where they cannot: Mooncake (FAST'25) and SGLang's router keep the same rule of
a short per-instance queue behind a global scheduler.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import structlog

from gateway.breaker import BreakerState, CircuitBreaker
from shared.config import BreakerConfig
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

log = structlog.get_logger("sluice.gateway")

RECONNECT_INTERVAL_S = 0.2
# Retry interval, seconds, before the first connection to a local worker the gateway just spawned: a forked worker
# listens about 50 ms after its spawn, and every 0.2 s of polling beyond that is cold start a request waits through.
# A connect to a Unix socket that is not there yet fails at once (ENOENT) and costs microseconds.
FIRST_CONNECT_INTERVAL_S = 0.01
CONNECT_TIMEOUT_S = 5.0
# Prompt-block hashes remembered per worker for prefix-aware routing (about 64 K tokens of 16-token blocks per
# 4096 entries; oldest forgotten first, like the worker's own LRU prefix cache).
MAX_PREFIX_HASHES_PER_WORKER = 4096
# Floor of a worker's prefill backlog budget, tokens: one default engine step (worker.max_num_batched_tokens), so
# short prompts batch into one step even when the measured rate is low (a mostly-decoding worker).
MIN_PREFILL_BUDGET_TOKENS = 512


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
        self._has_update = False  # a reply arrived that next_update has not returned yet
        self._waiter: asyncio.Future[None] | None = None  # next_update is waiting on it
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
        self._wake()

    def _finish(self, finished: Finished) -> None:
        self._started()
        self._finished = finished
        self.done = True
        self._wake()

    def _fail(self, error: SluiceError) -> None:
        self._started()
        self._error = error
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._has_update = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_update(self, timeout_s: float) -> StreamUpdate:
        """Wait for new tokens or the end of the request.

        Raises:
            SluiceError: the worker failed the request or its connection died (``worker_failed`` or the worker's
                code), or nothing arrived within ``timeout_s`` (``worker_timeout``).
        """
        if not self._has_update:
            await self._wait(timeout_s)
        self._has_update = False
        token_ids, self._token_ids = self._token_ids, []
        latency_ms, self._first_token_latency_ms = self._first_token_latency_ms, None
        if token_ids or self._finished is not None:
            return StreamUpdate(token_ids, latency_ms, self._finished)
        if self._error is not None:
            raise self._error
        return StreamUpdate([], latency_ms, None)

    async def _wait(self, timeout_s: float) -> None:
        """Wait until a reply arrives, on one future and one timer (``asyncio.wait_for`` would add a task per wait).

        Raises:
            SluiceError: ``worker_timeout`` when nothing arrived within ``timeout_s``.
        """
        if timeout_s > 0:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(timeout_s, _resolve, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        if not self._has_update:
            raise SluiceError(ErrorCode.WORKER_TIMEOUT, f"the worker sent no token for {timeout_s:g} s")


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class WorkerClient:
    """One multiplexed connection to one worker, reconnected whenever it drops.

    Args:
        address: ``HOST:PORT`` or ``unix:PATH``.
        name: label for logs, metrics and ``/status``.
        on_capacity: called with (name, Capacity) on every capacity report.
        breaker: this worker's circuit breaker; None = a closed one with the default settings.
        first_connect_interval_s: retry interval until the first connection succeeds (a local worker just
            spawned: :data:`FIRST_CONNECT_INTERVAL_S`); None = :data:`RECONNECT_INTERVAL_S` throughout.
    """

    def __init__(self, address: str, name: str,
                 on_capacity: Callable[[str, Capacity], None] | None = None,
                 breaker: CircuitBreaker | None = None, first_connect_interval_s: float | None = None) -> None:
        self.address = address
        self.name = name
        self._first_connect_interval_s = first_connect_interval_s
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.on_change: Callable[[], None] | None = None  # set by the pool: capacity, status or request end
        self.num_reserved = 0  # reservations (dispatched or about to be) of this gateway on this worker
        self.reserved_blocks = 0  # their KV demand in blocks (prompt + capped output each)
        self.prefix_hashes: collections.OrderedDict[bytes, None] = collections.OrderedDict()
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
    def committed_kv_blocks(self) -> int:
        """KV blocks promised or in use: this gateway's reservations, or the worker's used blocks when more."""
        used = self.capacity.used_kv_blocks if self.capacity is not None else 0
        return max(self.reserved_blocks, used)

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

    def cached_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        """Return how many leading prompt blocks were recently sent to this worker (likely in its prefix cache)."""
        num_blocks = 0
        for block_hash in block_hashes:
            if block_hash not in self.prefix_hashes:
                break
            num_blocks += 1
        return num_blocks

    def remember_prefix(self, block_hashes: list[bytes]) -> None:
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

    def start_request(self, message: Generate, reservation: "Reservation | None" = None) -> RequestStream:
        """Register a stream for ``message.request_id`` and send the ``Generate`` frame.

        Args:
            message: the request.
            reservation: its reservation on this worker; its prefill backlog entry ends with the first token.

        Raises:
            SluiceError: ``worker_failed`` when the connection is down (the request may be retried elsewhere).
        """
        if self._writer is None or self.hello is None:
            raise SluiceError(ErrorCode.WORKER_FAILED, f"worker {self.name} is not connected")
        stream = RequestStream(message.request_id, self)
        stream.reservation = reservation
        self._streams[message.request_id] = stream
        self._writer.write(self._codec.encode(message))
        return stream

    def mark_draining(self) -> None:
        """Send no new request to this worker from now on (``ready`` turns False); the running ones go on."""
        self.draining = True
        self._changed()

    def send_drain(self) -> None:
        """Send the protocol's ``Drain``: the worker finishes what it runs and refuses new requests."""
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(self._codec.encode(Drain()))

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
                first = self.num_connections == 0 and self._first_connect_interval_s is not None
                await asyncio.sleep(self._first_connect_interval_s if first else RECONNECT_INTERVAL_S)
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
        if writer is not None:
            writer.close()
            log.warning("worker_disconnected", worker=self.name, reason=reason, in_flight=len(self._streams))
        self.hello = None
        self.capacity = None
        self._ready.clear()
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._fail(SluiceError(ErrorCode.WORKER_FAILED, f"worker {self.name} failed: {reason}"))
        self.prefix_hashes.clear()  # a new process has an empty prefix cache
        self._changed()


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size_tokens: int) -> list[bytes]:
    """Return the chained hashes of the prompt's full blocks (each covers its parent's hash and its token ids).

    The same chaining as the worker's prefix cache (DESIGN.md, KV cache), so equal hashes mean equal prefixes.
    """
    hashes: list[bytes] = []
    parent = b""
    num_full_blocks = len(prompt_token_ids) // block_size_tokens
    for block_idx in range(num_full_blocks):
        tokens = prompt_token_ids[block_idx * block_size_tokens:(block_idx + 1) * block_size_tokens]
        parent = hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in tokens),
                                 digest_size=16).digest()
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class Reservation:
    """Room held on one worker for one admitted request (one choice), from admission until it ends.

    Attributes:
        reservation_id: unique per pool.
        worker: the worker the request goes to.
        demand_blocks: KV blocks held (prompt + capped output).
        verdict_given: the breaker heard whether the worker served it (else releasing counts it as abandoned).
    """

    reservation_id: int
    worker: WorkerClient
    demand_blocks: int
    verdict_given: bool = False
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    prefill_tokens: int = 0  # uncached prompt tokens, in the worker's prefill backlog while prefill_pending
    prefill_pending: bool = True
    priority: int = 0  # the request's tier priority as the worker orders prefills


class WorkerPool:
    """The workers this gateway serves from: the admission controller's capacity view and the router.

    Args:
        clients: one per worker.
        on_change: called whenever capacity may have changed (a capacity report, Hello, a lost connection, a
            released reservation); the app points it at ``AdmissionController.on_capacity_changed``.
    """

    def __init__(self, clients: list[WorkerClient], on_change: Callable[[], None] | None = None,
                 prefill_queue_s: float = 0.0) -> None:
        self.clients = clients
        self.prefill_queue_s = prefill_queue_s  # see the module docstring; 0 = no prefill backlog limit
        # tier name → priority, as the workers order prefills; {} = every tier alike (the FIFO baseline)
        self.tier_priorities: dict[str, int] = {}
        self._reservation_ids = itertools.count(1)
        self._known_prefill_tokens_per_s = 0.0
        self.on_change = on_change
        for client in clients:
            client.on_change = self._changed

    @classmethod
    def make_breaker(cls, config: BreakerConfig) -> CircuitBreaker:
        """Return a new breaker with the configured threshold and cooldown."""
        return CircuitBreaker(config.failure_threshold, config.cooldown_s)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def ready_clients(self) -> list[WorkerClient]:
        return [c for c in self.clients if c.ready]

    @property
    def is_ready(self) -> bool:
        return any(c.ready for c in self.clients)

    def max_model_len_tokens(self, configured_tokens: int) -> int:
        """Return the context length: the config's, lowered to what the ready workers announce."""
        lengths = [c.hello.max_model_len_tokens for c in self.ready_clients() if c.hello is not None]
        return min([configured_tokens, *lengths])

    def known_prefill_tokens_per_s(self) -> float:
        """Return the prefill rate, tokens/s, to assume for a worker that has measured none yet: the mean over
        the workers that have, else the last such mean (kept through a scale to zero); 0.0 = never measured.

        Workers of one pool run the same model on the same kind of device, so a worker that just started prefills
        at about its siblings' rate. Without it, the backlog limit would not hold for the first capacity reports
        of a new worker, and a burst that meets a cold start would be sent to the new worker whole, past the
        tier queues where priority, deadlines and early rejection act.
        """
        rates = [c.prefill_tokens_per_s for c in self.clients if c.prefill_tokens_per_s > 0]
        if rates:
            self._known_prefill_tokens_per_s = sum(rates) / len(rates)
        return self._known_prefill_tokens_per_s

    # ------------------------------------------------------------------ CapacityView

    def _serving_clients(self) -> list[WorkerClient]:
        """Ready workers whose breaker is not open (closed, or half-open and able to probe soon)."""
        return [c for c in self.ready_clients() if c.breaker.state is not BreakerState.OPEN]

    def try_reserve(self, demand_blocks: int, tier: str, prompt_token_ids: Sequence[int],
                    avoid: object | None = None) -> Reservation | None:
        """Pick a worker for a request and hold ``demand_blocks`` KV blocks and one sequence slot on it.

        Args:
            demand_blocks: KV blocks the request may need (prompt + capped output).
            tier: the request's tier (not used for the choice today).
            prompt_token_ids: the prompt, to find the worker with the longest cached prefix.
            avoid: a worker (:class:`WorkerClient`) to skip while another ready worker with an available breaker
                exists: a retry goes to another worker when there is one.

        Returns:
            The reservation, or None when no worker has room now.
        """
        num_prompt_tokens = len(prompt_token_ids)
        priority = self.tier_priorities.get(tier, 0)
        fallback_rate = self.known_prefill_tokens_per_s() if self.prefill_queue_s > 0 else 0.0
        candidates = [c for c in self.clients
                      if c.can_take(demand_blocks, num_prompt_tokens, self.prefill_queue_s, priority, fallback_rate)]
        if avoid is not None and any(c is not avoid and c.ready and c.breaker.available() for c in self.clients):
            candidates = [c for c in candidates if c is not avoid]
        if not candidates:
            return None
        hashes_by_block_size: dict[int, list[bytes]] = {}

        def rank(client: WorkerClient) -> tuple[int, int, int]:
            block_size = client.block_size_tokens
            if block_size not in hashes_by_block_size:
                hashes_by_block_size[block_size] = prompt_block_hashes(prompt_token_ids, block_size)
            cached = client.cached_prefix_blocks(hashes_by_block_size[block_size])
            free = client.total_kv_blocks - client.committed_kv_blocks
            return cached, free, -client.num_reserved

        best = max(candidates, key=rank)
        if not best.breaker.allow_request():
            return None
        best.num_reserved += 1
        best.reserved_blocks += demand_blocks
        block_hashes = hashes_by_block_size.get(best.block_size_tokens)
        if block_hashes is None:
            block_hashes = prompt_block_hashes(prompt_token_ids, best.block_size_tokens)
        prefill_tokens = max(1, num_prompt_tokens - best.cached_prefix_blocks(block_hashes) * best.block_size_tokens)
        reservation = Reservation(next(self._reservation_ids), best, demand_blocks, block_hashes=block_hashes,
                                  prefill_tokens=prefill_tokens, priority=priority)
        best.hold_prefill(reservation)
        return reservation

    def release(self, reservation: object) -> None:
        """Give back a reservation; a request that ended without a breaker verdict counts as abandoned."""
        if not isinstance(reservation, Reservation):
            return
        worker = reservation.worker
        worker.num_reserved -= 1
        worker.reserved_blocks -= reservation.demand_blocks
        worker.prefill_started(reservation)
        if not reservation.verdict_given:
            worker.breaker.on_abandoned()

    def num_serving_workers(self) -> int:
        """Return the ready workers whose breaker is not open."""
        return len(self._serving_clients())

    def num_starting_workers(self) -> int:
        """Return workers that will serve soon without having said Hello yet (none in a fixed pool)."""
        return 0

    def total_kv_blocks(self) -> int:
        """Return the KV blocks of ready workers whose breaker is not open; 0 = no worker can serve."""
        return sum(c.total_kv_blocks for c in self._serving_clients())

    def total_sequence_slots(self) -> int:
        """Return ``max_num_seqs`` summed over ready workers whose breaker is not open."""
        return sum(c.hello.max_num_seqs for c in self._serving_clients() if c.hello is not None)

    def block_size_tokens(self) -> int:
        """Return tokens per KV block (the first ready worker's; 16 before any said Hello)."""
        ready = self.ready_clients()
        return ready[0].block_size_tokens if ready else 16

    def drain_rate_tokens_per_s(self) -> float:
        """Return the rate at which the workers work off prompt + output tokens, summed over serving workers.

        Per worker: its measured prefill + decode tokens/s. Both are tokens per second of the same busy steps
        (a step prefills prompt chunks and decodes running sequences together), so their sum is the work done per
        busy second. 0.0 when nothing is measured yet.
        """
        total = 0.0
        for client in self._serving_clients():
            capacity = client.capacity
            if capacity is not None:
                total += capacity.prefill_tokens_per_s + capacity.decode_tokens_per_s
        return total

    def sequence_rates_tokens_per_s(self) -> tuple[float, float] | None:
        """Return (prefill, decode) tokens/s that one running sequence gets on a busy serving worker now.

        Per busy worker (one that reported running sequences and a measured decode rate): prefill at the worker's
        prompt tokens per second of its prefilling steps (``Capacity.sequence_prefill_tokens_per_s``, else its
        prefill rate per busy second); decode at its measured decode steps per second (``Capacity.
        sequence_decode_tokens_per_s``: a decode step advances every running sequence by one token), or, from a
        worker that does not report it, its decode tokens/s ÷ its running sequences. Each is the mean over those
        workers (prefill 0.0 when no busy worker has measured it). Admission turns these into how long an admitted
        request holds its sequence slot. None when no busy worker has measured its decode rate.
        """
        prefill_rates, decode_rates = [], []
        for client in self._serving_clients():
            capacity = client.capacity
            if capacity is None or capacity.num_running <= 0 or capacity.decode_tokens_per_s <= 0:
                continue
            decode_rates.append(capacity.sequence_decode_tokens_per_s
                                or capacity.decode_tokens_per_s / capacity.num_running)
            prefill = capacity.sequence_prefill_tokens_per_s or capacity.prefill_tokens_per_s
            if prefill > 0:
                prefill_rates.append(prefill)
        if not decode_rates:
            return None
        prefill = sum(prefill_rates) / len(prefill_rates) if prefill_rates else 0.0
        return prefill, sum(decode_rates) / len(decode_rates)

    def kv_used_fraction(self) -> float:
        """Return committed ÷ total KV blocks over serving workers (reservations or reported use, the larger)."""
        clients = self._serving_clients()
        total = sum(c.total_kv_blocks for c in clients)
        return sum(min(c.committed_kv_blocks, c.total_kv_blocks) for c in clients) / total if total else 0.0

    # ------------------------------------------------------------------ breaker verdicts and routing memory

    def dispatched(self, reservation: Reservation) -> None:
        """Remember that the reservation's prompt was sent to its worker (prefix-aware routing)."""
        reservation.worker.remember_prefix(reservation.block_hashes)

    def record_success(self, reservation: Reservation) -> None:
        """The worker served the request (first token or a clean answer): tell its breaker once."""
        if not reservation.verdict_given:
            reservation.verdict_given = True
            reservation.worker.breaker.on_success()

    def record_failure(self, reservation: Reservation) -> None:
        """The worker failed or timed out on the request: count it against its breaker."""
        reservation.verdict_given = True
        reservation.worker.breaker.on_failure()
        self._changed()

    # ------------------------------------------------------------------ lifecycle

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
                "backend": c.backend,
                "simulator": c.backend == "sim",
                "breaker": c.breaker.snapshot(),
                "in_flight": c.num_in_flight,
                "reservations": c.num_reserved,
                "pending_prefill": c.num_pending_prefill,
                "reserved_kv_blocks": c.reserved_blocks,
                "connections": c.num_connections,
                "hello": msgspec.structs.asdict(c.hello) if c.hello else None,
                "capacity": msgspec.structs.asdict(c.capacity) if c.capacity else None,
                "capacity_age_s": round(now_s - c.capacity_at_s, 3) if c.capacity else None,
            }
            for c in self.clients
        ]
