"""The worker's socket server: gateways connect, send ``Generate``/``Abort``, and receive tokens and capacity.

One asyncio loop owns the sockets; the engine steps in one dedicated thread. Arrivals and aborts are applied
between steps, so an ``Abort`` frees the sequence's blocks before the next step starts.

::

    gateway conn ──frames──▶ reader task ──▶ pending adds/aborts ──┐
                                                                   ▼
                                       engine loop: apply pending → step (thread) → dispatch events
    gateway conn ◀──TokenDelta/Finished/Capacity─────────────────────┘

With a shared secret, a new connection first proves it (``shared.auth``: Challenge → Authenticate → Authenticated)
and only then gets ``Hello``, capacity reports or any say over requests; a peer that fails is logged
(``gateway_auth_failed``) and closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import structlog

from shared.addresses import UnixAddress, parse_address
from shared.auth import HANDSHAKE_TIMEOUT_S, AuthError, verify_gateway
from shared.errors import ErrorCode
from shared.protocol import (
    Abort,
    Capacity,
    Drain,
    Failed,
    Finished,
    Generate,
    Hello,
    Ping,
    Pong,
    ProtocolError,
    TokenDelta,
    worker_codec,
)
from worker.engine import Engine, StepResult

log = structlog.get_logger("sluice.worker")


@dataclass(eq=False)
class _Connection:
    conn_id: int
    writer: asyncio.StreamWriter
    codec: object
    request_ids: set[str] = field(default_factory=set)  # internal ids owned by this connection
    closed: bool = False

    def send(self, message) -> None:
        if not self.closed:
            self.writer.write(self.codec.encode(message))


def _internal_id(conn_id: int, request_id: str) -> str:
    return f"{conn_id}:{request_id}"


def _external_id(internal_id: str) -> str:
    return internal_id.split(":", 1)[1]


class WorkerServer:
    """Serve one :class:`Engine` to any number of gateway connections.

    Args:
        engine: the engine (model or simulator).
        hello: the ``Hello`` sent on every new connection.
        capacity_fn: returns the current :class:`Capacity` (reads scheduler and engine counters).
        max_model_len_tokens: context length; longer prompts fail with ``context_length_exceeded``.
        capacity_interval_s: period of capacity reports.
        secret: the shared secret every connection must prove before anything else (``shared.auth``); None = no
            authentication (``Hello`` at once).
        executor: the one-thread executor that runs the engine's steps: the thread that loaded the model (its
            OpenMP team is the only one); None = a new one.
    """

    def __init__(
        self,
        engine: Engine,
        hello: Hello,
        capacity_fn: Callable[[], Capacity],
        max_model_len_tokens: int,
        capacity_interval_s: float = 0.25,
        secret: bytes | None = None,
        executor: concurrent.futures.ThreadPoolExecutor | None = None,
    ) -> None:
        self.engine = engine
        self.hello = hello
        self.capacity_fn = capacity_fn
        self.max_model_len_tokens = max_model_len_tokens
        self.capacity_interval_s = capacity_interval_s
        self._secret = secret
        self.draining = False
        self._connections: dict[int, _Connection] = {}
        self._owner: dict[str, _Connection] = {}
        self._pending_adds: list[tuple[str, Generate, float]] = []
        self._pending_aborts: list[str] = []
        self._wake = asyncio.Event()
        self._conn_ids = itertools.count(1)
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._engine_task: asyncio.Task | None = None
        self._capacity_task: asyncio.Task | None = None
        self._server: asyncio.AbstractServer | None = None
        self._last_capacity: Capacity | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, listen: str) -> None:
        """Listen on ``HOST:PORT`` or ``unix:PATH`` and start the engine loop.

        Raises:
            ConfigError: ``listen`` is no such address (:func:`shared.addresses.parse_address`).
            OSError: it cannot be bound.
        """
        address = parse_address(listen, "--listen")
        if isinstance(address, UnixAddress):
            if os.path.exists(address.path):
                os.unlink(address.path)
            self._server = await asyncio.start_unix_server(self._handle, path=address.path)
        else:
            self._server = await asyncio.start_server(self._handle, host=address.host or "127.0.0.1",
                                                      port=address.port)
        self._engine_task = asyncio.create_task(self._engine_loop(), name="engine-loop")
        self._capacity_task = asyncio.create_task(self._capacity_loop(), name="capacity-loop")
        log.info("worker_listening", listen=listen, worker_id=self.hello.worker_id, backend=self.hello.backend,
                 authenticated=self._secret is not None)

    async def close(self) -> None:
        """Stop listening, cancel the loops, close every connection."""
        if self._server is not None:
            self._server.close()
        for task in (self._engine_task, self._capacity_task):
            if task is not None:
                task.cancel()
        for task in (self._engine_task, self._capacity_task):
            if task is not None:
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for conn in list(self._connections.values()):
            conn.closed = True
            conn.writer.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def serve_forever(self, listen: str) -> None:
        await self.start(listen)
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    # ------------------------------------------------------------------ connections

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            codec) -> bool:
        """Return whether the new connection proved the shared secret (True at once without one)."""
        if self._secret is None:
            return True
        peer = str(writer.get_extra_info("peername") or "unix socket")
        try:
            await asyncio.wait_for(verify_gateway(reader, writer, codec, self._secret), HANDSHAKE_TIMEOUT_S)
            return True
        except (AuthError, ProtocolError) as exc:
            reason = str(exc)
        except TimeoutError:
            reason = f"no answer to the challenge within {HANDSHAKE_TIMEOUT_S:g} s"
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            reason = f"connection lost during authentication: {exc}"
        log.error("gateway_auth_failed", peer=peer, reason=reason)
        writer.close()
        return False

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        codec = worker_codec()
        if not await self._authenticate(reader, writer, codec):
            return
        conn = _Connection(next(self._conn_ids), writer, codec)
        self._connections[conn.conn_id] = conn
        log.info("gateway_connected", conn_id=conn.conn_id)
        try:
            conn.send(self.hello)
            conn.send(self.capacity_fn())
            await writer.drain()
            while True:
                message = await conn.codec.read(reader)
                if message is None:
                    break
                self._on_message(conn, message)
        except ProtocolError as exc:
            log.error("malformed_frame_closing_connection", conn_id=conn.conn_id, error=str(exc))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            conn.closed = True
            self._connections.pop(conn.conn_id, None)
            for internal_id in list(conn.request_ids):
                self._pending_aborts.append(internal_id)
                self.engine.request_abort(internal_id)
            self._wake.set()
            writer.close()
            log.info("gateway_disconnected", conn_id=conn.conn_id, aborted=len(conn.request_ids))

    def _on_message(self, conn: _Connection, message) -> None:
        match message:
            case Generate():
                self._on_generate(conn, message)
            case Abort(request_id=request_id):
                internal_id = _internal_id(conn.conn_id, request_id)
                if internal_id in conn.request_ids:
                    self._pending_aborts.append(internal_id)
                    self.engine.request_abort(internal_id)
                    self._wake.set()
            case Drain():
                self.draining = True
                log.info("worker_draining")
            case Ping(nonce=nonce):
                conn.send(Pong(nonce=nonce))

    def _on_generate(self, conn: _Connection, msg: Generate) -> None:
        internal_id = _internal_id(conn.conn_id, msg.request_id)
        error = self._validate(msg, internal_id in conn.request_ids)
        if error is not None:
            conn.send(Failed(msg.request_id, error[0].value, error[1]))
            return
        conn.request_ids.add(internal_id)
        self._owner[internal_id] = conn
        self._pending_adds.append((internal_id, msg, time.monotonic()))
        self._wake.set()

    def _validate(self, msg: Generate, duplicate: bool) -> tuple[ErrorCode, str] | None:
        if self.draining:
            return ErrorCode.DRAINING, "worker is draining and takes no new requests"
        if duplicate:
            return ErrorCode.INVALID_REQUEST, f"request id {msg.request_id!r} is already running"
        if not msg.prompt_token_ids:
            return ErrorCode.INVALID_VALUE, "prompt is empty"
        if len(msg.prompt_token_ids) >= self.max_model_len_tokens:
            return (
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"prompt of {len(msg.prompt_token_ids)} tokens leaves no room in the context of "
                f"{self.max_model_len_tokens} tokens",
            )
        if msg.max_tokens < 1:
            return ErrorCode.INVALID_VALUE, "max_tokens must be at least 1"
        return None

    # ------------------------------------------------------------------ engine loop

    def _apply_pending(self) -> None:
        aborts, self._pending_aborts = self._pending_aborts, []
        for internal_id in aborts:
            self.engine.abort(internal_id)
            self._forget(internal_id)
        if aborts:
            self._broadcast_capacity()  # the freed blocks and slots, now rather than at the next report
        adds, self._pending_adds = self._pending_adds, []
        for internal_id, msg, received_s in adds:
            if internal_id in self._owner:  # not aborted meanwhile
                self.engine.add(internal_id, msg, msg.priority, received_s)

    def _forget(self, internal_id: str) -> None:
        conn = self._owner.pop(internal_id, None)
        if conn is not None:
            conn.request_ids.discard(internal_id)

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.engine.has_work():
                self._wake.clear()
                if not self._pending_adds and not self._pending_aborts:
                    await self._wake.wait()
                continue
            try:
                result = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception:
                log.exception("engine_step_failed")
                self._fail_all("engine step failed; see the worker log")
                continue
            changed = self._dispatch(result)
            if changed:
                self._broadcast_capacity()
            await self._drain_writers()

    def _dispatch(self, result: StepResult) -> bool:
        changed = False
        for event in result.events:
            conn = self._owner.get(event.request_id)
            if conn is None:
                continue
            request_id = _external_id(event.request_id)
            if event.new_token_ids:
                latency_ms = result.first_token_latency_ms.get(event.request_id)
                found = result.logprobs.get(event.request_id)
                if found is None:
                    conn.send(TokenDelta(request_id, event.new_token_ids, None, latency_ms))
                else:
                    conn.send(TokenDelta(request_id, event.new_token_ids, [found.logprob], latency_ms,
                                         [found.top_token_ids], [found.top_logprobs]))
            error = event.error
            if error:
                code = event.error_code or ErrorCode.CONTEXT_LENGTH_EXCEEDED.value
                conn.send(Failed(request_id, code, error))
                self._forget(event.request_id)
                changed = True
            elif event.finish_reason is not None:
                conn.send(Finished(request_id, event.finish_reason, event.prompt_tokens, event.cached_tokens,
                                   event.completion_tokens))
                self._forget(event.request_id)
                changed = True
        return changed

    def _fail_all(self, message: str) -> None:
        for internal_id, conn in list(self._owner.items()):
            self.engine.abort(internal_id)
            conn.send(Failed(_external_id(internal_id), ErrorCode.WORKER_FAILED.value, message))
            self._forget(internal_id)

    async def _drain_writers(self) -> None:
        for conn in list(self._connections.values()):
            if conn.closed:
                continue
            try:
                await conn.writer.drain()
            except ConnectionError:
                conn.closed = True

    # ------------------------------------------------------------------ capacity

    def _broadcast_capacity(self) -> None:
        capacity = self.capacity_fn()
        if self.draining:
            capacity = msgspec.structs.replace(capacity, draining=True)
        self._last_capacity = capacity
        for conn in self._connections.values():
            conn.send(capacity)

    async def _capacity_loop(self) -> None:
        while True:
            await asyncio.sleep(self.capacity_interval_s)
            self._broadcast_capacity()
            await self._drain_writers()
