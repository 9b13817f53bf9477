"""TokenBucketRateLimiter: per-key requests and tokens per minute, refills, debt for oversize requests, refunds."""

from __future__ import annotations

import pytest

from gateway.admission.ratelimit import TokenBucketRateLimiter


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


async def test_unlimited_key_is_always_allowed():
    limiter = TokenBucketRateLimiter(FakeClock())
    for _ in range(1000):
        assert (await limiter.try_acquire("k", 0, 0, 10**6)).allowed


async def test_rpm_limit_refills_continuously():
    clock = FakeClock()
    limiter = TokenBucketRateLimiter(clock)
    for _ in range(6):
        assert (await limiter.try_acquire("k", 6, 0, 1)).allowed
    decision = await limiter.try_acquire("k", 6, 0, 1)
    assert not decision.allowed and decision.limit == "rpm"
    assert decision.retry_after_s == pytest.approx(10.0)  # one request per 10 s at 6 rpm
    clock.now_s = 10.0
    assert (await limiter.try_acquire("k", 6, 0, 1)).allowed
    assert (await limiter.try_acquire("other", 6, 0, 1)).allowed  # keys are independent


async def test_oversize_request_goes_through_a_full_bucket_and_leaves_debt():
    clock = FakeClock()
    limiter = TokenBucketRateLimiter(clock)
    assert (await limiter.try_acquire("k", 0, 1000, 2000)).allowed
    decision = await limiter.try_acquire("k", 0, 1000, 10)
    assert not decision.allowed and decision.limit == "tpm"
    assert decision.retry_after_s == pytest.approx(60.6)  # (1000 debt + 10) tokens at 1000/60 tokens per s


async def test_refused_request_counts_nothing_and_refund_gives_back():
    clock = FakeClock()
    limiter = TokenBucketRateLimiter(clock)
    assert (await limiter.try_acquire("k", 1, 100, 60)).allowed
    assert not (await limiter.try_acquire("k", 1, 100, 60)).allowed
    await limiter.refund("k", 60)
    assert (await limiter.try_acquire("k", 1, 100, 60)).allowed
