"""Read an inference engine's Prometheus ``/metrics`` text into one :class:`EngineSnapshot`.

Metric names per engine, from each project's documentation:

=============  ============================  ==========================  ===========================================
engine         running / waiting             KV use (fraction 0–1)       token counters (prompt, generated)
=============  ============================  ==========================  ===========================================
vllm           vllm:num_requests_running,    vllm:kv_cache_usage_perc    vllm:prompt_tokens_total,
               vllm:num_requests_waiting     (vllm:gpu_cache_usage_perc  vllm:generation_tokens_total
                                             before v0.10)
sglang         sglang:num_running_reqs,      sglang:token_usage          sglang:prompt_tokens_total,
               sglang:num_queue_reqs                                     sglang:generation_tokens_total
llama.cpp      llamacpp:requests_processing, llamacpp:kv_cache_usage_    llamacpp:prompt_tokens_total,
(--metrics)    llamacpp:requests_deferred    ratio                       llamacpp:tokens_predicted_total
               (slots: ``GET /slots``)                                   (tokens/s: …prompt_tokens_seconds,
                                                                         …predicted_tokens_seconds)
tgi            tgi_batch_current_size,       —                           tgi_request_input_length_sum,
               tgi_queue_size                                            tgi_request_generated_tokens_sum
=============  ============================  ==========================  ===========================================

``transformers`` (``transformers serve``) and ``generic`` upstreams publish no Prometheus metrics: the client counts
its own requests and tokens instead (:data:`ENGINES_WITHOUT_METRICS`). Samples of several label sets (vLLM's
``model_name``, several engines behind one port) are summed; a metric an engine version lacks reads as None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

ENGINES = ("vllm", "sglang", "llama.cpp", "tgi", "transformers", "generic")
ENGINES_WITHOUT_METRICS = frozenset({"transformers", "generic"})


@dataclass(frozen=True)
class EngineSnapshot:
    """One engine's state as its ``/metrics`` reported it.

    Attributes:
        num_running: requests being prefilled or decoded.
        num_waiting: requests queued inside the engine.
        kv_used_fraction: KV cache in use, 0–1; None when the engine does not report it.
        prompt_tokens_total: prompt tokens processed since the engine started (a counter); None when not reported.
        generation_tokens_total: output tokens generated since start (a counter); None when not reported.
        kv_capacity_tokens: KV cache size in tokens when the engine reports it (SGLang's ``max_total_num_tokens``);
            None otherwise.
        reported_prefill_tokens_per_s, reported_decode_tokens_per_s: throughputs the engine computes itself
            (llama.cpp's ``prompt_tokens_seconds`` and ``predicted_tokens_seconds``, SGLang's ``gen_throughput``);
            None when it does not. The client uses them until its own counter-based rates exist.
        sequence_prefill_tokens_per_s: how fast one prompt prefills, tokens/s of the engine's own prefill time:
            llama.cpp's ``prompt_tokens_total`` ÷ ``prompt_seconds_total`` (each slot's prompt time, summed), vLLM's
            prompt tokens of its finished requests ÷ their prefill seconds (``vllm:request_prompt_tokens`` and
            ``vllm:request_prefill_time_seconds`` histogram sums; the newly computed tokens,
            ``vllm:request_prefill_kv_computed_tokens``, where reported: cached ones cost no prefill). None when the
            engine does not report it or has prefilled nothing yet. Tokens per busy second (the rates from the token
            counters) understate it many times on an engine that mostly decodes.
    """

    num_running: int
    num_waiting: int
    kv_used_fraction: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    kv_capacity_tokens: int | None = None
    reported_prefill_tokens_per_s: float | None = None
    reported_decode_tokens_per_s: float | None = None
    sequence_prefill_tokens_per_s: float | None = None


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format, or lacks the engine's running-requests gauge."""


def _samples(text: str) -> dict[str, float]:
    """Return every sample's value summed over its label sets, by sample name (``vllm:prompt_tokens_total``).

    Raises:
        MetricsParseError: the text does not parse.
    """
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"not Prometheus text format: {exc}") from exc
    return values


def _first(values: dict[str, float], *names: str) -> float | None:
    for name in names:
        if name in values:
            return values[name]
    return None


def _ratio(tokens: float | None, seconds: float | None) -> float | None:
    """Return ``tokens / seconds`` (cumulative counters), or None when either is missing or nothing was timed."""
    if tokens is None or seconds is None or seconds <= 0 or tokens <= 0:
        return None
    return tokens / seconds


def _required(values: dict[str, float], engine: str, name: str) -> int:
    value = values.get(name)
    if value is None:
        raise MetricsParseError(f"{engine} /metrics has no {name} (is this the right engine?)")
    return int(value)


def parse_vllm(text: str) -> EngineSnapshot:
    """Parse vLLM's ``/metrics`` (v0 and v1 engines). Raises :class:`MetricsParseError`."""
    values = _samples(text)
    return EngineSnapshot(
        num_running=_required(values, "vllm", "vllm:num_requests_running"),
        num_waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_used_fraction=_first(values, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        prompt_tokens_total=_first(values, "vllm:prompt_tokens_total"),
        generation_tokens_total=_first(values, "vllm:generation_tokens_total"),
        sequence_prefill_tokens_per_s=_ratio(
            _first(values, "vllm:request_prefill_kv_computed_tokens_sum", "vllm:request_prompt_tokens_sum"),
            _first(values, "vllm:request_prefill_time_seconds_sum")),
    )


def parse_sglang(text: str) -> EngineSnapshot:
    """Parse SGLang's ``/metrics`` (``--enable-metrics``). Raises :class:`MetricsParseError`."""
    values = _samples(text)
    capacity = values.get("sglang:max_total_num_tokens")
    return EngineSnapshot(
        num_running=_required(values, "sglang", "sglang:num_running_reqs"),
        num_waiting=int(values.get("sglang:num_queue_reqs", 0)),
        kv_used_fraction=_first(values, "sglang:token_usage"),
        prompt_tokens_total=_first(values, "sglang:prompt_tokens_total"),
        generation_tokens_total=_first(values, "sglang:generation_tokens_total"),
        kv_capacity_tokens=int(capacity) if capacity else None,
        reported_decode_tokens_per_s=_first(values, "sglang:gen_throughput"),
    )


def parse_llamacpp(text: str) -> EngineSnapshot:
    """Parse llama.cpp ``llama-server --metrics`` output. Raises :class:`MetricsParseError`."""
    values = _samples(text)
    return EngineSnapshot(
        num_running=_required(values, "llama.cpp", "llamacpp:requests_processing"),
        num_waiting=int(values.get("llamacpp:requests_deferred", 0)),
        kv_used_fraction=_first(values, "llamacpp:kv_cache_usage_ratio"),
        prompt_tokens_total=_first(values, "llamacpp:prompt_tokens_total"),
        generation_tokens_total=_first(values, "llamacpp:tokens_predicted_total"),
        reported_prefill_tokens_per_s=_first(values, "llamacpp:prompt_tokens_seconds"),
        reported_decode_tokens_per_s=_first(values, "llamacpp:predicted_tokens_seconds"),
        sequence_prefill_tokens_per_s=_ratio(_first(values, "llamacpp:prompt_tokens_total"),
                                             _first(values, "llamacpp:prompt_seconds_total")),
    )


def parse_tgi(text: str) -> EngineSnapshot:
    """Parse Text Generation Inference's ``/metrics``. Raises :class:`MetricsParseError`.

    TGI counts tokens per finished request (histogram sums), so its rates lag by one request length.
    """
    values = _samples(text)
    return EngineSnapshot(
        num_running=_required(values, "tgi", "tgi_batch_current_size"),
        num_waiting=int(values.get("tgi_queue_size", 0)),
        prompt_tokens_total=_first(values, "tgi_request_input_length_sum"),
        generation_tokens_total=_first(values, "tgi_request_generated_tokens_sum"),
    )


PARSERS: dict[str, Callable[[str], EngineSnapshot]] = {
    "vllm": parse_vllm,
    "sglang": parse_sglang,
    "llama.cpp": parse_llamacpp,
    "tgi": parse_tgi,
}


def parse_engine_metrics(engine: str, text: str) -> EngineSnapshot:
    """Parse ``text`` as ``engine``'s ``/metrics``.

    Raises:
        MetricsParseError: unparsable text, or the engine's running-requests gauge is missing.
        ValueError: ``engine`` publishes no metrics this module reads (the message lists those that do).
    """
    parser = PARSERS.get(engine)
    if parser is None:
        raise ValueError(f"no metrics parser for engine {engine!r}; engines with one: {sorted(PARSERS)}")
    return parser(text)


def parse_llamacpp_slots(slots: list[dict]) -> tuple[int, int]:
    """Return (busy slots, total slots) from llama.cpp's ``GET /slots`` answer (a list of slot objects, each with
    ``is_processing``; older servers say ``state`` 1 for busy)."""
    busy = sum(1 for slot in slots if slot.get("is_processing", slot.get("state", 0) == 1))
    return busy, len(slots)


def llamacpp_slot_context_tokens(slots: list[dict]) -> int | None:
    """Return the context of one llama.cpp slot in tokens (``n_ctx`` of each slot object in ``GET /slots``: the
    server's ``--ctx-size`` ÷ ``--parallel``; the smallest where they differ), or None where no slot says."""
    sizes = [slot["n_ctx"] for slot in slots if isinstance(slot.get("n_ctx"), int) and slot["n_ctx"] > 0]
    return min(sizes) if sizes else None
