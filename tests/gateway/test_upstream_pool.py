"""An upstream pool inside the gateway, in process: its config, its place in a mixed fleet (degrade routing from our
workers' pool to it), and an :class:`UpstreamClient` against an HTTP server that answers with a recorded vLLM
``/metrics`` text (tests/fixtures/engine_metrics/vllm.txt) and, for generation, with HTTP 429: the overload answer no
engine gives on demand. The real engine end to end is tests/gateway/test_upstream_e2e.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from gateway.fleet.fleet import Fleet
from gateway.metrics import Metrics
from gateway.upstream.client import UpstreamClient
from gateway.upstream.request_body import UpstreamPrompt
from gateway.workers.breaker import BreakerState, CircuitBreaker
from gateway.workers.pool import WorkerPool
from gateway.workers.reservation import Reservation
from shared.config import Config, ConfigError, effective_pools, effective_tiers, validate_pool_config
from shared.errors import ErrorCode, SluiceError
from shared.protocol import Generate, SamplingParams
from tests.support.loopback import serve_routes

MODEL = "SmolLM2-135M-Instruct"
VLLM_METRICS = (Path(__file__).resolve().parents[1] / "fixtures" / "engine_metrics" / "vllm.txt").read_text()
WAIT_S = 30.0


def mixed_config(upstream_url: str = "http://127.0.0.1:9") -> Config:
    return msgspec.convert({
        "default_tier": "standard",
        "tiers": [{"name": "vip", "priority": 3},
                  {"name": "standard", "priority": 2},
                  {"name": "free", "priority": 1, "degrade_pool": "engine", "degrade_at": "elevated"}],
        "pools": [{"name": "ours", "backend": "sim", "min_workers": 0, "max_workers": 0},
                  {"name": "engine", "model_name": "small-model", "backend": "openai", "engine": "vllm",
                   "upstreams": [upstream_url], "upstream_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                   "min_workers": 2, "max_workers": 3}],
    }, Config)


def test_an_upstream_pool_has_no_local_workers_and_needs_http_upstreams():
    pools = {pool.name: pool for pool in effective_pools(mixed_config())}
    assert (pools["engine"].min_workers, pools["engine"].max_workers) == (0, 0)
    assert pools["engine"].upstream_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for pool, message in [({"name": "p", "backend": "openai"}, r"pools\[0\].upstreams: .* needs at least one URL"),
                          ({"name": "p", "backend": "openai", "upstreams": ["localhost:8000"]}, "not an http"),
                          ({"name": "p", "backend": "sim", "upstreams": ["http://h:1"]}, "only a pool with"),
                          ({"name": "p", "backend": "openai", "upstreams": ["http://h:1"], "api_key": "k",
                            "api_key_env": "KEY"}, r"pools\[0\]: set api_key or api_key_env, not both")]:
        with pytest.raises(ConfigError, match=message):
            validate_pool_config(msgspec.convert({"pools": [pool]}, Config))
    with pytest.raises(msgspec.ValidationError, match="engine"):
        msgspec.convert({"pools": [{"name": "p", "backend": "openai", "engine": "ollama"}]}, Config)


async def test_mixed_fleet_degrades_a_tier_from_our_workers_to_the_upstream_pool(recorded_vllm):
    url, _ = recorded_vllm
    fleet = Fleet(mixed_config(url), Metrics(), spawn_local=False)
    tiers = {tier.name: tier for tier in effective_tiers(fleet.config)}
    ours, engine = fleet.runtimes["ours"], fleet.runtimes["engine"]
    assert [type(c).__name__ for c in engine.pool.clients] == ["UpstreamClient"]
    assert fleet.scaling.max_local(engine) == 0 and not fleet.is_ready()  # the upstream was never polled
    assert fleet.route(MODEL, tiers["free"]).runtime is ours
    ours.pressure.observe(queue_wait_s=2.5, kv_used_fraction=0.0)  # elevated
    assert fleet.route(MODEL, tiers["free"]).runtime is ours  # no upstream has answered a poll: nothing to take it
    engine.pool.start()
    await wait_until(engine.has_serving_worker, "the upstream's first poll")
    route = fleet.route(MODEL, tiers["free"])
    assert (route.runtime, route.degraded, route.requested) == (engine, True, ours)
    assert fleet.route(MODEL, tiers["vip"]).runtime is ours
    assert fleet.route("small-model", tiers["vip"]).runtime is engine
    # a request the degrade pool cannot serve (logprobs from an engine, top_k on transformers serve) stays
    assert fleet.route(MODEL, tiers["free"], lambda pool: pool.config.backend != "openai").runtime is ours
    await fleet.close()


@pytest.fixture
async def recorded_vllm():
    """An HTTP server on loopback with vLLM's recorded /metrics; its chat endpoint answers 429, Retry-After: 2."""
    calls: list[dict] = []

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=VLLM_METRICS)

    async def chat(request: web.Request) -> web.Response:
        calls.append(await request.json())
        return web.json_response({"error": {"message": "too many requests", "type": "rate_limit"}}, status=429,
                                 headers={"Retry-After": "2"})

    url, runner = await serve_engine(metrics, chat)
    yield url, calls
    await runner.cleanup()


async def serve_engine(metrics, chat) -> tuple[str, web.AppRunner]:
    """Serve ``GET /metrics`` and ``POST /v1/chat/completions`` with these handlers on loopback; return the base URL
    and the runner (``cleanup()`` stops it)."""
    return await serve_routes(("GET", "/metrics", metrics), ("POST", "/v1/chat/completions", chat))


async def wait_until(predicate, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def test_capacity_from_the_engines_metrics_and_a_429_keeps_the_upstream_out_for_its_retry_after(
        recorded_vllm):
    url, calls = recorded_vllm
    client = UpstreamClient(url, "vllm-0", engine="vllm", model="m", max_concurrency=8,
                            kv_capacity_tokens=16000, metrics_interval_s=0.05, breaker=CircuitBreaker(3, 60.0))
    pool = WorkerPool([client])
    client.start()
    try:
        await wait_until(lambda: client.ready and client.capacity is not None, "the first poll")
        capacity = client.capacity
        assert (capacity.num_running, capacity.num_waiting, capacity.total_kv_blocks) == (7, 3, 1000)
        assert capacity.used_kv_blocks == 412  # kv_cache_usage_perc 0.4125 of 1000 blocks
        assert client.hello.max_num_seqs == 8 and pool.total_sequence_slots() == 8
        reservation = pool.try_reserve(10, "standard", list(range(40)))
        assert reservation is not None and reservation.worker is client

        message = Generate("r-1", list(range(40)), SamplingParams(temperature=0.0, seed=7), max_tokens=5)
        stream = client.start_request(message, reservation, UpstreamPrompt(messages=[{"role": "user",
                                                                                      "content": "hi"}]))
        with pytest.raises(SluiceError) as info:
            await stream.next_update(WAIT_S)
        pool.release(reservation)
        assert info.value.code is ErrorCode.SERVER_OVERLOADED and info.value.retry_after_s == 2
        assert calls == [{"model": "m", "max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "stream": True,
                          "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "hi"}],
                          "seed": 7}]
        assert pool.try_reserve(10, "standard", list(range(40))) is None  # out until its Retry-After passes
        assert client.breaker.snapshot()["consecutive_failures"] == 0  # overload is not ill health
        await wait_until(lambda: client.can_take(10), "the Retry-After to pass")

        # the engine prefills first come, first served: below the top tier, one prompt reserved and not started
        # at a time; top-tier prompts one after another; a request's own choices (its group) do not hold each
        # other back, since they are all reserved before the first is sent
        client.top_tier_priority = 3
        assert client.can_take(10, 40, prefill_queue_s=1.0, priority=2)
        pending = Reservation(1, client, 1, prefill_tokens=40, priority=3, group="req-a")
        client.hold_prefill(pending)  # what WorkerPool.try_reserve does
        assert not client.can_take(10, 40, prefill_queue_s=1.0, priority=2)
        assert not client.can_take(10, 40, prefill_queue_s=1.0, priority=3)
        assert not client.can_take(10, 40, prefill_queue_s=1.0, priority=3, group="req-b")
        assert client.can_take(10, 40, prefill_queue_s=1.0, priority=3, group="req-a")
        assert client.can_take(10, 40, prefill_queue_s=1.0, priority=2, group="req-a")
        client.prefill_started(pending)
        lower = Reservation(2, client, 1, prefill_tokens=40, priority=2)
        client.hold_prefill(lower)  # a lower tier's prompt does not hold the top tier back
        assert not client.can_take(10, 40, prefill_queue_s=1.0, priority=2)
        assert client.can_take(10, 40, prefill_queue_s=1.0, priority=3)
        assert client.can_take(10, 40, prefill_queue_s=0.0, priority=2)  # no prefill limit configured
        client.prefill_started(lower)
        assert client.can_take(10, 40, prefill_queue_s=1.0, priority=2)

        # through the pool, as one dispatch pass grants two queued top-tier prompts: the second waits for the
        # first to start (else the engine prefills both side by side and both first tokens come late), unless it
        # is another choice of the same request
        pool.prefill_queue_s, pool.tier_priorities = 1.0, {"vip": 3, "standard": 2}
        first = pool.try_reserve(10, "vip", list(range(40)))
        assert first is not None and pool.try_reserve(10, "vip", list(range(50, 90))) is None
        pool.release(first)
        both = [pool.try_reserve(10, "vip", list(range(40)), group="req-c") for _ in range(2)]
        assert None not in both
        for reservation in both:
            pool.release(reservation)
    finally:
        await client.close()


async def test_an_upstream_that_answers_its_polls_again_is_probed_at_once_not_after_the_breakers_cooldown():
    """README trial 5: an upstream back after being down answered its polls (so /readyz said 200) while its breaker
    stayed open for the rest of its cooldown, and every request got 503 no_worker_available meanwhile."""
    engine_up = False

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=VLLM_METRICS) if engine_up else web.Response(status=503, text="loading")

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy"}}, status=429)

    url, runner = await serve_engine(metrics, chat)
    client = UpstreamClient(url, "vllm-0", engine="vllm", model="m", max_concurrency=8, kv_capacity_tokens=16000,
                            metrics_interval_s=0.05, breaker=CircuitBreaker(3, 60.0))
    pool = WorkerPool([client])
    client.start()
    try:
        await wait_until(lambda: client.breaker.state is BreakerState.OPEN, "the failed polls to open the breaker")
        assert pool.num_serving_workers() == 0 and not client.ready
        engine_up = True
        await wait_until(lambda: client.ready, "the poll that finds the engine back")
        assert client.breaker.state is BreakerState.HALF_OPEN  # not open for the rest of its 60 s cooldown
        assert pool.num_serving_workers() == 1
        probe = pool.try_reserve(10, "standard", list(range(40)))
        assert probe is not None and pool.try_reserve(10, "standard", list(range(50, 90))) is None  # one probe
        pool.release(probe)
    finally:
        await client.close()
        await runner.cleanup()


LLAMACPP_METRICS = (Path(__file__).resolve().parents[1] / "fixtures" / "engine_metrics" / "llamacpp.txt").read_text()


async def test_llamacpp_slots_and_their_context_are_read_again_when_the_engine_comes_back():
    """README trial 12: llama-server restarted with fewer slots kept its first slot count (an n=2 request then
    waited out its deadline and read "overloaded" where a 400 naming n was due), and one slot's context (n_ctx)
    was never read (a prompt past it reached the engine, whose error came back instead of context_length_exceeded)."""
    engine = {"up": True, "slots": 4, "n_ctx": 2048}

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=LLAMACPP_METRICS) if engine["up"] else web.Response(status=503, text="loading")

    async def slots(request: web.Request) -> web.Response:
        return web.json_response([{"id": i, "id_task": -1, "n_ctx": engine["n_ctx"], "is_processing": False}
                                  for i in range(engine["slots"])])

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy"}}, status=503)

    url, runner = await serve_routes(("GET", "/metrics", metrics), ("GET", "/slots", slots),
                                     ("POST", "/v1/chat/completions", chat))
    client = UpstreamClient(url, "llamacpp-0", engine="llama.cpp", model="m", max_model_len_tokens=8192,
                            metrics_interval_s=0.05, breaker=CircuitBreaker(3, 60.0))
    pool = WorkerPool([client])
    client.start()
    try:
        await wait_until(lambda: client.ready, "the first poll")
        assert (client.hello.max_num_seqs, client.hello.max_model_len_tokens) == (4, 2048)
        assert pool.max_model_len_tokens(8192) == 2048
        engine.update(up=False, slots=1, n_ctx=1024)  # restarted with --parallel 1 and a smaller context
        await wait_until(lambda: not client.ready, "the failed poll")
        engine["up"] = True
        await wait_until(lambda: client.ready, "the poll that finds the engine back")
        assert (client.hello.max_num_seqs, client.hello.max_model_len_tokens) == (1, 1024)
        assert pool.max_model_len_tokens(8192) == 1024
    finally:
        await client.close()
        await runner.cleanup()


async def test_one_sequences_decode_speed_is_measured_from_the_streams_read():
    """The slot-wait estimate needs how fast one running request decodes: the client measures it from the tokens
    it reads (an engine that counts output only at a request's end tells it late, or never for an aborted one)."""
    token_gap_s = 0.02

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=VLLM_METRICS)  # counters that never move: no rate from them

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(11):
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "},
                                  "finish_reason": "length" if i == 10 else None}]}
            await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
            await asyncio.sleep(token_gap_s)
        await response.write(b"data: [DONE]\n\n")
        return response

    url, runner = await serve_engine(metrics, chat)
    client = UpstreamClient(url, "vllm-0", engine="vllm", model="m", max_concurrency=8, kv_capacity_tokens=16000,
                            metrics_interval_s=0.05)
    client.start()
    try:
        await wait_until(lambda: client.ready and client.capacity is not None, "the first poll")
        assert client.capacity.sequence_decode_tokens_per_s == 0.0
        message = Generate("r-1", list(range(8)), SamplingParams(temperature=0.0), max_tokens=11)
        stream = client.start_request(message, None, UpstreamPrompt(messages=[{"role": "user", "content": "hi"}]))
        while (await stream.next_update(WAIT_S)).finished is None:
            pass
        await wait_until(lambda: client.capacity.sequence_decode_tokens_per_s > 0, "a poll after the stream")
        # 10 tokens after the first, each at least token_gap_s after the one before
        assert client.capacity.sequence_decode_tokens_per_s <= 1 / token_gap_s
    finally:
        await client.close()
        await runner.cleanup()
