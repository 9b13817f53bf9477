"""``sluice replay``: replay an arrival trace against a Sluice gateway and report per tier latency, SLO and goodput.

Usage::

    sluice replay azure-code --capacity-scale 0.8 --base-url http://127.0.0.1:8000 --max-requests 40
    sluice replay azure-code --rate-scale 2 --base-url http://127.0.0.1:8000 \\
        --tier-mix vip=0.2,standard=0.6,free=0.2 --slo-ttft-s vip=1,standard=5,free=5 \\
        --max-requests 600 --duration-s 60 --json out.json --plot-dir plots/

``--capacity-scale X`` offers X times the capacity the gateway's workers measured for this trace
(:mod:`loadtest.sizing`), so the same command means the same relative load on a CPU and on an H200;
``--rate-scale`` divides the trace's own inter-arrival times instead.

Open loop: each request is sent at its (scaled) trace time whatever the server does, as a streamed chat completion
whose prompt is real text (Arena-Hard) of about the trace's input length in the served tokenizer's tokens, with
``max_tokens`` = the trace's output length and ``ignore_eos`` so the answer has that length. The tier travels in
the ``x-sluice-tier`` header, which can only lower a tier: the server must give the replay's key (``--api-key``
per tier, or none) a tier at least as high as the highest one in the mix — e.g. ``default_tier = "vip"``. Before
the replay, one 1-token request per tier checks which tier the gateway gives it; requests of a tier the key cannot
reach are replayed (and reported) in the tier the gateway gives them, with a line that says so.

Bounded: at most ``--max-requests`` requests arriving within ``--duration-s``; requests still running
``--drain-timeout-s`` after the last arrival are cancelled (outcome ``client_timeout``). Loopback only: any other
base URL is refused. ``/status`` is polled every ``--status-interval-s`` for the queue-depth plot.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from loadtest.sizing import (
    CALIBRATION_MAX_INPUT_TOKENS,
    CALIBRATION_REQUESTS,
    SizingError,
    measure_capacity,
    probe_tiers,
    rate_scale_for,
)
from loadtest.summary import RequestResult, format_table, summarize
from loadtest.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TraceError,
    TraceRequest,
    assign_tiers,
    load_trace,
    parse_mix,
    parse_per_tier_float,
    shape_trace,
    trace_stats,
)

DEFAULT_TIER_MIX = "vip=0.2,standard=0.6,free=0.2"
DEFAULT_SLO = "vip=1,standard=5,free=5"
DEFAULT_DURATION_S = 60.0  # arrival window of a --rate-scale replay, seconds
# Leave room for the chat template's rounding when clipping prompts to the context, tokens.
CONTEXT_MARGIN_TOKENS = 16


class ReplayError(Exception):
    """The replay cannot run (bad option, non-loopback URL, unreachable gateway); the message says why."""


def check_loopback(base_url: str) -> str:
    """Return ``base_url`` without a trailing slash if its host is a loopback address.

    Raises:
        ReplayError: not http(s), or the host is not ``localhost`` / a loopback IP (names are not resolved).
    """
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ReplayError(f"--base-url {base_url!r}: expected http://HOST:PORT")
    host = parts.hostname
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if not loopback:
        raise ReplayError(f"--base-url {base_url!r}: the replayer only targets loopback addresses "
                          "(127.0.0.0/8, ::1, localhost); refusing to load a remote host")
    return base_url.rstrip("/")


@dataclass
class StatusSample:
    """One ``/status`` poll, reduced to what the plots need.

    Attributes:
        t_s: seconds after the replay started.
        active_requests: requests the gateway is serving.
        queue_depth_by_tier: admission queue depth per tier (empty when the gateway has no admission section).
        running_by_worker, waiting_by_worker: sequences running / waiting in each worker.
        kv_used_fraction_by_worker: used ÷ total KV blocks per worker.
        pressure: the pressure level, or None.
    """

    t_s: float
    active_requests: int | None = None
    queue_depth_by_tier: dict[str, int] = field(default_factory=dict)
    running_by_worker: dict[str, int] = field(default_factory=dict)
    waiting_by_worker: dict[str, int] = field(default_factory=dict)
    kv_used_fraction_by_worker: dict[str, float] = field(default_factory=dict)
    pressure: str | None = None


def parse_status(t_s: float, status: dict[str, Any]) -> StatusSample:
    """Reduce a ``/status`` JSON body to a :class:`StatusSample` (tolerates missing sections)."""
    sample = StatusSample(t_s=t_s, active_requests=status.get("active_requests"))
    admission = status.get("admission") if isinstance(status.get("admission"), dict) else status
    tiers = admission.get("tiers") if isinstance(admission, dict) else None
    if isinstance(tiers, dict):
        for name, tier in tiers.items():
            if isinstance(tier, dict) and "queue_depth" in tier:
                sample.queue_depth_by_tier[name] = int(tier["queue_depth"])
    pressure = admission.get("pressure") if isinstance(admission, dict) else None
    if isinstance(pressure, dict):
        pressure = pressure.get("level")
    sample.pressure = pressure if isinstance(pressure, str) else None
    for worker in status.get("workers") or []:
        capacity = worker.get("capacity") or {}
        name = str(worker.get("name"))
        sample.running_by_worker[name] = int(capacity.get("num_running", 0))
        sample.waiting_by_worker[name] = int(capacity.get("num_waiting", 0))
        total = capacity.get("total_kv_blocks") or 0
        sample.kv_used_fraction_by_worker[name] = capacity.get("used_kv_blocks", 0) / total if total else 0.0
    return sample


@dataclass
class ReplayOptions:
    """How to replay (see the CLI flags of the same names)."""

    base_url: str
    slo_ttft_s_by_tier: dict[str, float]
    api_key_by_tier: dict[str, str] = field(default_factory=dict)
    tier_header: str = "x-sluice-tier"
    model: str | None = None
    ignore_eos: bool = True
    drain_timeout_s: float = 60.0
    max_concurrency: int = 4096
    status_interval_s: float = 0.5
    request_timeout_s: float = 600.0
    prompt_salt: int = 0
    max_input_tokens: int | None = None
    probe_tiers: bool = False  # the CLI probes; benches and the harness replay their tiers as given

    def headers_for(self, tier: str | None) -> dict[str, str]:
        """Return the tier header and the API key to send for a request of ``tier``."""
        headers: dict[str, str] = {}
        if tier:
            headers[self.tier_header] = tier
        api_key = self.api_key_by_tier.get(tier or "") or self.api_key_by_tier.get("*")
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        return headers


@dataclass
class ReplayRun:
    """Everything one replay measured."""

    results: list[RequestResult]
    status_samples: list[StatusSample]
    wall_s: float
    model: str
    max_model_len_tokens: int | None
    num_clipped: int
    tier_notes: list[str] = field(default_factory=list)


async def _fetch_model(session, base_url: str) -> tuple[str, int | None]:
    async with session.get(base_url + "/v1/models") as response:
        if response.status != 200:
            raise ReplayError(f"GET {base_url}/v1/models answered {response.status}")
        card = (await response.json())["data"][0]
    return card["id"], card.get("max_model_len")


def _retry_after_s(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


async def _send_one(session, opts: ReplayOptions, model: str, req: TraceRequest, text: str,
                    result: RequestResult, t0: float) -> None:
    """Send one streamed chat completion and fill ``result`` in place."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": result.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    headers = opts.headers_for(req.tier)
    sent = time.perf_counter()
    result.sent_s = sent - t0
    first_s: float | None = None
    last_s: float | None = None
    num_content_events = 0
    try:
        async with session.post(opts.base_url + "/v1/chat/completions", json=body, headers=headers) as response:
            result.status = response.status
            queue_ms = response.headers.get("x-sluice-queue-ms")
            result.queue_ms = float(queue_ms) if queue_ms is not None else None
            result.served_tier = response.headers.get("x-sluice-tier")
            if response.status != 200:
                result.outcome = "http_error"
                result.retry_after_s = _retry_after_s(response.headers.get("Retry-After"))
                try:
                    payload = await response.json(content_type=None)
                    result.error_code = (payload.get("error") or {}).get("code")
                except (ValueError, AttributeError):
                    result.error_code = None
                result.e2e_s = time.perf_counter() - sent
                return
            outcome = "client_error"
            async for raw_line in response.content:
                line = raw_line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    if outcome == "client_error":
                        outcome = "ok"
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome = "error_in_band"
                    result.error_code = (chunk["error"] or {}).get("code")
                    continue
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    result.completion_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        first_s = now if first_s is None else first_s
                        last_s = now
                        num_content_events += 1
            result.outcome = outcome
    except asyncio.CancelledError:
        result.outcome = "client_timeout"
        raise
    except Exception as exc:  # noqa: BLE001 — any transport failure is a measured outcome, not a crash
        result.outcome = "client_error"
        result.error_code = type(exc).__name__
    finally:
        end = time.perf_counter()
        result.e2e_s = end - sent
        if first_s is not None:
            result.ttft_s = first_s - sent
            num_tokens = result.completion_tokens or num_content_events
            if num_tokens > 1 and last_s is not None:
                result.tpot_s = (last_s - first_s) / (num_tokens - 1)


async def _poll_status(session, base_url: str, interval_s: float, t0: float, out: list[StatusSample]) -> None:
    while True:
        try:
            async with session.get(base_url + "/status") as response:
                if response.status == 200:
                    out.append(parse_status(time.perf_counter() - t0, await response.json()))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 — a missed poll is a gap in the plot, not a failure
            pass
        await asyncio.sleep(interval_s)


def clipped_input_tokens(req: TraceRequest, max_model_len_tokens: int | None,
                         max_input_tokens: int | None = None) -> int:
    """Return the request's prompt length clipped to the served context (less its output and a margin) and to
    ``max_input_tokens``, tokens (at least 1)."""
    input_tokens = req.input_tokens
    if max_model_len_tokens:
        limit = max_model_len_tokens - min(req.output_tokens, max_model_len_tokens // 2) - CONTEXT_MARGIN_TOKENS
        input_tokens = min(input_tokens, max(1, limit))
    if max_input_tokens:
        input_tokens = min(input_tokens, max_input_tokens)
    return max(1, input_tokens)


def build_texts(requests: list[TraceRequest], max_model_len_tokens: int | None,
                prompt_builder, salt: int = 0, max_input_tokens: int | None = None) -> tuple[list[str], list[int], int]:
    """Return (user text, clipped input tokens) per request, and how many prompts were clipped (to the context,
    or to ``max_input_tokens``).

    ``salt`` makes the prompts of one replay differ from another's (so a second run gets no prefix-cache hits).
    """
    texts: list[str] = []
    inputs: list[int] = []
    num_clipped = 0
    for i, req in enumerate(requests):
        input_tokens = clipped_input_tokens(req, max_model_len_tokens, max_input_tokens)
        num_clipped += input_tokens < req.input_tokens
        inputs.append(input_tokens)
        texts.append(prompt_builder.user_text(input_tokens, salt * 1_000_003 + i, req.hash_ids,
                                              MOONCAKE_BLOCK_TOKENS))
    return texts, inputs, num_clipped


async def run_replay(requests: list[TraceRequest], opts: ReplayOptions, prompt_builder) -> ReplayRun:
    """Replay ``requests`` (tiers assigned, arrivals scaled) against the gateway at ``opts.base_url``.

    Raises:
        ReplayError: the base URL is not loopback, the gateway does not answer ``/v1/models``, or it refused a
            tier's probe as bad input (:func:`_reach_tiers`).
    """
    import aiohttp

    base_url = check_loopback(opts.base_url)
    opts.base_url = base_url
    timeout = aiohttp.ClientTimeout(total=opts.request_timeout_s, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=opts.max_concurrency, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        try:
            served_model, max_model_len = await _fetch_model(session, base_url)
        except aiohttp.ClientError as exc:
            raise ReplayError(f"gateway at {base_url} unreachable: {exc}") from exc
        model = opts.model or served_model
        tier_notes = await _reach_tiers(session, opts, model, requests) if opts.probe_tiers else []
        texts, inputs, num_clipped = await asyncio.to_thread(build_texts, requests, max_model_len, prompt_builder,
                                                             opts.prompt_salt, opts.max_input_tokens)
        results = [RequestResult(index=i, tier=req.tier or "", arrival_s=req.arrival_s, input_tokens=inputs[i],
                                 max_tokens=max(1, req.output_tokens)) for i, req in enumerate(requests)]
        samples: list[StatusSample] = []
        t0 = time.perf_counter()
        poller = asyncio.create_task(_poll_status(session, base_url, opts.status_interval_s, t0, samples))

        async def scheduled(i: int) -> None:
            delay_s = requests[i].arrival_s - (time.perf_counter() - t0)
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            await _send_one(session, opts, model, requests[i], texts[i], results[i], t0)

        tasks = [asyncio.create_task(scheduled(i)) for i in range(len(requests))]
        last_arrival_s = requests[-1].arrival_s if requests else 0.0
        try:
            if tasks:
                await asyncio.wait(tasks, timeout=last_arrival_s + opts.drain_timeout_s)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
        wall_s = time.perf_counter() - t0
    return ReplayRun(results=results, status_samples=samples, wall_s=wall_s, model=model,
                     max_model_len_tokens=max_model_len, num_clipped=num_clipped, tier_notes=tier_notes)


async def _reach_tiers(session, opts: ReplayOptions, model: str, requests: list[TraceRequest]) -> list[str]:
    """Probe the tiers of ``requests``; give the requests of a tier the key cannot reach the tier the gateway
    gives them instead (in place); return one line per such tier, and per tier whose probe was turned away for now
    (429, 503: its requests are replayed as they are).

    Raises:
        ReplayError: the gateway refused a tier's probe as bad input (a 4xx other than 429: a tier it does not have,
            a key it does not know): every request of that tier would fail the same way.
    """
    tiers = sorted({req.tier for req in requests if req.tier})
    probes = await probe_tiers(session, opts.base_url, model, {tier: opts.headers_for(tier) for tier in tiers})
    notes = []
    for tier, probe in probes.items():
        if 400 <= probe.status < 500 and probe.status != 429:
            count = sum(req.tier == tier for req in requests)
            raise ReplayError(f"the gateway refused the probe of tier '{tier}' ({probe.status}: {probe.error}), so "
                              f"its {count} requests would all fail: replay the gateway's tiers (--tier-mix) or pass "
                              f"--api-key {tier}=KEY with a key it knows")
        if probe.status != 200:
            notes.append(f"tier '{tier}': its probe was answered {probe.status} ({probe.error}); its requests are "
                         f"replayed as sent")
    moved = {tier: probe.served_tier for tier, probe in probes.items()
             if probe.served_tier is not None and probe.served_tier != tier}
    for tier, got in moved.items():
        count = sum(req.tier == tier for req in requests)
        key = ("the key sent" if opts.api_key_by_tier.get(tier) or opts.api_key_by_tier.get("*")
               else "a request without an API key")
        notes.append(f"tier '{tier}' is above what {key} gets (the gateway serves it as '{got}'): its {count} "
                     f"requests are replayed as '{got}'. To replay '{tier}', pass --api-key {tier}=KEY with a key "
                     f"of that tier, or set default_tier = \"{tier}\" in the gateway's config")
    for i, req in enumerate(requests):
        if req.tier in moved:
            requests[i] = replace(req, tier=moved[req.tier])
    return notes


def prepare_requests(trace: str, rate_scale: float, max_requests: int, duration_s: float | None,
                     tier_mix: dict[str, float], seed: int, start_s: float = 0.0) -> list[TraceRequest]:
    """Load, shape and tier a trace (see :mod:`loadtest.traces`)."""
    shaped = shape_trace(load_trace(trace), rate_scale=rate_scale, max_requests=max_requests,
                         duration_s=duration_s, start_s=start_s)
    return assign_tiers(shaped, tier_mix, seed=seed)


def report(run: ReplayRun, requests: list[TraceRequest], options: dict[str, Any],
           slo_ttft_s_by_tier: dict[str, float]) -> dict[str, Any]:
    """Return the JSON report of a replay: options, trace stats, per-tier summary and per-request results."""
    stats = trace_stats(requests)
    return {
        "options": options,
        "trace": {"num_requests": stats.num_requests, "span_s": stats.span_s, "rate_per_s": stats.rate_per_s,
                  "mean_input_tokens": stats.mean_input_tokens, "mean_output_tokens": stats.mean_output_tokens,
                  "num_clipped_to_context": run.num_clipped},
        "model": run.model,
        "wall_s": run.wall_s,
        "summary": summarize(run.results, slo_ttft_s_by_tier),
        "requests": [r.to_dict() for r in run.results],
        "status_samples": [sample.__dict__ for sample in run.status_samples],
    }


def _parse_api_keys(values: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for value in values:
        tier, sep, key = value.partition("=")
        if not sep or not key:
            raise ReplayError(f"--api-key {value!r}: expected TIER=KEY (TIER may be '*' for all)")
        out[tier] = key
    return out


def _positive(kind, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    return _positive(float, text)


def _positive_int(text: str) -> int:
    return _positive(int, text)


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``sluice replay`` (every option with its help and default)."""
    parser = argparse.ArgumentParser(prog="sluice replay", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("trace", help="azure-code | azure-conv | mooncake-conv | path to a .csv/.jsonl trace")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--capacity-scale", type=_positive_float, default=None, metavar="X",
                      help="offer X times the capacity the gateway's workers measured for this trace (calibrates "
                      "with a few requests first when nothing is measured yet); 1 = as much as they serve")
    load.add_argument("--rate-scale", type=_positive_float, default=None, metavar="X",
                      help="divide the trace's inter-arrival times by X (default 1: the trace's own rate)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="gateway URL (loopback only)")
    parser.add_argument("--tier-mix", default=DEFAULT_TIER_MIX, metavar="TIER=WEIGHT,…",
                        help="share of requests per tier, assigned at random (see --seed; default %(default)s)")
    parser.add_argument("--slo-ttft-s", default=DEFAULT_SLO, metavar="TIER=SECONDS,…",
                        help="TTFT SLO per tier, seconds: attainment and goodput in the table (default %(default)s)")
    parser.add_argument("--max-requests", type=_positive_int, default=500,
                        help="replay at most this many requests (default %(default)s)")
    parser.add_argument("--duration-s", type=_positive_float, default=None,
                        help="replay requests arriving within this many seconds, after scaling (default 60 with "
                        "--rate-scale; none with --capacity-scale: --max-requests bounds the replay)")
    parser.add_argument("--start-s", type=float, default=0.0, help="skip the trace's first S seconds (unscaled)")
    parser.add_argument("--max-input-tokens", type=_positive_int, default=None,
                        help="clip prompts to this many tokens (default: the served model's context, less the "
                        "output)")
    parser.add_argument("--drain-timeout-s", type=float, default=60.0,
                        help="cancel requests still running this long after the last arrival, seconds "
                        "(default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tier assignment (default %(default)s)")
    parser.add_argument("--prompt-salt", type=int, default=0, help="vary prompt text between runs (no cache hits)")
    parser.add_argument("--api-key", action="append", default=[], metavar="TIER=KEY",
                        help="API key to send for a tier ('*=KEY' for all; repeatable); default none")
    parser.add_argument("--tier-header", default="x-sluice-tier",
                        help="request header that carries the tier (the gateway's admission.tier_header)")
    parser.add_argument("--no-tier-probe", action="store_true",
                        help="do not check first which tier the gateway gives each tier's requests")
    parser.add_argument("--model", default=None, help="model id (default: the gateway's /v1/models)")
    parser.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    parser.add_argument("--no-tokenizer", action="store_true",
                        help="size prompts by words instead of the served tokenizer")
    parser.add_argument("--status-interval-s", type=_positive_float, default=0.5,
                        help="how often /status is polled for the queue-depth plot, seconds (default %(default)s)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the JSON report here")
    parser.add_argument("--plot-dir", default=None, help="write latency and queue-depth PNGs here")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``sluice replay``'s options (exit 2 with a usage error naming a bad one)."""
    return build_parser().parse_args(argv)


async def size_to_capacity(args: argparse.Namespace, tier_mix: dict[str, float], api_keys: dict[str, str],
                           prompt_builder) -> float:
    """Return the ``rate_scale`` that offers ``args.capacity_scale`` × the gateway's measured capacity for the
    trace window ``args`` selects; print how it was measured.

    Raises:
        ReplayError: the gateway is unreachable or measures no capacity.
    """
    import aiohttp

    base_url = check_loopback(args.base_url)
    unscaled = prepare_requests(args.trace, 1.0, args.max_requests, None, tier_mix, args.seed, args.start_s)
    timeout = aiohttp.ClientTimeout(total=600, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            served_model, max_model_len = await _fetch_model(session, base_url)
            inputs = [clipped_input_tokens(r, max_model_len, args.max_input_tokens) for r in unscaled]
            calibration_tokens = min(int(statistics.median(inputs)), CALIBRATION_MAX_INPUT_TOKENS)
            texts = [prompt_builder.user_text(calibration_tokens, 7_000_000 + i + args.prompt_salt * 1_000_003)
                     for i in range(CALIBRATION_REQUESTS)]
            headers = ReplayOptions(base_url, {}, api_key_by_tier=api_keys).headers_for(None)
            capacity, calibrated = await measure_capacity(session, base_url, args.model or served_model, texts,
                                                          headers, ignore_eos=not args.no_ignore_eos)
        except (aiohttp.ClientError, SizingError) as exc:
            raise ReplayError(f"--capacity-scale: {exc}") from exc
    outputs = [max(1, r.output_tokens) for r in unscaled]
    capacity_per_s = capacity.requests_per_s(inputs, outputs)
    try:
        rate_scale = rate_scale_for(args.capacity_scale, capacity_per_s, unscaled)
    except SizingError as exc:
        raise ReplayError(f"--capacity-scale: {exc}") from exc
    how = f"after {CALIBRATION_REQUESTS} calibration requests" if calibrated else "from /status"
    print(f"capacity: {capacity_per_s:.3f} requests/s of this trace (mean prompt {statistics.fmean(inputs):.0f}, "
          f"answer {statistics.fmean(outputs):.0f} tokens) on {capacity.num_workers} worker(s), measured {how}: "
          f"{capacity.describe()}")
    print(f"replaying at {args.capacity_scale:g} × capacity = {args.capacity_scale * capacity_per_s:.3f} "
          f"requests/s (--rate-scale {rate_scale:.4g})")
    return rate_scale


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sluice replay``; returns the exit status (2 on bad options or a refused URL)."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        check_loopback(args.base_url)
        tier_mix = parse_mix(args.tier_mix)
        slo = parse_per_tier_float(args.slo_ttft_s)
        api_keys = _parse_api_keys(args.api_key)
        load_trace(args.trace)  # a bad trace name fails here, before any request is sent
    except (ReplayError, TraceError) as exc:
        print(f"sluice replay: {exc}", file=sys.stderr)
        return 2
    from loadtest.prompts import PromptBuilder, load_tokenizer

    builder = PromptBuilder(None if args.no_tokenizer else load_tokenizer())
    try:
        rate_scale = args.rate_scale or 1.0
        if args.capacity_scale is not None:
            rate_scale = asyncio.run(size_to_capacity(args, tier_mix, api_keys, builder))
        duration_s = args.duration_s or (None if args.capacity_scale is not None else DEFAULT_DURATION_S)
        requests = prepare_requests(args.trace, rate_scale, args.max_requests, duration_s, tier_mix,
                                    args.seed, args.start_s)
    except (ReplayError, TraceError) as exc:
        print(f"sluice replay: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print("sluice replay: the trace window holds no request", file=sys.stderr)
        return 2
    print(f"replaying {len(requests)} requests arriving over {requests[-1].arrival_s:.0f} s")
    opts = ReplayOptions(base_url=args.base_url, slo_ttft_s_by_tier=slo, api_key_by_tier=api_keys,
                         tier_header=args.tier_header, model=args.model, ignore_eos=not args.no_ignore_eos,
                         drain_timeout_s=args.drain_timeout_s, status_interval_s=args.status_interval_s,
                         prompt_salt=args.prompt_salt, max_input_tokens=args.max_input_tokens,
                         probe_tiers=not args.no_tier_probe)
    try:
        run = asyncio.run(run_replay(requests, opts, builder))
    except ReplayError as exc:
        print(f"sluice replay: {exc}", file=sys.stderr)
        return 2
    for note in run.tier_notes:
        print(f"sluice replay: note: {note}", file=sys.stderr)
    options = {k: v for k, v in vars(args).items() if k != "api_key"} | {"rate_scale": rate_scale}
    result = report(run, requests, options, slo)
    print(format_table(result["summary"]))
    mislabelled = Counter((r.tier, r.served_tier) for r in run.results if r.served_in_another_tier)
    for (tier, served), count in sorted(mislabelled.items()):
        print(f"sluice replay: warning: {count} '{tier}' requests were served in tier '{served}': the gateway "
              f"gives a key its own tier at most (the x-sluice-tier header only lowers it); pass --api-key "
              f"{tier}=KEY with a key of that tier", file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot_dir:
        from loadtest.plots import plot_replay

        for path in plot_replay(run.results, run.status_samples, args.plot_dir, slo):
            print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
