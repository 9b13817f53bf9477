"""``sluice plan``: how many workers a traffic level needs, from T/L extended with prefill, KV limits and queueing.

The seed model (DESIGN.md): a GPU decodes about T tokens/s, an answer averages L tokens, so one GPU sustains about
T / L answers/s. This planner keeps that core and adds what it leaves out:

1. **Step costs** (the sim backend's roofline, :func:`worker.backends.sim.step_time_s`, imported, not copied): one
   engine step costs ``c_step`` (weights read once + fixed overhead), plus ``c_prefill`` per prompt token computed
   and ``c_kv`` per cached token whose K/V is read. A step carries at most ``max_num_batched_tokens`` (B) tokens
   and at most ``b`` running sequences (one decode token each).
2. **KV-bound batch**: ``b = min(max_num_seqs, ⌊KV blocks ÷ blocks per sequence⌋)`` with blocks per sequence =
   ⌈(mean prompt + mean output) ÷ block size⌉.
3. **Service demand** of request i (worker-seconds it consumes at saturation)::

       S_i = c_step · max((in_i + out_i) / B, out_i / b) + c_prefill · in_i + c_kv · kv_reads_i
       kv_reads_i = Σ_chunks (tokens computed so far + chunk)  +  Σ_{j=1..out_i} (in_i + j)

   The step count is whichever bound binds: the token budget (prefill-heavy) or one decode token per sequence per
   step (decode-heavy). With no prompt and no KV reads this is exactly T / L: ``1 / E[S] = (b / c_step) / L``.
   A worker saturates at ``mu = 1 / E[S]`` answers/s.
4. **Queueing** at a TTFT SLO. Workers are the servers of a G/G/c queue (service time of step 7; the gateway
   routes to the worker with the most free KV, close to one shared queue). Mean wait by the Allen–Cunneen approximation,
   ``Wq ≈ C(c, a) / (c·mu − λ) · (Ca² + Cs²) / 2`` with ``C(c, a)`` the Erlang C probability of waiting,
   ``a = λ / mu`` (A. K. Erlang, 1917; O. Allen, "Probability, Statistics and Queueing Theory", 2nd ed., 1990,
   §6; see also Hopp & Spearman, "Factory Physics", eq. 8.10). Ca² is the squared coefficient of variation of
   inter-arrival times (1 = Poisson), Cs² that of S_i. The wait, given that one waits, is taken as exponential
   with mean ``Wq / C`` (exact for M/M/c: P(W > t) = C · e^{−(c·mu − λ)t}), which gives percentiles.
   Tiers under priority order: non-preemptive priority classes with equal service rates (A. Cobham, "Priority
   assignment in waiting line problems", Operations Research 2(1), 1954; Gross & Harris, "Fundamentals of Queueing
   Theory", §3.4): ``W_k = Wq_FCFS · (1 − ρ) / ((1 − σ_{k−1})(1 − σ_k))``, σ_k = load of tiers of priority ≥ k.
5. **TTFT** of request i = its wait + its own prefill: ``⌈in_i / (B − n)⌉ · (c_step + c_kv · n · ctx) +
   c_prefill · in_i``, n = running decode sequences at that load (Little's law, fixed point).
6. **Traces** are not stationary (the Azure code trace alternates bursts of simultaneous requests and minutes of
   silence: Ca² ≈ 200 within 30 s windows, where renewal-process formulas mean nothing). For a trace the planner
   therefore runs the same c-server queue on the trace's own arrival times (Kiefer–Wolfowitz / Lindley recursion:
   J. Kiefer & J. Wolfowitz, "On the theory of queues with many servers", Trans. AMS 78, 1955), with the service
   times of step 7 and the tier order, and reads each request's wait off it (``--queue-model trace``, the default
   with a trace). ``--queue-model allen-cunneen`` instead applies the formulas of step 4 window by window
   (pointwise stationary approximation: Green, Kolesar & Soares, Management Science 37(1), 1991; a window with
   ρ ≥ 1 misses the SLO for all its requests), with Ca² measured inside windows.
7. **What a new request waits for**: each step serves decode first, then prefill chunks in tier/arrival order
   (the worker's scheduler). So a prompt waits for the *prefill* work ahead of it, served at the capacity decode
   leaves: the queue's service time is ``S_i^prefill / (1 − ρ_decode)``, where S_i^prefill is the prefill part of
   S_i (its steps (in_i / B), compute and KV reads) and ρ_decode = λ_worker · E[S^decode] the share of time decode
   takes (decode as the high class of a preemptive priority queue). Utilisation is still λ · E[S] / c.

Workers needed = the least c for which every tier's predicted SLO attainment (share of its requests with TTFT ≤
SLO) reaches the target. Inputs: decode and prefill tokens/s (and TPOT) measured by a running gateway's workers
(``/status``: the config's gateway when it answers with measured rates, or ``--from-status URL``; measure under the
load to plan for), else (or with ``--roofline``) the roofline from ``[sim]``/``[worker]`` of config.toml, with a
first line that says which; a trace (``loadtest.traces``) or a rate and lengths; SLOs and the tier mix.

Usage::

    sluice plan --trace azure-code --rate-scale 4 --slo-ttft-s vip=1,standard=5,free=5 \\
        --tier-mix vip=0.2,standard=0.6,free=0.2 [--config config.toml] [--json plan.json]
    sluice plan --rate-per-s 20 --input-tokens 2048 --output-tokens 28 --from-status http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.argtypes import NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, number
from shared.config import Config, ConfigError, SimConfig, WorkerConfig, effective_tiers, load_config
from worker.backends.sim import GIB, step_time_s

DEFAULT_TIER_MIX = "vip=0.2,standard=0.6,free=0.2"
DEFAULT_SLO = "vip=1,standard=5,free=5"
MAX_WORKERS = 4096


class PlanError(ValueError):
    """Invalid planner input; the message names it."""


# --------------------------------------------------------------------------------------------- queueing formulas


def erlang_c(num_servers: int, offered_load: float) -> float:
    """Return the Erlang C probability that an arrival waits in an M/M/c queue.

    Args:
        num_servers: c ≥ 1.
        offered_load: a = λ / μ in Erlangs (must be < c for a stable queue).

    Returns:
        C(c, a) in [0, 1]; 1.0 when a ≥ c (unstable: everyone waits).

    Computed with the stable Erlang B recursion B(k) = a·B(k−1) / (k + a·B(k−1)), then
    C = c·B / (c − a·(1 − B)).
    """
    if num_servers < 1:
        raise PlanError(f"num_servers must be ≥ 1, got {num_servers}")
    if offered_load <= 0:
        return 0.0
    if offered_load >= num_servers:
        return 1.0
    erlang_b = 1.0
    for k in range(1, num_servers + 1):
        erlang_b = offered_load * erlang_b / (k + offered_load * erlang_b)
    return num_servers * erlang_b / (num_servers - offered_load * (1.0 - erlang_b))


def mmc_mean_wait_s(num_servers: int, arrival_rate_per_s: float, service_rate_per_s: float) -> float:
    """Return the mean queueing delay of M/M/c, ``C(c, a) / (c·μ − λ)`` in seconds (inf when unstable)."""
    capacity = num_servers * service_rate_per_s
    if arrival_rate_per_s >= capacity:
        return math.inf
    return erlang_c(num_servers, arrival_rate_per_s / service_rate_per_s) / (capacity - arrival_rate_per_s)


def allen_cunneen_wait_s(num_servers: int, arrival_rate_per_s: float, service_rate_per_s: float,
                         arrival_cv2: float, service_cv2: float) -> float:
    """Return the Allen–Cunneen G/G/c mean wait: M/M/c wait × (Ca² + Cs²) / 2, seconds."""
    return mmc_mean_wait_s(num_servers, arrival_rate_per_s, service_rate_per_s) * (arrival_cv2 + service_cv2) / 2.0


def priority_waits_s(fcfs_wait_s: float, utilisation: float, class_loads: list[float]) -> list[float]:
    """Split an FCFS mean wait into non-preemptive priority classes (Cobham 1954, equal service rates).

    Args:
        fcfs_wait_s: the FCFS mean wait of the whole queue, seconds.
        utilisation: ρ = λ / (c·μ) of the whole queue.
        class_loads: ρ_k of each class, highest priority first (sum = ρ).

    Returns:
        Mean wait of each class in seconds, highest priority first. Load-weighted they average to the FCFS wait.
    """
    w0 = fcfs_wait_s * (1.0 - utilisation)
    waits: list[float] = []
    sigma_prev = 0.0
    for load in class_loads:
        sigma = sigma_prev + load
        denom = (1.0 - sigma_prev) * (1.0 - sigma)
        waits.append(math.inf if denom <= 0 else w0 / denom)
        sigma_prev = sigma
    return waits


def wait_cdf(t_s: np.ndarray, prob_wait: float, mean_wait_s: float) -> np.ndarray:
    """Return P(W ≤ t): 0 for t < 0, else 1 − C·exp(−t·C / W̄) (an exponential wait given that one waits)."""
    t_s = np.asarray(t_s, dtype=np.float64)
    if math.isinf(mean_wait_s):
        return np.zeros_like(t_s)
    if prob_wait <= 0 or mean_wait_s <= 0:
        return (t_s >= 0).astype(np.float64)
    conditional_mean_s = mean_wait_s / prob_wait
    cdf = 1.0 - prob_wait * np.exp(-np.maximum(t_s, 0.0) / conditional_mean_s)
    return np.where(t_s < 0, 0.0, cdf)


def squared_cv(values: np.ndarray) -> float:
    """Return the squared coefficient of variation var / mean² (0 for a constant or empty array)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size < 2 or values.mean() <= 0:
        return 0.0
    return float(values.var() / values.mean() ** 2)


def simulate_waits(arrivals_s: np.ndarray, service_s: np.ndarray, num_servers: int,
                   priority: np.ndarray | None = None) -> np.ndarray:
    """Return each customer's wait in a c-server queue driven by given arrival and service times.

    Args:
        arrivals_s: [n] float64 sorted arrival times, seconds.
        service_s: [n] float64 service times, seconds.
        num_servers: c ≥ 1.
        priority: [n] larger is served first (non-preemptive), ties by arrival; None = FCFS.

    Returns:
        [n] float64 waits (service start − arrival), seconds. With FCFS this is the Kiefer–Wolfowitz recursion.
    """
    import heapq

    n = len(arrivals_s)
    waits = np.zeros(n)
    servers = [0.0] * num_servers  # min-heap of times each server frees
    waiting: list[tuple[float, float, int]] = []
    prio = np.zeros(n) if priority is None else np.asarray(priority, dtype=np.float64)
    i = 0
    while i < n or waiting:
        t_free = servers[0]
        while i < n and arrivals_s[i] <= t_free:
            heapq.heappush(waiting, (-prio[i], arrivals_s[i], i))
            i += 1
        if not waiting:
            heapq.heappush(waiting, (-prio[i], arrivals_s[i], i))
            i += 1
        _, arrival, k = heapq.heappop(waiting)
        start = max(t_free, arrival)
        heapq.heapreplace(servers, start + float(service_s[k]))
        waits[k] = start - arrival
    return waits


# ------------------------------------------------------------------------------------------------ worker model


@dataclass(frozen=True)
class WorkerModel:
    """Cost of one worker's engine steps, in seconds.

    Attributes:
        step_s: fixed cost of a step (weights read + overhead), seconds.
        prefill_token_s: cost per prompt token computed, seconds (0 in measured mode: folded into the rates).
        kv_token_s: cost per cached token read by attention, seconds.
        max_num_batched_tokens: B, tokens per step.
        max_num_seqs: most running sequences.
        kv_capacity_tokens: KV pool size in tokens.
        block_size_tokens: tokens per KV block.
        measured_decode_tokens_per_s: measured decode throughput (measured mode), or None.
        measured_prefill_tokens_per_s: measured prefill throughput (measured mode), or None.
        measured_tpot_s: measured time per output token of one running sequence (measured mode; 1 ÷ the worker's
            ``sequence_decode_tokens_per_s``), seconds, or None (then b ÷ the decode rate).
        source: ``roofline`` or ``measured:<url>``.
    """

    step_s: float
    prefill_token_s: float
    kv_token_s: float
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_capacity_tokens: int
    block_size_tokens: int
    measured_decode_tokens_per_s: float | None = None
    measured_prefill_tokens_per_s: float | None = None
    measured_tpot_s: float | None = None
    source: str = "roofline"

    @classmethod
    def from_roofline(cls, sim: SimConfig, worker: WorkerConfig) -> WorkerModel:
        """Build from the sim backend's roofline (step costs are differences of ``step_time_s``)."""
        step_s = step_time_s(sim, 0, 0)
        bytes_per_block = sim.kv_bytes_per_token * worker.block_size_tokens
        num_blocks = int(sim.kv_cache_gib * GIB // bytes_per_block)
        return cls(step_s=step_s, prefill_token_s=step_time_s(sim, 1, 0) - step_s,
                   kv_token_s=step_time_s(sim, 0, 1) - step_s,
                   max_num_batched_tokens=worker.max_num_batched_tokens, max_num_seqs=worker.max_num_seqs,
                   kv_capacity_tokens=num_blocks * worker.block_size_tokens,
                   block_size_tokens=worker.block_size_tokens)

    def batch_limit(self, mean_seq_tokens: float) -> int:
        """Return b = min(max_num_seqs, ⌊KV blocks ÷ ⌈mean sequence tokens ÷ block size⌉⌋), at least 1."""
        blocks_per_seq = max(1, math.ceil(mean_seq_tokens / self.block_size_tokens))
        kv_bound = (self.kv_capacity_tokens // self.block_size_tokens) // blocks_per_seq
        return max(1, min(self.max_num_seqs, kv_bound))

    def decode_step_s(self, batch: float, mean_context_tokens: float) -> float:
        """Return the time of a decode step of ``batch`` sequences of ``mean_context_tokens`` context, seconds."""
        return self.step_s + self.kv_token_s * batch * mean_context_tokens


def prefill_kv_reads(input_tokens: np.ndarray, chunk_tokens: int) -> np.ndarray:
    """Return KV tokens read while prefilling in chunks: Σ over chunks of (computed so far + chunk) = chunk·m(m+1)/2
    for m full chunks, plus the last partial one."""
    input_tokens = np.asarray(input_tokens, dtype=np.float64)
    m = np.floor(input_tokens / chunk_tokens)
    rest = input_tokens - m * chunk_tokens
    return chunk_tokens * m * (m + 1) / 2 + np.where(rest > 0, input_tokens, 0.0)


@dataclass
class Workload:
    """Request lengths and tiers (one entry per request), plus the arrival process.

    Attributes:
        input_tokens, output_tokens: [num_requests] int64 lengths.
        tiers: [num_requests] tier names.
        window_rates_per_s: arrival rate of each window (pointwise stationary approximation), per second.
        window_counts: requests in each window (weights).
        arrival_cv2: Ca² of inter-arrival times within windows (1 for Poisson).
        mean_rate_per_s: requests ÷ offered window.
        arrival_s: [num_requests] float64 arrival times of a trace (seconds), or None for a stationary rate.
    """

    input_tokens: np.ndarray
    output_tokens: np.ndarray
    tiers: list[str]
    window_rates_per_s: list[float]
    window_counts: list[int]
    arrival_cv2: float
    mean_rate_per_s: float
    arrival_s: np.ndarray | None = None


def workload_from_trace(requests, window_s: float, max_model_len_tokens: int | None = None) -> Workload:
    """Build a :class:`Workload` from tiered, shaped ``loadtest.traces.TraceRequest`` s.

    Args:
        requests: sorted by arrival, with ``tier`` set.
        window_s: length of the stationary windows, seconds (after rate scaling).
        max_model_len_tokens: clip prompts as the replayer does (prompt ≤ context − output), or None.

    Raises:
        PlanError: fewer than two requests, or a zero span.
    """
    if len(requests) < 2:
        raise PlanError("a trace needs at least two requests")
    arrivals = np.array([r.arrival_s for r in requests])
    span_s = float(arrivals[-1] - arrivals[0])
    if span_s <= 0:
        raise PlanError("the trace's requests all arrive at once")
    outputs = np.array([max(1, r.output_tokens) for r in requests], dtype=np.int64)
    inputs = np.array([r.input_tokens for r in requests], dtype=np.int64)
    if max_model_len_tokens:
        limit = max_model_len_tokens - np.minimum(outputs, max_model_len_tokens // 2) - 16
        inputs = np.maximum(1, np.minimum(inputs, limit))
    window_s = min(window_s, span_s)
    # windows cover [first arrival, first arrival + n·window); the last one is shortened to the offered window
    offered_s = span_s * len(requests) / (len(requests) - 1)
    index = np.floor((arrivals - arrivals[0]) / window_s).astype(np.int64)
    num_windows = int(index.max()) + 1
    counts = np.bincount(index, minlength=num_windows)
    lengths = np.full(num_windows, window_s)
    lengths[-1] = max(offered_s - window_s * (num_windows - 1), 1e-9)
    gaps = []
    for k in range(num_windows):
        inside = arrivals[index == k]
        if inside.size > 2:
            gaps.append(np.diff(inside))
    arrival_cv2 = squared_cv(np.concatenate(gaps)) if gaps else 1.0
    keep = counts > 0
    return Workload(input_tokens=inputs, output_tokens=outputs, tiers=[r.tier or "" for r in requests],
                    window_rates_per_s=list((counts[keep] / lengths[keep]).astype(float)),
                    window_counts=[int(c) for c in counts[keep]], arrival_cv2=arrival_cv2,
                    mean_rate_per_s=len(requests) / offered_s, arrival_s=arrivals - arrivals[0])


def workload_from_rate(rate_per_s: float, input_tokens: list[int], output_tokens: list[int],
                       tier_mix: dict[str, float], arrival_cv2: float = 1.0) -> Workload:
    """Build a stationary :class:`Workload` from a rate and a length sample (tiers by the mix, exact shares)."""
    from loadtest.traces import tier_counts

    if rate_per_s <= 0:
        raise PlanError(f"rate must be > 0, got {rate_per_s}")
    n = max(len(input_tokens), len(output_tokens))
    inputs = np.resize(np.asarray(input_tokens, dtype=np.int64), n)
    outputs = np.maximum(1, np.resize(np.asarray(output_tokens, dtype=np.int64), n))
    counts = tier_counts(max(n, 100 * len(tier_mix)), tier_mix)
    tiers: list[str] = []
    for name, count in counts.items():
        tiers.extend([name] * count)
    reps = math.ceil(len(tiers) / n)
    return Workload(input_tokens=np.tile(inputs, reps)[: len(tiers)],
                    output_tokens=np.tile(outputs, reps)[: len(tiers)],
                    tiers=tiers, window_rates_per_s=[rate_per_s], window_counts=[len(tiers)],
                    arrival_cv2=arrival_cv2, mean_rate_per_s=rate_per_s)


@dataclass
class ServiceProfile:
    """Per-request costs on one worker for a workload.

    Attributes:
        service_s: [num_requests] S_i, worker-seconds each request consumes at saturation.
        prefill_service_s: [num_requests] the prefill part of S_i (its share of steps, compute, KV reads), seconds.
        batch_limit: b, the KV- and max_num_seqs-bound batch.
        mean_context_tokens: mean context of a decoding sequence, tokens.
        decode_tokens_per_s: T = b ÷ decode step time at batch b (roofline) or the measured rate.
        mean_output_tokens: L.
    """

    service_s: np.ndarray
    prefill_service_s: np.ndarray
    batch_limit: int
    mean_context_tokens: float
    decode_tokens_per_s: float
    mean_output_tokens: float

    @property
    def saturation_rate_per_s(self) -> float:
        """mu = 1 / E[S]: answers/s one worker completes when always busy."""
        return 1.0 / float(self.service_s.mean())

    @property
    def t_over_l_per_s(self) -> float:
        """The seed's T / L in answers/s (decode only)."""
        return self.decode_tokens_per_s / self.mean_output_tokens


def service_profile(model: WorkerModel, inputs: np.ndarray, outputs: np.ndarray) -> ServiceProfile:
    """Return the per-request service demands S_i of a workload on ``model`` (module docstring, step 3)."""
    inputs = inputs.astype(np.float64)
    outputs = outputs.astype(np.float64)
    mean_context = float(inputs.mean() + outputs.mean() / 2)
    batch = model.batch_limit(float(inputs.mean() + outputs.mean()))
    if model.measured_decode_tokens_per_s:
        decode_rate = model.measured_decode_tokens_per_s
        prefill_rate = model.measured_prefill_tokens_per_s or math.inf
        prefill = inputs / prefill_rate
        return ServiceProfile(outputs / decode_rate + prefill, prefill, batch, mean_context, decode_rate,
                              float(outputs.mean()))
    budget = model.max_num_batched_tokens
    steps = np.maximum((inputs + outputs) / budget, outputs / batch)
    decode_reads = outputs * inputs + outputs * (outputs + 1) / 2
    prefill_reads = prefill_kv_reads(inputs, budget)
    prefill = model.step_s * inputs / budget + model.prefill_token_s * inputs + model.kv_token_s * prefill_reads
    service = model.step_s * steps + model.prefill_token_s * inputs + model.kv_token_s * (prefill_reads + decode_reads)
    decode_rate = batch / model.decode_step_s(batch, mean_context)
    return ServiceProfile(service, prefill, batch, mean_context, decode_rate, float(outputs.mean()))


def _own_prefill_s(model: WorkerModel, inputs: np.ndarray, per_worker_rate: float,
                   profile: ServiceProfile) -> tuple[np.ndarray, float, float]:
    """Return (own prefill time per request, decode step time, running decode sequences) at a per-worker rate."""
    inputs = inputs.astype(np.float64)
    if model.measured_decode_tokens_per_s:
        prefill_rate = model.measured_prefill_tokens_per_s or math.inf
        tpot = model.measured_tpot_s or profile.batch_limit / model.measured_decode_tokens_per_s
        return inputs / prefill_rate, tpot, min(profile.batch_limit, per_worker_rate * profile.mean_output_tokens
                                                * tpot)
    budget = model.max_num_batched_tokens
    mean_in = float(inputs.mean())
    prefill_share = min(0.95, per_worker_rate * mean_in * (model.prefill_token_s + model.step_s / budget))
    running = 0.0
    step_s = model.step_s
    for _ in range(50):  # fixed point of Little's law: running = λ · L · step time; step time grows with running
        step_s = model.decode_step_s(running, profile.mean_context_tokens) / (1.0 - prefill_share)
        running = min(float(profile.batch_limit), per_worker_rate * profile.mean_output_tokens * step_s)
    chunk = max(1.0, budget - running)
    own = np.ceil(inputs / chunk) * model.decode_step_s(running, profile.mean_context_tokens) \
        + model.prefill_token_s * inputs
    return own, step_s, running


# ----------------------------------------------------------------------------------------------------- predict


@dataclass
class TierPrediction:
    """Predicted TTFT of one tier for one worker count.

    Attributes:
        name: tier.
        slo_ttft_s: the SLO, seconds.
        attainment: predicted share of the tier's requests with TTFT ≤ SLO.
        ttft_p50_s, ttft_p99_s: predicted TTFT percentiles, seconds (inf when part of the traffic is unstable).
        mean_wait_s: mean queueing delay (arrival-weighted over windows), seconds.
    """

    name: str
    slo_ttft_s: float | None
    attainment: float | None
    ttft_p50_s: float
    ttft_p99_s: float
    mean_wait_s: float


@dataclass
class Prediction:
    """The planner's prediction for one worker count."""

    num_workers: int
    utilisation: float
    peak_window_utilisation: float
    predicted_tpot_s: float
    tiers: list[TierPrediction] = field(default_factory=list)

    def meets(self, target: float) -> bool:
        """True when every tier with an SLO reaches ``target`` attainment."""
        return all(t.attainment is None or t.attainment >= target for t in self.tiers)


def _quantile_from_cdf(cdf, q: float, hi_s: float) -> float:
    """Smallest t with cdf(t) ≥ q, by bisection on [0, hi_s]; inf when cdf(hi_s) < q."""
    if cdf(hi_s) < q:
        hi = hi_s
        for _ in range(40):
            hi *= 2
            if cdf(hi) >= q:
                break
        else:
            return math.inf
        hi_s = hi
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi_s) / 2
        if cdf(mid) >= q:
            hi_s = mid
        else:
            lo = mid
    return hi_s


def predict(model: WorkerModel, workload: Workload, num_workers: int, slo_ttft_s_by_tier: dict[str, float],
            tier_priority: dict[str, int] | None, queue_model: str = "auto") -> Prediction:
    """Predict utilisation and per-tier TTFT for ``num_workers`` workers.

    Args:
        model: the worker's costs.
        workload: lengths, tiers and arrivals.
        num_workers: c.
        slo_ttft_s_by_tier: TTFT SLO per tier, seconds.
        tier_priority: tier → priority (larger first) for priority order; None = one FCFS queue.
        queue_model: ``trace`` (run the queue on the trace's arrivals), ``allen-cunneen`` (formulas per window) or
            ``auto`` (trace when the workload has arrival times).
    """
    if queue_model == "auto":
        queue_model = "trace" if workload.arrival_s is not None else "allen-cunneen"
    if queue_model not in ("trace", "allen-cunneen"):
        raise PlanError(f"queue model {queue_model!r}: valid are auto, trace, allen-cunneen")
    if queue_model == "trace" and workload.arrival_s is None:
        raise PlanError("the trace queue model needs a trace")
    profile = service_profile(model, workload.input_tokens, workload.output_tokens)
    mean_service_s = float(profile.service_s.mean())
    decode_service_s = float((profile.service_s - profile.prefill_service_s).mean())
    tier_names = sorted(set(workload.tiers), key=lambda t: -(tier_priority or {}).get(t, 0))
    tiers_arr = np.array(workload.tiers)
    masks = {t: tiers_arr == t for t in tier_names}
    mean_rho = workload.mean_rate_per_s * mean_service_s / num_workers
    if queue_model == "trace":
        per_worker = workload.mean_rate_per_s / num_workers
        own, tpot_s, _ = _own_prefill_s(model, workload.input_tokens, per_worker, profile)
        rho_decode = min(0.95, per_worker * decode_service_s)
        priority = None if tier_priority is None else np.array([tier_priority.get(t, 0) for t in workload.tiers])
        waits = simulate_waits(workload.arrival_s, profile.prefill_service_s / (1.0 - rho_decode), num_workers,
                               priority)
        ttft = waits + own
        tiers_out = []
        for tier in tier_names:
            mask = masks[tier]
            slo = slo_ttft_s_by_tier.get(tier)
            tiers_out.append(TierPrediction(
                name=tier, slo_ttft_s=slo,
                attainment=None if slo is None else float((ttft[mask] <= slo).mean()),
                ttft_p50_s=float(np.percentile(ttft[mask], 50)), ttft_p99_s=float(np.percentile(ttft[mask], 99)),
                mean_wait_s=float(waits[mask].mean())))
        return Prediction(num_workers=num_workers, utilisation=mean_rho, peak_window_utilisation=max(
            rate * mean_service_s / num_workers for rate in workload.window_rates_per_s),
            predicted_tpot_s=tpot_s, tiers=tiers_out)
    windows = []
    tpots = []
    for rate, count in zip(workload.window_rates_per_s, workload.window_counts):
        per_worker = rate / num_workers
        rho = per_worker * mean_service_s
        own, step_s, _ = _own_prefill_s(model, workload.input_tokens, per_worker, profile)
        tpots.append((count, step_s))
        rho_decode = per_worker * decode_service_s
        if rho >= 1.0 or rho_decode >= 1.0:
            windows.append((count, rho, 1.0, {t: math.inf for t in tier_names}, own))
            continue
        service = profile.prefill_service_s / (1.0 - rho_decode)
        if float(service.mean()) <= 0:  # no prompt work: nothing to wait for
            windows.append((count, rho, 0.0, {t: 0.0 for t in tier_names}, own))
            continue
        mu = 1.0 / float(service.mean())
        prob_wait = erlang_c(num_workers, rate / mu)
        fcfs_wait = allen_cunneen_wait_s(num_workers, rate, mu, workload.arrival_cv2, squared_cv(service))
        if tier_priority is None:
            waits = {t: fcfs_wait for t in tier_names}
        else:
            rho_q = rate / (num_workers * mu)
            class_waits = priority_waits_s(fcfs_wait, rho_q, [rho_q * float(masks[t].mean()) for t in tier_names])
            waits = dict(zip(tier_names, class_waits))
        windows.append((count, rho, prob_wait, waits, own))
    tiers_out = []
    horizon_s = max(1.0, 10 * mean_service_s)
    window_total = sum(workload.window_counts)
    for tier in tier_names:
        mask = masks[tier]

        def cdf(t_s: float, tier: str = tier, mask: np.ndarray = mask) -> float:
            acc = 0.0
            for count, _rho, prob_wait, waits, own in windows:
                acc += count * float(wait_cdf(t_s - own[mask], prob_wait, waits[tier]).mean())
            return acc / window_total

        slo = slo_ttft_s_by_tier.get(tier)
        mean_wait = sum(c * w[tier] for c, _r, _p, w, _o in windows) / window_total
        tiers_out.append(TierPrediction(
            name=tier, slo_ttft_s=slo, attainment=None if slo is None else cdf(slo),
            ttft_p50_s=_quantile_from_cdf(cdf, 0.5, horizon_s), ttft_p99_s=_quantile_from_cdf(cdf, 0.99, horizon_s),
            mean_wait_s=mean_wait))
    return Prediction(num_workers=num_workers, utilisation=mean_rho,
                      peak_window_utilisation=max(r for _c, r, *_ in windows),
                      predicted_tpot_s=sum(c * s for c, s in tpots) / window_total, tiers=tiers_out)


@dataclass
class Plan:
    """The planner's answer.

    Attributes:
        workers_needed: least worker count meeting the SLO target (None if none up to the search limit).
        prediction: the prediction at ``workers_needed``.
        one_fewer: the prediction at ``workers_needed − 1`` (None when that is 0).
        saturation_rate_per_worker_s: mu = 1 / E[S], answers/s of one always-busy worker.
        sustained_rate_per_worker_s: the largest Poisson arrival rate one worker serves within the SLO target
            (Allen–Cunneen, this workload's lengths and tier mix), answers/s.
        queue_model: ``trace`` or ``allen-cunneen``.
        t_over_l_per_s: the seed's T / L (decode only), answers/s.
        decode_tokens_per_s: T; mean_output_tokens: L; batch_limit: b.
    """

    workers_needed: int | None
    prediction: Prediction | None
    one_fewer: Prediction | None
    saturation_rate_per_worker_s: float
    sustained_rate_per_worker_s: float
    t_over_l_per_s: float
    decode_tokens_per_s: float
    mean_output_tokens: float
    mean_input_tokens: float
    batch_limit: int
    mean_service_s: float
    service_cv2: float
    arrival_cv2: float
    mean_rate_per_s: float
    slo_attainment_target: float
    worker_source: str
    queue_model: str

    def to_dict(self) -> dict[str, Any]:
        return _finite(asdict(self))


def _finite(obj):
    """Replace inf/nan floats by None so the JSON is standard."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def sustained_rate_per_worker(model: WorkerModel, workload: Workload, slo_ttft_s_by_tier: dict[str, float],
                              tier_priority: dict[str, int] | None, target: float) -> float:
    """Return the largest Poisson arrival rate one worker serves with every tier at ``target`` (bisection)."""
    profile = service_profile(model, workload.input_tokens, workload.output_tokens)
    lo, hi = 0.0, profile.saturation_rate_per_s
    base = Workload(workload.input_tokens, workload.output_tokens, workload.tiers, [hi], [len(workload.tiers)],
                    1.0, hi)
    for _ in range(40):
        mid = (lo + hi) / 2
        base.window_rates_per_s = [mid]
        base.mean_rate_per_s = mid
        if mid > 0 and predict(model, base, 1, slo_ttft_s_by_tier, tier_priority).meets(target):
            lo = mid
        else:
            hi = mid
    return lo


def plan(model: WorkerModel, workload: Workload, slo_ttft_s_by_tier: dict[str, float],
         tier_priority: dict[str, int] | None = None, target: float = 0.95, max_workers: int = 256,
         queue_model: str = "auto", with_sustained_rate: bool = True) -> Plan:
    """Find the least worker count whose predicted SLO attainment reaches ``target`` for every tier.

    ``with_sustained_rate=False`` skips the bisection for ``sustained_rate_per_worker_s`` (reported as 0).
    """
    if queue_model == "auto":
        queue_model = "trace" if workload.arrival_s is not None else "allen-cunneen"
    if not 0 < target <= 1:
        raise PlanError(f"SLO attainment target must be in (0, 1], got {target}")
    profile = service_profile(model, workload.input_tokens, workload.output_tokens)
    mu = profile.saturation_rate_per_s
    start = max(1, math.floor(workload.mean_rate_per_s / mu))
    needed: int | None = None
    prediction: Prediction | None = None
    for c in range(start, max_workers + 1):
        prediction = predict(model, workload, c, slo_ttft_s_by_tier, tier_priority, queue_model)
        if prediction.meets(target):
            needed = c
            break
    if needed is not None and needed == start and start > 1:
        # the search started above 1: walk down while smaller counts still meet the target
        while needed > 1:
            lower = predict(model, workload, needed - 1, slo_ttft_s_by_tier, tier_priority, queue_model)
            if not lower.meets(target):
                break
            needed, prediction = needed - 1, lower
    one_fewer = None
    if needed is not None and needed > 1:
        one_fewer = predict(model, workload, needed - 1, slo_ttft_s_by_tier, tier_priority, queue_model)
    return Plan(
        workers_needed=needed, prediction=prediction if needed is not None else None, one_fewer=one_fewer,
        saturation_rate_per_worker_s=mu,
        sustained_rate_per_worker_s=sustained_rate_per_worker(model, workload, slo_ttft_s_by_tier, tier_priority,
                                                              target) if with_sustained_rate else 0.0,
        t_over_l_per_s=profile.t_over_l_per_s, decode_tokens_per_s=profile.decode_tokens_per_s,
        mean_output_tokens=profile.mean_output_tokens, mean_input_tokens=float(workload.input_tokens.mean()),
        batch_limit=profile.batch_limit, mean_service_s=float(profile.service_s.mean()),
        service_cv2=squared_cv(profile.service_s), arrival_cv2=workload.arrival_cv2,
        mean_rate_per_s=workload.mean_rate_per_s, slo_attainment_target=target, worker_source=model.source,
        queue_model=queue_model)


def format_plan(result: Plan) -> str:
    """Return the plan as a text table."""

    def s(value: float | None) -> str:
        return "inf" if value is None or not math.isfinite(value) else f"{value:.3f}"

    lines = [
        f"worker model: {result.worker_source}; batch limit b = {result.batch_limit}; "
        f"T = {result.decode_tokens_per_s:.0f} decode tokens/s; L = {result.mean_output_tokens:.1f} tokens; "
        f"T/L = {result.t_over_l_per_s:.2f} answers/s",
        f"mean prompt {result.mean_input_tokens:.0f} tokens; service demand E[S] = {result.mean_service_s * 1000:.1f} "
        f"ms (Cs² {result.service_cv2:.2f}); arrivals {result.mean_rate_per_s:.2f}/s (Ca² {result.arrival_cv2:.2f})",
        f"one worker: saturates at {result.saturation_rate_per_worker_s:.2f} answers/s; sustains "
        f"{result.sustained_rate_per_worker_s:.2f}/s within the SLO at {100 * result.slo_attainment_target:.0f}% "
        "attainment",
        f"queue model: {result.queue_model}; workers needed: "
        f"{result.workers_needed if result.workers_needed is not None else 'more than the limit'}",
    ]
    if result.workers_needed is None and result.sustained_rate_per_worker_s == 0:
        lines.append(f"why: even an idle worker misses the TTFT targets at {100 * result.slo_attainment_target:.0f}% "
                     f"attainment (a mean prompt of {result.mean_input_tokens:.0f} tokens, service demand "
                     f"{result.mean_service_s:.1f} s a request on this worker model): loosen --slo-ttft-s (e.g. "
                     "vip=30,standard=60,free=60), or plan for a GPU with --roofline")
    for label, pred in (("plan", result.prediction), ("one fewer", result.one_fewer)):
        if pred is None:
            continue
        lines.append(f"\n{label}: {pred.num_workers} workers, utilisation {100 * pred.utilisation:.0f}% "
                     f"(peak window {100 * pred.peak_window_utilisation:.0f}%), TPOT {pred.predicted_tpot_s * 1000:.1f}"
                     " ms")
        lines.append(f"  {'tier':<10}{'slo s':>7}{'attain':>9}{'ttft p50 s':>12}{'ttft p99 s':>12}{'mean wait s':>13}")
        for t in pred.tiers:
            attain = "-" if t.attainment is None else f"{100 * t.attainment:.1f}%"
            lines.append(f"  {t.name:<10}{s(t.slo_ttft_s):>7}{attain:>9}{s(t.ttft_p50_s):>12}{s(t.ttft_p99_s):>12}"
                         f"{s(t.mean_wait_s):>13}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------- CLI


def measured_worker_model(base_url: str, fallback: WorkerModel, timeout_s: float = 5.0) -> WorkerModel:
    """Return ``fallback`` with the decode and prefill tokens/s measured by a running gateway's workers.

    Reads ``/status`` (each worker's last Capacity report: tokens per busy second of the steps of each phase) and
    takes the highest per-worker rates, with the TPOT of the worker that decodes fastest; loopback only. The decode
    rate is the one measured at the batch the worker ran (decode rate × TPOT), so it understates a worker that runs
    larger batches at saturation: measure under the load to plan for.

    Raises:
        PlanError: not loopback, unreachable, or no worker reported a decode rate yet.
    """
    import urllib.request

    from loadtest.replay import ReplayError, check_loopback

    try:
        url = check_loopback(base_url) + "/status"
    except ReplayError as exc:
        raise PlanError(str(exc)) from exc
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status = json.loads(response.read())
    except OSError as exc:
        raise PlanError(f"GET {url}: {exc}") from exc
    decode = prefill = sequence_decode = 0.0
    for worker in status.get("workers") or []:
        capacity = worker.get("capacity") or {}
        worker_decode = float(capacity.get("decode_tokens_per_s") or 0.0)
        if worker_decode > decode:
            decode = worker_decode
            sequence_decode = float(capacity.get("sequence_decode_tokens_per_s") or 0.0)
        prefill = max(prefill, float(capacity.get("prefill_tokens_per_s") or 0.0))
    if decode <= 0:
        raise PlanError(f"{url}: no worker reports a decode rate yet (measure under load)")
    from dataclasses import replace

    return replace(fallback, measured_decode_tokens_per_s=decode, measured_prefill_tokens_per_s=prefill or None,
                   measured_tpot_s=1.0 / sequence_decode if sequence_decode > 0 else None,
                   source=f"measured:{base_url}")


LIVE_PROBE_TIMEOUT_S = 1.0


def _live_or_roofline(config: Config, roofline: WorkerModel, roofline_only: bool) -> WorkerModel:
    """Return the worker model measured by the config's gateway when it answers with rates (and not
    ``roofline_only``), else ``roofline``; print one line that says which and why."""
    sim = config.sim
    what = (f"the built-in [sim] roofline ({sim.model_params_b:g} B parameters, {sim.hbm_bandwidth_gb_s:g} GB/s "
            f"HBM: an H200 serving Llama-3-8B unless [sim] says otherwise), not a served model")
    if roofline_only:
        print(f"planning for {what} (--roofline)")
        return roofline
    host = "127.0.0.1" if config.gateway.host in ("0.0.0.0", "", "::") else config.gateway.host
    url = f"http://{host}:{config.gateway.port}"
    try:
        measured = measured_worker_model(url, roofline, timeout_s=LIVE_PROBE_TIMEOUT_S)
    except PlanError as exc:
        print(f"planning for {what}: no measured rates from {url} ({exc}). To plan for the served model, run "
              f"load through it first (e.g. sluice replay … --capacity-scale 0.5), then plan again or pass "
              f"--from-status URL; --roofline silences this line")
        return roofline
    print(f"planning from the rates the workers of {url} measured (decode "
          f"{measured.measured_decode_tokens_per_s:.1f} tokens/s, prefill "
          f"{measured.measured_prefill_tokens_per_s or 0:.0f} tokens/s); --roofline plans for the [sim] roofline")
    return measured


def tier_priorities(config: Config) -> dict[str, int]:
    """Return tier → priority from the config's tiers."""
    return {tier.name: tier.priority for tier in effective_tiers(config)}


def _tier_mix(text: str) -> dict[str, float]:
    """argparse type: ``vip=0.2,standard=0.6,free=0.2`` -> weights normalised to sum to 1."""
    from loadtest.traces import TraceError, parse_mix

    try:
        return parse_mix(text)
    except TraceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _slo_ttft_s(text: str) -> dict[str, float]:
    """argparse type: ``vip=1,standard=5`` -> TTFT SLO per tier, seconds, each finite and > 0; at least one."""
    from loadtest.traces import TraceError, parse_per_tier_float

    try:
        slo = parse_per_tier_float(text)
    except TraceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not slo:
        raise argparse.ArgumentTypeError(f"expected tier=seconds,…, got {text!r}")
    for tier, seconds in slo.items():
        if not (math.isfinite(seconds) and seconds > 0):
            raise argparse.ArgumentTypeError(f"SLO of tier {tier!r} must be > 0 seconds, got {seconds}")
    return slo


def _loopback_url(text: str) -> str:
    """argparse type: an http(s) URL of a gateway on a loopback address."""
    from loadtest.replay import ReplayError, check_loopback

    try:
        return check_loopback(text)
    except ReplayError:
        raise argparse.ArgumentTypeError(
            f"expected http://HOST:PORT with a loopback HOST (localhost, 127.0.0.0/8, ::1), got {text!r}") from None


# options that only mean something with a trace, or only with --rate-per-s: (dest, default)
_TRACE_ONLY_DEFAULTS = {"rate_scale": 1.0, "max_requests": None, "duration_s": None, "start_s": 0.0,
                        "window_s": 30.0, "seed": 0}
_RATE_ONLY_DEFAULTS = {"input_tokens": 1024, "output_tokens": 256, "arrival_cv2": 1.0}


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``sluice plan``: every number and list is checked here (exit 2 naming the option)."""
    parser = argparse.ArgumentParser(prog="sluice plan", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--config", default=None, help="config.toml for [sim], [worker] and tiers (must exist if "
                        "given; default: $SLUICE_CONFIG or ./config.toml, built-in defaults without one)")
    parser.add_argument("--time-scale", type=POSITIVE_FLOAT, default=None, help="override sim.time_scale (> 0)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", default=None, help="azure-code | azure-conv | mooncake-conv | path")
    source.add_argument("--rate-per-s", type=POSITIVE_FLOAT, default=None,
                        help="stationary arrival rate instead of a trace, requests/s (> 0)")
    trace = parser.add_argument_group("with --trace")
    trace.add_argument("--rate-scale", type=POSITIVE_FLOAT, default=None,
                       help="divide inter-arrival times by this (> 0; default 1)")
    trace.add_argument("--max-requests", type=number(int, "≥ 2", lambda v: v >= 2), default=None,
                       help="keep the first N requests (≥ 2; default all)")
    trace.add_argument("--duration-s", type=POSITIVE_FLOAT, default=None,
                       help="keep requests arriving within this many seconds after scaling (> 0; default all)")
    trace.add_argument("--start-s", type=NON_NEGATIVE_FLOAT, default=None,
                       help="skip the trace's first seconds, before scaling (≥ 0; default 0)")
    trace.add_argument("--window-s", type=POSITIVE_FLOAT, default=None,
                       help="stationary window of the trace, seconds (> 0; default 30)")
    trace.add_argument("--seed", type=int, default=None, help="seed of the tier assignment (default 0)")
    rate = parser.add_argument_group("with --rate-per-s")
    rate.add_argument("--input-tokens", type=NON_NEGATIVE_INT, default=None,
                      help="prompt length, tokens (≥ 0; default 1024)")
    rate.add_argument("--output-tokens", type=POSITIVE_INT, default=None,
                      help="answer length, tokens (≥ 1; default 256)")
    rate.add_argument("--arrival-cv2", type=NON_NEGATIVE_FLOAT, default=None,
                      help="Ca², squared coefficient of variation of inter-arrival times (≥ 0; default 1 = Poisson)")
    parser.add_argument("--tier-mix", type=_tier_mix, default=DEFAULT_TIER_MIX, metavar="TIER=WEIGHT,…",
                        help="share of requests per tier, weights ≥ 0 (default %(default)s)")
    parser.add_argument("--slo-ttft-s", type=_slo_ttft_s, default=DEFAULT_SLO, metavar="TIER=SECONDS,…",
                        help="TTFT SLO per tier, seconds > 0; tiers without one are not planned for "
                             "(default %(default)s)")
    parser.add_argument("--slo-attainment", type=number(float, "in (0, 1]", lambda v: 0 < v <= 1), default=0.95,
                        help="share of each tier's requests that must meet its SLO, in (0, 1] (default %(default)s)")
    parser.add_argument("--order", choices=("priority", "fifo"), default="priority",
                        help="queue order: by tier priority or arrival (default %(default)s)")
    model_source = parser.add_mutually_exclusive_group()
    model_source.add_argument("--from-status", type=_loopback_url, default=None, metavar="URL",
                              help="use decode/prefill tokens/s measured by this gateway's workers (/status; "
                              "loopback). Default: the gateway of --config (gateway.host:port) when it answers "
                              "with measured rates, else the [sim] roofline")
    model_source.add_argument("--roofline", action="store_true",
                              help="plan for the [sim] roofline (an H200 serving Llama-3-8B by default) even when "
                              "a gateway answers")
    parser.add_argument("--queue-model", choices=("auto", "trace", "allen-cunneen"), default="auto",
                        help="auto = trace-driven with a trace, Allen–Cunneen with a rate; trace needs --trace")
    parser.add_argument("--max-workers", type=number(int, f"in [1, {MAX_WORKERS}]", lambda v: 1 <= v <= MAX_WORKERS),
                        default=256, help=f"search limit, workers (1..{MAX_WORKERS}; default %(default)s)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the plan as JSON here")
    return parser


def parse_args(argv: list[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse and cross-check the options; fill the mode-specific defaults.

    Raises:
        SystemExit: 2 with an argparse usage error naming the option.
    """
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    given, ignored = ((_TRACE_ONLY_DEFAULTS, _RATE_ONLY_DEFAULTS) if args.trace is not None
                      else (_RATE_ONLY_DEFAULTS, _TRACE_ONLY_DEFAULTS))
    for dest in ignored:
        if getattr(args, dest) is not None:
            mode = "--rate-per-s" if args.trace is not None else "--trace"
            parser.error(f"argument --{dest.replace('_', '-')}: only applies with {mode}")
    for dest, default in {**given, **ignored}.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if args.queue_model == "trace" and args.trace is None:
        parser.error("argument --queue-model: 'trace' needs --trace")
    if not set(args.slo_ttft_s) & set(args.tier_mix):
        parser.error(f"argument --slo-ttft-s: no SLO for any tier of --tier-mix ({', '.join(args.tier_mix)})")
    if args.config is not None and not Path(args.config).is_file():
        parser.error(f"argument --config: no such file {args.config}")
    if args.json is not None and not Path(args.json).resolve().parent.is_dir():
        parser.error(f"argument --json: no such directory {Path(args.json).resolve().parent}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sluice plan``; returns the exit status.

    Raises:
        SystemExit: 2 with an argparse usage error naming the option, for a bad option, config file or trace.
    """
    from loadtest.traces import TraceError, assign_tiers, load_trace, shape_trace

    parser = build_parser()
    args = parse_args(list(sys.argv[1:] if argv is None else argv), parser)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        parser.error(f"argument --config: {exc}")
    sim = config.sim
    if args.time_scale is not None:
        import msgspec

        sim = msgspec.structs.replace(sim, time_scale=args.time_scale)
    model = WorkerModel.from_roofline(sim, config.worker)
    max_len = min(config.model.max_model_len_tokens, sim.max_model_len_tokens)
    if args.trace is not None:
        try:
            requests = load_trace(args.trace)
        except TraceError as exc:
            parser.error(f"argument --trace: {exc}")
        try:
            requests = shape_trace(requests, args.rate_scale, args.max_requests, args.duration_s, args.start_s)
            workload = workload_from_trace(assign_tiers(requests, args.tier_mix, args.seed), args.window_s, max_len)
        except (TraceError, PlanError) as exc:
            parser.error(f"argument --trace: {exc} (in the window that --start-s, --duration-s and --max-requests "
                         "keep)")
    else:
        workload = workload_from_rate(args.rate_per_s, [args.input_tokens], [args.output_tokens], args.tier_mix,
                                      args.arrival_cv2)
    try:
        if args.from_status:
            model = measured_worker_model(args.from_status, model)
        else:
            model = _live_or_roofline(config, model, args.roofline)
        priorities = tier_priorities(config) if args.order == "priority" else None
        result = plan(model, workload, args.slo_ttft_s, priorities, args.slo_attainment, args.max_workers,
                      args.queue_model)
    except PlanError as exc:
        print(f"sluice plan: {exc}", file=sys.stderr)
        return 2
    print(format_plan(result))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result.to_dict(), file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
