"""Sluice in front of a real third-party engine: ``transformers serve`` (CPU) serving SmolLM2-135M-Instruct, as the
only pool of a gateway that starts no worker of its own (``backend = "openai"``, ``num_local_workers = 0``).

One engine process and one gateway serve the whole module. The tests that break the engine (killed mid-stream,
then down) come last, in file order.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import psutil
import pytest

from tests.conftest import sluice_serve
from tests.support.server import get_json, wait_for
from tests.support.transformers_serve import TransformersServe, smollm2_hf_folder

MODEL = "smollm2-upstream"  # the name clients send to Sluice
PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
LONG_PROMPT = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]
REQUEST_TIMEOUT_S = 300.0
MAX_TOKENS = 12


def gateway_config(upstream: TransformersServe) -> str:
    return f"""
[model]
name = "{MODEL}"
max_model_len_tokens = 2048

[gateway]
max_tokens_cap = 192
default_max_tokens = 24
first_token_timeout_s = 300.0
stall_timeout_s = 120.0

[worker]
num_local_workers = 0

[breaker]
failure_threshold = 3
cooldown_s = 600.0

[[pools]]
name = "engine"
backend = "openai"
engine = "transformers"
upstreams = ["{upstream.base_url}"]
upstream_model = "{upstream.model}"
tokenizer = "{upstream.model}"
max_concurrency = 4
"""


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    engine = TransformersServe(smollm2_hf_folder(), tmp_path_factory.mktemp("transformers_serve") / "serve.log")
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    with sluice_serve(tmp_path_factory.mktemp("sluice_upstream"), gateway_config(upstream)) as server:
        yield server


def client_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="test", max_retries=0, timeout=REQUEST_TIMEOUT_S)


def upstream_status(gateway) -> dict:
    return gateway.status()["workers"][0]


async def read_sse(response: aiohttp.ClientResponse) -> list[str]:
    """Return the ``data:`` payloads of an SSE response, in order."""
    events = []
    async for line in response.content:
        if line.startswith(b"data: "):
            events.append(line[len(b"data: "):].decode().strip())
    return events


def test_no_local_worker_and_the_upstream_is_the_pools_worker(gateway):
    status = gateway.status()
    assert status["local_workers"] == []
    worker = status["workers"][0]
    assert (worker["ready"], worker["backend"], worker["pool"]) == (True, "openai:transformers", "engine")
    assert worker["hello"]["max_num_seqs"] == 4


@pytest.fixture(scope="module")
def direct(upstream):
    """The engine's own answer to PROMPT at temperature 0, asked directly."""
    return client_for(upstream.base_url).chat.completions.create(
        model=upstream.model, messages=PROMPT, temperature=0, max_tokens=MAX_TOKENS)


def test_chat_through_sluice_equals_the_engines_own_answer_at_temperature_0(gateway, direct):
    via = client_for(gateway.base_url).chat.completions.create(
        model=MODEL, messages=PROMPT, temperature=0, max_tokens=MAX_TOKENS)
    assert via.choices[0].message.content == direct.choices[0].message.content
    assert via.choices[0].message.content
    assert via.model == MODEL and via.choices[0].finish_reason == direct.choices[0].finish_reason
    assert via.usage.completion_tokens == direct.usage.completion_tokens


def test_stream_is_sluices_sse_contract_and_equals_the_engines_answer(gateway, direct):
    async def stream() -> list[str]:
        body = {"model": MODEL, "messages": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True,
                "stream_options": {"include_usage": True}}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
            async with session.post(gateway.base_url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/event-stream")
                return await read_sse(response)

    events = asyncio.run(stream())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    with_choices = [c for c in chunks if c["choices"]]
    assert [c["choices"][0]["finish_reason"] for c in with_choices[:-1]] == [None] * (len(with_choices) - 1)
    assert with_choices[-1]["choices"][0]["finish_reason"] == direct.choices[0].finish_reason
    usage_chunks = [c for c in chunks if c.get("usage")]
    assert len(usage_chunks) == 1 and usage_chunks[0]["choices"] == [] and usage_chunks[0] is chunks[-1]
    assert usage_chunks[0]["usage"]["completion_tokens"] == direct.usage.completion_tokens
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in with_choices)
    assert text == direct.choices[0].message.content


def test_bad_input_is_a_400_from_sluice_before_the_engine_is_called(gateway):
    sent_before = upstream_status(gateway)["connections"]
    status, body = post_json(gateway.base_url + "/v1/chat/completions",
                             {"model": MODEL, "messages": PROMPT, "temperature": "hot"})
    assert status == 400 and body["error"]["param"] == "temperature"
    status, body = post_json(gateway.base_url + "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert status == 400 and body["error"]["param"] == "messages"
    too_long = [{"role": "user", "content": "word " * 3000}]  # past the 2048-token context, by Sluice's count
    status, body = post_json(gateway.base_url + "/v1/chat/completions", {"model": MODEL, "messages": too_long})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    # vLLM's sampling extensions, which transformers serve refuses with a 400 naming no field (README trial 5)
    for field, value in (("top_k", 5), ("ignore_eos", True)):
        status, body = post_json(gateway.base_url + "/v1/chat/completions",
                                 {"model": MODEL, "messages": PROMPT, "max_tokens": 3, field: value})
        assert status == 400 and body["error"]["param"] == field and "transformers" in body["error"]["message"], body
    assert upstream_status(gateway)["connections"] == sent_before


def test_a_job_runs_on_the_upstream_pool_with_the_stop_string_enforced_by_the_gateway(gateway, direct):
    answer = direct.choices[0].message.content
    stop = answer.split()[2]  # a word in the middle of the engine's answer
    status, job = post_json(gateway.base_url + "/v1/jobs", {"model": MODEL, "messages": PROMPT, "temperature": 0,
                                                           "max_tokens": MAX_TOKENS, "stop": [stop]})
    assert status == 202, job

    def finished():
        job_status, body = get_json(f"{gateway.base_url}/v1/jobs/{job['id']}")
        return body if body["status"] in ("succeeded", "failed") else None

    done = wait_for(finished, REQUEST_TIMEOUT_S, "the job to finish")
    assert done["status"] == "succeeded", done
    choice = done["result"]["choices"][0]
    assert choice["message"]["content"] == answer[:answer.index(stop)] and choice["finish_reason"] == "stop"


def test_client_disconnect_closes_the_upstream_connection_at_once(gateway, upstream):
    gateway_process = psutil.Process(gateway.process.pid)

    def upstream_connections() -> int:
        processes = [gateway_process, *gateway_process.children(recursive=True)]
        return sum(1 for p in processes for c in p.net_connections(kind="tcp")
                   if c.raddr and c.raddr.port == upstream.port and c.status == psutil.CONN_ESTABLISHED)

    async def start_then_leave() -> int:
        body = {"model": MODEL, "messages": LONG_PROMPT, "temperature": 0, "max_tokens": 192, "stream": True}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
            async with session.post(gateway.base_url + "/v1/chat/completions", json=body) as response:
                async for line in response.content:
                    if b'"content":"' in line and b'"content":""' not in line:
                        break  # the first text: the engine is generating
                open_during = upstream_connections()
                response.close()
        return open_during

    assert asyncio.run(start_then_leave()) >= 1  # the stream's (a health poll may hold another for a moment)
    wait_for(lambda: upstream_connections() == 0, 10.0, "the gateway to close its connection to the engine")
    wait_for(lambda: upstream_status(gateway)["in_flight"] == 0, 10.0, "the request to end in the gateway")


def test_engine_killed_mid_stream_is_an_in_band_error_then_the_breaker_opens_and_readyz_says_why(gateway,
                                                                                                  upstream):
    async def stream_and_kill() -> list[str]:
        body = {"model": MODEL, "messages": LONG_PROMPT, "temperature": 0, "max_tokens": 192, "stream": True}
        events = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
            async with session.post(gateway.base_url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
                async for line in response.content:
                    if not line.startswith(b"data: "):
                        continue
                    events.append(line[len(b"data: "):].decode().strip())
                    if len(events) == 3:
                        upstream.kill()
        return events

    events = asyncio.run(stream_and_kill())
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert error["error"]["code"] == "worker_failed" and error["error"]["type"] == "server_error"
    assert "TransferEncodingError" not in error["error"]["message"], error  # no parser internals (README trial 5)

    def readyz_says_why():
        status, body = get_json(gateway.base_url + "/readyz")
        return body if status == 503 and "circuit breaker open" in body["error"]["message"] else None

    body = wait_for(readyz_says_why, 30.0, "/readyz to report the open breaker")
    assert "unreachable" in body["error"]["message"] and upstream.base_url in body["error"]["message"]
    worker = upstream_status(gateway)
    assert worker["breaker"]["state"] == "open"
    assert worker["state"] == "down" and "unreachable" in worker["not_ready_reason"]  # /status says so too
    status, body = post_json(gateway.base_url + "/v1/chat/completions", {"model": MODEL, "messages": PROMPT})
    assert status == 503 and body["error"]["code"] == "no_worker_available"


def post_json(url: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
