"""Per-key RPM/TPM limits kept in Redis, so several gateways share one key's buckets.

The same two token buckets as :class:`gateway.admission.ratelimit.TokenBucketRateLimiter` (one request token, ``tokens``
tokens; each bucket holds one minute of its limit and refills continuously; an oversize request goes through a full
bucket and leaves it in debt), but refilled, checked and debited by one Lua script that Redis runs atomically, so
concurrent gateways never both spend the last token. Time is the Redis server's ``TIME``, one clock for every
gateway (an injectable clock replaces it in tests).

Layout: one hash per API key, ``<key_prefix>:<sha256(api key)[:32]>`` with fields ``requests``, ``tokens``,
``updated_s``; it expires once both buckets would be full again, which reads the same as a missing hash. The API key
itself never reaches Redis.

When Redis fails, this gateway counts in its own in-process buckets until ``retry_s`` has passed (limits then hold
per gateway instead of across gateways: service over strictness), and logs once per failed retry.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import structlog
from redis import asyncio as aioredis
from redis.exceptions import RedisError

from gateway.admission.ratelimit import RateDecision, RateLimiter, TokenBucketRateLimiter
from shared.config import RateLimitConfig

log = structlog.get_logger("sluice.gateway")

DEFAULT_RETRY_S = 5.0

# KEYS[1]: the bucket hash. ARGV: rpm_limit, tpm_limit, tokens, now_s ("" = Redis TIME).
# Returns {allowed 0/1, retry_after_s as a string (Lua numbers become integers in replies), limit name}.
_ACQUIRE_LUA = """
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local tokens = tonumber(ARGV[3])
local now
if ARGV[4] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[4])
end
local state = redis.call('HMGET', KEYS[1], 'requests', 'tokens', 'updated_s')
local req, tok
if state[3] == false then
  req = rpm
  tok = tpm
else
  local elapsed = math.max(0, now - tonumber(state[3]))
  req = math.min(rpm, tonumber(state[1]) + elapsed * rpm / 60)
  tok = math.min(tpm, tonumber(state[2]) + elapsed * tpm / 60)
end
local wait = 0
local limit = ''
if rpm > 0 and req < 1 then
  wait = (1 - req) * 60 / rpm
  limit = 'rpm'
end
local needed = math.min(tokens, tpm)
if tpm > 0 and tok < needed then
  local tpm_wait = (needed - tok) * 60 / tpm
  if tpm_wait >= wait then
    wait = tpm_wait
    limit = 'tpm'
  end
end
if limit == '' then
  if rpm > 0 then req = req - 1 end
  if tpm > 0 then tok = tok - tokens end
end
redis.call('HSET', KEYS[1], 'requests', string.format('%.17g', req), 'tokens', string.format('%.17g', tok),
           'updated_s', string.format('%.17g', now))
local full_s = 0
if rpm > 0 then full_s = math.max(full_s, (rpm - req) * 60 / rpm) end
if tpm > 0 then full_s = math.max(full_s, (tpm - tok) * 60 / tpm) end
redis.call('PEXPIRE', KEYS[1], math.ceil(full_s * 1000) + 1000)
if limit == '' then
  return {1, '0', ''}
end
return {0, string.format('%.17g', wait), limit}
"""

# KEYS[1]: the bucket hash. ARGV: tokens. Gives back one request and the tokens if the bucket still exists (a missing
# bucket is full already; the next refill clamps an over-full one).
_REFUND_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBYFLOAT', KEYS[1], 'requests', 1)
  redis.call('HINCRBYFLOAT', KEYS[1], 'tokens', ARGV[1])
end
return 0
"""


def bucket_key(key_prefix: str, api_key: str) -> str:
    """Return the Redis key of ``api_key``'s buckets (the key only as a SHA-256 digest)."""
    return f"{key_prefix}:{hashlib.sha256(api_key.encode()).hexdigest()[:32]}"


class RedisRateLimiter(RateLimiter):
    """Token buckets per key in Redis, shared by every gateway on the same Redis and prefix.

    Args:
        client: an asyncio Redis client (its socket timeout bounds each call).
        key_prefix: prefix of the bucket keys.
        clock: seconds to use instead of the Redis server's clock (tests); None = Redis ``TIME``.
        retry_s: after a Redis failure, seconds of counting locally before Redis is tried again.
        fallback: the in-process limiter used meanwhile (default: a new :class:`TokenBucketRateLimiter`).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        key_prefix: str = "sluice:ratelimit",
        clock: Callable[[], float] | None = None,
        retry_s: float = DEFAULT_RETRY_S,
        fallback: RateLimiter | None = None,
    ) -> None:
        self._client = client
        self._key_prefix = key_prefix
        self._clock = clock
        self._retry_s = retry_s
        self._fallback = fallback if fallback is not None else TokenBucketRateLimiter()
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._refund = client.register_script(_REFUND_LUA)
        self._down_until_s = 0.0
        self.num_redis_errors = 0
        # keys whose last acquire was counted locally: their refund goes to the same place
        self._local_keys: set[str] = set()

    @classmethod
    def from_config(cls, config: RateLimitConfig, registry_redis_url: str = "") -> RedisRateLimiter:
        """Build the limiter of ``[ratelimit]`` (its ``redis_url``, else the registry's)."""
        url = config.redis_url or registry_redis_url
        client = aioredis.Redis.from_url(url, socket_timeout=config.timeout_s,
                                         socket_connect_timeout=config.timeout_s)
        return cls(client, config.key_prefix)

    async def close(self) -> None:
        """Close the Redis connection pool."""
        await self._client.aclose()

    async def try_acquire(self, key: str, rpm_limit: int, tpm_limit: int, tokens: int) -> RateDecision:
        """See :meth:`RateLimiter.try_acquire`; counted in Redis, or locally while Redis is failing."""
        if rpm_limit <= 0 and tpm_limit <= 0:
            return RateDecision(allowed=True)
        if time.monotonic() >= self._down_until_s:
            now_arg = "" if self._clock is None else repr(float(self._clock()))
            try:
                allowed, wait, limit = await self._acquire(
                    keys=[bucket_key(self._key_prefix, key)], args=[rpm_limit, tpm_limit, tokens, now_arg])
            except (RedisError, OSError) as exc:
                self._on_error("acquire", exc)
            else:
                self._local_keys.discard(key)
                if int(allowed) == 1:
                    return RateDecision(allowed=True)
                limit_name = limit.decode() if isinstance(limit, bytes) else str(limit)
                return RateDecision(allowed=False, retry_after_s=float(wait), limit=limit_name)
        self._local_keys.add(key)
        return await self._fallback.try_acquire(key, rpm_limit, tpm_limit, tokens)

    async def refund(self, key: str, tokens: int) -> None:
        """See :meth:`RateLimiter.refund`."""
        if key in self._local_keys:
            await self._fallback.refund(key, tokens)
            return
        try:
            await self._refund(keys=[bucket_key(self._key_prefix, key)], args=[tokens])
        except (RedisError, OSError) as exc:
            self._on_error("refund", exc)

    def _on_error(self, operation: str, exc: BaseException) -> None:
        self.num_redis_errors += 1
        if time.monotonic() >= self._down_until_s:
            log.warning("ratelimit_redis_failed_counting_locally", operation=operation, error=str(exc),
                        retry_in_s=self._retry_s)
        self._down_until_s = time.monotonic() + self._retry_s
