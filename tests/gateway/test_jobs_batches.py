"""The OpenAI Files + Batch APIs through the real ``openai`` SDK against a real gateway and a real CPU worker.

The 50-line batch input is tests/fixtures/batch_mt_bench_64.jsonl: the first-turn MT-Bench questions
(../shared/data/mt_bench, Apache-2.0, Zheng et al., NeurIPS 2023) as OpenAI batch lines, ``max_tokens`` 8.
"""

from __future__ import annotations

import io
import json
import time
import uuid

import openai
import pytest

from tests.gateway.jobs_support import MODEL, Server, batch_lines

pytestmark = pytest.mark.slow

MAX_FILE_BYTES = 64 * 1024
MAX_BATCH_LINES = 64
RETENTION_DAYS = 2

CPU_CONFIG = """
[model]
max_model_len_tokens = 2048

[gateway]
max_tokens_cap = 192
default_max_tokens = 24

[worker]
num_local_workers = 1
backend = "cpu"
kv_cache_gib = 0.25
max_num_seqs = 16
max_num_batched_tokens = 512
num_threads = 2

[jobs]
sqlite_path = "{sqlite_path}"
lease_timeout_s = 3.0
poll_interval_s = 0.05
max_file_bytes = {max_file_bytes}
max_batch_lines = {max_batch_lines}
result_retention_days = {retention_days}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    workdir = tmp_path_factory.mktemp("jobs_batches")
    config = CPU_CONFIG.format(sqlite_path=workdir / "jobs.sqlite3", max_file_bytes=MAX_FILE_BYTES,
                               max_batch_lines=MAX_BATCH_LINES, retention_days=RETENTION_DAYS)
    server = Server(workdir, config).start()
    yield server
    server.stop()


def _client(server: Server, key: str = "key-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def _wait_final(client: openai.OpenAI, batch_id: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    batch = client.batches.retrieve(batch_id)
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch not final after {timeout_s} s: {batch}"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch_id)
    return batch


def test_openai_sdk_batch_workflow_50_real_prompts(server):
    client = _client(server)
    content = batch_lines(50, max_tokens=8)
    inputs = {row["custom_id"]: row for row in map(json.loads, content.decode().splitlines())}
    uploaded = client.files.create(file=("mt_bench_50.jsonl", io.BytesIO(content)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(content) and uploaded.filename == "mt_bench_50.jsonl"
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).read() == content

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"suite": "jobs"})
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 50
    assert batch.usage is None  # summed once the batch is final
    batch = _wait_final(client, batch.id, timeout_s=150)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (50, 50, 0)
    assert batch.error_file_id is None and batch.metadata == {"suite": "jobs"}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert any(b.id == batch.id for b in client.batches.list().data)

    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert len(output) == 50
    assert sorted(row["custom_id"] for row in output) == sorted(inputs)
    num_quoting = 0
    for row in output:
        assert row["error"] is None and row["id"].startswith("batch_req_")
        response = row["response"]
        assert response["status_code"] == 200 and response["request_id"]
        completion = response["body"]
        assert completion["object"] == "chat.completion" and completion["model"] == MODEL
        text = completion["choices"][0]["message"]["content"]
        prompt = inputs[row["custom_id"]]["body"]["messages"][0]["content"]
        assert text.strip() and not prompt.startswith(text.strip())  # generated, not the input echoed back
        num_quoting += text.strip() in prompt  # a small model sometimes quotes a piece of the question
        assert 1 <= completion["usage"]["completion_tokens"] <= 8
        assert completion["usage"]["prompt_tokens"] > 10
    assert num_quoting <= 5
    # the batch's usage is its lines' usage summed
    usages = [row["response"]["body"]["usage"] for row in output]
    assert batch.usage is not None
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in usages)
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in usages)
    assert batch.usage.input_tokens_details.cached_tokens == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens


def test_files_and_batches_are_invisible_to_another_key(server):
    alice, bob = _client(server, "key-alice"), _client(server, "key-bob")
    uploaded = alice.files.create(file=("a.jsonl", io.BytesIO(batch_lines(2))), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.cancel(batch.id)
    assert all(b.id != batch.id for b in bob.batches.list().data)
    assert all(f.id != uploaded.id for f in bob.files.list().data)
    _wait_final(alice, batch.id, timeout_s=60)


def test_files_list_in_either_order_through_the_sdk(server):
    carol = _client(server, f"key-carol-{uuid.uuid4().hex[:8]}")
    ids = [carol.files.create(file=(f"{i}.jsonl", io.BytesIO(batch_lines(1))), purpose="batch").id
           for i in range(3)]
    assert [f.id for f in carol.files.list(order="asc")] == ids  # the SDK pages through with `after`
    assert [f.id for f in carol.files.list(order="desc", limit=2)] == ids[::-1]
    assert [f.id for f in carol.files.list()] == ids[::-1]
    with pytest.raises(openai.BadRequestError) as info:
        carol.files.list(order="sideways")
    assert info.value.body["param"] == "order"


def _upload_error(server: Server, content: bytes, **kwargs) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        _client(server).files.create(file=("bad.jsonl", io.BytesIO(content)), purpose=kwargs.pop("purpose", "batch"),
                                     **kwargs)
    return info.value


def test_upload_limits_and_bad_lines_name_the_line(server):
    good = batch_lines(3).decode().splitlines()
    too_many = _upload_error(server, batch_lines(MAX_BATCH_LINES + 1))
    assert too_many.status_code == 400 and f"line {MAX_BATCH_LINES + 1}" in too_many.message
    assert "jobs.max_batch_lines" in too_many.message
    too_big = _upload_error(server, b"x" * (MAX_FILE_BYTES + 1))
    assert too_big.status_code == 413 and str(MAX_FILE_BYTES) in too_big.message
    bad_json = _upload_error(server, "\n".join([good[0], good[1], "{not json"]).encode())
    assert bad_json.status_code == 400 and "line 3" in bad_json.message
    duplicate = _upload_error(server, "\n".join([good[0], good[1], good[0]]).encode())
    assert duplicate.status_code == 400 and "line 3" in duplicate.message and "line 1" in duplicate.message
    no_custom_id = json.dumps({k: v for k, v in json.loads(good[0]).items() if k != "custom_id"})
    missing = _upload_error(server, "\n".join([good[0], no_custom_id]).encode())
    assert missing.status_code == 400 and "line 2" in missing.message and "custom_id" in missing.message
    wrong_purpose = _upload_error(server, batch_lines(1), purpose="fine-tune")
    assert wrong_purpose.status_code == 400
    retention = _upload_error(server, batch_lines(1),
                              expires_after={"anchor": "created_at", "seconds": (RETENTION_DAYS + 1) * 86400})
    assert retention.status_code == 400 and "result_retention_days" in retention.message


def _post_raw(server: Server, path: str, data: bytes, content_type: str) -> tuple[int, dict]:
    """POST ``data`` as it is (no client library reshapes it); return (status, the JSON body)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(server.base_url + path, data=data, method="POST",
                                     headers={"Content-Type": content_type, "Authorization": "Bearer key-alice"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("content_type", ["multipart/form-data; boundary=zzz", "multipart/form-data"])
def test_a_malformed_multipart_upload_is_400_not_a_500(server, content_type):
    status, body = _post_raw(server, "/v1/files", b"garbage", content_type)
    assert status == 400 and body["error"]["code"] == "invalid_request_error"
    assert "multipart" in body["error"]["message"]


@pytest.mark.parametrize("name", ["données.jsonl", "résumé 🙂.jsonl", "plain.jsonl"])
def test_a_utf8_filename_comes_back_as_it_was_sent(server, name):
    """curl and browsers send a part's filename as raw UTF-8, the OpenAI SDK as RFC 5987's ``filename*``: both are
    stored and listed as sent (README trial 14 read "donnÃ©es.jsonl" back: its client's decoding of the UTF-8 answer
    as Latin-1; the name here, read as bytes and decoded as UTF-8, is whole)."""
    body = (f'--zzz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--zzz\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            f'Content-Type: application/octet-stream\r\n\r\n').encode() + batch_lines(1) + b"\r\n--zzz--\r\n"
    status, uploaded = _post_raw(server, "/v1/files", body, "multipart/form-data; boundary=zzz")
    assert status == 200 and uploaded["filename"] == name, uploaded
    assert _client(server).files.retrieve(uploaded["id"]).filename == name
    assert _client(server).files.create(file=(name, batch_lines(1)), purpose="batch").filename == name  # the SDK


def test_a_batch_field_of_the_wrong_type_is_invalid_type_naming_it(server):
    body = {"input_file_id": 5, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    status, answer = _post_raw(server, "/v1/batches", json.dumps(body).encode(), "application/json")
    assert status == 400 and answer["error"]["code"] == "invalid_type"
    assert answer["error"]["param"] == "input_file_id"
    del body["input_file_id"]
    status, answer = _post_raw(server, "/v1/batches", json.dumps(body).encode(), "application/json")
    assert status == 400 and answer["error"]["code"] == "missing_required_parameter"


def test_batch_with_an_unserved_model_fails_with_per_line_errors(server):
    client = _client(server)
    rows = [json.loads(line) for line in batch_lines(3).decode().splitlines()]
    rows[1]["body"]["model"] = "no-such-model"
    rows[2]["body"]["messages"] = "not a list"  # a bad body alone fails its line when it runs (BC44), not the batch
    uploaded = client.files.create(file=("mixed.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.failed_at
    assert sorted(error.line for error in batch.errors.data) == [2]
    assert batch.errors.data[0].param == "body.model"
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=f"file-{uuid.uuid4().hex}", endpoint="/v1/chat/completions",
                              completion_window="24h")


def test_completions_endpoint_batch(server):
    client = _client(server)
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": f"The capital of country number {i} is", "max_tokens": 4}})
             for i in range(3)]
    uploaded = client.files.create(file=("c.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    batch = _wait_final(client, batch.id, timeout_s=60)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [row["custom_id"] for row in output] == ["c0", "c1", "c2"]
    assert all(row["response"]["body"]["object"] == "text_completion" for row in output)
    assert all(row["response"]["body"]["choices"][0]["text"] for row in output)


def test_cancel_batch_in_progress_ends_cancelled_with_every_line_accounted(server):
    client = _client(server)
    uploaded = client.files.create(file=("c.jsonl", io.BytesIO(batch_lines(MAX_BATCH_LINES, max_tokens=64))),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    time.sleep(0.5)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    batch = _wait_final(client, batch.id, timeout_s=30)
    assert batch.status == "cancelled" and batch.cancelled_at
    counts = batch.request_counts
    assert counts.total == MAX_BATCH_LINES and counts.completed + counts.failed == counts.total
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert len(errors) == counts.failed and all(row["error"]["code"] == "batch_cancelled" for row in errors)
    assert client.batches.cancel(batch.id).status == "cancelled"  # a final batch is returned unchanged


def test_a_batch_larger_than_the_job_limit_is_told_that_waiting_cannot_help():
    from gateway.jobs.api import too_many_jobs
    from gateway.jobs.store import TooManyJobsError

    wait = too_many_jobs(TooManyJobsError(1, 2), 2, 7)
    assert wait.status == 429 and wait.message.endswith("Wait for some to finish.") and wait.retry_after_s == 7
    never = too_many_jobs(TooManyJobsError(0, 2), 3, 7)  # a 429 would have the SDK retry it for nothing
    assert never.status == 400 and never.param == "input_file_id", never
    assert "can never fit" in never.message and "Wait" not in never.message
