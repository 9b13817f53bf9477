"""One OpenAI-compatible upstream (vLLM, SGLang, llama.cpp, TGI, transformers serve, …) as a worker of a pool.

::

    WorkerPool ── can_take / try_reserve ──▶ UpstreamClient ── POST /v1/chat/completions (SSE) ──▶ engine
        ▲                                        │ RequestStream: text, then Finished (usage) or Failed
        └──── Capacity every metrics_interval_s ─┘◀── GET /metrics (or /v1/models) ───────────────── engine

:class:`UpstreamClient` is a :class:`~gateway.workers.client.WorkerClient` to the pool, admission and the request
pipeline: it says Hello once the upstream answers its first poll (``max_num_seqs`` = the concurrency limit, KV
blocks from the engine's KV size), reports a ``Capacity`` from every poll (running, waiting and KV use from the
engine's ``/metrics``, rates from its token counters: :mod:`gateway.upstream.engine_metrics`,
:mod:`gateway.upstream.rates`), and runs each request as one streamed HTTP request whose text the pipeline turns
into Sluice's own stream. Failures, as a worker's:

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
answers only for the models its ``/v1/models`` lists (:data:`ENGINES_SERVING_ONLY_LISTED_MODELS`), a model not
listed marks the upstream not ready, naming the models it serves (an operator's error, not the client's: requests
get a 503 ``no_worker_available`` with that reason instead of the engine's 400 on every request).

A failed poll marks the upstream unready (``/readyz`` says why: :meth:`UpstreamClient.not_ready_reason`) and counts
against its breaker, so an upstream that is down opens its breaker within ``failure_threshold`` polls; the first
poll that succeeds again half-opens it (the next request is its probe), instead of leaving every request shed for the
rest of the breaker's cooldown. Aborting a
request (client gone, stop string matched) cancels its task, which closes its HTTP connection at once: the engine
sees the disconnect and frees the sequence.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, Callable

import aiohttp
import structlog

from gateway.upstream.engine_metrics import ENGINES_WITHOUT_METRICS, EngineSnapshot, MetricsParseError, \
    llamacpp_slot_context_tokens, parse_engine_metrics, parse_llamacpp_slots
from gateway.upstream.rates import StreamDecodeRate, UpstreamRates
from gateway.upstream.replies import error_message, error_param, model_ids, retry_after_s_of
from gateway.upstream.request_body import ENGINES_RESUMING_FROM_TOKEN_IDS, UpstreamPrompt, upstream_body
from gateway.upstream.sse import MAX_LINE_BYTES, SSEFormatError, decode_event, sse_data
from gateway.workers.breaker import BreakerState, CircuitBreaker
from gateway.workers.client import WorkerClient
from gateway.workers.stream import RequestStream
from shared.errors import ErrorCode, SluiceError
from shared.protocol import Capacity, Finished, Generate, Hello

if TYPE_CHECKING:
    from gateway.workers.reservation import Reservation

log = structlog.get_logger("sluice.gateway")

DEFAULT_MAX_CONCURRENCY = 64
# engines that answer only for a model their /v1/models lists (vLLM: 404 "The model `x` does not exist";
# ``transformers serve`` pinned to a model: 400 "Server is pinned to ..."; unpinned, it lists the models of its hub
# cache and loaded ones). llama.cpp's server, SGLang and TGI answer any model name; a generic engine may.
ENGINES_SERVING_ONLY_LISTED_MODELS = frozenset({"vllm", "transformers"})
MODEL_CHECK_INTERVAL_S = 30.0  # how often an engine with /metrics is asked for its /v1/models again
BLOCK_SIZE_TOKENS = 16  # the unit admission counts an upstream's KV in (engines page their own KV)
CONNECT_TIMEOUT_S = 5.0
MAX_ERROR_BODY_BYTES = 4096


class UpstreamClient(WorkerClient):
    """One upstream server of a ``backend = "openai"`` pool, presented as a worker.

    Args:
        base_url: the server, ``http://host:port`` (requests go to ``{base_url}/v1/...``).
        name: label for logs, metrics and ``/status``.
        engine: ``vllm``, ``sglang``, ``llama.cpp``, ``tgi``, ``transformers`` or ``generic``.
        model: the model name sent upstream.
        max_concurrency: most requests at once from this gateway; 0 = the engine's slot count (llama.cpp) or
            :data:`DEFAULT_MAX_CONCURRENCY`.
        kv_capacity_tokens: the engine's KV size in tokens; 0 = what the engine reports (SGLang), else
            concurrency × ``max_model_len_tokens``.
        max_model_len_tokens: context length in tokens.
        metrics_interval_s: seconds between polls.
        api_key: bearer token for the upstream ("" = none).
        on_capacity: called with (name, Capacity) on every poll.
        breaker: this upstream's circuit breaker.
        top_tier_priority: the highest tier priority; requests of lower tiers are sent one prompt at a time
            (:meth:`can_take`).
        model_key: the config key that sets ``model``, for the message when the engine does not serve it.
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
        self.model_key = model_key
        self.max_concurrency = max_concurrency
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_model_len_tokens = max_model_len_tokens
        self.metrics_interval_s = metrics_interval_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._requests: dict[str, asyncio.Task] = {}
        self._reachable = False
        self.last_error: str | None = None
        self.model_error: str | None = None  # the engine does not serve ``model`` (its /v1/models, read at a poll)
        self._models_checked_at_s = -math.inf  # monotonic
        self._saturated_until_s = 0.0  # monotonic: the upstream said 429/503; nothing is sent before this
        self._rates = UpstreamRates()
        self._sequence_decode_tokens_per_s = 0.0
        self._stream_decode = StreamDecodeRate()  # one request's decode speed, from the streams read here
        self._num_slots: int | None = None  # llama.cpp's slots (``GET /slots``), read again after a restart
        self._slot_context_tokens: int | None = None  # the context of one llama.cpp slot, tokens
        self._own_prompt_tokens = 0  # tokens this gateway sent and received, for engines without counters
        self._own_generation_tokens = 0
        self._last_running = 0

    # ------------------------------------------------------------------ what the pool reads

    @property
    def ready(self) -> bool:
        """The last poll answered, a Hello was made from it, the engine serves the configured model, and the gateway
        does not drain this upstream."""
        return self._reachable and self.hello is not None and self.model_error is None and not self.draining

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

    async def close(self) -> None:
        """Stop polling, cancel every request (each fails with ``worker_failed``) and close the session."""
        self._closing = True
        tasks = [t for t in (self._task, *self._requests.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        for stream in list(self._streams.values()):
            stream._fail(SluiceError(ErrorCode.WORKER_FAILED, f"upstream {self.name}: gateway shutting down"))
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
        self._own_prompt_tokens += len(message.prompt_token_ids)
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
                        self._own_generation_tokens += 1
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
            self._stream_decode.observe(time.perf_counter(), num_chunks, first_token_s, last_token_s)
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
                self._on_snapshot(await self._poll_once())
            except (aiohttp.ClientError, OSError, TimeoutError, MetricsParseError, ValueError) as exc:
                self._mark_unreachable(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            await asyncio.sleep(self.metrics_interval_s)

    async def _poll_once(self) -> EngineSnapshot:
        """Read the upstream's state: its ``/metrics``, or for an engine without metrics ``/v1/models`` (a health
        check) and this gateway's own counts.

        Raises:
            aiohttp.ClientError, OSError, TimeoutError: the upstream did not answer (status ≥ 400 included).
            MetricsParseError: its ``/metrics`` is not what the engine publishes.
        """
        timeout = aiohttp.ClientTimeout(total=max(2.0, 4 * self.metrics_interval_s))
        session = self._session
        if self.engine in ENGINES_WITHOUT_METRICS:
            async with session.get(self.address + "/v1/models", headers=self._headers, timeout=timeout) as response:
                response.raise_for_status()
                self._check_model(await response.read())
            return EngineSnapshot(num_running=len(self._streams), num_waiting=0,
                                  prompt_tokens_total=self._own_prompt_tokens,
                                  generation_tokens_total=self._own_generation_tokens)
        async with session.get(self.address + "/metrics", headers=self._headers, timeout=timeout) as response:
            response.raise_for_status()
            text = await response.text()
        if (self.engine in ENGINES_SERVING_ONLY_LISTED_MODELS
                and time.monotonic() - self._models_checked_at_s >= MODEL_CHECK_INTERVAL_S):
            async with session.get(self.address + "/v1/models", headers=self._headers, timeout=timeout) as response:
                if response.status == 200:
                    self._check_model(await response.read())
        if self.engine == "llama.cpp" and self._num_slots is None:
            self._num_slots, self._slot_context_tokens = await self._llamacpp_slots(timeout)
        return await asyncio.to_thread(parse_engine_metrics, self.engine, text)

    def _check_model(self, models_body: bytes) -> None:
        """Set :attr:`model_error` from the engine's ``/v1/models`` answer: why the engine does not serve
        :attr:`model`, or None (also when the engine may answer a model it does not list, or lists none)."""
        self._models_checked_at_s = time.monotonic()
        served = model_ids(models_body)
        error = None
        if self.engine in ENGINES_SERVING_ONLY_LISTED_MODELS and served and self.model not in served:
            error = (f"the engine serves {', '.join(repr(m) for m in served[:8])}, not the configured model "
                     f"'{self.model}' (set {self.model_key} to one of them)")
        if error != self.model_error:
            if error is not None:
                log.warning("upstream_model_not_served", upstream=self.name, address=self.address, model=self.model,
                            served=served[:8])
            self.model_error = error
            self._changed()

    async def _llamacpp_slots(self, timeout: aiohttp.ClientTimeout) -> tuple[int, int | None]:
        """Return llama-server's slot count and the context of one slot in tokens from ``GET /slots`` ((0, None)
        when it does not serve that endpoint; the context None when its slots do not say)."""
        try:
            async with self._session.get(self.address + "/slots", headers=self._headers, timeout=timeout) as response:
                if response.status != 200:
                    return 0, None
                slots = await response.json()
                return parse_llamacpp_slots(slots)[1], llamacpp_slot_context_tokens(slots)
        except (aiohttp.ClientError, ValueError):
            return 0, None

    def _on_snapshot(self, snapshot: EngineSnapshot) -> None:
        busy = snapshot.num_running > 0 or self._last_running > 0
        self._last_running = snapshot.num_running
        if snapshot.prompt_tokens_total is not None and snapshot.generation_tokens_total is not None:
            self._rates.observe(time.monotonic(), snapshot.prompt_tokens_total, snapshot.generation_tokens_total,
                                busy)
        if self._stream_decode.tokens_per_s > 0:
            self._sequence_decode_tokens_per_s = self._stream_decode.tokens_per_s
        elif snapshot.num_running > 0 and self._rates.decode_tokens_per_s > 0:
            self._sequence_decode_tokens_per_s = self._rates.decode_tokens_per_s / snapshot.num_running
        reconnected = not self._reachable and self.last_error is not None
        if self.hello is None or reconnected:  # a restarted engine may have other slots or another context
            hello = self._make_hello(snapshot)
            if hello != self.hello:
                self.hello = hello
                log.info("upstream_ready", upstream=self.name, address=self.address, engine=self.engine,
                         model=self.model, max_num_seqs=hello.max_num_seqs,
                         kv_capacity_tokens=hello.kv_capacity_tokens,
                         max_model_len_tokens=hello.max_model_len_tokens)
        if reconnected:
            log.info("upstream_reachable_again", upstream=self.name, address=self.address)
            self._models_checked_at_s = -math.inf  # a restarted engine may serve another model: ask at the next poll
            self.breaker.probe_now()  # the polls opened it; the next request tests the engine now, not in cooldown_s
        self._reachable, self.last_error = True, None
        self._ready.set()
        total = self.hello.num_kv_blocks
        used = min(total, round(snapshot.kv_used_fraction * total)) if snapshot.kv_used_fraction is not None else 0
        rates = self._rates
        # until the counters have measured a busy interval, the engine's own throughput figures, where it has them
        prefill = rates.prefill_tokens_per_s or snapshot.reported_prefill_tokens_per_s or 0.0
        decode = rates.decode_tokens_per_s or snapshot.reported_decode_tokens_per_s or 0.0
        self.capacity = Capacity(
            free_kv_blocks=total - used, total_kv_blocks=total, used_kv_blocks=used, cached_kv_blocks=0,
            num_running=snapshot.num_running, num_waiting=snapshot.num_waiting,
            decode_tokens_per_s=decode, prefill_tokens_per_s=prefill,
            sequence_decode_tokens_per_s=self._sequence_decode_tokens_per_s,
            sequence_prefill_tokens_per_s=prefill, busy_tokens_per_s=rates.busy_tokens_per_s or prefill + decode)
        self.capacity_at_s = time.time()
        if self._on_capacity is not None:
            self._on_capacity(self.name, self.capacity)
        self._changed()

    def _make_hello(self, snapshot: EngineSnapshot) -> Hello:
        """Return the Hello the pool reads: ``max_concurrency`` slots, else llama.cpp's own, else
        :data:`DEFAULT_MAX_CONCURRENCY`; the context ``max_model_len_tokens``, or one llama.cpp slot's where smaller
        (a prompt past it is then a 400 ``context_length_exceeded`` from the gateway, not the engine's error)."""
        max_num_seqs = self.max_concurrency or self._num_slots or DEFAULT_MAX_CONCURRENCY
        max_model_len_tokens = min(self.max_model_len_tokens, self._slot_context_tokens or self.max_model_len_tokens)
        kv_tokens = self.kv_capacity_tokens or snapshot.kv_capacity_tokens or max_num_seqs * max_model_len_tokens
        num_blocks = max(1, kv_tokens // BLOCK_SIZE_TOKENS)
        return Hello(worker_id=self.name, model_id=self.model, backend=self.backend, device=self.address,
                     block_size_tokens=BLOCK_SIZE_TOKENS, num_kv_blocks=num_blocks,
                     kv_capacity_tokens=num_blocks * BLOCK_SIZE_TOKENS, max_num_seqs=max_num_seqs,
                     max_model_len_tokens=max_model_len_tokens, attention_backend="none")

    def _mark_unreachable(self, reason: str) -> None:
        if self._reachable or self.last_error is None:
            log.warning("upstream_unreachable", upstream=self.name, address=self.address, error=reason)
        self._reachable, self.last_error = False, reason
        self._num_slots = None  # read again once it answers: it may come back with other slots
        self.capacity = None
        self._ready.clear()
        self.breaker.on_failure()
        self._changed()
