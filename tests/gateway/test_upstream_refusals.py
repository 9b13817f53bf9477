"""What reaches an upstream engine that is stricter than vLLM, and what the client hears when it refuses: a real
gateway (``sluice serve``) in front of a fake engine that answers as ``transformers serve`` does (pinned to one
model, listed alone by its ``/v1/models``; a prompt only as a string; 422 "Unexpected fields" for ``top_k``).

- token-id prompts on ``/v1/completions`` reach such an engine as their text;
- ``top_k`` and ``ignore_eos`` are a 400 naming the field on a ``transformers`` or ``generic`` pool, before the
  engine is called;
- an engine's own 400 that names a field (OpenAI's ``error.param``) keeps it as ``param``;
- an upstream that does not serve the configured ``upstream_model`` is not ready, and a mixed fleet's ``/readyz``
  and 503s name why a pool does not serve (misconfigured model, engine down).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest
from aiohttp import web

from gateway.upstream.client import UpstreamClient
from gateway.upstream.replies import error_param, model_ids
from loadtest.prompts import load_tokenizer
from shared.config import default_model_path
from tests.conftest import sluice_serve
from tests.support.loopback import serve_routes
from tests.support.server import free_port, get_json

SERVED = "engine-served"  # the one model the fake engine is pinned to
ACCEPTED_FIELDS = {"model", "messages", "prompt", "max_tokens", "temperature", "top_p", "stream", "stream_options",
                   "seed"}
WAIT_S = 30.0


class PinnedEngine:
    """An OpenAI-compatible upstream on loopback, in a thread of its own, refusing as ``transformers serve`` does;
    it streams ``w0 w1 …``, one word per chunk. A temperature above 1.5 gets an OpenAI-style 400 naming
    ``temperature`` (an engine's own limit the gateway does not know). While :attr:`busy_answers` is above 0, a
    generation request gets 503 with ``Retry-After: 1`` instead, as an engine loading its model or full answers
    (and the count goes down by one)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.requests: list[dict] = []
        self.busy_answers = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "PinnedEngine":
        self._thread.start()
        assert self._started.wait(30)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": SERVED, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.busy_answers > 0:
            self.busy_answers -= 1
            return web.json_response({"error": {"message": "Loading model"}}, status=503,
                                     headers={"Retry-After": "1"})
        if body["model"] != SERVED:
            return web.json_response({"detail": f"Server is pinned to '{SERVED}'; requested '{body['model']}'."},
                                     status=400)
        unexpected = set(body) - ACCEPTED_FIELDS
        if unexpected:
            return web.json_response({"detail": f"Unexpected fields in the request: {unexpected}"}, status=422)
        if "prompt" in body and not isinstance(body["prompt"], str):
            return web.json_response({"detail": "prompt must be a string."}, status=400)
        if body.get("temperature", 1.0) > 1.5:
            return web.json_response({"error": {"message": "temperature must be at most 1.5 on this engine",
                                                "type": "invalid_request_error", "param": "temperature",
                                                "code": None}}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chat = "messages" in body
        for i in range(body["max_tokens"]):
            word = f"w{i} "
            choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        end = {"index": 0, "delta": {}, "finish_reason": "length"} if chat else {"index": 0, "text": "",
                                                                                  "finish_reason": "length"}
        usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"], "total_tokens": 0}
        await response.write(f"data: {json.dumps({'choices': [end]})}\n\n".encode())
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return response


def upstream_pool(name: str, engine: PinnedEngine, kind: str, upstream_model: str = SERVED) -> str:
    return f"""
[[pools]]
name = "{name}"
model_name = "{name}-model"
backend = "openai"
engine = "{kind}"
upstreams = ["{engine.base_url}"]
upstream_model = "{upstream_model}"
tokenizer = "{default_model_path()}"
metrics_interval_s = 0.1
"""


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture
def engine():
    engine = PinnedEngine().start()
    yield engine
    engine.stop()


def test_an_engines_error_body_gives_the_field_it_names_and_its_model_list_the_ids():
    assert error_param('{"error": {"message": "bad", "param": "temperature"}}') == "temperature"
    assert error_param('{"detail": "Unexpected fields in the request: {\'top_k\'}"}') == "top_k"
    assert error_param('{"detail": [{"loc": ["body", "max_tokens"], "msg": "too big"}]}') == "max_tokens"
    assert error_param('{"error": {"message": "bad", "param": null}}') is None
    assert error_param("prompt must be a string.") is None
    assert model_ids(b'{"object": "list", "data": [{"id": "a"}, {"id": "b"}]}') == ["a", "b"]
    assert model_ids(b'{"data": []}') == [] and model_ids(b"not json") == []


async def test_a_vllm_upstream_not_serving_the_configured_model_is_not_ready_until_it_does():
    """vLLM publishes /metrics; its /v1/models is read too (at the first poll, after a reconnect, then every
    MODEL_CHECK_INTERVAL_S): a model it does not list makes the upstream not ready, naming what it serves."""
    served = ["other-model"]

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_running{model_name="m"} 0\n')

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": name} for name in served]})

    url, runner = await serve_routes(("GET", "/metrics", metrics), ("GET", "/v1/models", models))
    client = UpstreamClient(url, "engine-0", engine="vllm", model="org/model", metrics_interval_s=0.05,
                            model_key="pools[1].upstream_model")
    client.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while client.hello is None or client.model_error is None:
            assert time.monotonic() < deadline, "no poll checked the model"
            await asyncio.sleep(0.05)
        assert not client.ready
        assert client.not_ready_reason() == (
            f"upstream engine-0 at {url}: the engine serves 'other-model', not the configured model 'org/model' "
            "(set pools[1].upstream_model to one of them)")
        served.append("org/model")
        client.probe.recheck_models()  # as after MODEL_CHECK_INTERVAL_S
        while not client.ready:
            assert time.monotonic() < deadline, "the model check never passed"
            await asyncio.sleep(0.05)
        assert client.not_ready_reason() is None
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_strict_engine_gets_token_id_prompts_as_text_and_vllm_only_fields_are_a_400_from_sluice(
        engine, tokenizer, tmp_path):
    config = ('[model]\nname = "no-pool-serves-this-name"\n\n[worker]\nnum_local_workers = 0\n'
              + upstream_pool("tf", engine, "transformers") + upstream_pool("gen", engine, "generic"))
    hello = tokenizer.encode("Hello, world", add_special_tokens=False)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    clef = tokenizer.encode("\U0001d11e", add_special_tokens=False)  # one character, several byte tokens
    assert len(clef) > 1
    with sluice_serve(tmp_path, config, min_ready_workers=2) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert get_json(server.base_url + "/status")[1]["model"] == "tf-model"  # the first pool's, not [model]'s
        one = await client.completions.create(model="tf-model", prompt=hello, max_tokens=2)
        two = await client.completions.create(model="tf-model", prompt=[hello, [im_start, *hello]], max_tokens=2)
        assert engine.requests[-3]["prompt"] == "Hello, world"
        assert sorted(r["prompt"] for r in engine.requests[-2:]) == ["<|im_start|>Hello, world", "Hello, world"]
        assert one.choices[0].text == "w0 w1 " and [c.text for c in two.choices] == ["w0 w1 "] * 2
        num_called = len(engine.requests)
        refused = [("tf-model", {"top_k": 5}, "top_k"), ("gen-model", {"top_k": 5}, "top_k"),
                   ("gen-model", {"ignore_eos": True}, "ignore_eos")]
        for model, extra, param in refused:
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model=model, prompt="Say", max_tokens=2, extra_body=extra)
            assert info.value.body["param"] == param, info.value.body
        with pytest.raises(openai.BadRequestError) as info:  # a byte token cut from its character: no text
            await client.completions.create(model="gen-model", prompt=[hello, clef[:1]], max_tokens=2)
        assert info.value.body["param"] == "prompt[1]", info.value.body
        assert len(engine.requests) == num_called  # none of these reached the engine
        with pytest.raises(openai.BadRequestError) as info:  # the engine's own refusal keeps the field it names
            await client.chat.completions.create(model="gen-model", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2, temperature=1.8)
        assert info.value.body["param"] == "temperature", info.value.body
        assert "temperature must be at most 1.5" in info.value.body["message"]
        await client.close()


async def test_a_mixed_fleet_names_the_pools_that_do_not_serve_and_why(engine, tmp_path):
    """Our own sim worker serves; an upstream pool whose upstream_model the engine does not serve is not ready
    (a 503 naming the models the engine serves, not the engine's 400 blamed on the client); an upstream pool whose
    engine goes down is named with the connection error."""
    config = ('[model]\nname = "ours-model"\n\n[worker]\nbackend = "sim"\n\n'
              '[[pools]]\nname = "ours"\nbackend = "sim"\nmin_workers = 1\nmax_workers = 1\n'
              + upstream_pool("engine", engine, "transformers")
              + upstream_pool("misnamed", engine, "transformers", upstream_model="no-such-model"))
    with sluice_serve(tmp_path, config, 180.0, min_ready_workers=2) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        body = wait_for_readyz(server, lambda b: "misnamed" in b.get("pools_not_serving", {}))
        reason = body["pools_not_serving"]["misnamed"]
        assert f"serves '{SERVED}', not the configured model 'no-such-model'" in reason, body
        assert "pools[2].upstream_model" in reason and "engine" not in body["pools_not_serving"], body
        with pytest.raises(openai.InternalServerError) as info:
            await client.completions.create(model="misnamed-model", prompt="Say", max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "no_worker_available"
        assert reason in info.value.body["message"], info.value.body
        assert all(r["model"] == SERVED for r in engine.requests)  # no request was sent for the wrong model
        answer = await client.completions.create(model="engine-model", prompt="Say", max_tokens=2)
        assert answer.choices[0].text == "w0 w1 "

        engine.stop()
        body = wait_for_readyz(server, lambda b: "engine" in b.get("pools_not_serving", {}))
        assert body["ready_workers"] == 1 and "unreachable" in body["pools_not_serving"]["engine"], body
        with pytest.raises(openai.InternalServerError) as info:
            await client.completions.create(model="engine-model", prompt="Say", max_tokens=2)
        assert info.value.status_code == 503 and "unreachable" in info.value.body["message"], info.value.body
        ours = await client.completions.create(model="ours-model", prompt="Say", max_tokens=2)
        assert ours.choices[0].text
        await client.close()


def wait_for_readyz(server, predicate) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        status, body = get_json(server.base_url + "/readyz")
        if status == 200 and predicate(body):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"/readyz never matched: {status} {body}")
        time.sleep(0.1)


async def test_an_engines_503_never_reaches_the_client_the_request_waits_in_its_tier_queue(engine, tmp_path):
    """README trial 16: llama-server answering 503 twice (loading) made Sluice pass the engine's 503 on after one
    retry, with the engine's Retry-After and words. The choice now waits in its tier queue again (that upstream takes
    nothing for its Retry-After) until its tier's deadline, and the client gets the answer, or at the deadline
    Sluice's own 503 ``queue_timeout``."""
    config = ('[model]\nname = "no-pool-serves-this-name"\n\n[worker]\nnum_local_workers = 0\n\n'
              '[[tiers]]\nname = "standard"\npriority = 2\nqueue_timeout_s = 4.0\n'
              + upstream_pool("gen", engine, "generic"))
    with sluice_serve(tmp_path, config, min_ready_workers=1) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        engine.busy_answers = 2
        before = len(engine.requests)
        answer = await client.chat.completions.create(model="gen-model", max_tokens=2,
                                                      messages=[{"role": "user", "content": "Hi"}])
        assert answer.choices[0].message.content == "w0 w1 "
        assert len(engine.requests) - before == 3  # refused twice, answered the third time
        assert len(server.log_events("requeued_after_engine_refusal")) == 2
        engine.busy_answers = 1000  # refuses past the tier's 4 s deadline
        started_s = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="gen-model", max_tokens=2,
                                                 messages=[{"role": "user", "content": "Hi"}])
        waited_s = time.monotonic() - started_s
        assert info.value.status_code == 503 and info.value.body["code"] == "queue_timeout", info.value.body
        assert "upstream" not in info.value.body["message"]  # Sluice's own words, not the engine's
        assert int(info.value.response.headers["Retry-After"]) >= 1
        assert 3.5 <= waited_s < 10.0, waited_s  # the tier's deadline, not the first refusal
        await client.close()
