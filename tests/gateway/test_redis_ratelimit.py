"""RedisRateLimiter against the real Redis at 127.0.0.1:6379 (``make redis`` starts it), each test under its own
key prefix: the token-bucket semantics of the local limiter, one key's limits shared by two gateways (atomic under
concurrency), the Redis clock, key hygiene (hashed key, expiry), and counting locally while Redis is down."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis import asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.admission.redis_ratelimit import RedisRateLimiter, bucket_key
from shared.config import RateLimitConfig
from tests.support.server import free_port

REDIS_URL = "redis://127.0.0.1:6379/0"


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
async def redis_url():
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await client.ping()
    except RedisConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379 (run `make redis`)")
    finally:
        await client.aclose()
    return REDIS_URL


@pytest.fixture
async def prefix(redis_url):
    prefix = f"test-rl-{uuid.uuid4().hex[:8]}"
    yield prefix
    client = aioredis.Redis.from_url(redis_url)
    async for key in client.scan_iter(match=prefix + ":*"):
        await client.delete(key)
    await client.aclose()


def limiter(prefix: str, clock=None, url: str = REDIS_URL, **kwargs) -> RedisRateLimiter:
    client = aioredis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    return RedisRateLimiter(client, prefix, clock=clock, **kwargs)


async def test_rpm_limit_refills_continuously(prefix):
    clock = FakeClock()
    rl = limiter(prefix, clock)
    for _ in range(6):
        assert (await rl.try_acquire("k", 6, 0, 1)).allowed
    decision = await rl.try_acquire("k", 6, 0, 1)
    assert not decision.allowed and decision.limit == "rpm"
    assert decision.retry_after_s == pytest.approx(10.0)  # one request per 10 s at 6 rpm
    clock.now_s += 10.0
    assert (await rl.try_acquire("k", 6, 0, 1)).allowed
    assert (await rl.try_acquire("other", 6, 0, 1)).allowed  # keys are independent
    await rl.close()


async def test_oversize_request_goes_through_a_full_bucket_and_leaves_debt(prefix):
    rl = limiter(prefix, FakeClock())
    assert (await rl.try_acquire("k", 0, 1000, 2000)).allowed
    decision = await rl.try_acquire("k", 0, 1000, 10)
    assert not decision.allowed and decision.limit == "tpm"
    assert decision.retry_after_s == pytest.approx(60.6)  # (1000 debt + 10) tokens at 1000/60 tokens per s
    await rl.close()


async def test_refused_request_counts_nothing_and_refund_gives_back(prefix):
    rl = limiter(prefix, FakeClock())
    assert (await rl.try_acquire("k", 1, 100, 60)).allowed
    assert not (await rl.try_acquire("k", 1, 100, 60)).allowed
    await rl.refund("k", 60)
    assert (await rl.try_acquire("k", 1, 100, 60)).allowed
    assert (await rl.try_acquire("unlimited", 0, 0, 10**9)).allowed
    await rl.close()


async def test_two_gateways_share_one_keys_rpm_limit_atomically(prefix):
    gateway_a, gateway_b = limiter(prefix), limiter(prefix)  # two clients, Redis's clock
    attempts = [rl.try_acquire("sk-shared", 10, 0, 1) for _ in range(25) for rl in (gateway_a, gateway_b)]
    decisions = await asyncio.gather(*attempts)
    assert sum(d.allowed for d in decisions) == 10  # not 10 per gateway
    refused = [d for d in decisions if not d.allowed]
    assert all(d.limit == "rpm" and 0 < d.retry_after_s <= 6.0 for d in refused)  # 1 request per 6 s at 10 rpm
    assert not (await gateway_b.try_acquire("sk-shared", 10, 0, 1)).allowed
    await gateway_a.close()
    await gateway_b.close()


async def test_bucket_key_hides_the_api_key_and_expires_once_full_again(prefix):
    rl = limiter(prefix)
    await rl.try_acquire("sk-secret-123", 60, 6000, 100)
    client = aioredis.Redis.from_url(REDIS_URL)
    keys = [key.decode() async for key in client.scan_iter(match=prefix + ":*")]
    assert keys == [bucket_key(prefix, "sk-secret-123")]
    assert "sk-secret" not in keys[0]
    # 1 request of 60 and 100 tokens of 6000 refill in 1 s; the hash lives that long plus a second of slack
    assert 0 < await client.pttl(keys[0]) <= 2000
    await client.aclose()
    await rl.close()


async def test_redis_down_counts_locally_and_comes_back(prefix):
    port = free_port()  # nothing listens there
    rl = limiter(prefix, url=f"redis://127.0.0.1:{port}/0", retry_s=60.0)
    assert (await rl.try_acquire("k", 2, 0, 1)).allowed
    assert (await rl.try_acquire("k", 2, 0, 1)).allowed
    decision = await rl.try_acquire("k", 2, 0, 1)
    assert not decision.allowed and decision.limit == "rpm"  # still limited, in this gateway
    await rl.refund("k", 1)  # goes to the local bucket the request was counted in
    assert (await rl.try_acquire("k", 2, 0, 1)).allowed
    assert rl.num_redis_errors == 1  # marked down after the first failure: no call per request
    await rl.close()


async def test_from_config_uses_the_registry_url_when_its_own_is_empty(prefix):
    rl = RedisRateLimiter.from_config(RateLimitConfig(backend="redis", key_prefix=prefix), REDIS_URL)
    assert (await rl.try_acquire("k", 1, 0, 1)).allowed
    assert not (await rl.try_acquire("k", 1, 0, 1)).allowed
    assert rl.num_redis_errors == 0
    await rl.close()
