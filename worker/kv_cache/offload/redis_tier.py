"""Redis tier: KV blocks shared by every worker serving the same model, bounded per worker, with a TTL per key.

Key: ``sluice:kv:{model_id}:{dtype}:{chain_hash as 16 hex digits}``, so nothing crosses models or dtypes (the block
size is part of the chain hash: a block hashes its own token ids). Value: msgpack ``(parent_hash, token_ids,
data)``; a reload verifies the token ids, so even a foreign or colliding key never serves another conversation.

Bound: each worker counts the bytes of the keys it wrote (least recently used first) and deletes its oldest keys
to stay under ``capacity_bytes``; every key also expires after ``ttl_s`` (sooner when the block's retention ends
sooner). Keys written by other workers are read but not counted.

Redis down: every call is guarded; a failure marks the tier down for ``retry_s`` seconds (no call is made
meanwhile, so serving pays no timeouts), logs one warning per outage, counts ``redis_errors_total`` and sets the
``redis_up`` gauge to 0. The worker recomputes what it cannot reload.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec
import structlog
import torch

from worker.kv_cache.offload.base import OffloadedBlock, OffloadTier, _Entry
from worker.kv_cache.stats import KVStats

log = structlog.get_logger("sluice.worker.kv")

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(tuple[int | None, tuple[int, ...], bytes])


def redis_key_prefix(model_id: str, dtype: str) -> str:
    """Return the key prefix of one model and dtype: ``sluice:kv:{model_id}:{dtype}:``."""
    return f"sluice:kv:{model_id}:{dtype}:"


class RedisTier(OffloadTier):
    """Bounded Redis store of KV blocks.

    Args:
        url: ``redis://host:port/db``.
        model_id: the served model's id (part of every key).
        dtype: the KV dtype name, e.g. ``float32`` (part of every key).
        block_bytes: bytes of one block; a stored value of another size is a miss.
        capacity_bytes: most bytes of block data this worker keeps in Redis.
        ttl_s: expiry of every key in seconds.
        timeout_s: connect and socket timeout of each call in seconds.
        retry_s: how long the tier stays marked down after a failure, seconds.
        stats, clock: see :class:`OffloadTier` (no lower tier: Redis is the last).
    """

    name = "redis"

    def __init__(self, url: str, model_id: str, dtype: str, block_bytes: int, capacity_bytes: int,
                 ttl_s: float = 3600.0, timeout_s: float = 0.5, retry_s: float = 30.0,
                 stats: KVStats | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        import redis

        super().__init__(capacity_bytes, stats, None, clock)
        self._errors = (redis.exceptions.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.url = url
        self.prefix = redis_key_prefix(model_id, dtype)
        self.block_bytes = block_bytes
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.is_up = True
        self._down_until_s = 0.0  # time.monotonic()
        self.stats.set_gauge("redis_up", 1.0)

    def key(self, block_hash: int) -> str:
        return f"{self.prefix}{block_hash:016x}"

    # ------------------------------------------------------------------ availability

    def available(self) -> bool:
        """Whether calls are made now (up, or down long enough to try again)."""
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

    # ------------------------------------------------------------------ lookups (any worker's keys)

    def contains(self, block_hash: int) -> bool:
        return self.contains_many([block_hash])[0]

    def contains_many(self, block_hashes: Sequence[int]) -> list[bool]:
        """One pipelined ``EXISTS`` per hash, one round trip; all False while Redis is down."""
        if not block_hashes or not self.available():
            return [False] * len(block_hashes)
        try:
            pipe = self.client.pipeline(transaction=False)
            for block_hash in block_hashes:
                pipe.exists(self.key(block_hash))
            found = [bool(n) for n in pipe.execute()]
        except self._errors as exc:
            self._failed("exists", exc)
            return [False] * len(block_hashes)
        self._succeeded()
        return found

    def get(self, block_hash: int) -> OffloadedBlock | None:
        if not self.available():
            return None
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

    def _forget(self, block_hash: int) -> None:
        """Drop an own key that Redis no longer has (expired) from the byte count."""
        entry = self._index.pop(block_hash, None)
        if entry is not None:
            self.used_bytes -= entry.nbytes

    # ------------------------------------------------------------------ storage

    def put(self, block: OffloadedBlock) -> bool:
        if not self.available():
            return False
        return super().put(block)

    def _store(self, block: OffloadedBlock) -> str | None:
        ttl_s = min(self.ttl_s, block.expires_at_s - self.clock())
        value = _ENCODER.encode((block.parent_hash, list(block.token_ids), block.data.contiguous().numpy().tobytes()))
        key = self.key(block.block_hash)
        try:
            self.client.set(key, value, px=max(1, int(ttl_s * 1000)))
        except self._errors as exc:
            self._failed("set", exc)
            return None
        self._succeeded()
        return key

    def _load(self, entry: _Entry) -> None:
        return None  # never demoted further; reads go through get()

    def _drop(self, entry: _Entry) -> None:
        if not self.available():
            return  # the key expires by its TTL
        try:
            self.client.delete(entry.handle)
        except self._errors as exc:
            self._failed("delete", exc)

    def close(self) -> None:
        """Close the connection; the keys stay for other workers until their TTL."""
        self._index.clear()
        self.used_bytes = 0
        try:
            self.client.close()
        except self._errors:
            pass
