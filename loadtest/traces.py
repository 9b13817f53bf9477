"""Arrival traces for replay and planning: Azure LLM inference 2023 (code, conv) and Mooncake FAST'25 conversation.

Every loader returns a list of :class:`TraceRequest` with ``arrival_s`` relative to the trace's first request
(seconds, sorted). Sources (see ``../shared/data/*/LICENSE-NOTE.md``):

- Azure 2023 (CC-BY-4.0; Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting",
  ISCA 2024): CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``; timestamps like ``2023-11-16 18:17:03.9799600``.
- Mooncake conversation (Apache-2.0; Qin et al., "Mooncake", FAST'25): JSONL ``timestamp`` (ms),
  ``input_length``, ``output_length``, ``hash_ids`` (prefix blocks of 512 tokens; equal ids = shareable prefix).

Shaping: :func:`shape_trace` compresses inter-arrival times by ``rate_scale`` (2 = twice the request rate) and
bounds the result by count and by duration; :func:`assign_tiers` gives each request a tier so that the mix is met
exactly (largest remainder) in a seeded random order.
"""

from __future__ import annotations

import csv
import json
import os
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Short names of the traces in the shared data folder (relative to it).
TRACE_FILES: dict[str, str] = {
    "azure-code": "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
    "azure-conv": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
    "mooncake-conv": "mooncake_fast25/conversation_trace.jsonl",
}
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace file or a trace option is invalid; the message names it."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: arrival time in seconds after the trace's first request (after rate scaling, if any).
        input_tokens: prompt length in tokens.
        output_tokens: answer length in tokens.
        hash_ids: Mooncake prefix block ids (512 tokens each), or None.
        tier: the tier assigned by :func:`assign_tiers`, or None.
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None
    tier: str | None = None


def data_dir() -> Path:
    """Return the shared data folder: ``$SLUICE_DATA_DIR`` or ``<repo>/../shared/data``."""
    return Path(os.environ.get("SLUICE_DATA_DIR", REPO_ROOT.parent / "shared" / "data"))


def resolve_trace_path(name_or_path: str) -> Path:
    """Return the file of a trace given by short name (``azure-code``, ``azure-conv``, ``mooncake-conv``) or path.

    Raises:
        TraceError: neither a known name nor an existing file.
    """
    if name_or_path in TRACE_FILES:
        path = data_dir() / TRACE_FILES[name_or_path]
    else:
        path = Path(name_or_path)
    if not path.is_file():
        where = " (set SLUICE_DATA_DIR to the folder holding the traces)" if name_or_path in TRACE_FILES else ""
        raise TraceError(f"trace {name_or_path!r}: no such file {path}{where} (names: {', '.join(TRACE_FILES)})")
    return path


def load_trace(name_or_path: str) -> list[TraceRequest]:
    """Load a trace by short name or path; ``.csv`` = Azure 2023, ``.jsonl`` = Mooncake.

    Raises:
        TraceError: unknown format or a malformed row (the message names file and line).
    """
    path = resolve_trace_path(name_or_path)
    if path.suffix == ".csv":
        return load_azure_csv(path)
    if path.suffix == ".jsonl":
        return load_mooncake_jsonl(path)
    raise TraceError(f"trace {path}: unknown format (expected .csv for Azure 2023 or .jsonl for Mooncake)")


def _parse_azure_timestamp_s(text: str) -> float:
    """Parse ``2023-11-16 18:17:03.9799600`` (7 fraction digits) into POSIX seconds (naive = UTC)."""
    whole, _, fraction = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    return base.timestamp() + (float("0." + fraction) if fraction else 0.0)


def load_azure_csv(path: str | Path) -> list[TraceRequest]:
    """Load an Azure LLM inference 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``), sorted by arrival.

    Raises:
        TraceError: a missing column or a malformed row.
    """
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise TraceError(f"{path}: missing columns {sorted(missing)}")
        for line_no, row in enumerate(reader, start=2):
            try:
                rows.append((_parse_azure_timestamp_s(row["TIMESTAMP"]), int(row["ContextTokens"]),
                             int(row["GeneratedTokens"])))
            except (ValueError, TypeError) as exc:
                raise TraceError(f"{path}:{line_no}: {exc}") from exc
    rows.sort(key=lambda r: r[0])
    if not rows:
        return []
    t0 = rows[0][0]
    return [TraceRequest(arrival_s=t - t0, input_tokens=i, output_tokens=o) for t, i, o in rows]


def load_mooncake_jsonl(path: str | Path) -> list[TraceRequest]:
    """Load a Mooncake FAST'25 trace (JSONL: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``).

    Raises:
        TraceError: a malformed line.
    """
    path = Path(path)
    out: list[TraceRequest] = []
    with open(path) as file:
        for line_no, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                out.append(TraceRequest(arrival_s=float(obj["timestamp"]) / 1000.0,
                                        input_tokens=int(obj["input_length"]),
                                        output_tokens=int(obj["output_length"]),
                                        hash_ids=tuple(int(h) for h in obj.get("hash_ids") or ()) or None))
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{line_no}: {exc}") from exc
    out.sort(key=lambda r: r.arrival_s)
    if out and out[0].arrival_s != 0.0:
        t0 = out[0].arrival_s
        out = [replace(r, arrival_s=r.arrival_s - t0) for r in out]
    return out


def shape_trace(
    requests: list[TraceRequest],
    rate_scale: float = 1.0,
    max_requests: int | None = None,
    duration_s: float | None = None,
    start_s: float = 0.0,
) -> list[TraceRequest]:
    """Scale and bound a trace.

    Args:
        requests: sorted by ``arrival_s``.
        rate_scale: divide inter-arrival times by this (> 0); 2 doubles the request rate.
        max_requests: keep at most this many requests (None = all).
        duration_s: keep requests arriving before this many seconds after the first kept one, measured after
            scaling (None = no bound).
        start_s: skip requests arriving before this trace time (seconds, before scaling).

    Returns:
        The kept requests, ``arrival_s`` rebased to 0 at the first kept request and divided by ``rate_scale``.

    Raises:
        TraceError: ``rate_scale`` ≤ 0, or a negative bound.
    """
    if not rate_scale > 0:
        raise TraceError(f"rate_scale must be > 0, got {rate_scale}")
    if max_requests is not None and max_requests < 0:
        raise TraceError(f"max_requests must be ≥ 0, got {max_requests}")
    if duration_s is not None and duration_s < 0:
        raise TraceError(f"duration_s must be ≥ 0, got {duration_s}")
    kept = [r for r in requests if r.arrival_s >= start_s]
    if not kept:
        return []
    t0 = kept[0].arrival_s
    out: list[TraceRequest] = []
    for r in kept:
        if max_requests is not None and len(out) >= max_requests:
            break
        arrival_s = (r.arrival_s - t0) / rate_scale
        if duration_s is not None and arrival_s >= duration_s:
            break
        out.append(replace(r, arrival_s=arrival_s))
    return out


def parse_mix(text: str) -> dict[str, float]:
    """Parse ``vip=0.2,standard=0.6,free=0.2`` into a dict of weights (normalised to sum to 1).

    Raises:
        TraceError: a malformed entry, a negative weight or an all-zero mix.
    """
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not name.strip() or weight < 0:
            raise TraceError(f"mix entry {part!r}: expected name=weight with weight ≥ 0")
        mix[name.strip()] = weight
    total = sum(mix.values())
    if total <= 0:
        raise TraceError(f"mix {text!r}: weights must sum to more than 0")
    return {name: weight / total for name, weight in mix.items()}


def parse_per_tier_float(text: str) -> dict[str, float]:
    """Parse ``vip=1,standard=5`` into ``{"vip": 1.0, "standard": 5.0}`` (not normalised).

    Raises:
        TraceError: a malformed entry.
    """
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError as exc:
            raise TraceError(f"entry {part!r}: expected name=number") from exc
        if not sep or not name.strip():
            raise TraceError(f"entry {part!r}: expected name=number")
    return out


def tier_counts(num_requests: int, mix: dict[str, float]) -> dict[str, int]:
    """Split ``num_requests`` by ``mix`` with the largest-remainder method (counts sum to ``num_requests``)."""
    total = sum(mix.values()) or 1.0
    exact = {name: num_requests * weight / total for name, weight in mix.items()}
    counts = {name: int(value) for name, value in exact.items()}
    left = num_requests - sum(counts.values())
    by_remainder = sorted(mix, key=lambda name: (-(exact[name] - counts[name]), list(mix).index(name)))
    for name in by_remainder[:left]:
        counts[name] += 1
    return counts


def assign_tiers(requests: list[TraceRequest], mix: dict[str, float], seed: int = 0) -> list[TraceRequest]:
    """Return copies of ``requests`` with ``tier`` set: exactly :func:`tier_counts` of each, in a seeded order.

    The same (number of requests, mix, seed) always gives the same assignment.
    """
    labels: list[str] = []
    for name, count in tier_counts(len(requests), mix).items():
        labels.extend([name] * count)
    random.Random(seed).shuffle(labels)
    return [replace(r, tier=label) for r, label in zip(requests, labels)]


@dataclass(frozen=True)
class TraceStats:
    """Summary of a (shaped) trace.

    Attributes:
        num_requests: requests.
        span_s: last arrival − first arrival, seconds.
        rate_per_s: requests ÷ span (0 for fewer than two requests).
        mean_input_tokens, mean_output_tokens: means in tokens.
    """

    num_requests: int
    span_s: float
    rate_per_s: float
    mean_input_tokens: float
    mean_output_tokens: float


def trace_stats(requests: list[TraceRequest]) -> TraceStats:
    """Return :class:`TraceStats` of a list of requests sorted by arrival."""
    n = len(requests)
    if n == 0:
        return TraceStats(0, 0.0, 0.0, 0.0, 0.0)
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    # n arrivals over the span: n - 1 inter-arrival gaps
    rate = (n - 1) / span_s if span_s > 0 else 0.0
    return TraceStats(n, span_s, rate, sum(r.input_tokens for r in requests) / n,
                      sum(r.output_tokens for r in requests) / n)


def busy_rate_per_s(requests: list[TraceRequest], window_s: float = 10.0) -> float:
    """Return the arrival rate of a trace while it is busy: requests ÷ (windows holding an arrival × ``window_s``).

    The trace's span is cut into windows of ``window_s`` from its first arrival; windows with no arrival (the idle
    gaps of a bursty trace) are left out. This is the rate a fleet sized for the bursts must carry, where
    :func:`trace_stats`'s ``rate_per_s`` spreads the bursts over the gaps.

    Args:
        requests: sorted by ``arrival_s``.
        window_s: window length, seconds of the trace's own clock.

    Returns:
        Requests per second; 0 for no requests.

    Raises:
        TraceError: ``window_s`` ≤ 0.
    """
    if not window_s > 0:
        raise TraceError(f"window_s must be > 0, got {window_s}")
    if not requests:
        return 0.0
    t0 = requests[0].arrival_s
    busy_windows = {int((r.arrival_s - t0) // window_s) for r in requests}
    return len(requests) / (len(busy_windows) * window_s)
