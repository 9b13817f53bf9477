"""Sizing a replay to the gateway it targets: the tiers its keys reach, and the capacity its workers measured.

``sluice replay --capacity-scale X`` offers X times what the gateway's workers can serve of this trace, whatever
the hardware: a CPU worker and an H200 get the same relative load. The capacity comes from each worker's last
``Capacity`` report in ``/status`` (tokens per busy second of the steps of each phase, ``worker.step_rates``):

    S_i = input_i / prefill tokens/s + output_i / decode tokens/s     (worker-seconds request i takes)
    capacity = Σ_workers 1 / mean_i(S_i)                               (requests/s the workers complete, busy)

The decode rate is the one measured at the batch the worker ran, so the capacity is that of a worker batching as
it did when measured (conservative on a worker that batches more at saturation). A gateway whose workers have not
measured anything yet gets a short calibration first: :data:`CALIBRATION_REQUESTS` concurrent requests of the
trace's median prompt (at most :data:`CALIBRATION_MAX_INPUT_TOKENS`) and :data:`CALIBRATION_OUTPUT_TOKENS` tokens.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from dataclasses import dataclass
from typing import Any

from loadtest.traces import TraceRequest

CALIBRATION_REQUESTS = 4
CALIBRATION_OUTPUT_TOKENS = 32
CALIBRATION_MAX_INPUT_TOKENS = 1024
PROBE_TEXT = "Say OK."


class SizingError(Exception):
    """The gateway's capacity cannot be measured; the message says why."""


@dataclass(frozen=True)
class WorkerRates:
    """One worker's measured speeds, from its ``/status`` capacity report.

    Attributes:
        name: the worker.
        prefill_tokens_per_s: prompt tokens per second of the steps that prefill.
        decode_tokens_per_s: decode tokens per second of the steps that decode (all sequences together).
        sequence_decode_tokens_per_s: 1 / TPOT, tokens/s (0.0 when the worker does not report it).
    """

    name: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    sequence_decode_tokens_per_s: float

    @property
    def decode_batch(self) -> float:
        """Mean decode batch while measured: decode rate × TPOT (1.0 when TPOT is not reported)."""
        if self.sequence_decode_tokens_per_s <= 0:
            return 1.0
        return self.decode_tokens_per_s / self.sequence_decode_tokens_per_s


@dataclass(frozen=True)
class MeasuredCapacity:
    """The serving workers' measured rates (see the module docstring).

    Attributes:
        num_workers: workers serving (those without a measurement count at the mean of the measured ones).
        measured: the workers that reported prefill and decode rates.
    """

    num_workers: int
    measured: list[WorkerRates]

    def requests_per_s(self, inputs_tokens: list[int], outputs_tokens: list[int]) -> float:
        """Return the requests/s the workers complete of requests like these (busy all the time)."""
        per_worker = []
        for rates in self.measured:
            mean_service_s = statistics.fmean(
                i / rates.prefill_tokens_per_s + o / rates.decode_tokens_per_s
                for i, o in zip(inputs_tokens, outputs_tokens, strict=True))
            per_worker.append(1.0 / mean_service_s)
        return statistics.fmean(per_worker) * self.num_workers

    def describe(self) -> str:
        """One line per measured worker: its rates and the batch they were measured at."""
        return "; ".join(f"{w.name}: prefill {w.prefill_tokens_per_s:.0f} tokens/s, decode "
                         f"{w.decode_tokens_per_s:.1f} tokens/s at batch {w.decode_batch:.1f}" for w in self.measured)


def capacity_from_status(status: dict[str, Any], model: str | None = None) -> MeasuredCapacity:
    """Return the capacity a ``/status`` body reports (``measured`` empty when no worker measured both rates).

    With ``model``, only the workers of the pools serving it count (``fleet.pools[…].model``; a mixed fleet's
    other pools never see the replay's requests). A worker's prefill rate is the larger of its prompt tokens per
    second (``prefill_tokens_per_s``: of prefilling steps on our workers, but of busy time, decode included, on an
    upstream engine) and one prompt's prefill speed (``sequence_prefill_tokens_per_s``, from an engine's own
    prefill time), so an engine that mostly decodes is not sized as if it prefilled at a tenth of its speed.
    """
    workers = [w for w in status.get("workers") or [] if isinstance(w, dict) and not w.get("draining")]
    pools = (status.get("fleet") or {}).get("pools") or {}
    serving = {name for name, pool in pools.items() if isinstance(pool, dict) and pool.get("model") == model}
    if model is not None and serving:
        workers = [w for w in workers if w.get("pool") in serving]
    measured = []
    for worker in workers:
        capacity = worker.get("capacity") or {}
        prefill = max(float(capacity.get("prefill_tokens_per_s") or 0.0),
                      float(capacity.get("sequence_prefill_tokens_per_s") or 0.0))
        decode = float(capacity.get("decode_tokens_per_s") or 0.0)
        if prefill > 0 and decode > 0:
            measured.append(WorkerRates(str(worker.get("name")), prefill, decode,
                                        float(capacity.get("sequence_decode_tokens_per_s") or 0.0)))
    return MeasuredCapacity(num_workers=len(workers), measured=measured)


def rate_scale_for(capacity_scale: float, capacity_per_s: float, requests: list[TraceRequest]) -> float:
    """Return the ``rate_scale`` that makes ``requests`` (unscaled arrivals) arrive at ``capacity_scale`` ×
    ``capacity_per_s`` requests/s on average.

    Raises:
        SizingError: fewer than two requests, or all at the same instant (no rate to scale).
    """
    span_s = requests[-1].arrival_s - requests[0].arrival_s if len(requests) >= 2 else 0.0
    if span_s <= 0:
        raise SizingError("the trace window needs two requests at different times to scale its rate")
    native_rate_per_s = (len(requests) - 1) / span_s
    return capacity_scale * capacity_per_s / native_rate_per_s


async def fetch_status(session, base_url: str) -> dict[str, Any]:
    """Return ``GET /status`` as JSON.

    Raises:
        SizingError: the gateway does not answer 200.
    """
    async with session.get(base_url + "/status") as response:
        if response.status != 200:
            raise SizingError(f"GET {base_url}/status answered {response.status}")
        return await response.json()


async def calibrate(session, base_url: str, model: str, texts: list[str], headers: dict[str, str],
                    ignore_eos: bool = True) -> list[tuple[int, str]]:
    """Send ``texts`` at once as chat completions of :data:`CALIBRATION_OUTPUT_TOKENS` tokens (with ``ignore_eos``
    unless told not to: engines such as ``transformers serve`` refuse it); return (status, error message) of each
    request that was not answered with 200."""
    bodies = [{"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0,
               "max_tokens": CALIBRATION_OUTPUT_TOKENS} for text in texts]
    if ignore_eos:
        for body in bodies:
            body["ignore_eos"] = True
    answers = await asyncio.gather(*(_complete_or_error(session, base_url, body, headers) for body in bodies))
    return [(status, message) for status, message in answers if status != 200]


async def _complete_or_error(session, base_url: str, body: dict[str, Any], headers: dict[str, str]
                             ) -> tuple[int, str]:
    """POST a non-streamed chat completion; return (status, the error's message, "" for a 200)."""
    async with session.post(base_url + "/v1/chat/completions", json=body, headers=headers) as response:
        raw = await response.read()
        if response.status == 200:
            return 200, ""
    return response.status, _error_text(raw)


def _error_text(raw: bytes) -> str:
    """Return the message of an OpenAI error body (with its ``param``), else the body's first 300 characters."""
    text = raw.decode("utf-8", errors="replace")
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("message"):
        param = f" (param: {error['param']})" if error.get("param") else ""
        return f"{error['message']}{param}"
    return text.strip()[:300] or "(empty body)"


async def measure_capacity(session, base_url: str, model: str, calibration_texts: list[str],
                           headers: dict[str, str], settle_s: float = 1.0,
                           ignore_eos: bool = True) -> tuple[MeasuredCapacity, bool]:
    """Return the gateway's measured capacity, calibrating first when no worker has measured its rates; and
    whether it calibrated.

    Raises:
        SizingError: no serving worker, or still no rates after the calibration (naming the status and error of
            the first calibration request that failed, when one did).
    """
    capacity = capacity_from_status(await fetch_status(session, base_url), model)
    if capacity.num_workers == 0:
        raise SizingError(f"{base_url}/status lists no serving worker")
    if capacity.measured:
        return capacity, False
    failures = await calibrate(session, base_url, model, calibration_texts, headers, ignore_eos)
    await asyncio.sleep(settle_s)  # the next capacity report of each worker carries the new rates
    capacity = capacity_from_status(await fetch_status(session, base_url), model)
    if not capacity.measured:
        failed = ""
        if failures:
            status, message = failures[0]
            hint = "; pass --no-ignore-eos for an engine that does not take it" if (
                ignore_eos and "ignore_eos" in message) else ""
            failed = (f" ({len(failures)} of {len(calibration_texts)} calibration requests failed; the first: "
                      f"HTTP {status}: {message}{hint})")
        raise SizingError(f"{base_url}: no worker reported prefill and decode rates after the calibration "
                          f"requests{failed}; pass --rate-scale instead")
    return capacity, True


@dataclass(frozen=True)
class TierProbe:
    """The answer to one tier's probe: its HTTP status, the tier that served it (``x-sluice-tier``; None when not
    answered with 200) and, for another status, the error's message."""

    status: int
    served_tier: str | None
    error: str = ""


async def probe_tiers(session, base_url: str, model: str, headers_by_tier: dict[str, dict[str, str]]
                      ) -> dict[str, TierProbe]:
    """Send one 1-token request per tier with that tier's headers; return tier → its :class:`TierProbe`."""
    probes: dict[str, TierProbe] = {}
    for tier, headers in headers_by_tier.items():
        body = {"model": model, "messages": [{"role": "user", "content": PROBE_TEXT}], "max_tokens": 1,
                "temperature": 0}
        async with session.post(base_url + "/v1/chat/completions", json=body, headers=headers) as response:
            raw = await response.read()
            if response.status == 200:
                probes[tier] = TierProbe(200, response.headers.get("x-sluice-tier"))
            else:
                probes[tier] = TierProbe(response.status, None, _error_text(raw))
    return probes
