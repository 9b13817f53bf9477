"""Wire protocol between gateway and workers (DESIGN.md, Wire protocol).

Frames: a 4-byte big-endian unsigned length, then one msgpack-encoded message. Messages are msgspec
``Struct``s with ``tag=True`` (a tagged union), all ``array_like=True`` (msgspec requires one encoding
per union; arrays are also the compact one for hot messages). New fields are only ever
appended at the end, each with a default, so old peers keep decoding.

One long-lived :class:`FrameCodec` (a typed encoder and decoder) per connection.

Authentication (when the worker has a shared secret; :mod:`shared.auth` computes and checks the proofs)::

    worker  ── Challenge(worker_nonce) ──────────────────────────▶ gateway
    worker ◀── Authenticate(HMAC(secret, "gateway" ‖ worker_nonce ‖ gateway_nonce), gateway_nonce) ── gateway
    worker  ── Authenticated(HMAC(secret, "worker" ‖ gateway_nonce ‖ worker_nonce)), Hello, Capacity… ─▶ gateway

A worker without a secret sends ``Hello`` at once (no handshake); a gateway with a secret refuses such a worker, and a
worker with a secret closes a connection whose first frame is not a correct ``Authenticate``.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Union

import msgspec

FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 1024 * 1024
# Largest frame a side accepts before the peer has proved the shared secret (Challenge, Authenticate, Authenticated
# and Hello are a few hundred bytes).
MAX_HANDSHAKE_FRAME_BYTES = 64 * 1024
PROTOCOL_VERSION = 1


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Sampling settings of one request; ``temperature == 0`` means greedy.

    ``seed`` makes sampling reproducible per request (None: a fresh random seed). ``logprobs``: every
    :class:`TokenDelta` carries the sampled tokens' log-probabilities, and the ``top_logprobs`` (0–20) most likely
    alternatives at each position; both of the model's raw distribution (before temperature, top-k and top-p).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0


# ---------------------------------------------------------------- gateway -> worker


class Generate(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Start generating for one request.

    Attributes:
        request_id: unique per gateway; every reply names it.
        prompt_token_ids: the full prompt, already templated and tokenized.
        sampling: sampling parameters.
        max_tokens: effective output cap in tokens (already capped by the gateway).
        stop_token_ids: tokens that end the answer (EOS included by the gateway).
        tier: admission tier label, carried to eviction.
        cache_key: session / prompt cache key, or "".
        cache_ttl_s: requested KV retention in seconds, 0 for the worker's default.
        deadline_s: absolute ``time.time()`` by which the worker must start the request (admit it to a step), else
            it drops it unstarted and answers :class:`Failed` with code ``queue_timeout``; 0 for none. A request
            already started (prefilling, decoding, or preempted after starting) is never dropped.
        ignore_eos: keep generating past EOS (benchmarks).
        priority: the request's numeric priority (its tier's, from the gateway's config; larger first): the worker
            admits and prefills higher priorities first, preempts and evicts lower ones first, and keeps no tier
            config of its own. Equal for every request when the gateway's admission is off (arrival order).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: list[int] = []
    tier: str = "standard"
    cache_key: str = ""
    cache_ttl_s: float = 0.0
    deadline_s: float = 0.0
    ignore_eos: bool = False
    priority: int = 0


class Abort(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Stop a request now and free its KV blocks (within one engine step)."""

    request_id: str


class Drain(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Take no new requests; finish the running ones."""


class Ping(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Liveness probe; the worker answers with :class:`Pong`."""

    nonce: int = 0


class Authenticate(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The gateway's answer to :class:`Challenge`: its proof of the shared secret and its own challenge.

    Attributes:
        proof: ``HMAC-SHA256(secret, b"sluice-gateway\\0" + worker_nonce + gateway_nonce)``, 32 bytes.
        nonce: the gateway's random nonce, 32 bytes; the worker answers it in :class:`Authenticated`.
    """

    proof: bytes
    nonce: bytes


GatewayMessage = Union[Generate, Abort, Drain, Ping, Authenticate]


# ---------------------------------------------------------------- worker -> gateway


class Hello(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """First message of a worker on a new connection (after the handshake when the worker has a shared secret).

    Attributes:
        worker_id: stable for the worker process.
        model_id: the served model's name.
        backend: ``torch``, ``cuda`` or ``sim`` (the simulator always says so).
        device: e.g. ``cpu``, ``cuda:0``.
        block_size_tokens: tokens per KV block.
        num_kv_blocks: KV blocks in the device pool.
        kv_capacity_tokens: ``num_kv_blocks * block_size_tokens``.
        max_num_seqs: most sequences running at once.
        max_model_len_tokens: context length in tokens.
        attention_backend: ``torch`` or ``cupy``.
        protocol_version: :data:`PROTOCOL_VERSION`.
        weights: how the worker holds the weights: ``int4``, ``int8``, ``float32``, ``bfloat16``, ``sim`` (the
            simulator); "" from a worker that does not say.
    """

    worker_id: str
    model_id: str
    backend: str
    device: str
    block_size_tokens: int
    num_kv_blocks: int
    kv_capacity_tokens: int
    max_num_seqs: int
    max_model_len_tokens: int
    attention_backend: str = "torch"
    protocol_version: int = PROTOCOL_VERSION
    weights: str = ""


class Challenge(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """First message of a worker that has a shared secret: the gateway must prove it (see :class:`Authenticate`).

    Attributes:
        nonce: random, 32 bytes, fresh per connection.
    """

    nonce: bytes


class Authenticated(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The worker accepted the gateway's proof and proves the secret in turn; ``Hello`` follows.

    Attributes:
        proof: ``HMAC-SHA256(secret, b"sluice-worker\\0" + gateway_nonce + worker_nonce)``, 32 bytes.
    """

    proof: bytes


class TokenDelta(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """New output tokens of one request (one engine step's worth).

    ``first_token_latency_ms`` is set on the first delta only: worker-side time from ``Generate`` received to the
    first token sampled, in ms (the gateway subtracts it from its TTFT to measure its own overhead).

    With ``SamplingParams.logprobs``: ``logprobs[i]`` is the natural-log probability of ``token_ids[i]``,
    ``top_token_ids[i]`` / ``top_logprobs[i]`` the most likely alternatives at that position (most likely first,
    as many as ``SamplingParams.top_logprobs``). None without.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    first_token_latency_ms: float | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class Finished(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """A request ended normally; no further messages name it.

    ``finish_reason``: ``stop`` (EOS or a stop token) or ``length`` (max_tokens or context end) or ``abort``.
    """

    request_id: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class Failed(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """A request failed on the worker; ``code`` is an :class:`shared.errors.ErrorCode` value."""

    request_id: str
    code: str
    message: str


#: Names in ``Capacity.kv_stats`` (the part before any ``{labels}``) that are monotonic totals since the worker
#: started (``worker.kv_cache.stats.KVStats.add``): the gateway exports them as Prometheus counters,
#: ``sluice_worker_kv_<name>_total``. Every other name is a gauge: a level, an estimate, a quantile.
KV_STAT_COUNTERS = frozenset({
    "prefix_query_tokens", "prefix_hit_tokens", "partial_block_hit_tokens",
    "evicted_blocks", "expired_blocks",
    "offloaded_bytes", "offloaded_blocks", "reloaded_bytes", "reloaded_blocks",
    "offload_evicted_blocks", "offload_dropped_blocks",
    "reload_decisions_total", "recompute_decisions_total", "recompute_decision_tokens", "reload_verify_failures_total",
    "preemptions", "swapped_out_bytes", "swapped_in_bytes",
    "redis_errors_total", "pressure_switches_total",
})


class Capacity(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The worker's state, sent every ``capacity_interval_s`` and when it changes.

    Attributes:
        free_kv_blocks: blocks that can be allocated now (free + evictable cached).
        total_kv_blocks: blocks in the device pool.
        used_kv_blocks: blocks held by running or waiting sequences.
        cached_kv_blocks: blocks held only by the prefix cache (evictable).
        num_running: sequences being decoded / prefilled.
        num_waiting: sequences queued in the worker.
        decode_tokens_per_s: decode tokens per second of the engine steps that decode (summed over the batch: the
            mean decode batch ÷ TPOT), over the last few busy seconds of decoding (``worker.step_rates``).
        prefill_tokens_per_s: prompt tokens per second of the engine steps that prefill, over the last few busy
            seconds of prefilling. The two phase rates share the time of mixed steps: they do not add up.
        prefix_hit_rate: cached / prompt tokens over the last window.
        num_preemptions: total since start.
        pressure: ``normal``, ``elevated`` or ``critical`` as the worker sees its KV pool.
        draining: the worker takes no new requests.
        kv_stats: KV lifetime counters and gauges (hits per storage tier, evictions, offload / reload bytes,
            reload vs recompute decisions, preemptions by mode, block lifetime and reuse gap); keys are
            ``name`` or ``name{label=value,...}`` (see ``worker.kv_cache.stats.KVStats``); the names of
            :data:`KV_STAT_COUNTERS` are totals since the worker started, the others gauges.
        sequence_decode_tokens_per_s: decode steps per second of the steps that decode: 1 / TPOT, the tokens/s
            one running sequence gets, whatever the batch (0.0 = not measured; after the fields above, so that a
            report from an older worker still decodes).
        sequence_prefill_tokens_per_s: how fast a prompt goes once it is being prefilled, tokens/s (equal to
            ``prefill_tokens_per_s``). 0.0 = not measured.
        busy_tokens_per_s: prompt + decode tokens per second of all engine steps: the work a backlog drains at per
            busy second (0.0 = not measured).
    """

    free_kv_blocks: int
    total_kv_blocks: int
    used_kv_blocks: int
    cached_kv_blocks: int
    num_running: int
    num_waiting: int
    decode_tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    prefix_hit_rate: float = 0.0
    num_preemptions: int = 0
    pressure: str = "normal"
    draining: bool = False
    kv_stats: dict[str, float] = {}
    sequence_decode_tokens_per_s: float = 0.0
    sequence_prefill_tokens_per_s: float = 0.0
    busy_tokens_per_s: float = 0.0


class Pong(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Answer to :class:`Ping`."""

    nonce: int = 0


WorkerMessage = Union[Hello, TokenDelta, Finished, Failed, Capacity, Pong, Challenge, Authenticated]


class ProtocolError(Exception):
    """A malformed or oversized frame; the connection that sent it is closed."""


class FrameCodec:
    """A typed msgpack encoder/decoder pair for one connection direction.

    Args:
        decode_type: the union this side receives (``GatewayMessage`` on a worker, ``WorkerMessage`` on a
            gateway).
    """

    def __init__(self, decode_type: object) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)

    def encode(self, message: msgspec.Struct) -> bytes:
        """Return one frame: 4-byte big-endian length + msgpack body."""
        body = self._encoder.encode(message)
        return FRAME_HEADER.pack(len(body)) + body

    def decode(self, body: bytes) -> msgspec.Struct:
        """Decode one frame body (without its length prefix).

        Raises:
            ProtocolError: the body is not a valid message of the expected union.
        """
        try:
            return self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"malformed frame: {exc}") from exc

    async def read(self, reader: asyncio.StreamReader,
                   max_frame_bytes: int = MAX_FRAME_BYTES) -> msgspec.Struct | None:
        """Read and decode one frame; return None on a clean end of stream.

        Args:
            reader: the connection's stream.
            max_frame_bytes: largest body accepted (:data:`MAX_HANDSHAKE_FRAME_BYTES` before authentication).

        Raises:
            ProtocolError: oversized or malformed frame, or a stream cut inside a frame.
        """
        try:
            header = await reader.readexactly(FRAME_HEADER.size)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return None
            raise ProtocolError("stream ended inside a frame header") from exc
        (length,) = FRAME_HEADER.unpack(header)
        if length > max_frame_bytes:
            raise ProtocolError(f"frame of {length} bytes exceeds {max_frame_bytes}")
        try:
            body = await reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise ProtocolError("stream ended inside a frame body") from exc
        return self.decode(body)


class FrameSplitter:
    """Cut a connection's bytes into frames and decode each: every whole frame of one socket read at once, instead
    of two awaited ``readexactly`` calls per frame (a decode step sends one ``TokenDelta`` per running sequence).

    Args:
        codec: decodes each frame body.
        max_frame_bytes: largest body accepted.
    """

    def __init__(self, codec: FrameCodec, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._codec = codec
        self._max_frame_bytes = max_frame_bytes
        self._held = bytearray()  # the start of a frame not yet whole
        self._held_needed = 0  # bytes the held frame needs before it is worth parsing again

    @property
    def partial(self) -> bool:
        """Bytes of a frame not yet whole are held (a stream that ends now ends inside a frame)."""
        return bool(self._held)

    def feed(self, data: bytes, on_message: Callable[[msgspec.Struct], None]) -> None:
        """Add ``data`` (the next bytes read) and pass each frame it completes to ``on_message``, in order.

        A frame split over reads is held until whole (each read is copied once while it waits, so a large frame
        costs its size, not its size times its reads).

        Raises:
            ProtocolError: an oversized or malformed frame (the frames before it were passed on).
        """
        if self._held:
            self._held += data
            if len(self._held) < self._held_needed:
                return
            data = bytes(self._held)
            self._held.clear()
        start, end = 0, len(data)
        header_size = FRAME_HEADER.size
        while end - start >= header_size:
            (length,) = FRAME_HEADER.unpack_from(data, start)
            if length > self._max_frame_bytes:
                raise ProtocolError(f"frame of {length} bytes exceeds {self._max_frame_bytes}")
            body_start = start + header_size
            if end - body_start < length:
                break
            start = body_start + length
            on_message(self._codec.decode(data[body_start:start]))
        if start < end:
            self._held += memoryview(data)[start:]
            self._held_needed = header_size + (FRAME_HEADER.unpack_from(data, start)[0]
                                               if end - start >= header_size else 0)


def gateway_codec() -> FrameCodec:
    """Codec for the gateway side: decodes worker messages."""
    return FrameCodec(WorkerMessage)


def worker_codec() -> FrameCodec:
    """Codec for the worker side: decodes gateway messages."""
    return FrameCodec(GatewayMessage)
