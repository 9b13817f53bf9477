"""A worker test double speaking the real wire protocol (shared/protocol.py), for the gateway's health decisions.

It says Hello and Capacity like a real worker, then answers ``Generate`` in one of three modes:

- ``silent``: accepts the request and never sends anything (the worker that hangs);
- ``stall``: sends one token, then nothing (a stream that stalls after its first byte);
- ``ok``: sends ``max_tokens`` copies of ``token_id`` and ``Finished`` at once.

A fake is used here because these tests pin the gateway's timeout, retry and circuit-breaker decisions, which need
a worker that misbehaves on command; everything else in the same tests runs against real sim-worker processes.
It runs its own event loop in a thread, so blocking test code never stalls it.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from shared.protocol import Abort, Capacity, Finished, Generate, Hello, Ping, Pong, TokenDelta, worker_codec

MODES = ("silent", "stall", "ok")


@dataclass
class FakeWorker:
    """One fake worker listening on 127.0.0.1:``port``.

    Attributes:
        name: worker id in its Hello.
        num_kv_blocks: KV blocks it announces (a large pool makes the gateway's router prefer it).
        mode: ``silent``, ``stall`` or ``ok`` (may be changed while running).
        token_id: the token it sends in ``stall`` and ``ok`` modes.
        generates: request ids of the ``Generate`` frames received, in order.
        aborts: request ids of the ``Abort`` frames received.
    """

    name: str
    num_kv_blocks: int
    mode: str = "silent"
    token_id: int = 1000
    model_id: str = "SmolLM2-135M-Instruct"
    port: int = 0
    generates: list[str] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    _server: asyncio.AbstractServer | None = None
    _writers: list[asyncio.StreamWriter] = field(default_factory=list)

    def hello(self) -> Hello:
        return Hello(worker_id=self.name, model_id=self.model_id, backend="fake", device="test-double",
                     block_size_tokens=16, num_kv_blocks=self.num_kv_blocks,
                     kv_capacity_tokens=self.num_kv_blocks * 16, max_num_seqs=8, max_model_len_tokens=2048)

    def capacity(self) -> Capacity:
        return Capacity(free_kv_blocks=self.num_kv_blocks, total_kv_blocks=self.num_kv_blocks, used_kv_blocks=0,
                        cached_kv_blocks=0, num_running=0, num_waiting=0)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        codec = worker_codec()
        self._writers.append(writer)
        writer.write(codec.encode(self.hello()))
        writer.write(codec.encode(self.capacity()))
        try:
            while (message := await codec.read(reader)) is not None:
                match message:
                    case Generate(request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens):
                        self.generates.append(request_id)
                        if self.mode == "stall":
                            writer.write(codec.encode(TokenDelta(request_id, [self.token_id], None, 1.0)))
                        elif self.mode == "ok":
                            writer.write(codec.encode(TokenDelta(request_id, [self.token_id] * max_tokens, None,
                                                                 1.0)))
                            writer.write(codec.encode(Finished(request_id, "length", len(prompt), 0, max_tokens)))
                    case Abort(request_id=request_id):
                        self.aborts.append(request_id)
                    case Ping(nonce=nonce):
                        writer.write(codec.encode(Pong(nonce=nonce)))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


class FakeWorkers:
    """Run several :class:`FakeWorker` on one event loop in a background thread."""

    def __init__(self, workers: list[FakeWorker]) -> None:
        self.workers = workers
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-workers", daemon=True)

    def __enter__(self) -> "FakeWorkers":
        self._thread.start()
        for worker in self.workers:
            self.call(worker.start())
        return self

    def call(self, coroutine, timeout_s: float = 10.0):
        """Run a coroutine on the fakes' loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def stop_all(self) -> None:
        """Close every listener and connection (the gateway sees the workers go away)."""
        for worker in self.workers:
            self.call(worker.stop())

    def __exit__(self, *exc) -> None:
        self.stop_all()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
