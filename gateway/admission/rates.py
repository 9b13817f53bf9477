"""The rates admission measures: offered load, dispatches, service under backlog, and how much of ``max_tokens``
answers use (see ``gateway.admission.controller`` for how the predicted wait uses them)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from gateway.admission.capacity import CapacityView
from gateway.admission.tickets import TierQueue
from shared.config import AdmissionConfig

# Backlogged worker-seconds the rate window must hold before the service rate under backlog is re-measured; below
# it, the last measured rate stands (a property of the workers, kept through idle periods and scale to zero).
MIN_BACKLOG_WORKER_S = 2.0
# Weight of one finished request in the running mean of (completion tokens ÷ max_tokens).
OUTPUT_FRACTION_EWMA_WEIGHT = 0.05


class ServiceRates:
    """Windowed logs of arrivals, dispatches and backlogged service, over ``admission.rate_window_s``.

    Args:
        config: the admission settings (``rate_window_s``).
        view: the pool's capacity view (serving and starting workers, the workers' reported rates).
        clock: monotonic time in seconds.
    """

    def __init__(self, config: AdmissionConfig, view: CapacityView[Any], clock: Callable[[], float]) -> None:
        self._window_s = config.rate_window_s
        self._view = view
        self._clock = clock
        self.started_s = clock()
        self._dispatch_log: deque[tuple[float, float]] = deque()  # (time s, expected work tokens) per dispatch
        # service rate under backlog: (time s, expected work tokens dispatched, serving worker-seconds backlogged)
        self._backlog_log: deque[tuple[float, float, float]] = deque()
        self.backlogged = False  # the last dispatch pass left a request queued for lack of room
        self._last_backlog_rate_tokens_per_s: float | None = None  # per serving worker, the last one measured
        self._num_serving_at_last_pass = 0
        self._arrival_log: deque[tuple[float, float]] = deque()  # (time s, expected work tokens) per arrival
        self._arrival_log_work_tokens = 0.0  # sum of the log's expected work tokens
        self._backlog_mark_s = clock()
        self.output_fraction = 1.0  # running mean of completion tokens ÷ max_tokens

    # ------------------------------------------------------------------------------------------------ recording

    def record_arrival(self, work_tokens: float) -> None:
        """Log an arrival of ``work_tokens`` expected work tokens (the offered load)."""
        now_s = self._clock()
        self._arrival_log.append((now_s, work_tokens))
        self._arrival_log_work_tokens += work_tokens
        while self._arrival_log and self._arrival_log[0][0] < now_s - self._window_s:
            self._arrival_log_work_tokens -= self._arrival_log.popleft()[1]

    def record_output(self, completion_tokens: int, max_tokens: int) -> None:
        """Fold a finished request's share of its ``max_tokens`` into :attr:`output_fraction`."""
        fraction = min(1.0, max(0.0, completion_tokens / max_tokens))
        weight = OUTPUT_FRACTION_EWMA_WEIGHT
        self.output_fraction = (1.0 - weight) * self.output_fraction + weight * fraction

    def start_pass(self, now_s: float) -> bool:
        """Begin a dispatch pass at ``now_s``; return whether its dispatches count as service (False when a worker
        joined since the last pass: it brings room, not service, and this pass fills it uncounted)."""
        self.account_backlog(now_s)
        num_serving = self.num_workers()
        count_service = num_serving <= self._num_serving_at_last_pass
        self._num_serving_at_last_pass = num_serving
        return count_service

    def record_dispatch(self, now_s: float, work_tokens: float, count_service: bool) -> None:
        """Log a dispatch of ``work_tokens`` expected work tokens (as service too when backlogged and counted)."""
        if self.backlogged and count_service:
            self.account_backlog(now_s, work_tokens)
        self._dispatch_log.append((now_s, work_tokens))

    def account_backlog(self, now_s: float, work_tokens: float = 0.0) -> None:
        """Add the serving worker-seconds since the last mark (when backlogged) and ``work_tokens`` dispatched."""
        busy_s = 0.0
        if self.backlogged:
            busy_s = max(0.0, now_s - self._backlog_mark_s) * self.num_workers()
        self._backlog_mark_s = now_s
        if busy_s > 0 or work_tokens > 0:
            self._backlog_log.append((now_s, work_tokens, busy_s))
        window_start_s = now_s - self._window_s
        while self._backlog_log and self._backlog_log[0][0] < window_start_s:
            self._backlog_log.popleft()

    # ------------------------------------------------------------------------------------------------- rates

    def num_workers(self, starting: bool = False) -> int:
        """Serving workers of the view (+ starting ones)."""
        return self._view.num_serving_workers() + (self._view.num_starting_workers() if starting else 0)

    def arrival_rate_tokens_per_s(self, window_s: float) -> float:
        """Return the expected work (prompt + expected output tokens) of requests that arrived within the last
        ``window_s`` seconds (at most ``admission.rate_window_s``; rate-limited ones left out), ÷ ``window_s``:
        the offered load, admitted or not, that the autoscaler sizes the pool for."""
        now_s = self._clock()
        window_s = min(window_s, self._window_s)
        if window_s <= 0:
            return 0.0
        cutoff_s = now_s - window_s
        log = self._arrival_log
        if not log or log[-1][0] < cutoff_s:
            return 0.0
        if window_s < self._window_s / 2:  # the newest few: sum them
            work_tokens = 0.0
            for at_s, work in reversed(log):
                if at_s < cutoff_s:
                    break
                work_tokens += work
            return work_tokens / window_s
        work_tokens = self._arrival_log_work_tokens  # the whole log, less its oldest entries outside the window
        for at_s, work in log:
            if at_s >= cutoff_s:
                break
            work_tokens -= work
        return max(0.0, work_tokens) / window_s

    def backlog_rate_tokens_per_s(self) -> float | None:
        """Return the measured service rate per serving worker under backlog, expected work tokens/s: over the
        window once :data:`MIN_BACKLOG_WORKER_S` backlogged worker-seconds fall in it, else the last one so
        measured; None when none ever was."""
        self.account_backlog(self._clock())
        work = sum(sample[1] for sample in self._backlog_log)
        worker_s = sum(sample[2] for sample in self._backlog_log)
        if worker_s >= MIN_BACKLOG_WORKER_S and work > 0:
            self._last_backlog_rate_tokens_per_s = work / worker_s
        return self._last_backlog_rate_tokens_per_s

    def service_rate_per_worker_tokens_per_s(self) -> float | None:
        """Return the expected work tokens/s one serving worker drains: measured under backlog, else the workers'
        reported rates ÷ their number; None when neither is known."""
        per_worker = self.backlog_rate_tokens_per_s()
        if per_worker is not None:
            return per_worker
        # an elastic pool's rate already counts its starting workers at the serving ones' mean rate
        workers = self.num_workers(starting=True)
        rate = self._view.drain_rate_tokens_per_s()
        return rate / workers if rate > 0 and workers > 0 else None

    def drain_rate_tokens_per_s(self) -> float:
        """Return the drain rate of the queues in expected work tokens/s: the service rate measured under backlog
        × the serving (and starting) workers, else the workers' measured decode + prefill rate, else the measured
        dispatch rate; 0.0 when none is known."""
        per_worker = self.backlog_rate_tokens_per_s()
        if per_worker is not None:
            return per_worker * self.num_workers(starting=True)
        rate = self._view.drain_rate_tokens_per_s()
        if rate > 0:
            return rate
        return self.dispatch_rate_tokens_per_s()

    def dispatch_rate_tokens_per_s(self) -> float:
        """Return the expected work tokens dispatched per second over the window."""
        now_s = self._clock()
        while self._dispatch_log and self._dispatch_log[0][0] < now_s - self._window_s:
            self._dispatch_log.popleft()
        if not self._dispatch_log:
            return 0.0
        span_s = max(1.0, min(self._window_s, now_s - self.started_s))
        return sum(work for _, work in self._dispatch_log) / span_s

    def tier_dispatch_rate_per_s(self, queue: TierQueue, now_s: float) -> float:
        """Return the requests of ``queue``'s tier dispatched per second over the window."""
        while queue.dispatch_times_s and queue.dispatch_times_s[0] < now_s - self._window_s:
            queue.dispatch_times_s.popleft()
        return len(queue.dispatch_times_s) / max(1.0, min(self._window_s, now_s - self.started_s))
