"""Per-request results of a replay and their per-tier summary (latency percentiles, SLO attainment, goodput).

Definitions (the overload issue; DistServe, Zhong et al., OSDI'24, for goodput under an SLO):

- TTFT: request sent → first output token received (the first non-empty content delta), seconds.
- TPOT: (last token time − first token time) ÷ (completion tokens − 1), seconds per output token; only for
  answers of two or more tokens.
- e2e: request sent → end of the stream, seconds.
- SLO attainment of a tier: requests that finished OK with TTFT ≤ the tier's SLO ÷ ALL requests of the tier
  (rejected and failed ones count as misses).
- goodput: requests that finished OK within the SLO ÷ the offered window, per second. The window is the trace's
  arrival span plus one mean gap (so that it equals requests ÷ offered rate); it is the same for every run of the
  same shaped trace, whatever the server did, so goodputs of two servers compare directly.
- rejections: HTTP 429/503 responses, by error ``code``, with their ``Retry-After`` (seconds).

Percentiles use linear interpolation between order statistics (numpy's default).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

REJECTION_STATUSES = (429, 503)
PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What one replayed request did.

    Attributes:
        index: position in the shaped trace.
        tier: tier it was sent in.
        arrival_s: scheduled send time, seconds after the replay started.
        sent_s: actual send time, seconds after the replay started (None if never sent).
        input_tokens: the trace's prompt length (after clipping to the context), tokens.
        max_tokens: ``max_tokens`` sent (the trace's output length), tokens.
        outcome: ``ok``, ``http_error`` (non-200), ``error_in_band`` (error event in the stream),
            ``client_error`` (connection failure), ``client_timeout`` (cut by the replay's time bound).
        status: HTTP status, or None.
        error_code: the error envelope's ``code``, or None.
        retry_after_s: the ``Retry-After`` header in seconds, or None when absent.
        ttft_s, tpot_s, e2e_s: latencies in seconds (None when not measured).
        prompt_tokens, completion_tokens: from the usage chunk, or None.
        queue_ms: the ``x-sluice-queue-ms`` response header, or None.
        served_tier: the ``x-sluice-tier`` response header (the tier the gateway served it in), or None.
    """

    index: int
    tier: str
    arrival_s: float
    input_tokens: int
    max_tokens: int
    outcome: str = "client_timeout"
    sent_s: float | None = None
    status: int | None = None
    error_code: str | None = None
    retry_after_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    queue_ms: float | None = None
    served_tier: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def served_in_another_tier(self) -> bool:
        """The gateway served it in another tier than the replay gave it (its key could not reach that tier)."""
        return self.served_tier is not None and self.served_tier != self.tier

    @property
    def is_rejection(self) -> bool:
        return self.outcome == "http_error" and self.status in REJECTION_STATUSES


def percentiles(values: list[float]) -> dict[str, float | None]:
    """Return ``{"p50", "p90", "p99", "mean", "max"}`` of ``values`` (None each when empty)."""
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None, "max": None}
    array = np.asarray(values, dtype=np.float64)
    out: dict[str, float | None] = {f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}
    out["mean"] = float(array.mean())
    out["max"] = float(array.max())
    return out


def offered_window_s(arrivals_s: list[float]) -> float:
    """Return the offered window: arrival span × n ÷ (n − 1), i.e. requests ÷ offered rate (0 if < 2 requests)."""
    n = len(arrivals_s)
    if n < 2:
        return 0.0
    span_s = max(arrivals_s) - min(arrivals_s)
    return span_s * n / (n - 1)


def _rejections(results: list[RequestResult]) -> dict[str, Any]:
    by_code: dict[str, dict[str, Any]] = {}
    for r in results:
        if not r.is_rejection:
            continue
        code = r.error_code or f"http_{r.status}"
        entry = by_code.setdefault(code, {"count": 0, "status": r.status, "with_retry_after": 0, "retry_after_s": []})
        entry["count"] += 1
        if r.retry_after_s is not None:
            entry["with_retry_after"] += 1
            entry["retry_after_s"].append(r.retry_after_s)
    for entry in by_code.values():
        values = entry.pop("retry_after_s")
        entry["retry_after_s"] = {
            "min": min(values) if values else None,
            "p50": float(np.percentile(values, 50)) if values else None,
            "max": max(values) if values else None,
        }
    return by_code


def summarize_group(results: list[RequestResult], slo_ttft_s: float | None, window_s: float) -> dict[str, Any]:
    """Summarize one group of requests (one tier, or all).

    Args:
        results: the group's requests.
        slo_ttft_s: the TTFT SLO in seconds, or None (no SLO: attainment and goodput are None).
        window_s: the offered window in seconds (see module docstring); ≤ 0 makes goodput None.
    """
    ok = [r for r in results if r.outcome == "ok"]
    rejections = [r for r in results if r.is_rejection]
    within = None if slo_ttft_s is None else [r for r in ok if r.ttft_s is not None and r.ttft_s <= slo_ttft_s]
    outcomes: dict[str, int] = {}
    for r in results:
        key = r.outcome if r.outcome != "http_error" else f"http_{r.status}"
        outcomes[key] = outcomes.get(key, 0) + 1
    queue_ms = [r.queue_ms for r in ok if r.queue_ms is not None]
    return {
        "count": len(results),
        "ok": len(ok),
        "outcomes": outcomes,
        "slo_ttft_s": slo_ttft_s,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "queue_ms": percentiles(queue_ms),
        "slo_met": None if within is None else len(within),
        "slo_attainment": None if within is None or not results else len(within) / len(results),
        "goodput_per_s": None if within is None or window_s <= 0 else len(within) / window_s,
        "throughput_ok_per_s": len(ok) / window_s if window_s > 0 else None,
        "rejected": len(rejections),
        "rejections": _rejections(results),
        "all_rejections_have_retry_after": all(r.retry_after_s is not None for r in rejections),
    }


def summarize(results: list[RequestResult], slo_ttft_s_by_tier: dict[str, float],
              window_s: float | None = None) -> dict[str, Any]:
    """Summarize a replay per tier and overall.

    Args:
        results: every request of the replay.
        slo_ttft_s_by_tier: TTFT SLO per tier in seconds; a tier without one gets no attainment/goodput.
        window_s: the offered window in seconds; None = :func:`offered_window_s` of the arrivals.

    Returns:
        ``{"window_s", "offered_rate_per_s", "tiers": {tier: group}, "all": group}`` where ``all`` uses each
        request's own tier SLO (its attainment is the share of all requests within their tier's SLO).
    """
    if window_s is None:
        window_s = offered_window_s([r.arrival_s for r in results])
    tiers: dict[str, list[RequestResult]] = {}
    for r in results:
        tiers.setdefault(r.tier, []).append(r)
    tier_summaries = {name: summarize_group(group, slo_ttft_s_by_tier.get(name), window_s)
                      for name, group in sorted(tiers.items())}
    overall = summarize_group(results, None, window_s)
    met = sum(s["slo_met"] or 0 for s in tier_summaries.values())
    has_slo = any(s["slo_ttft_s"] is not None for s in tier_summaries.values())
    overall["slo_met"] = met if has_slo else None
    overall["slo_attainment"] = met / len(results) if has_slo and results else None
    overall["goodput_per_s"] = met / window_s if has_slo and window_s > 0 else None
    return {
        "window_s": window_s,
        "offered_rate_per_s": len(results) / window_s if window_s > 0 else None,
        "tiers": tier_summaries,
        "all": overall,
    }


def format_table(summary: dict[str, Any]) -> str:
    """Return a fixed-width text table of a :func:`summarize` result (ms for latencies)."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}%"

    header = (f"{'tier':<10}{'count':>6}{'ok':>6}{'rej':>5}{'ttft p50':>10}{'p90':>8}{'p99':>8}{'tpot p50':>10}"
              f"{'e2e p99':>9}{'slo':>8}{'goodput/s':>11}")
    lines = [header, "-" * len(header)]
    rows = list(summary["tiers"].items()) + [("all", summary["all"])]
    for name, s in rows:
        goodput = "-" if s["goodput_per_s"] is None else f"{s['goodput_per_s']:.2f}"
        lines.append(f"{name:<10}{s['count']:>6}{s['ok']:>6}{s['rejected']:>5}{ms(s['ttft_s']['p50']):>10}"
                     f"{ms(s['ttft_s']['p90']):>8}{ms(s['ttft_s']['p99']):>8}{ms(s['tpot_s']['p50']):>10}"
                     f"{ms(s['e2e_s']['p99']):>9}{pct(s['slo_attainment']):>8}{goodput:>11}")
    reasons = [(name, text) for name, s in summary["tiers"].items() if (text := not_ok_reasons(s))]
    if reasons:
        lines += ["", "not ok, by reason (error code, or outcome):"]
        lines += [f"  {name:<10}{text}" for name, text in reasons]
    return "\n".join(lines)


def not_ok_reasons(group: dict[str, Any]) -> str:
    """Return why a :func:`summarize_group`'s requests were not ok, e.g. ``queue_timeout 12 (503, Retry-After
    p50 3 s), client_timeout 1``; "" when all were ok."""
    parts = []
    for code, entry in sorted(group["rejections"].items(), key=lambda item: -item[1]["count"]):
        retry = entry["retry_after_s"]["p50"]
        after = f", Retry-After p50 {retry:.0f} s" if retry is not None else ""
        parts.append(f"{code} {entry['count']} ({entry['status']}{after})")
    rejected_keys = {f"http_{status}" for status in REJECTION_STATUSES}
    for outcome, count in sorted(group["outcomes"].items()):
        if outcome != "ok" and outcome not in rejected_keys:
            parts.append(f"{outcome} {count}")
    return ", ".join(parts)
