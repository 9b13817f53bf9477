"""What one choice of a request is while it runs (:class:`ChoiceState`) and what its run yields: :class:`TextEvent`
pieces, then one :class:`FinishEvent` (:class:`~gateway.pipeline.choice.ChoiceRunner` advances it)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gateway.admission.tickets import Ticket
from gateway.pipeline.detokenize import IncrementalDetokenizer
from gateway.pipeline.logprobs import LogprobLedger, TokenLogprob
from gateway.pipeline.stop import StopStringMatcher
from gateway.workers.client import WorkerClient
from gateway.workers.reservation import Reservation
from gateway.workers.stream import RequestStream


@dataclass
class TextEvent:
    """New text of one choice (never empty), with the log-probabilities of the tokens whose text starts in it
    (when the request asked for them; else empty)."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class FinishEvent:
    """The end of one choice."""

    index: int
    finish_reason: str  # "stop" | "length"


@dataclass
class ChoiceState:
    """Bookkeeping of one choice."""

    index: int
    prompt_index: int
    request_id: str
    prompt_tokens: int
    ticket: Ticket[Reservation] | None = None
    attempt: int = 0
    stream: RequestStream | None = None
    dispatched_at_s: float = 0.0
    first_token_deadline_s: float | None = None  # time.perf_counter() of the first Generate + first_token_timeout_s
    detokenizer: IncrementalDetokenizer | None = None
    matcher: StopStringMatcher | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    engine_prompt_tokens: int | None = None  # the prompt as the engine counted it (its Finished; not a resumption's)
    finish_reason: str | None = None
    text_parts: list[str] = field(default_factory=list)
    last_token_at_s: float = 0.0
    logprobs: LogprobLedger = field(default_factory=LogprobLedger)
    num_preemptions: int = 0
    num_requeues: int = 0  # times an engine turned it away with its own 429/503 (ChoiceRunner._requeue)
    resume_prompt: list[int] | None = None  # prompt + output token ids the current attempt continues from
    resume_base_tokens: int = 0  # output tokens streamed before the current attempt
    pending: deque[TextEvent | FinishEvent] = field(default_factory=deque)  # made, not yet read by next_event

    @property
    def reservation(self) -> Reservation | None:
        return self.ticket.reservation if self.ticket is not None else None

    @property
    def worker(self) -> WorkerClient | None:
        reservation = self.reservation
        return reservation.worker if reservation is not None else None
