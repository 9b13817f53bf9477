"""The polling half of one upstream: what a poll reads of the engine, and the Hello and Capacity made of it.

::

    UpstreamClient._poll_loop ── read() ──▶ EngineProbe ── GET /metrics, /slots, /v1/models ──▶ engine
        ◀── EngineSnapshot; hello(snapshot), capacity(snapshot, blocks) ──┘

:class:`EngineProbe` reads the engine's ``/metrics`` (:func:`~gateway.upstream.engine_metrics.parse_engine_metrics`),
llama.cpp's ``GET /slots`` once per engine start (its slot count and one slot's context), and, for an engine that
answers only the models its ``/v1/models`` lists (:data:`ENGINES_SERVING_ONLY_LISTED_MODELS`), that list every
:data:`MODEL_CHECK_INTERVAL_S`; an engine without metrics is asked ``/v1/models`` only (a health check), and its load
is what this gateway sent it (:attr:`EngineProbe.own_prompt_tokens`, :attr:`EngineProbe.own_generation_tokens`, the
requests running there). It turns a snapshot into the Hello the pool reads (:meth:`EngineProbe.hello`) and the
Capacity admission reads (:meth:`EngineProbe.capacity`: rates from the engine's token counters,
:mod:`gateway.upstream.rates`, and one sequence's decode speed from the streams the client read). Readiness, the
breaker and the pool's change callback stay with :class:`~gateway.upstream.client.UpstreamClient`, which applies
what a poll found; the probe tells it only that the engine's model check changed (``on_change``).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Callable

import aiohttp
import structlog

from gateway.upstream.engine_metrics import ENGINES_WITHOUT_METRICS, EngineSnapshot, llamacpp_slot_context_tokens, \
    parse_engine_metrics, parse_llamacpp_slots
from gateway.upstream.rates import StreamDecodeRate, UpstreamRates
from gateway.upstream.replies import model_ids
from shared.protocol import Capacity, Hello

log = structlog.get_logger("sluice.gateway")

DEFAULT_MAX_CONCURRENCY = 64
# engines that answer only for a model their /v1/models lists (vLLM: 404 "The model `x` does not exist";
# ``transformers serve`` pinned to a model: 400 "Server is pinned to ..."; unpinned, it lists the models of its hub
# cache and loaded ones). llama.cpp's server, SGLang and TGI answer any model name; a generic engine may.
ENGINES_SERVING_ONLY_LISTED_MODELS = frozenset({"vllm", "transformers"})
MODEL_CHECK_INTERVAL_S = 30.0  # how often an engine with /metrics is asked for its /v1/models again
BLOCK_SIZE_TOKENS = 16  # the unit admission counts an upstream's KV in (engines page their own KV)


class EngineProbe:
    """Polls one upstream engine's state (see the module docstring).

    Args:
        address: the server, ``http://host:port``.
        name: the upstream's label, for logs.
        engine: ``vllm``, ``sglang``, ``llama.cpp``, ``tgi``, ``transformers`` or ``generic``.
        model: the model name sent upstream, which the engine must serve.
        model_key: the config key that sets ``model``, for the message when the engine does not serve it.
        headers: the headers of every poll (the upstream's bearer token).
        max_concurrency: most requests at once from this gateway; 0 = the engine's slot count (llama.cpp) or
            :data:`DEFAULT_MAX_CONCURRENCY`.
        kv_capacity_tokens: the engine's KV size in tokens; 0 = what the engine reports (SGLang), else
            concurrency × ``max_model_len_tokens``.
        max_model_len_tokens: context length in tokens.
        metrics_interval_s: seconds between polls (a poll's timeout is 4 of them, at least 2 s).
        on_change: called when :attr:`model_error` changes.

    Attributes:
        model_error: why the engine does not serve ``model`` (from its ``/v1/models``), or None.
        own_prompt_tokens, own_generation_tokens: tokens this gateway sent the engine and read back (the counters
            of an engine without metrics).
        stream_decode: one request's decode speed, observed by the client from the streams it reads.
    """

    def __init__(self, address: str, name: str, *, engine: str, model: str, model_key: str, headers: dict[str, str],
                 max_concurrency: int, kv_capacity_tokens: int, max_model_len_tokens: int, metrics_interval_s: float,
                 on_change: Callable[[], None]) -> None:
        self.address = address
        self.name = name
        self.engine = engine
        self.model = model
        self.model_key = model_key
        self._headers = headers
        self.max_concurrency = max_concurrency
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_model_len_tokens = max_model_len_tokens
        self.metrics_interval_s = metrics_interval_s
        self._on_change = on_change
        self.model_error: str | None = None
        self._models_checked_at_s = -math.inf  # monotonic
        self._num_slots: int | None = None  # llama.cpp's slots (``GET /slots``), read again after a restart
        self._slot_context_tokens: int | None = None  # the context of one llama.cpp slot, tokens
        self._rates = UpstreamRates()
        self.stream_decode = StreamDecodeRate()
        self._sequence_decode_tokens_per_s = 0.0
        self._last_running = 0
        self.own_prompt_tokens = 0
        self.own_generation_tokens = 0

    async def read(self, session: aiohttp.ClientSession, num_running: int) -> EngineSnapshot:
        """Read the engine's state: its ``/metrics``, or for an engine without metrics ``/v1/models`` (a health
        check) and this gateway's own counts (``num_running``: its requests running there now).

        Raises:
            aiohttp.ClientError, OSError, TimeoutError: the upstream did not answer (status ≥ 400 included).
            MetricsParseError: its ``/metrics`` is not what the engine publishes.
        """
        timeout = aiohttp.ClientTimeout(total=max(2.0, 4 * self.metrics_interval_s))
        if self.engine in ENGINES_WITHOUT_METRICS:
            async with session.get(self.address + "/v1/models", headers=self._headers, timeout=timeout) as response:
                response.raise_for_status()
                self._check_model(await response.read())
            return EngineSnapshot(num_running=num_running, num_waiting=0, prompt_tokens_total=self.own_prompt_tokens,
                                  generation_tokens_total=self.own_generation_tokens)
        async with session.get(self.address + "/metrics", headers=self._headers, timeout=timeout) as response:
            response.raise_for_status()
            text = await response.text()
        if (self.engine in ENGINES_SERVING_ONLY_LISTED_MODELS
                and time.monotonic() - self._models_checked_at_s >= MODEL_CHECK_INTERVAL_S):
            async with session.get(self.address + "/v1/models", headers=self._headers, timeout=timeout) as response:
                if response.status == 200:
                    self._check_model(await response.read())
        if self.engine == "llama.cpp" and self._num_slots is None:
            self._num_slots, self._slot_context_tokens = await self._llamacpp_slots(session, timeout)
        return await asyncio.to_thread(parse_engine_metrics, self.engine, text)

    def recheck_models(self) -> None:
        """Ask for the engine's ``/v1/models`` at the next poll (an engine that came back may serve another model)."""
        self._models_checked_at_s = -math.inf

    def engine_lost(self) -> None:
        """The engine stopped answering: read its slots again once it answers (it may come back with others)."""
        self._num_slots = None

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
            self._on_change()

    async def _llamacpp_slots(self, session: aiohttp.ClientSession,
                              timeout: aiohttp.ClientTimeout) -> tuple[int, int | None]:
        """Return llama-server's slot count and the context of one slot in tokens from ``GET /slots`` ((0, None)
        when it does not serve that endpoint; the context None when its slots do not say)."""
        try:
            async with session.get(self.address + "/slots", headers=self._headers, timeout=timeout) as response:
                if response.status != 200:
                    return 0, None
                slots = await response.json()
                return parse_llamacpp_slots(slots)[1], llamacpp_slot_context_tokens(slots)
        except (aiohttp.ClientError, ValueError):
            return 0, None

    def hello(self, snapshot: EngineSnapshot) -> Hello:
        """Return the Hello the pool reads: ``max_concurrency`` slots, else llama.cpp's own, else
        :data:`DEFAULT_MAX_CONCURRENCY`; the context ``max_model_len_tokens``, or one llama.cpp slot's where smaller
        (a prompt past it is then a 400 ``context_length_exceeded`` from the gateway, not the engine's error)."""
        max_num_seqs = self.max_concurrency or self._num_slots or DEFAULT_MAX_CONCURRENCY
        max_model_len_tokens = min(self.max_model_len_tokens, self._slot_context_tokens or self.max_model_len_tokens)
        kv_tokens = self.kv_capacity_tokens or snapshot.kv_capacity_tokens or max_num_seqs * max_model_len_tokens
        num_blocks = max(1, kv_tokens // BLOCK_SIZE_TOKENS)
        return Hello(worker_id=self.name, model_id=self.model, backend=f"openai:{self.engine}", device=self.address,
                     block_size_tokens=BLOCK_SIZE_TOKENS, num_kv_blocks=num_blocks,
                     kv_capacity_tokens=num_blocks * BLOCK_SIZE_TOKENS, max_num_seqs=max_num_seqs,
                     max_model_len_tokens=max_model_len_tokens, attention_backend="none")

    def capacity(self, snapshot: EngineSnapshot, total_kv_blocks: int) -> Capacity:
        """Return the Capacity of one poll's snapshot over ``total_kv_blocks`` (the Hello's): running, waiting and
        KV use as the engine reported them; prefill and decode rates from its token counters
        (:class:`~gateway.upstream.rates.UpstreamRates`; until they have measured a busy interval, the engine's own
        throughput figures where it has them); one sequence's prefill rate from the engine's own prefill time where
        it reports one (``EngineSnapshot.sequence_prefill_tokens_per_s``), else the prefill rate; one sequence's
        decode rate from the streams read here, else the engine's decode rate ÷ its running requests."""
        busy = snapshot.num_running > 0 or self._last_running > 0
        self._last_running = snapshot.num_running
        rates = self._rates
        if snapshot.prompt_tokens_total is not None and snapshot.generation_tokens_total is not None:
            rates.observe(time.monotonic(), snapshot.prompt_tokens_total, snapshot.generation_tokens_total, busy)
        if self.stream_decode.tokens_per_s > 0:
            self._sequence_decode_tokens_per_s = self.stream_decode.tokens_per_s
        elif snapshot.num_running > 0 and rates.decode_tokens_per_s > 0:
            self._sequence_decode_tokens_per_s = rates.decode_tokens_per_s / snapshot.num_running
        total = total_kv_blocks
        used = min(total, round(snapshot.kv_used_fraction * total)) if snapshot.kv_used_fraction is not None else 0
        prefill = rates.prefill_tokens_per_s or snapshot.reported_prefill_tokens_per_s or 0.0
        decode = rates.decode_tokens_per_s or snapshot.reported_decode_tokens_per_s or 0.0
        return Capacity(
            free_kv_blocks=total - used, total_kv_blocks=total, used_kv_blocks=used, cached_kv_blocks=0,
            num_running=snapshot.num_running, num_waiting=snapshot.num_waiting,
            decode_tokens_per_s=decode, prefill_tokens_per_s=prefill,
            sequence_decode_tokens_per_s=self._sequence_decode_tokens_per_s,
            sequence_prefill_tokens_per_s=snapshot.sequence_prefill_tokens_per_s or prefill,
            busy_tokens_per_s=rates.busy_tokens_per_s or prefill + decode)
