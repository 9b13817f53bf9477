"""The app's error ladder and operational endpoints, in-process and without workers (validation runs first).

Every request here fails or succeeds before any worker is involved; with no worker connected, a *valid* generation
request gets 503 ``no_worker_available`` with Retry-After (and /readyz is 503).
"""

from __future__ import annotations

import gzip
import json
import re

import brotli
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import build_app
from gateway.state import GatewayOptions
from shared.config import Config, with_overrides

try:  # Python 3.14's, else the backport aiohttp reads zstd with
    from compression import zstd
except ImportError:
    from backports import zstd

MODEL = Config().model.name
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
async def client(tokenizer):
    config = with_overrides(Config(), gateway={"max_body_bytes": 64 * 1024})
    app = build_app(GatewayOptions(config=config, spawn_local_workers=False), tokenizer=tokenizer)
    async with TestClient(TestServer(app)) as test_client:
        yield test_client


async def _post(client, path: str, body=None, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    response = await client.post(path, data=data, headers={"Content-Type": "application/json"})
    return response.status, response.headers, await response.read()


def _envelope(raw: bytes) -> dict:
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["code"], str)
    return error


@pytest.mark.parametrize("raw", [
    b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "stream": true, x}',
    b'"just a string"', b"[]", b"null", b"",
    b'{"model": "M", "messages": [{"role": "user", "content": "hi"}]',
])
async def test_bc22_invalid_json_bodies_are_json_400(client, raw):
    status, headers, body = await _post(client, CHAT, raw=raw.replace(b"M", MODEL.encode()))
    assert status == 400
    assert headers["Content-Type"].startswith("application/json")
    assert _envelope(body)["type"] == "invalid_request_error"
    assert headers["x-request-id"]


@pytest.mark.parametrize("sent, echoed", [("trace-42", True), ("00-4bf92f3577b34da6a3ce929d0e0e4736-01", True),
                                           ("x" * 129, False), ("has space", False), ("", False)])
async def test_a_usable_x_request_id_is_echoed_else_the_gateways_own(client, sent, echoed):
    response = await client.post(CHAT, data=b"{}", headers={"Content-Type": "application/json",
                                                            "X-Request-Id": sent})
    assert response.status == 400
    if echoed:
        assert response.headers["x-request-id"] == sent
    else:
        assert re.fullmatch("[0-9a-f]{32}", response.headers["x-request-id"])


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
async def test_a_body_its_content_encoding_cannot_decode_is_400_not_a_500(client, path, encoding):
    """README trial 14: a br body aiohttp could not decode came back with aiohttp's own words ("400, message:\n
    Can not decode content-encoding: br"); the 400 names the header."""
    response = await client.post(path, data=b'{"not": "compressed at all"}',
                                 headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    error = _envelope(await response.read())
    assert response.status == 400 and error["code"] == "invalid_request_error"
    assert f"could not be decoded as its Content-Encoding ('{encoding}')" in error["message"], error


@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("br", brotli.compress),
                                                ("zstd", zstd.compress)])
async def test_a_compressed_body_is_read(client, encoding, compress):
    """gzip, deflate, br and zstd bodies are decoded (README trial 14: zstd was a text/plain 400 asking the server to
    install backports.zstd, and br worked only where locust's dependencies had brought Brotli)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}
    response = await client.post(CHAT, data=compress(json.dumps(body).encode()),
                                 headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    error = _envelope(await response.read())
    assert response.status == 400 and error["param"] == "temperature", error  # decoded, then validated


async def test_bc22_trailing_comma_on_completions_is_400(client):
    raw = b'{"model": "%s", "prompt": "hi", "max_tokens": 4,}' % MODEL.encode()
    status, _, body = await _post(client, "/v1/completions", raw=raw)
    assert status == 400 and _envelope(body)["code"] == "invalid_json"


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "messages": [], "max_tokens": 64}, 400, "messages"),
    ({"model": MODEL, "max_tokens": 64}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user"}], "max_tokens": 8}, 400, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 123}], "max_tokens": 8}, 400, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 8}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": "does-not-exist", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
])
async def test_bc23_empty_messages_and_wrong_types(client, body, status, param):
    got_status, _, raw = await _post(client, CHAT, body)
    error = _envelope(raw)
    assert got_status == status and error["param"] == param
    if status == 404:
        assert "model" in error["code"]


@pytest.mark.parametrize("max_tokens", [0, -5, 1.5, "10"])
async def test_bc19_bad_max_tokens_rejected_fast(client, max_tokens):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write the numbers from 1 to 5000"}],
            "max_tokens": max_tokens}
    status, _, raw = await _post(client, CHAT, body)
    assert status == 400 and _envelope(raw)["param"] == "max_tokens"


async def test_bc06_stream_validation_error_is_json_not_sse(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
            "stream": True, "top_p": 1.5}
    status, headers, raw = await _post(client, CHAT, body)
    assert status == 400 and headers["Content-Type"].startswith("application/json")
    assert not raw.startswith(b"data:") and _envelope(raw)["message"]


async def test_context_length_exceeded(client, tokenizer):
    prompt = list(range(100, 100 + 9000))  # more token ids than the default 8192-token context
    status, _, raw = await _post(client, "/v1/completions", {"model": MODEL, "prompt": prompt})
    assert status == 400 and _envelope(raw)["code"] == "context_length_exceeded"


async def test_body_over_limit_is_413_envelope(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (70 * 1024)}]}
    status, _, raw = await _post(client, CHAT, body)
    assert status == 413 and _envelope(raw)["code"] == "request_too_large"


async def test_unknown_route_404_and_wrong_method_405_in_envelope(client):
    response = await client.get("/v1/nope")
    assert response.status == 404 and _envelope(await response.read())["code"] == "not_found"
    response = await client.get(CHAT)
    assert response.status == 405 and _envelope(await response.read())["code"] == "method_not_allowed"


def metric_sample(text: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` in a Prometheus text exposition."""
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


async def test_no_worker_is_503_with_retry_after_and_not_ready(client):
    status, headers, raw = await _post(client, CHAT, {"model": MODEL, "messages": [{"role": "user",
                                                                                    "content": "hi"}]})
    assert status == 503 and headers["Retry-After"] == "1"
    assert _envelope(raw)["code"] == "no_worker_available"
    assert (await client.get("/readyz")).status == 503
    assert (await client.get("/healthz")).status == 200
    health = await client.get("/health")  # vLLM's and TGI's path (BC12 polls it)
    assert health.status == 200 and (await health.json()) == {"status": "ok"}


async def test_readyz_names_a_local_worker_that_is_still_loading(tokenizer):
    """A spawned local worker joins its pool once it listens (after loading the model: seconds, or a minute while
    the CPU kernels build): until then ``/readyz`` says it is starting, not "no worker configured"."""
    from gateway.fleet.pools import LocalWorker
    from gateway.state import FLEET
    from gateway.workers.client import WorkerClient

    app = build_app(GatewayOptions(config=Config(), spawn_local_workers=False), tokenizer=tokenizer)
    async with TestClient(TestServer(app)) as loading_client:
        runtime = next(iter(app[FLEET].runtimes.values()))  # the fleet is built as the app starts
        client = WorkerClient("unix:/tmp/sluice-test-not-listening.sock", "local-0")
        runtime.local["w-1"] = LocalWorker(runtime.name, 0, "w-1", "/tmp/sluice-test-not-listening.sock", None,
                                           client, 0.0)
        response = await loading_client.get("/readyz")
        error = _envelope(await response.read())
    assert response.status == 503 and error["code"] == "no_worker_available"
    assert "local worker local-0 starting (loading the model" in error["message"], error["message"]
    assert "no worker configured" not in error["message"]


async def test_models_status_metrics(client):
    status, _, _ = await _post(client, CHAT, {"model": MODEL, "messages": []})  # counted as a 400
    assert status == 400
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == MODEL
    status = await (await client.get("/status")).json()
    assert status["model"] == MODEL and status["workers"] == []
    text = await (await client.get("/metrics")).text()
    assert 'sluice_requests_total{endpoint="/v1/chat/completions",status="400"}' in text
    # the gateway process's own resources (BC05: CPU not spinning; BC33: memory flat)
    assert metric_sample(text, "process_cpu_seconds_total") > 0
    assert metric_sample(text, "process_resident_memory_bytes") > 10_000_000
    assert "sluice_active_requests 0.0" in text


async def test_a_model_id_with_a_slash_is_retrieved_by_its_id(tokenizer):
    """Hugging Face style ids (``org/name``, as vLLM serves them) are listed and retrieved; an unknown one is a 404
    ``model_not_found`` whatever its slashes."""
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config = with_overrides(Config(), model={"name": name})
    app = build_app(GatewayOptions(config=config, spawn_local_workers=False), tokenizer=tokenizer)
    async with TestClient(TestServer(app)) as slash_client:
        models = await (await slash_client.get("/v1/models")).json()
        card = await slash_client.get("/v1/models/" + name)
        unknown = await slash_client.get("/v1/models/HuggingFaceTB/other")
        assert [m["id"] for m in models["data"]] == [name]
        assert card.status == 200 and (await card.json())["id"] == name
        assert unknown.status == 404 and _envelope(await unknown.read())["code"] == "model_not_found"


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
_field_values = {
    "model": st.just(MODEL) | _json_values,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot", 3]),
                                                "content": _json_values}), max_size=3) | _json_values,
    "prompt": _json_values | st.lists(st.integers(min_value=-5, max_value=60000), max_size=5),
    "max_tokens": _json_values, "temperature": _json_values, "top_p": _json_values, "n": _json_values,
    "stop": _json_values, "seed": _json_values, "stream": _json_values, "stream_options": _json_values,
    "logprobs": _json_values, "top_k": _json_values,
}
_bodies = (
    st.fixed_dictionaries({}, optional=_field_values).map(lambda d: json.dumps(d).encode())
    | _json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=64)
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_bodies, path=st.sampled_from([CHAT, "/v1/completions"]))
async def test_malformed_bodies_never_5xx_in_process(client, body, path):
    status, _, raw = await _post(client, path, raw=body)
    error = _envelope(raw)
    # the only allowed 5xx without a worker: a valid request that would need one
    assert status < 500 or (status == 503 and error["code"] == "no_worker_available"), (status, raw)


async def test_cors_is_off_by_default(client):
    response = await client.options(CHAT, headers={"Origin": "https://chat.example.com",
                                                   "Access-Control-Request-Method": "POST"})
    assert response.status == 405 and "Access-Control-Allow-Origin" not in response.headers
    response = await client.get("/healthz", headers={"Origin": "https://chat.example.com"})
    assert "Access-Control-Allow-Origin" not in response.headers


@pytest.mark.parametrize("origins, allowed", [(["*"], True), (["https://chat.example.com"], True),
                                              (["https://other.example.com"], False)])
async def test_cors_preflight_and_headers_for_the_configured_origins(tokenizer, origins, allowed):
    config = with_overrides(Config(), gateway={"cors_allow_origins": origins})
    app = build_app(GatewayOptions(config=config, spawn_local_workers=False), tokenizer=tokenizer)
    origin = "https://chat.example.com"
    async with TestClient(TestServer(app)) as cors_client:
        preflight = await cors_client.options(CHAT, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        answer = await cors_client.post(CHAT, data=b"{}", headers={"Origin": origin,
                                                                   "Content-Type": "application/json"})
    if allowed:
        assert preflight.status == 200
        assert preflight.headers["Access-Control-Allow-Origin"] == origin
        assert preflight.headers["Access-Control-Allow-Methods"] == "POST"
        assert set(preflight.headers["Access-Control-Allow-Headers"].lower().split(",")) == {
            "authorization", "content-type"}
        assert "Access-Control-Allow-Credentials" not in preflight.headers
        # the answer (here a 400 for the empty body) carries the headers too, so the page can read the error
        assert answer.status == 400 and answer.headers["Access-Control-Allow-Origin"] == origin
        assert "x-request-id" in answer.headers["Access-Control-Expose-Headers"].lower()
    else:
        assert preflight.status == 403 and "Access-Control-Allow-Origin" not in preflight.headers
        assert "Access-Control-Allow-Origin" not in answer.headers
