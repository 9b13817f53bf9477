"""One OpenAI-compatible upstream (vLLM, SGLang, llama.cpp, TGI, transformers serve, …) as a worker of a pool.

::

    WorkerPool ── can_take / try_reserve ──▶ UpstreamClient ── POST /v1/chat/completions (SSE) ──▶ engine
        ▲                                        │ RequestStream: text, then Finished (usage) or Failed
        └──── Capacity every metrics_interval_s ─┘◀── EngineProbe: GET /metrics (or /v1/models) ──── engine

:class:`UpstreamClient` is a :class:`~gateway.workers.client.WorkerClient` to the pool, admission and the request
pipeline: it says Hello once the upstream answers its first poll (``max_num_seqs`` = the concurrency limit, KV
blocks from the engine's KV size), reports a ``Capacity`` from every poll (what a poll reads and makes of it is
:class:`~gateway.upstream.probe.EngineProbe`'s), and runs each request as one streamed HTTP request whose text the
pipeline turns into Sluice's own stream. Failures, as a worker's:

- connection refused, reset or cut mid-stream, an HTTP 5xx, an in-band error, a stream that ends without a finish
  reason → ``worker_failed`` (counted by the breaker; retried on another upstream before the first byte, in-band
  after);
- HTTP 429 or 503 → ``server_overloaded``, not a health failure: the upstream takes nothing more for its
  ``Retry-After`` (1 s when absent), and the retry waits in Sluice's tier queues, where deadlines and early
  rejection answer the client with Sluice's own 503 and ``Retry-After``;
- HTTP 400 / 413 / 422 → ``invalid_request_error`` with the upstream's message and, where its error body names
  the field (OpenAI's ``error.param``, FastAPI's ``detail[].loc``, ``transformers serve``'s "Unexpected fields"),
  that field as ``param`` (the gateway validated first, so this is a field Sluice passes on and the engine does not
  accept).

A poll also checks that the engine serves the configured model (``pools[…].upstream_model``): for an engine that
answers only for the models its ``/v1/models`` lists, a model not listed marks the upstream not ready, naming the
models it serves (an operator's error, not the client's: requests get a 503 ``no_worker_available`` with that
reason instead of the engine's 400 on every request).

A failed poll marks the upstream unready (``/readyz`` says why: :meth:`UpstreamClient.not_ready_reason`) and counts
against its breaker, so an upstream that is down opens its breaker within ``failure_threshold`` polls; the first
poll that succeeds again half-opens it (the next request is its probe), instead of leaving every request shed for the
rest of the breaker's cooldown. Aborting a request (client gone, stop string matched) cancels its task, which closes
its HTTP connection at once: the engine sees the disconnect and frees the sequence.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, Callable

import aiohttp
import structlog

from gateway.upstream.engine_metrics import EngineSnapshot, MetricsParseError
from gateway.upstream.probe import EngineProbe
from gateway.upstream.replies import error_message, error_param, retry_after_s_of
from gateway.upstream.request_body import ENGINES_RESUMING_FROM_TOKEN_IDS, UpstreamPrompt, upstream_body
from gateway.upstream.sse import MAX_LINE_BYTES, SSEFormatError, decode_event, sse_data
from gateway.workers.breaker import BreakerState, CircuitBreaker
from gateway.workers.client import WorkerClient
from gateway.workers.stream import RequestStream
from shared.errors import ErrorCode, SluiceError
from shared.protocol import Capacity, Finished, Generate

if TYPE_CHECKING:
    from gateway.workers.reservation import Reservation

log = structlog.get_logger("sluice.gateway")

CONNECT_TIMEOUT_S = 5.0
MAX_ERROR_BODY_BYTES = 4096


class UpstreamClient(WorkerClient):
    """One upstream server of a ``backend = "openai"`` pool, presented as a worker.

    Args:
        base_url: the server, ``http://host:port`` (requests go to ``{base_url}/v1/...``).
        name: label for logs, metrics and ``/status``.
        engine: ``vllm``, ``sglang``, ``llama.cpp``, ``tgi``, ``transformers`` or ``generic``.
        model: the model name sent upstream.
        max_concurrency, kv_capacity_tokens, max_model_len_tokens, metrics_interval_s: the limits and the poll
            interval, as :class:`~gateway.upstream.probe.EngineProbe` takes them.
        api_key: bearer token for the upstream ("" = none).
        on_capacity: called with (name, Capacity) on every poll.
        breaker: this upstream's circuit breaker.
        top_tier_priority: the highest tier priority; requests of lower tiers are sent one prompt at a time
            (:meth:`can_take`).
        model_key: the config key that sets ``model``, for the message when the engine does not serve it.

    Attributes:
        probe: what the polls read of the engine (its model check, its rates, the Hello and Capacity made of them).
    """

    preemptible_by_gateway = True  # engines run first come, first served: the gateway preempts by tier for them

    def __init__(self, base_url: str, name: str, *, engine: str, model: str, max_concurrency: int = 0,
                 kv_capacity_tokens: int = 0, max_model_len_tokens: int = 8192, metrics_interval_s: float = 0.25,
                 api_key: str = "", on_capacity: Callable[[str, Capacity], None] | None = None,
                 breaker: CircuitBreaker | None = None, top_tier_priority: int = 0,
                 model_key: str = "upstream_model") -> None:
        super().__init__(base_url.rstrip("/"), name, on_capacity, breaker)
        self.top_tier_priority = top_tier_priority
        # reservation id → (tier priority, group) of each prompt reserved here whose first text has not come
        self._held_not_started: dict[int, tuple[int, object | None]] = {}
        self.engine = engine
        self.model = model
        self.metrics_interval_s = metrics_interval_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.probe = EngineProbe(self.address, name, engine=engine, model=model, model_key=model_key,
                                 headers=self._headers, max_concurrency=max_concurrency,
                                 kv_capacity_tokens=kv_capacity_tokens, max_model_len_tokens=max_model_len_tokens,
                                 metrics_interval_s=metrics_interval_s, on_change=self._changed)
        self._session: aiohttp.ClientSession | None = None
        self._requests: dict[str, asyncio.Task] = {}
        self._reachable = False
        self.last_error: str | None = None
        self._saturated_until_s = 0.0  # monotonic: the upstream said 429/503; nothing is sent before this

    # ------------------------------------------------------------------ what the pool reads

    @property
    def ready(self) -> bool:
        """The last poll answered, a Hello was made from it, the engine serves the configured model, and the gateway
        does not drain this upstream."""
        return self._reachable and self.hello is not None and self.model_error is None and not self.draining

    @property
    def model_error(self) -> str | None:
        """Why the engine does not serve the configured model (its ``/v1/models``, read at a poll), or None."""
        return self.probe.model_error

    @property
    def backend(self) -> str:
        return f"openai:{self.engine}"

    @property
    def resumes_from_token_ids(self) -> bool:  # type: ignore[override]
        """The engine continues a prompt given as token ids on ``/v1/completions`` (vLLM, SGLang, llama.cpp), so a
        preempted answer resumes where it stopped; TGI, ``transformers serve`` and ``generic`` do not say they do."""
        return self.engine in ENGINES_RESUMING_FROM_TOKEN_IDS

    def can_take(self, demand_blocks: int, prefill_tokens: int = 0, prefill_queue_s: float = 0.0,
                 priority: int = 0, fallback_prefill_tokens_per_s: float = 0.0, group: object | None = None) -> bool:
        """See :meth:`WorkerClient.can_take`; also no while the upstream's last 429/503 ``Retry-After`` runs, and,
        with a prefill limit (``prefill_queue_s`` > 0), no for a tier below ``top_tier_priority`` while any prompt
        reserved here has not started: the engine prefills first come, first served, so each prompt queued there is
        prefill time a top-tier request arriving next must wait through (one lower-tier prompt at most). A top-tier
        prompt waits while another top-tier prompt reserved here has not started: an engine prefills the prompts it
        holds side by side (llama.cpp, vLLM's chunked prefill), so two of them both get their first token when both
        are done, where one after the other the first gets it after its own (the order the vip-alone bound of
        ``bench/engine_overload_bench.py`` assumes); it does not wait for a lower tier's prompt, which it would wait
        through whole. Reservations count from the moment they are made, so two prompts granted in one dispatch
        pass are not both sent; those of the asking request's own ``group`` do not count: a request's choices are
        all reserved before the first is sent."""
        if time.monotonic() < self._saturated_until_s:
            return False
        if prefill_queue_s > 0 and self._held_not_started:
            top = self.top_tier_priority
            others = [held for held, held_group in self._held_not_started.values()
                      if group is None or held_group != group]
            if others and (priority < top or any(held >= top for held in others)):
                return False
        return super().can_take(demand_blocks, prefill_tokens, prefill_queue_s, priority,
                                fallback_prefill_tokens_per_s)

    def hold_prefill(self, reservation: "Reservation") -> None:
        """See :meth:`WorkerClient.hold_prefill`; the prompt holds back others until it starts (:meth:`can_take`)."""
        self._held_not_started[reservation.reservation_id] = (reservation.priority, reservation.group)
        super().hold_prefill(reservation)

    def prefill_started(self, reservation: "Reservation") -> None:
        """See :meth:`WorkerClient.prefill_started`; the prompt no longer holds back others (:meth:`can_take`)."""
        self._held_not_started.pop(reservation.reservation_id, None)
        super().prefill_started(reservation)

    def not_ready_reason(self) -> str | None:
        """Return why this upstream takes no request now (``/readyz``), or None when it can."""
        breaker = self.breaker.state
        if self.ready and breaker is not BreakerState.OPEN:
            return None
        parts = []
        if not self._reachable:
            parts.append(f"unreachable ({self.last_error})" if self.last_error else "not polled yet")
        elif self.model_error is not None:
            parts.append(self.model_error)
        if self.draining:
            parts.append("draining")
        if breaker is BreakerState.OPEN:
            parts.append("circuit breaker open")
        return f"upstream {self.name} at {self.address}: " + ", ".join(parts or ["not ready"])

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Open the HTTP session and start polling (tasks owned here; :meth:`close` ends them)."""
        if self._task is None:
            # One connection per request (no keep-alive): closing it is how an engine learns that a request is
            # aborted, and a connection never outlives the request it served.
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            self._session = aiohttp.ClientSession(
                connector=connector, read_bufsize=MAX_LINE_BYTES,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S))
            self._task = asyncio.create_task(self._poll_loop(), name=f"upstream-poll-{self.name}")

    async def close(self, reason: str = "gateway shutting down") -> None:
        """Stop polling, cancel every request (each fails with ``worker_failed`` naming ``reason``) and close the
        session."""
        self._closing = True
        tasks = [t for t in (self._task, *self._requests.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        for stream in list(self._streams.values()):
            stream._fail(SluiceError(ErrorCode.WORKER_FAILED, f"upstream {self.name}: {reason}"))
        self._streams.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ requests

    def start_request(self, message: Generate, reservation: "Reservation | None" = None,
                      prompt: UpstreamPrompt | None = None) -> RequestStream:
        """Send one choice upstream as a streamed request; return its stream.

        Args:
            message: the choice (capped ``max_tokens``, sampling with its seed).
            reservation: its reservation here (prefill backlog until the first text).
            prompt: the client's messages or prompt; None = the prompt token ids on ``/v1/completions``.

        Raises:
            SluiceError: ``worker_failed`` when the upstream is not reachable now (retried elsewhere).
        """
        if not self.ready or self._session is None:
            raise SluiceError(ErrorCode.WORKER_FAILED, f"upstream {self.name} is not reachable")
        stream = RequestStream(message.request_id, self)
        stream.reservation = reservation
        self._streams[message.request_id] = stream
        if prompt is None:
            prompt = UpstreamPrompt(prompt=message.prompt_token_ids)
        self.probe.own_prompt_tokens += len(message.prompt_token_ids)
        self.num_connections += 1  # one HTTP connection per request (``/status`` ``connections``)
        self._requests[message.request_id] = asyncio.create_task(
            self._run_request(stream, message, prompt), name=f"upstream-{self.name}-{message.request_id}")
        return stream

    def abort(self, request_id: str) -> None:
        """Close the request's HTTP connection now (synchronous: safe in ``finally``)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.end()
        task = self._requests.pop(request_id, None)
        if task is not None and not task.done():
            task.cancel()

    def send_drain(self) -> None:
        """Upstreams have no drain message: the gateway just stops sending (:meth:`mark_draining`)."""

    async def _run_request(self, stream: RequestStream, message: Generate, prompt: UpstreamPrompt) -> None:
        request_id = message.request_id
        started_s = time.perf_counter()
        finish_reason: str | None = None
        num_chunks = 0
        first_token_s = last_token_s = 0.0
        usage: tuple[int | None, int | None, int | None] = (None, None, None)
        try:
            async with self._session.post(self.address + prompt.path, json=upstream_body(prompt, message, self.model),
                                          headers=self._headers) as response:
                if response.status != 200:
                    raise await self._http_error(response)
                async for data in sse_data(response.content):
                    delta = decode_event(data)
                    if delta.error is not None:
                        raise SluiceError(ErrorCode.WORKER_FAILED, f"upstream {self.name}: {delta.error}")
                    if delta.text:
                        last_token_s = time.perf_counter()
                        latency_ms = None
                        if num_chunks == 0:
                            first_token_s = last_token_s
                            latency_ms = (last_token_s - started_s) * 1000
                        num_chunks += 1
                        self.probe.own_generation_tokens += 1
                        stream._push_text(delta.text, 1, latency_ms)
                    finish_reason = delta.finish_reason or finish_reason
                    if delta.completion_tokens is not None:
                        usage = (delta.prompt_tokens, delta.completion_tokens, delta.cached_tokens)
            if finish_reason is None:
                raise SluiceError(ErrorCode.WORKER_FAILED,
                                  f"upstream {self.name} ended the stream before the answer ended")
        except SluiceError as exc:
            stream._fail(exc)
        except aiohttp.ClientPayloadError:
            # aiohttp's text names its parser's internals (e.g. "TransferEncodingError: 400, message=…" for a
            # chunked body cut short), which reads as an HTTP status the engine never sent
            stream._fail(SluiceError(ErrorCode.WORKER_FAILED, f"upstream {self.name} failed: its response ended "
                                     "before the answer did (the connection closed mid-stream)"))
        except (aiohttp.ClientError, OSError, SSEFormatError, ValueError, TimeoutError) as exc:
            stream._fail(SluiceError(ErrorCode.WORKER_FAILED, f"upstream {self.name} failed: "
                                     f"{type(exc).__name__}: {exc}"))
        else:
            prompt_tokens, completion_tokens, cached_tokens = usage
            stream._finish(Finished(request_id, "length" if finish_reason == "length" else "stop",
                                    prompt_tokens or len(message.prompt_token_ids), cached_tokens or 0,
                                    completion_tokens if completion_tokens is not None else num_chunks))
        finally:
            self.probe.stream_decode.observe(time.perf_counter(), num_chunks, first_token_s, last_token_s)
            self._streams.pop(request_id, None)
            self._requests.pop(request_id, None)
            self._changed()

    async def _http_error(self, response: aiohttp.ClientResponse) -> SluiceError:
        """Turn an upstream's non-200 answer into our error (see the module docstring)."""
        status = response.status
        body = (await response.content.read(MAX_ERROR_BODY_BYTES)).decode("utf-8", errors="replace")
        if status in (429, 503):
            retry_after_s = retry_after_s_of(response.headers.get("Retry-After"))
            self._saturated_until_s = time.monotonic() + retry_after_s
            asyncio.get_running_loop().call_later(retry_after_s, self._changed)
            log.info("upstream_overloaded", upstream=self.name, status=status, retry_after_s=retry_after_s)
            return SluiceError(ErrorCode.SERVER_OVERLOADED, f"upstream {self.name} is overloaded (HTTP {status})",
                               retry_after_s=math.ceil(retry_after_s))
        message = error_message(body)
        if status in (400, 413, 422):
            return SluiceError(ErrorCode.INVALID_REQUEST, f"upstream {self.name} rejected the request: {message}",
                               param=error_param(body))
        return SluiceError(ErrorCode.WORKER_FAILED, f"upstream {self.name} answered HTTP {status}: {message}")

    # ------------------------------------------------------------------ polling

    async def _poll_loop(self) -> None:
        while not self._closing:
            try:
                self._on_snapshot(await self.probe.read(self._session, len(self._streams)))
            except (aiohttp.ClientError, OSError, TimeoutError, MetricsParseError, ValueError) as exc:
                self._mark_unreachable(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            await asyncio.sleep(self.metrics_interval_s)

    def _on_snapshot(self, snapshot: EngineSnapshot) -> None:
        """Apply one poll's snapshot: a Hello at the first poll and at the first after the engine was unreachable
        (a restarted engine may have other slots or another context; its breaker half-opens, so the next request
        tests it now, not after the cooldown), the upstream ready, its Capacity reported."""
        reconnected = not self._reachable and self.last_error is not None
        if self.hello is None or reconnected:
            hello = self.probe.hello(snapshot)
            if hello != self.hello:
                self.hello = hello
                log.info("upstream_ready", upstream=self.name, address=self.address, engine=self.engine,
                         model=self.model, max_num_seqs=hello.max_num_seqs,
                         kv_capacity_tokens=hello.kv_capacity_tokens,
                         max_model_len_tokens=hello.max_model_len_tokens)
        if reconnected:
            log.info("upstream_reachable_again", upstream=self.name, address=self.address)
            self.probe.recheck_models()
            self.breaker.probe_now()
        self._reachable, self.last_error = True, None
        self._ready.set()
        self.capacity = self.probe.capacity(snapshot, self.hello.num_kv_blocks)
        self.capacity_at_s = time.time()
        if self._on_capacity is not None:
            self._on_capacity(self.name, self.capacity)
        self._changed()

    def _mark_unreachable(self, reason: str) -> None:
        if self._reachable or self.last_error is None:
            log.warning("upstream_unreachable", upstream=self.name, address=self.address, error=reason)
        self._reachable, self.last_error = False, reason
        self.probe.engine_lost()
        self.capacity = None
        self._ready.clear()
        self.breaker.on_failure()
        self._changed()
