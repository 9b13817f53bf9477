"""Behaviour cases BC37–BC42 of ../shared/cases/gateway_cases.jsonl against a real ``sluice serve`` (CPU worker).

Each test checks the case's ``expect`` and what its ``notes`` mark EXT. The cases are sized for a GPU server; here
the counts and lengths shrink to what the CPU test server (tests/conftest.py: 2048-token context, 16 sequences,
``max_tokens_cap`` 192) runs in seconds, keeping what each case proves: more concurrent requests than decode slots
(BC37), a shared prefix of many blocks pushed out of the pool and back (BC39), cancel-then-resend with no pause
(BC40), a batch cancelled once its first line completed (BC43).

BC39, BC43 and BC44 run on a second server with the same worker, a jobs store of its own and admission off (one
FIFO queue without deadlines): admission predicts waits and books KV from a request's whole prompt, cached prefix
included, so on a busy CPU BC39's burst of prompts sharing a cached prefix is shed (``predicted_queue_timeout``,
``queue_timeout``) before it reaches the worker whose KV cache the case is about, and critical pressure sheds the
batch tier that BC43 and BC44 run in.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import io
import json
import socket
import time
import zlib

import openai
import pytest

from tests.conftest import TEST_CONFIG, sluice_serve
from tests.gateway.test_e2e import CAP, MODEL, SSE, _chat, _post, _post_sse, _raw_request, _read_events

pytestmark = pytest.mark.slow

CODE = "K7-QX-42-ZEBRA-9"


@pytest.fixture(scope="module")
def server(sluice_server):
    return sluice_server


@pytest.fixture(scope="module")
def jobs_server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cases_jobs")
    config = TEST_CONFIG.replace("kv_cache_gib = 0.25", "kv_cache_gib = 0.1") + f"""
[admission]
enabled = false

[jobs]
sqlite_path = "{workdir / 'jobs.sqlite3'}"
poll_interval_s = 0.05
"""
    with sluice_serve(workdir, config) as server:
        yield server
        capacity = _idle(server)
        assert capacity["used_kv_blocks"] == 0 and _running(capacity) == 0, capacity


def _filler(tokenizer, num_tokens: int, salt: str = "") -> str:
    """Return text of about ``num_tokens`` tokens, the same for the same arguments."""
    text = " ".join(f"{salt}The lighthouse keeper logged ship number {i} passing the northern reef at dawn."
                    for i in range(num_tokens // 10 + 10))
    return tokenizer.decode(tokenizer.encode_text_sync(text)[:num_tokens])


def _running(capacity: dict) -> int:
    return capacity["num_running"] + capacity["num_waiting"]


def _idle(server, timeout_s: float = 30.0) -> dict:
    return server.wait_for_capacity(lambda c: _running(c) == 0 and c["used_kv_blocks"] == 0, timeout_s)


def _read_response(sock: socket.socket, on_first_event=None,
                   timeout_s: float = 300) -> tuple[list[tuple[float, bytes]], bytes]:
    """Read a whole HTTP/1.1 response from ``sock``; return ((arrival time, bytes) per recv, the raw bytes).
    ``on_first_event`` is called once the first SSE event has arrived."""
    sock.settimeout(timeout_s)
    pieces: list[tuple[float, bytes]] = []
    raw = b""
    while True:
        data = sock.recv(65536)
        if not data:
            break
        pieces.append((time.monotonic(), data))
        raw += data
        if on_first_event is not None and b"data: " in raw:
            on_first_event()
            on_first_event = None
        if raw.endswith(b"0\r\n\r\n") or (b"Content-Length" in raw.split(b"\r\n\r\n")[0]
                                          and _complete_with_length(raw)):
            break
    return pieces, raw


def _complete_with_length(raw: bytes) -> bool:
    head, _, body = raw.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def _dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2:]
    return out


# ---------------------------------------------------------------------- BC37: non-streamed disconnects


def test_bc37_closed_non_stream_requests_leave_no_ghost_generations(server):
    slots = server.config["worker"]["max_num_seqs"]
    base_active = server.status()["active_requests"]
    body = _chat("Write an extremely long, detailed story about a lighthouse keeper. Never stop early.",
                 max_tokens=CAP, temperature=0.8)
    sockets = [_raw_request(server, body) for _ in range(4 * slots)]  # more than the decode slots
    server.wait_for_capacity(lambda c: c["num_running"] >= 1, 60)
    time.sleep(1.5)
    for sock in sockets:
        sock.close()
    # every abort reaches the worker at once; it applies them between engine steps (a prefill step of 16 prompts
    # takes seconds on a busy CPU, so no bound tighter than a few steps is asserted here)
    capacity = _idle(server)
    assert _running(capacity) == 0 and capacity["used_kv_blocks"] == 0, capacity
    deadline = time.monotonic() + 30
    while server.status()["active_requests"] != base_active and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.status()["active_requests"] == base_active
    probe = _post_sse(server, "/v1/chat/completions", _chat("Say hi.", max_tokens=16, stream=True))
    assert probe.status == 200 and probe.data[-1] == "[DONE]"


# ---------------------------------------------------------------------- BC38: max_completion_tokens


def test_bc38_max_completion_tokens_caps_and_reports_length(server):
    prompt = "Count from 1 to 2000, separated by single spaces. Do not stop early."
    chat = "/v1/chat/completions"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        s1, s2, s3, s4 = [f.result() for f in [
            pool.submit(_post, server, chat, _chat(prompt, max_completion_tokens=8, temperature=0)),
            pool.submit(_post_sse, server, chat, _chat(prompt, max_completion_tokens=8, temperature=0, stream=True,
                                                       stream_options={"include_usage": True})),
            pool.submit(_post, server, chat, _chat(prompt, max_tokens=64, max_completion_tokens=8, temperature=0)),
            pool.submit(_post, server, chat, _chat(prompt + " Then keep going forever.",
                                                   max_completion_tokens=1_000_000, temperature=0))]]
    assert s1.status_code == 200 and 1 <= s1.json()["usage"]["completion_tokens"] <= 8
    assert s1.json()["choices"][0]["finish_reason"] == "length"
    assert s2.status == 200 and s2.final_finish_reason() == "length" and s2.data[-1] == "[DONE]"
    assert s2.usage_chunks()[0]["usage"]["completion_tokens"] <= 8
    assert s3.status_code == 200 and s3.json()["usage"]["completion_tokens"] <= 8  # max_completion_tokens wins
    # over the cap: clamped to the gateway's cap, and the cap ending the answer is reported as length
    assert s4.status_code in (200, 400), s4.text
    if s4.status_code == 200:
        assert s4.json()["usage"]["completion_tokens"] <= CAP
        assert s4.json()["choices"][0]["finish_reason"] == "length"
    else:
        assert s4.json()["error"]["param"] == "max_completion_tokens"


# ---------------------------------------------------------------------- BC39: prefix reuse under concurrency


def test_bc39_shared_prefix_answers_identical_under_concurrency_and_after_eviction(jobs_server, tokenizer):
    server = jobs_server
    system = _filler(tokenizer, 256)
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Ignore the text above. Reply with exactly this code and nothing else: {CODE}"}]}
    base = _post(server, "/v1/chat/completions", body)
    assert base.status_code == 200
    expected = base.json()["choices"][0]["message"]["content"]
    concurrency = 6  # as many as admission books at once without credit for the shared prefix (20 of 145 blocks)

    def burst() -> list[str]:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            responses = list(pool.map(lambda _: _post(server, "/v1/chat/completions", body), range(concurrency)))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
        return [r.json()["choices"][0]["message"]["content"] for r in responses]

    first = burst()
    total_blocks = server.worker_capacity()["total_kv_blocks"]
    evict_tokens = 1200  # unique prompts that together fill the pool: the shared prefix leaves the device pool
    num_evict = total_blocks * 16 // evict_tokens + 1
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        evicts = list(pool.map(lambda i: _post(server, "/v1/chat/completions", {
            "model": MODEL, "max_tokens": 1, "messages": [
                {"role": "user", "content": _filler(tokenizer, evict_tokens, salt=f"evict {i}: ")}]}),
            range(num_evict)))
    assert all(r.status_code < 500 for r in evicts)
    second = burst()
    for content in first + second:
        assert "\ufffd" not in content
        assert content == expected  # any difference is corrupted KV: temperature 0, float32 weights
    hits = server.worker_capacity()["kv_stats"]
    assert server.worker_capacity()["prefix_hit_rate"] > 0 or any(
        v > 0 for k, v in hits.items() if k.startswith("prefix_hit")), hits


# ---------------------------------------------------------------------- BC40: cancel then resend


def test_bc40_cut_stream_then_immediate_resend_gets_the_same_answer(server, tokenizer):
    body = {"model": MODEL, "temperature": 0, "max_tokens": 16, "messages": [
        {"role": "system", "content": _filler(tokenizer, 512, salt="regenerate ")},
        {"role": "user", "content": "Summarize the text above in one sentence."}]}
    status = server.status()["local_workers"][0]
    pid, starts = status["pid"], status["starts"]
    warm = _post(server, "/v1/chat/completions", body)
    assert warm.status_code == 200
    warm_body = warm.json()
    for _ in range(3):
        sock = _raw_request(server, {**body, "max_tokens": 256, "stream": True}, linger_rst=True)
        _read_events(sock, 1)
        sock.close()  # an abortive close (RST), and the resend at once
        again = _post(server, "/v1/chat/completions", body)
        assert again.status_code == 200, again.text
        again_body = again.json()
        assert again_body["usage"]["prompt_tokens"] == warm_body["usage"]["prompt_tokens"]
        content = again_body["choices"][0]["message"]["content"]
        assert "\ufffd" not in content
        assert content == warm_body["choices"][0]["message"]["content"]
    time.sleep(3.0)
    assert _post(server, "/v1/chat/completions", {**body, "max_tokens": 4}).status_code == 200
    status = server.status()["local_workers"][0]
    assert (status["pid"], status["starts"]) == (pid, starts)  # no crash, no restart
    capacity = _idle(server)
    assert capacity["used_kv_blocks"] == 0 and _running(capacity) == 0, capacity


# ---------------------------------------------------------------------- BC41: SSE not buffered


def test_bc41_sse_events_arrive_while_generating_whatever_accept_encoding(server):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(_check_sse_not_buffered, server, e) for e in ("gzip, deflate, br", "identity")]:
            future.result()


def _check_sse_not_buffered(server, encoding: str) -> None:
    payload = json.dumps(_chat("Count from 1 to 2000, one number per line.", max_tokens=64, temperature=0,
                               stream=True, ignore_eos=True)).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    started = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Accept-Encoding: " + encoding.encode() + b"\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(payload), payload))
    active_at_first_event = []
    pieces, raw = _read_response(sock, lambda: active_at_first_event.append(server.status()["active_requests"]))
    active_at_end = server.status()["active_requests"]
    sock.close()
    ended = time.monotonic()
    head, _, body = raw.partition(b"\r\n\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.decode().partition(":") for line in head.split(b"\r\n")[1:])}
    assert head.startswith(b"HTTP/1.1 200")
    assert headers["content-type"].split(";")[0] == "text/event-stream"
    assert headers.get("x-accel-buffering") == "no" and headers.get("cache-control") == "no-cache"
    data = _dechunk(body) if headers.get("transfer-encoding") == "chunked" else body
    if headers.get("content-encoding") == "gzip":
        data = gzip.decompress(data)
    elif headers.get("content-encoding") == "deflate":
        data = zlib.decompress(data)
    sse = SSE(200, headers, data)
    assert sse.data[-1] == "[DONE]" and all(isinstance(c, dict) for c in sse.chunks)
    # the first event reached the client while the gateway still served the request, and the events spread
    # over the generation instead of arriving together at its end
    assert active_at_first_event[0] > active_at_end
    assert pieces[-1][0] - pieces[0][0] >= 0.4 * (ended - started)


# ---------------------------------------------------------------------- BC42: no usage chunk unless asked


def test_bc42_usage_chunk_only_with_include_usage_true(server):
    body = _chat("Say hello in five words.", max_tokens=16, stream=True)
    chat = "/v1/chat/completions"
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        empty_opts, false_opts, no_opts, true_opts, nonstream = [f.result() for f in [
            pool.submit(_post_sse, server, chat, {**body, "stream_options": {}}),
            pool.submit(_post_sse, server, chat, {**body, "stream_options": {"include_usage": False}}),
            pool.submit(_post_sse, server, chat, body),
            pool.submit(_post_sse, server, chat, {**body, "stream_options": {"include_usage": True}}),
            pool.submit(_post, server, chat, {**body, "stream": False, "stream_options": {"include_usage": True}})]]
    for sse in (empty_opts, false_opts, no_opts):
        assert sse.status == 200 and sse.data[-1] == "[DONE]"
        assert sse.usage_chunks() == [] and all(chunk["choices"] for chunk in sse.chunks)
    assert true_opts.status == 200 and len(true_opts.usage_chunks()) == 1
    assert true_opts.usage_chunks()[0]["choices"] == []
    assert nonstream.status_code in (200, 400)


# ---------------------------------------------------------------------- BC43, BC44: Batch API


def _sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="test", max_retries=0, timeout=120)


def _upload(client: openai.OpenAI, rows: list[dict], name: str) -> str:
    content = "\n".join(json.dumps(row) for row in rows).encode()
    return client.files.create(file=(name, io.BytesIO(content)), purpose="batch").id


def _line(custom_id: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _poll(client: openai.OpenAI, batch_id: str, done, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    batch = client.batches.retrieve(batch_id)
    while not done(batch):
        assert time.monotonic() < deadline, f"batch not there after {timeout_s} s: {batch}"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch_id)
    return batch


def _jsonl(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def test_bc43_cancelled_batch_keeps_its_finished_lines_reachable_and_stops(jobs_server):
    client = _sdk(jobs_server)
    rows = [_line(f"bc43-{i:02d}", {"model": MODEL, "max_tokens": 16, "messages": [
        {"role": "user", "content": f"Write a 400-word essay about topic number {i}."}]}) for i in range(40)]
    created = client.batches.create(input_file_id=_upload(client, rows, "bc43.jsonl"),
                                    endpoint="/v1/chat/completions", completion_window="24h")
    _poll(client, created.id, lambda b: b.request_counts.completed >= 1)
    cancel = client.batches.cancel(created.id)
    assert cancel.status in ("cancelling", "cancelled")
    done = _poll(client, created.id, lambda b: b.status == "cancelled", timeout_s=60)
    counts = done.request_counts
    assert done.cancelled_at and counts.total == 40 and counts.completed + counts.failed <= counts.total
    assert done.output_file_id
    out = _jsonl(client, done.output_file_id)
    ids = [row["custom_id"] for row in out]
    assert len(out) == counts.completed and len(set(ids)) == len(ids)
    assert set(ids) <= {row["custom_id"] for row in rows}
    assert all(row["response"]["status_code"] == 200 for row in out)
    recancel = client.batches.cancel(created.id)  # a final batch is returned unchanged (200)
    again = client.batches.retrieve(created.id)
    assert recancel.status == again.status == "cancelled" and again.output_file_id == done.output_file_id
    # no further generation for the cancelled batch: the worker runs nothing within 10 s
    capacity = jobs_server.wait_for_capacity(lambda c: _running(c) == 0, 10)
    assert _running(capacity) == 0, capacity


def test_bc44_failed_lines_go_to_the_error_file_and_the_batch_completes(jobs_server):
    client = _sdk(jobs_server)
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "Reply with OK."}], "max_tokens": 8}
    mixed_rows = [_line("bc44-good-1", ok),
                  _line("bc44-bad-negmax", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                            "max_tokens": -5}),
                  _line("bc44-good-2", ok),
                  _line("bc44-bad-msgs", {"model": MODEL, "messages": "not-a-list", "max_tokens": 8})]
    bad_rows = [_line("bc44b-bad-1", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": -1}),
                _line("bc44b-bad-2", {"model": MODEL, "messages": [], "max_tokens": 8})]
    final = ("completed", "failed", "expired", "cancelled")
    mixed = client.batches.create(input_file_id=_upload(client, mixed_rows, "bc44a.jsonl"),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    all_bad = client.batches.create(input_file_id=_upload(client, bad_rows, "bc44b.jsonl"),
                                    endpoint="/v1/chat/completions", completion_window="24h")
    mixed = _poll(client, mixed.id, lambda b: b.status in final)
    assert mixed.status == "completed"
    assert (mixed.request_counts.total, mixed.request_counts.completed, mixed.request_counts.failed) == (4, 2, 2)
    assert sorted(row["custom_id"] for row in _jsonl(client, mixed.output_file_id)) == ["bc44-good-1", "bc44-good-2"]
    errors = _jsonl(client, mixed.error_file_id)
    assert sorted(row["custom_id"] for row in errors) == ["bc44-bad-msgs", "bc44-bad-negmax"]
    for row in errors:
        assert row["response"]["status_code"] == 400 and row["response"]["body"]["error"]["message"]
    all_bad = _poll(client, all_bad.id, lambda b: b.status in final)
    assert all_bad.status == "completed" and all_bad.output_file_id is None and all_bad.error_file_id
    assert (all_bad.request_counts.completed, all_bad.request_counts.failed) == (0, 2)
    assert {row["custom_id"] for row in _jsonl(client, all_bad.error_file_id)} == {"bc44b-bad-1", "bc44b-bad-2"}
    assert all_bad.id in [b.id for b in client.batches.list(limit=10).data]
