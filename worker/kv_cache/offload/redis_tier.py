"""Redis tier: KV blocks shared by every worker serving the same model, bounded per worker, with a TTL per key.

Key: ``sluice:kv:{model_id}:{dtype}:{chain_hash as 16 hex digits}``, so nothing crosses models, weights or dtypes
(``model_id`` is the worker's :func:`worker.__main__.kv_model_id`: the model's name, the weights it runs — int4, int8
or dense — and the checkpoint's file name and size; the block size is part of the chain hash: a block hashes its own
token ids). Value: msgpack ``(parent_hash, token_ids,
data)``; a reload verifies the token ids, so even a foreign or colliding key never serves another conversation.

Bound: each worker counts the bytes of the keys it wrote (least recently used first) and deletes its oldest keys
to stay under ``capacity_bytes``; every key also expires after ``ttl_s`` (sooner when the block's retention ends
sooner). Keys written by other workers are read but not counted.

The engine thread never waits for a write: :meth:`RedisTier.put_many` copies the batch into memory (a buffer the
writer handed back, :class:`~worker.kv_cache.offload.base.ReusableRows`) and queues it; a writer thread encodes it
and sends one pipelined ``SET … PX`` per block, then hands the memory back. Deletes
(the size bound, :meth:`~OffloadTier.discard`) travel through the same first-in first-out queue, so a key is never
deleted before it is written. A lookup of a block still queued is served from the memory copy. The queue is bounded
in bytes (``max_pending_bytes``): a batch that would exceed it is dropped (``offload_dropped_blocks{tier=redis}``)
rather than making the engine wait. Lookups (``EXISTS``, ``GET``) stay on the engine thread: a reload needs them.

Redis down: every call is guarded; a failure (the writer's are reported on the engine thread's next call) marks the
tier down for ``retry_s`` seconds (no call is made meanwhile, so serving pays no timeouts), logs one warning per
outage, counts ``redis_errors_total`` and sets the ``redis_up`` gauge to 0. The worker recomputes what it cannot
reload.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import structlog
import torch

from worker.kv_cache.offload.base import OffloadedBlock, OffloadTier, ReusableRows, _Entry
from worker.kv_cache.stats import KVStats

log = structlog.get_logger("sluice.worker.kv")

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(tuple[int | None, tuple[int, ...], bytes])


def redis_key_prefix(model_id: str, dtype: str) -> str:
    """Return the key prefix of one model and dtype: ``sluice:kv:{model_id}:{dtype}:``."""
    return f"sluice:kv:{model_id}:{dtype}:"


class _Batch:
    """Blocks queued for the writer: in memory (``data``) until their ``SET``s have been sent.

    ``data``, ``sending`` and ``dropped`` are read and set under the tier's lock.
    """

    def __init__(self, keys: list[str], data: torch.Tensor, headers: list[tuple[int | None, tuple[int, ...]]],
                 ttls_ms: list[int]) -> None:
        self.keys = keys
        self.rows = data  # [n, block_bytes] uint8 taken from the tier's ReusableRows; the writer hands it back
        self.data: torch.Tensor | None = data  # the same rows, readable until sent
        self.headers = headers
        self.ttls_ms = ttls_ms
        self.nbytes = data.numel()
        self.sending = False  # the writer has taken the batch: a row dropped from now on is deleted after it
        self.dropped: set[int] = set()  # rows discarded before the writer took the batch: never written


class RedisTier(OffloadTier):
    """Bounded Redis store of KV blocks, written in the background.

    Args:
        url: ``redis://host:port/db``.
        model_id: the served model and weights (``kv_model_id``; part of every key).
        dtype: the KV dtype name, e.g. ``float32`` (part of every key).
        block_bytes: bytes of one block; a stored value of another size is a miss.
        capacity_bytes: most bytes of block data this worker keeps in Redis.
        ttl_s: expiry of every key in seconds.
        timeout_s: connect and socket timeout of each call in seconds.
        retry_s: how long the tier stays marked down after a failure, seconds.
        max_pending_bytes: most bytes of block data queued for the writer; a batch beyond it is dropped.
        stats, clock: see :class:`OffloadTier` (no lower tier: Redis is the last).
    """

    name = "redis"

    def __init__(self, url: str, model_id: str, dtype: str, block_bytes: int, capacity_bytes: int,
                 ttl_s: float = 3600.0, timeout_s: float = 0.5, retry_s: float = 30.0,
                 stats: KVStats | None = None, clock: Callable[[], float] = time.monotonic,
                 max_pending_bytes: int = 256 * 1024**2) -> None:
        import redis

        super().__init__(capacity_bytes, stats, None, clock)
        if max_pending_bytes < 0:
            raise ValueError(f"redis tier: max_pending_bytes must be >= 0, got {max_pending_bytes}")
        self._errors = (redis.exceptions.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.url = url
        self.prefix = redis_key_prefix(model_id, dtype)
        self.block_bytes = block_bytes
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self._reusable_rows = ReusableRows(block_bytes)
        self.is_up = True
        self._down_until_s = 0.0  # time.monotonic()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified whenever the writer finishes an item
        self._num_queued = 0  # items put on the queue and not yet done, under the lock
        self._writer_outcomes: list[tuple[str, BaseException | None]] = []  # (op, error or None), under the lock
        self._queue: queue.SimpleQueue[_Batch | list[str] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="sluice-kv-redis-writer", daemon=True)
        self._writer.start()
        self.stats.set_gauge("redis_up", 1.0)

    def key(self, block_hash: int) -> str:
        return f"{self.prefix}{block_hash:016x}"

    # ------------------------------------------------------------------ availability

    def available(self) -> bool:
        """Whether calls are made now (up, or down long enough to try again)."""
        self._collect_writer_outcomes()
        return self.is_up or time.monotonic() >= self._down_until_s

    def _failed(self, op: str, exc: BaseException) -> None:
        self.stats.add("redis_errors_total")
        self.stats.set_gauge("redis_up", 0.0)
        self._down_until_s = time.monotonic() + self.retry_s
        if self.is_up:
            log.warning("kv_redis_unavailable", url=self.url, op=op, error=str(exc), retry_s=self.retry_s,
                        fallback="recompute")
        self.is_up = False

    def _succeeded(self) -> None:
        if not self.is_up:
            log.info("kv_redis_recovered", url=self.url)
            self.stats.set_gauge("redis_up", 1.0)
        self.is_up = True

    def _collect_writer_outcomes(self) -> None:
        """Apply the writer thread's successes and failures on the calling (engine) thread, in order."""
        if not self._writer_outcomes:
            return
        with self._lock:
            outcomes, self._writer_outcomes = self._writer_outcomes, []
        for op, exc in outcomes:
            if exc is None:
                self._succeeded()
            else:
                self._failed(op, exc)

    # ------------------------------------------------------------------ lookups (any worker's keys)

    def contains(self, block_hash: int) -> bool:
        return self.contains_many([block_hash])[0]

    def contains_many(self, block_hashes: Sequence[int]) -> list[bool]:
        """Blocks of this worker still queued are found in memory; one pipelined ``EXISTS`` per other hash, one
        round trip; all False while Redis is down."""
        if not block_hashes or not self.available():
            return [False] * len(block_hashes)
        found = [self._pending_row(block_hash) is not None for block_hash in block_hashes]
        ask = [pos for pos, hit in enumerate(found) if not hit]
        if not ask:
            return found
        try:
            pipe = self.client.pipeline(transaction=False)
            for pos in ask:
                pipe.exists(self.key(block_hashes[pos]))
            for pos, n in zip(ask, pipe.execute()):
                found[pos] = bool(n)
        except self._errors as exc:
            self._failed("exists", exc)
            return [False] * len(block_hashes)
        self._succeeded()
        return found

    def get(self, block_hash: int) -> OffloadedBlock | None:
        if not self.available():
            return None
        pending = self._pending_row(block_hash)
        if pending is not None:
            self._index.move_to_end(block_hash)
            entry = self._index[block_hash]
            return OffloadedBlock(block_hash, entry.parent_hash, entry.token_ids, pending, entry.expires_at_s)
        try:
            raw = self.client.get(self.key(block_hash))
        except self._errors as exc:
            self._failed("get", exc)
            return None
        self._succeeded()
        if raw is None:
            self._forget(block_hash)
            return None
        try:
            parent_hash, token_ids, payload = _DECODER.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if len(payload) != self.block_bytes:
            return None
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return OffloadedBlock(block_hash, parent_hash, tuple(token_ids), data)

    def _pending_row(self, block_hash: int) -> torch.Tensor | None:
        """The memory copy of an own block whose ``SET`` is still queued (a view, valid until the next call)."""
        entry = self._index.get(block_hash)
        if entry is None or entry.expires_at_s <= self.clock():
            return None
        batch, row = entry.handle
        with self._lock:
            data = batch.data
        return data[row] if data is not None else None

    def _forget(self, block_hash: int) -> None:
        """Drop an own key that Redis no longer has (expired) from the byte count."""
        entry = self._index.pop(block_hash, None)
        if entry is not None:
            self.used_bytes -= entry.nbytes

    # ------------------------------------------------------------------ storage

    def put_many(self, blocks: Sequence[OffloadedBlock]) -> list[bool]:
        if not self.available():
            return [False] * len(blocks)
        return super().put_many(blocks)

    def _store(self, block: OffloadedBlock) -> tuple[_Batch, int] | None:
        return self._store_many([block])[0]

    def _store_many(self, blocks: Sequence[OffloadedBlock]) -> list[tuple[_Batch, int] | None]:
        """Copy the batch into memory and queue it for the writer; None for a block not ``block_bytes`` long, all
        None when the queue is full."""
        handles: list[tuple[_Batch, int] | None] = [None] * len(blocks)
        fits = [pos for pos, block in enumerate(blocks) if block.data.numel() == self.block_bytes]
        if not fits:
            return handles
        with self._lock:
            if self.pending_bytes + len(fits) * self.block_bytes > self.max_pending_bytes:
                self.stats.add("offload_dropped_blocks", len(fits), tier=self.name)
                return handles
            self.pending_bytes += len(fits) * self.block_bytes
            self._num_queued += 1
        now_s = self.clock()
        data = self._reusable_rows.take(len(fits))  # owned: the caller may reuse its memory
        torch.stack([blocks[pos].data.reshape(-1) for pos in fits], out=data)
        batch = _Batch([self.key(blocks[pos].block_hash) for pos in fits], data,
                       [(blocks[pos].parent_hash, blocks[pos].token_ids) for pos in fits],
                       [max(1, int(min(self.ttl_s, blocks[pos].expires_at_s - now_s) * 1000)) for pos in fits])
        self._queue.put(batch)
        for row, pos in enumerate(fits):
            handles[pos] = (batch, row)
        return handles

    def _load(self, entry: _Entry) -> None:
        return None  # never demoted further; reads go through get()

    def _drop(self, entry: _Entry) -> None:
        batch, row = entry.handle
        with self._lock:
            if not batch.sending:  # the writer skips the row
                batch.dropped.add(row)
                return
            self._num_queued += 1
        self._queue.put([batch.keys[row]])  # after the batch's SET in the queue

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write and delete is done, then apply their outcomes; True when none is left."""
        with self._idle:
            done = self._idle.wait_for(lambda: self._num_queued == 0, timeout_s)
        self._collect_writer_outcomes()
        return done

    def close(self) -> None:
        """Send what is queued, stop the writer and close the connection; the keys stay for other workers until
        their TTL."""
        self._queue.put(None)
        self._writer.join(timeout=10)
        self._index.clear()
        self.used_bytes = 0
        try:
            self.client.close()
        except self._errors:
            pass

    # ------------------------------------------------------------------ the writer thread

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, _Batch):
                outcome = self._send_batch(item)
            else:
                outcome = self._send(lambda pipe, keys=item: pipe.delete(*keys), "delete")
            with self._idle:
                if outcome is not None:
                    self._writer_outcomes.append(outcome)
                self._num_queued -= 1
                self._idle.notify_all()

    def _send_batch(self, batch: _Batch) -> tuple[str, BaseException | None] | None:
        with self._lock:
            batch.sending = True
            data, dropped = batch.data, set(batch.dropped)
        rows = [row for row in range(len(batch.keys)) if row not in dropped]

        def set_rows(pipe) -> None:
            for row in rows:
                parent_hash, token_ids = batch.headers[row]
                value = _ENCODER.encode((parent_hash, list(token_ids), memoryview(data[row].numpy())))
                pipe.set(batch.keys[row], value, px=batch.ttls_ms[row])

        outcome = self._send(set_rows, "set") if rows else None
        with self._lock:
            self.pending_bytes -= batch.nbytes
            batch.data = None
        self._reusable_rows.release(batch.rows)
        return outcome

    def _send(self, fill: Callable[[object], None], op: str) -> tuple[str, BaseException | None] | None:
        """Run one pipeline on the writer thread; skipped (None) while the tier is marked down."""
        if time.monotonic() < self._down_until_s:
            return None
        try:
            pipe = self.client.pipeline(transaction=False)
            fill(pipe)
            pipe.execute()
        except self._errors as exc:
            self._down_until_s = time.monotonic() + self.retry_s  # the writer skips until the retry time
            return op, exc
        return op, None
