"""Preemption by tier in front of an engine without priorities, end to end: a real gateway (``sluice serve``, no
worker of its own) in front of a vLLM-shaped HTTP upstream with one slot, and the real OpenAI SDK as the client.

The upstream is a fake because the test pins exact decisions (which request was stopped, what the continuation
sent): it streams the words ``w0 w1 …`` one per chunk, continues a ``/v1/completions`` prompt of token ids from
the last word in it, and records every request and whether its client closed it. The decisions of who is stopped
for whom are pinned in tests/gateway/test_preemption.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import openai
import pytest
from aiohttp import web
from loadtest.prompts import load_tokenizer
from shared.config import default_model_path
from tests.conftest import sluice_serve
from tests.support.server import free_port, get_json

MODEL = "engine-model"
WORD_INTERVAL_S = 0.05
MAX_TOKENS = 16
VLLM_METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="{model}"}} {running}
vllm:num_requests_waiting{{model_name="{model}"}} 0
vllm:kv_cache_usage_perc{{model_name="{model}"}} 0.0
"""


class WordEngine:
    """An OpenAI-compatible upstream on loopback, in a thread of its own (the gateway polls it while the test's
    loop waits): one word per chunk, ``max_tokens`` words, then ``length`` and a usage chunk."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.port = free_port()
        self.requests: list[dict] = []  # {"path", "body", "closed_by_client"}
        self.running = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "WordEngine":
        self._thread.start()
        assert self._started.wait(30)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=VLLM_METRICS.format(model=MODEL, running=self.running))

    def _first_word(self, body: dict) -> int:
        """0 for a chat; for a completion prompt of token ids, the number of words already in the answer."""
        if "messages" in body:
            return 0
        text = self.tokenizer.decode(body["prompt"])
        answer = text.rsplit("assistant\n", 1)[-1]
        return len(re.findall(r"w\d+ ", answer))

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        record = {"path": request.path, "body": body, "closed_by_client": False}
        self.requests.append(record)
        first = self._first_word(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chat = "messages" in body
        self.running += 1
        try:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(WORD_INTERVAL_S)
                word = f"w{first + i} "
                choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
                await response.write(f"data: {_json({'choices': [choice]})}\n\n".encode())
            end = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                   else {"index": 0, "text": "", "finish_reason": "length"})
            await response.write(f"data: {_json({'choices': [end]})}\n\n".encode())
            usage = {"prompt_tokens": 10, "completion_tokens": body["max_tokens"], "total_tokens": 0}
            await response.write(f"data: {_json({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        except (ConnectionResetError, asyncio.CancelledError):
            record["closed_by_client"] = True
        finally:
            self.running -= 1
        return response


def _json(value) -> str:
    return json.dumps(value)


def gateway_config(engine: WordEngine, max_concurrency: int = 1) -> str:
    tiers = "".join(f"""
[[tiers]]
name = "{name}"
priority = {priority}
queue_timeout_s = 30.0
reserved_slot_fraction = 0.0
reserved_kv_fraction = 0.0
""" for name, priority in (("vip", 3), ("standard", 2)))
    return f"""
default_tier = "vip"

[model]
name = "{MODEL}"
max_model_len_tokens = 2048

[gateway]
stall_timeout_s = 30.0

[worker]
num_local_workers = 0

[[pools]]
name = "engine"
backend = "openai"
engine = "vllm"
upstreams = ["{engine.base_url}"]
tokenizer = "{default_model_path()}"
max_concurrency = {max_concurrency}
metrics_interval_s = 0.1
{tiers}"""


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture
def engine(tokenizer):
    engine = WordEngine(tokenizer).start()
    yield engine
    engine.stop()


async def test_a_vip_request_preempts_a_running_standard_stream_which_resumes_where_it_stopped(
        engine, tokenizer, tmp_path):
    messages = [{"role": "user", "content": "Say some words."}]
    with sluice_serve(tmp_path, gateway_config(engine), min_ready_workers=0) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True}, extra_headers={"x-sluice-tier": "standard"})
        pieces: list[str] = []
        chunks = aiter(stream)
        while len("".join(pieces).split()) < 3:  # the standard answer is running: its first words arrived
            chunk = await anext(chunks)
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        started_s = time.perf_counter()
        vip = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        vip_s = time.perf_counter() - started_s
        finish_reason, usage = None, None
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish_reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                usage = chunk.usage
        _, status = get_json(server.base_url + "/status")
        await client.close()

    # the vip answer did not wait for the standard one to end (16 words at 50 ms)
    assert vip.choices[0].message.content == "w0 w1 w2 w3 "
    assert vip_s < MAX_TOKENS * WORD_INTERVAL_S
    # the standard stream lost nothing and repeated nothing
    assert "".join(pieces) == "".join(f"w{i} " for i in range(MAX_TOKENS))
    assert finish_reason == "length" and usage.completion_tokens == MAX_TOKENS
    first, vip_request, resumed = engine.requests
    assert first["path"] == "/v1/chat/completions" and first["closed_by_client"]
    assert vip_request["path"] == "/v1/chat/completions" and not vip_request["closed_by_client"]
    # the continuation: the prompt's token ids as the gateway counts them, then the answer so far's
    assert resumed["path"] == "/v1/completions" and not resumed["closed_by_client"]
    prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
    sent = resumed["body"]["prompt"]
    assert sent[:len(prompt_ids)] == list(prompt_ids)
    words_before = len(re.findall(r"w\d+ ", tokenizer.decode(sent[len(prompt_ids):])))
    assert words_before >= 3 and resumed["body"]["max_tokens"] == MAX_TOKENS - words_before
    assert status["admission"]["tiers"]["standard"]["preempted"] == 1
    assert status["admission"]["tiers"]["vip"]["preempted"] == 0
    # usage counts the prompt as the engine did (it reports 10), except for a resumption, whose prompt holds the
    # answer so far: then as the gateway tokenized the client's (README trial 5: always the gateway's count)
    assert vip.usage.prompt_tokens == 10 != len(prompt_ids)
    assert usage.prompt_tokens == len(prompt_ids)


async def test_the_choices_of_one_lower_tier_request_all_run_though_lower_tiers_send_one_prompt_at_a_time(
        engine, tmp_path):
    """All choices of a request are reserved before the first is sent: only prompts sent hold back the next."""
    messages = [{"role": "user", "content": "Say some words."}]
    with sluice_serve(tmp_path, gateway_config(engine, max_concurrency=2), min_ready_workers=0) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2,
                                                      extra_headers={"x-sluice-tier": "standard"})
        await client.close()
    assert [c.message.content for c in answer.choices] == ["w0 w1 w2 w3 "] * 2
    assert answer.usage.completion_tokens == 8


async def test_logprobs_from_an_upstream_pool_are_a_400_naming_the_field_and_the_engine_is_not_called(
        engine, tmp_path):
    """The gateway streams an upstream's text, not its log-probabilities: asking for them is a 400 (chat,
    completions, a job at submission), never an answer with an empty logprobs list."""
    messages = [{"role": "user", "content": "Say some words."}]
    with sluice_serve(tmp_path, gateway_config(engine), min_ready_workers=0) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        calls = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, logprobs=True),
                 client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, logprobs=True,
                                                top_logprobs=2, stream=True),
                 client.completions.create(model=MODEL, prompt="Say", max_tokens=4, logprobs=2)]
        for call in calls:
            with pytest.raises(openai.BadRequestError) as info:
                await call
            assert info.value.body["param"] == "logprobs", info.value.body
        with pytest.raises(openai.BadRequestError) as info:
            await client.post("/jobs", cast_to=object, body={"model": MODEL, "messages": messages, "logprobs": True})
        assert info.value.body["param"] == "logprobs"
        answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        await client.close()
    assert answer.choices[0].message.content == "w0 w1 "
    assert len(engine.requests) == 1  # only the last one reached the engine
