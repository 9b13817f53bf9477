"""Per-API-key rate limits: requests and tokens per minute (429 ``rate_limit_exceeded``).

:class:`RateLimiter` is the tiny interface admission talks to; :class:`TokenBucketRateLimiter` keeps the buckets in
this process. A Redis-backed limiter (shared by several gateways) implements the same two coroutines.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass

SECONDS_PER_MINUTE = 60.0


@dataclass(frozen=True)
class RateDecision:
    """The answer of a rate limiter.

    Attributes:
        allowed: True when the request was counted and may proceed.
        retry_after_s: when not allowed, seconds until the same request would be allowed (> 0); else 0.
        limit: ``rpm`` or ``tpm`` when not allowed (the limit that was hit); else "".
    """

    allowed: bool
    retry_after_s: float = 0.0
    limit: str = ""


class RateLimiter(abc.ABC):
    """Count requests and tokens per key against per-minute limits."""

    @abc.abstractmethod
    async def try_acquire(self, key: str, rpm_limit: int, tpm_limit: int, tokens: int) -> RateDecision:
        """Count one request of ``tokens`` tokens for ``key`` if both limits allow it.

        Args:
            key: the rate-limit identity (an API key).
            rpm_limit: requests per minute; 0 = unlimited.
            tpm_limit: tokens per minute; 0 = unlimited.
            tokens: the request's tokens (prompt + capped output).

        Returns:
            allowed (and counted), or not allowed (nothing counted) with the seconds to wait.
        """

    @abc.abstractmethod
    async def refund(self, key: str, tokens: int) -> None:
        """Give back one request and ``tokens`` tokens counted by ``try_acquire`` (the request was not served)."""

    async def close(self) -> None:
        """Release the limiter's connections, if it holds any (nothing for an in-process limiter)."""


class _Bucket:
    __slots__ = ("requests", "tokens", "updated_s")

    def __init__(self, requests: float, tokens: float, now_s: float) -> None:
        self.requests = requests
        self.tokens = tokens
        self.updated_s = now_s


class TokenBucketRateLimiter(RateLimiter):
    """Two token buckets per key, each holding one minute of its limit and refilling continuously.

    A request needs one request token and ``tokens`` tokens. A request larger than a whole minute's token limit is
    let through when the bucket is full and leaves it in debt, so that it is delayed, never refused forever.

    Args:
        clock: monotonic time in seconds (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    async def try_acquire(self, key: str, rpm_limit: int, tpm_limit: int, tokens: int) -> RateDecision:
        """See :meth:`RateLimiter.try_acquire`."""
        if rpm_limit <= 0 and tpm_limit <= 0:
            return RateDecision(allowed=True)
        now_s = self._clock()
        bucket = self._refill(key, rpm_limit, tpm_limit, now_s)
        waits: list[tuple[float, str]] = []
        if rpm_limit > 0 and bucket.requests < 1.0:
            waits.append(((1.0 - bucket.requests) * SECONDS_PER_MINUTE / rpm_limit, "rpm"))
        needed_tokens = min(float(tokens), float(tpm_limit))
        if tpm_limit > 0 and bucket.tokens < needed_tokens:
            waits.append(((needed_tokens - bucket.tokens) * SECONDS_PER_MINUTE / tpm_limit, "tpm"))
        if waits:
            wait_s, limit = max(waits)
            return RateDecision(allowed=False, retry_after_s=wait_s, limit=limit)
        if rpm_limit > 0:
            bucket.requests -= 1.0
        if tpm_limit > 0:
            bucket.tokens -= tokens
        return RateDecision(allowed=True)

    async def refund(self, key: str, tokens: int) -> None:
        """See :meth:`RateLimiter.refund`; buckets never refill past one minute's limit (done at the next refill)."""
        bucket = self._buckets.get(key)
        if bucket is not None:
            bucket.requests += 1.0
            bucket.tokens += tokens

    def _refill(self, key: str, rpm_limit: int, tpm_limit: int, now_s: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(float(rpm_limit), float(tpm_limit), now_s)
            return bucket
        elapsed_s = max(0.0, now_s - bucket.updated_s)
        bucket.requests = min(float(rpm_limit), bucket.requests + elapsed_s * rpm_limit / SECONDS_PER_MINUTE)
        bucket.tokens = min(float(tpm_limit), bucket.tokens + elapsed_s * tpm_limit / SECONDS_PER_MINUTE)
        bucket.updated_s = now_s
        return bucket
