"""The connection life of one worker address: connect, authenticate, read frames, reconnect.

:class:`WorkerConnector` owns the socket loop and nothing else; :class:`~gateway.workers.client.WorkerClient`
multiplexes requests over whatever connection it reports::

    connect ──▶ handshake (shared.auth, Hello) ──▶ on_open(writer, codec, hello) ──▶ read frames ──▶ on_message
       ▲                                                                                     │ EOF / error
       └──────────────── sleep (reconnect, or auth retry) ◀── on_close(reason) ◀─────────────┘

A refused handshake (wrong secret) is logged as ``worker_auth_failed`` and retried every
:data:`AUTH_RETRY_INTERVAL_S`; a malformed frame ends that connection with a logged error, never the process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import structlog

from shared.addresses import UnixAddress, parse_address
from shared.auth import HANDSHAKE_TIMEOUT_S, AuthError, authenticate_worker
from shared.protocol import FrameCodec, FrameSplitter, Hello, ProtocolError, gateway_codec

log = structlog.get_logger("sluice.gateway")

RECONNECT_INTERVAL_S = 0.2
# Retry interval, seconds, before the first connection to a local worker the gateway just spawned: a forked worker
# listens about 50 ms after its spawn, and every 0.2 s of polling beyond that is cold start a request waits through.
# A connect to a Unix socket that is not there yet fails at once (ENOENT) and costs microseconds.
FIRST_CONNECT_INTERVAL_S = 0.01
CONNECT_TIMEOUT_S = 5.0
READ_CHUNK_BYTES = 256 * 1024  # most bytes taken from the connection per read (its frames are decoded together)
# Seconds before connecting again to a worker that failed authentication (a configuration error, not a blip).
AUTH_RETRY_INTERVAL_S = 5.0


class WorkerConnector:
    """Keep one authenticated connection to a worker address open, reconnecting whenever it drops.

    Args:
        address: ``HOST:PORT`` or ``unix:PATH``.
        name: the worker's label in logs.
        secret: the shared secret this gateway proves and requires of the worker; None = a worker without one.
        first_connect_interval_s: retry interval until the first connection succeeds; None =
            :data:`RECONNECT_INTERVAL_S` throughout.
        on_open: ``(writer, codec, hello)`` of a new authenticated connection (the codec reads and writes it).
        on_message: every frame read after the Hello.
        on_close: ``(reason)`` when the connection ends (EOF, reset, malformed frame).
        is_closing: True once the owner stops (no reconnect).
    """

    def __init__(self, address: str, name: str, *, secret: bytes | None, first_connect_interval_s: float | None,
                 on_open: Callable[[asyncio.StreamWriter, FrameCodec, Hello], None],
                 on_message: Callable[[msgspec.Struct], None], on_close: Callable[[str], None],
                 is_closing: Callable[[], bool]) -> None:
        self.address = address
        self.name = name
        self._secret = secret
        self._first_connect_interval_s = first_connect_interval_s
        self._on_open = on_open
        self._on_message = on_message
        self._on_close = on_close
        self._is_closing = is_closing
        self.num_auth_failures = 0  # refused handshakes in a row
        self.last_handshake_failure: str | None = None  # why the last handshake failed, until one succeeds
        self.num_opened = 0

    async def run(self) -> None:
        """Connect, read and reconnect until ``is_closing()``; cancel the task running it to stop at once."""
        failures = 0
        while not self._is_closing():
            try:
                reader, writer = await asyncio.wait_for(self._open(), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as exc:
                failures += 1
                if failures in (1, 50) or failures % 300 == 0:
                    log.info("worker_connect_retry", worker=self.name, address=self.address, error=str(exc))
                first = self.num_opened == 0 and self._first_connect_interval_s is not None
                await asyncio.sleep(self._first_connect_interval_s if first else RECONNECT_INTERVAL_S)
                continue
            failures = 0
            codec = gateway_codec()
            try:
                hello = await self._handshake(reader, writer, codec)
            except asyncio.CancelledError:
                writer.close()
                raise
            if hello is None:
                writer.close()
                await asyncio.sleep(AUTH_RETRY_INTERVAL_S if self.num_auth_failures else RECONNECT_INTERVAL_S)
                continue
            self.num_auth_failures = 0
            self.last_handshake_failure = None
            self.num_opened += 1
            self._on_open(writer, codec, hello)
            self._on_close(await self._read_loop(reader, codec))
            if not self._is_closing():
                await asyncio.sleep(RECONNECT_INTERVAL_S)

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        address = parse_address(self.address, "worker address", check_path=False)
        if isinstance(address, UnixAddress):
            return await asyncio.open_unix_connection(address.path)
        return await asyncio.open_connection(address.host or "127.0.0.1", address.port)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         codec: FrameCodec) -> Hello | None:
        """Authenticate a new connection (``shared.auth``) and return the worker's Hello; None when it failed
        (logged; ``num_auth_failures`` counts refusals in a row)."""
        try:
            return await asyncio.wait_for(authenticate_worker(reader, writer, codec, self._secret),
                                          HANDSHAKE_TIMEOUT_S)
        except AuthError as exc:
            self.num_auth_failures += 1
            self.last_handshake_failure = f"handshake refused: {exc}"
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

    async def _read_loop(self, reader: asyncio.StreamReader, codec: FrameCodec) -> str:
        """Hand every frame to ``on_message``; return why the connection ended."""
        frames = FrameSplitter(codec)
        try:
            while True:
                data = await reader.read(READ_CHUNK_BYTES)
                if not data:
                    if frames.partial:
                        raise ProtocolError("stream ended inside a frame")
                    return "worker closed the connection"
                frames.feed(data, self._on_message)
        except ProtocolError as exc:
            log.error("worker_malformed_frame", worker=self.name, error=str(exc))
            return f"malformed frame from worker: {exc}"
        except (ConnectionError, OSError) as exc:
            return f"connection to worker lost: {exc}"
