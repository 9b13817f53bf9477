"""Deep readiness (``GET /readyz?deep=1``): every ready worker proves it can generate, one token each.

A worker can be connected, say Hello and report capacity, and still not generate (a wedged device, a model step
that raises, an engine loop stuck behind a lock); plain ``/readyz`` cannot see that, and users of other engines ask
for a check that does (vLLM issues 24207 and 39863). The deep check sends each ready worker a ``Generate`` of one
token (a short prompt, greedy, the top tier's priority so it is not queued behind lower tiers' prefills) and waits
for that token for at most :data:`PROBE_TIMEOUT_S` (or ``gateway.first_token_timeout_s`` when shorter). A worker
that produced a token for a real request within :data:`CACHE_S` has shown it generates and is not probed.

Results are cached for :data:`CACHE_S`: balancers that poll every second cost one probe per worker per interval,
and concurrent checks share one run. Probes bypass admission: each is one sequence of one block on its worker, for
one step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from gateway.workers.client import WorkerClient
from shared.errors import ErrorCode, SluiceError
from shared.protocol import Generate, SamplingParams

CACHE_S = 5.0
PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class GenerationProbe:
    """One worker's answer to the deep check.

    Attributes:
        worker: the worker's name.
        ok: it generated (a token of the probe, or of a real request within :data:`CACHE_S`).
        reason: why not, for the 503 (empty when ok).
    """

    worker: str
    ok: bool
    reason: str = ""


class DeepReadiness:
    """Run and cache the deep check over the workers that ``clients`` returns.

    Args:
        clients: the ready workers of every pool, now.
        prompt_token_ids: the probe's prompt.
        tier, priority: the probe's tier label and priority on the workers (the top tier's).
        timeout_s: how long a worker may take to produce the probe's token.
        clock: monotonic seconds.
    """

    def __init__(self, clients: Callable[[], list[WorkerClient]], prompt_token_ids: list[int], tier: str,
                 priority: int, timeout_s: float = PROBE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clients = clients
        self._tier = tier
        self._prompt_token_ids = prompt_token_ids
        self._priority = priority
        self._timeout_s = timeout_s
        self._clock = clock
        self._result: list[GenerationProbe] | None = None
        self._result_at_s = 0.0
        self._running: asyncio.Task[list[GenerationProbe]] | None = None

    async def check(self) -> list[GenerationProbe]:
        """Return every ready worker's probe: the cached run when younger than :data:`CACHE_S`, else a new one
        (shared by concurrent callers; a caller that goes away leaves it running for the others)."""
        if self._result is not None and self._clock() - self._result_at_s < CACHE_S:
            return self._result
        if self._running is None:
            self._running = asyncio.create_task(self._run(), name="deep-readiness")
        return await asyncio.shield(self._running)

    async def close(self) -> None:
        """Cancel a run in progress (the app shuts down)."""
        if self._running is not None:
            self._running.cancel()
            await asyncio.gather(self._running, return_exceptions=True)

    async def _run(self) -> list[GenerationProbe]:
        try:
            result = list(await asyncio.gather(*(self._probe(client) for client in self._clients())))
            self._result, self._result_at_s = result, self._clock()
            return result
        finally:
            self._running = None

    async def _probe(self, client: WorkerClient) -> GenerationProbe:
        if self._clock() - client.last_token_at_s < CACHE_S:
            return GenerationProbe(client.name, True)
        request_id = f"readyz-{uuid.uuid4().hex}"
        message = Generate(request_id=request_id, prompt_token_ids=self._prompt_token_ids,
                           sampling=SamplingParams(temperature=0.0), max_tokens=1, tier=self._tier,
                           priority=self._priority)
        try:
            stream = client.start_request(message)
        except SluiceError as exc:
            return GenerationProbe(client.name, False, exc.message)
        try:
            update = await stream.next_update(self._timeout_s)
        except SluiceError as exc:
            reason = (f"worker {client.name} generated no token within {self._timeout_s:g} s"
                      if exc.code is ErrorCode.WORKER_TIMEOUT else exc.message)
            return GenerationProbe(client.name, False, reason)
        finally:
            if not stream.done:
                client.abort(request_id)
        if update.num_tokens or (update.finished is not None and update.finished.completion_tokens > 0):
            return GenerationProbe(client.name, True)
        return GenerationProbe(client.name, False, f"worker {client.name} answered the probe without a token")
