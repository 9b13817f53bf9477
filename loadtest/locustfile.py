"""Locust load test of a Sluice gateway: streaming chat users with tiers, and async-job users.

Run headless against a local gateway (loopback only, bounded in time)::

    .venv/bin/locust -f loadtest/locustfile.py --headless -u 8 -r 2 -t 60s --host http://127.0.0.1:8000 \\
        --csv bench/results/locust

Locust's own per-endpoint rows of the streamed chat requests time the response headers, which Sluice sends with
the first token: they are a time to first byte, not the answer's time. Every streamed answer also records two custom
metrics (request type ``SSE``):
``TTFT`` (ms from sending the request to the first content delta) and ``TPOT`` (ms per output token after the
first, from the usage chunk's token count). Chat users draw a tier from ``SLUICE_LOCUST_TIER_MIX`` (default
``vip=0.2,standard=0.6,free=0.2``) and send it in the ``x-sluice-tier`` header (which can only lower a tier) with
the API key of ``SLUICE_LOCUST_API_KEYS`` (``vip=sk-…,standard=sk-…``; none by default). Prompts are real:
Arena-Hard questions (one turn) and MT-Bench two-turn conversations whose second turn carries the first answer
as history (copies under ``loadtest/data``; see its ``LICENSE-NOTE.md``).

Async-job users (``POST /v1/jobs``, poll ``GET /v1/jobs/{id}``, fetch the result) have weight 0 unless
``SLUICE_LOCUST_JOBS=1``. Other knobs: ``SLUICE_LOCUST_MAX_TOKENS`` (default 64), ``SLUICE_LOCUST_MODEL``
(default: the gateway's ``/v1/models``), ``SLUICE_LOCUST_SEED``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from locust import HttpUser, between, events, task  # noqa: E402

from loadtest.prompts import arena_hard_prompts, mt_bench_conversations  # noqa: E402
from loadtest.traces import parse_mix  # noqa: E402

TIER_HEADER = "x-sluice-tier"
MAX_TOKENS = int(os.environ.get("SLUICE_LOCUST_MAX_TOKENS", "64"))
TIER_MIX = parse_mix(os.environ.get("SLUICE_LOCUST_TIER_MIX", "vip=0.2,standard=0.6,free=0.2"))
API_KEYS = dict(part.split("=", 1) for part in os.environ.get("SLUICE_LOCUST_API_KEYS", "").split(",") if "=" in part)
JOBS_ENABLED = os.environ.get("SLUICE_LOCUST_JOBS", "") == "1"
JOB_POLL_INTERVAL_S = 0.5
JOB_TIMEOUT_S = 120.0
JOB_FINAL_STATES = {"completed", "succeeded", "failed", "cancelled", "canceled", "expired"}
_rng = random.Random(int(os.environ.get("SLUICE_LOCUST_SEED", "0")))


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@events.test_start.add_listener
def _refuse_remote_hosts(environment, **_kwargs) -> None:
    """Stop at once unless ``--host`` is a loopback address (the load tests never load a remote service)."""
    host = environment.host or ""
    if not _is_loopback(host):
        print(f"locustfile: --host {host!r} is not a loopback address; refusing to run", file=sys.stderr)
        if environment.runner is not None:
            environment.runner.quit()


def _fire(environment, name: str, value_ms: float, exception: Exception | None = None) -> None:
    environment.events.request.fire(request_type="SSE", name=name, response_time=value_ms, response_length=0,
                                    exception=exception, context={})


class _SluiceUser(HttpUser):
    abstract = True

    def on_start(self) -> None:
        self.tier = _rng.choices(list(TIER_MIX), weights=list(TIER_MIX.values()))[0]
        self.headers = {TIER_HEADER: self.tier}
        key = API_KEYS.get(self.tier) or API_KEYS.get("*")
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self.model = os.environ.get("SLUICE_LOCUST_MODEL") or self._served_model()

    def _served_model(self) -> str:
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as response:
            try:
                return response.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError):
                response.failure(f"/v1/models answered {response.status_code}")
                return "default"


class ChatUser(_SluiceUser):
    """A chat frontend user: streamed answers, one-turn Arena-Hard and two-turn MT-Bench conversations."""

    weight = 10
    wait_time = between(0.2, 1.0)

    def stream_chat(self, messages: list[dict], name: str) -> str | None:
        """Send one streamed chat completion; record TTFT and TPOT; return the answer text (None on failure)."""
        body = {"model": self.model, "messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
                "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        first_s = last_s = None
        completion_tokens = None
        parts: list[str] = []
        with self.client.post("/v1/chat/completions", json=body, headers=self.headers, stream=True,
                              catch_response=True, name=name) as response:
            if response.status_code != 200:
                retry_after = response.headers.get("Retry-After")
                response.failure(f"HTTP {response.status_code} (Retry-After {retry_after}): {response.text[:200]}")
                return None
            error = None
            for raw in response.iter_lines():
                if not raw or not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                if chunk.get("usage"):
                    completion_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        first_s = now if first_s is None else first_s
                        last_s = now
                        parts.append(text)
            if error is not None:
                response.failure(f"in-band error: {error}")
                return None
            response.success()
        if first_s is None:
            return ""
        _fire(self.environment, "TTFT", (first_s - sent) * 1000)
        num_tokens = completion_tokens or len(parts)
        if num_tokens > 1 and last_s is not None:
            _fire(self.environment, "TPOT", (last_s - first_s) * 1000 / (num_tokens - 1))
        return "".join(parts)

    @task(3)
    def arena_hard_question(self) -> None:
        prompt = _rng.choice(arena_hard_prompts())
        self.stream_chat([{"role": "user", "content": prompt}], "chat (arena-hard)")

    @task(1)
    def mt_bench_conversation(self) -> None:
        turns = _rng.choice(mt_bench_conversations())
        messages: list[dict] = []
        for i, turn in enumerate(turns[:2]):
            messages.append({"role": "user", "content": turn})
            answer = self.stream_chat(messages, f"chat (mt-bench turn {i + 1})")
            if answer is None:
                return
            messages.append({"role": "assistant", "content": answer})


class JobUser(_SluiceUser):
    """An async-job user: submit a chat request as a job, poll until it is final, fetch the result."""

    weight = 1 if JOBS_ENABLED else 0
    wait_time = between(1.0, 3.0)

    @task
    def submit_poll_fetch(self) -> None:
        prompt = _rng.choice(arena_hard_prompts())
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS}
        started = time.perf_counter()
        with self.client.post("/v1/jobs", json=body, headers=self.headers, catch_response=True,
                              name="/v1/jobs (submit)") as response:
            if response.status_code not in (200, 201, 202):
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            job_id = response.json().get("id")
            if not job_id:
                response.failure("no job id in the answer")
                return
        state = None
        deadline = time.perf_counter() + JOB_TIMEOUT_S
        while time.perf_counter() < deadline:
            with self.client.get(f"/v1/jobs/{job_id}", headers=self.headers, catch_response=True,
                                 name="/v1/jobs/{id} (poll)") as response:
                if response.status_code != 200:
                    response.failure(f"HTTP {response.status_code}")
                    return
                job = response.json()
                state = job.get("status")
            if state in JOB_FINAL_STATES:
                break
            time.sleep(JOB_POLL_INTERVAL_S)
        elapsed_ms = (time.perf_counter() - started) * 1000
        ok = state in ("completed", "succeeded")
        self.environment.events.request.fire(
            request_type="JOB", name="job end-to-end", response_time=elapsed_ms, response_length=0,
            exception=None if ok else RuntimeError(f"job {job_id} ended {state!r}"), context={})
