"""Preemption by tier in front of engines that schedule first come, first served.

An upstream engine (vLLM, llama.cpp, … behind a ``backend = "openai"`` pool) runs what it is sent in arrival order,
and its slots are all the room there is: under overload every slot holds a lower tier's long answer, and a
top-tier request that arrives waits for one to end (seconds on a CPU engine) or is rejected as predicted to miss
its deadline. Sluice's own workers preempt the lowest tier themselves (``worker.scheduler``); for the others the
gateway does, the way vLLM's priority scheduling does inside one engine (vLLM ``--scheduling-policy priority``,
preempt-and-recompute): when the request that should be dispatched next finds no room, a running request of a
strictly lower tier is stopped — its HTTP request to the engine is closed, which frees the engine's slot — and
its ticket is released at once, so the dispatcher's next try finds the room. The victim resumes from where it
stopped once its tier's turn comes again (:mod:`gateway.pipeline.choice`): before its first token it is simply
queued again; after it, the engine is sent the prompt and the answer so far as token ids and continues it, so the
client sees a pause in its stream, not an error.

Victim order: the lowest tier first; then a request that is decoding before one whose prompt is still being
prefilled (an engine notices a closed connection when it next emits a token of that request: a decoding victim's
slot is free one decode step later, a prefilling one's only after its prompt, which on a CPU engine can take a
second, all of it added to the preempting request's TTFT); then the most recently admitted (the least work lost,
and the oldest requests of a tier keep running). Whether a request may be stopped is its owner's call
(``Ticket.on_preempt`` returns False for a request on one of our workers, already finishing, already preempted
``MAX_PREEMPTIONS_PER_CHOICE`` times, or with output on an engine that cannot continue from token ids).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gateway.admission.capacity import CapacityView
from gateway.admission.tickets import Ticket, TicketState

MAX_VICTIMS_PER_DISPATCH = 4  # most requests stopped to make room for one: beyond, the room is not slots


class Preemption:
    """Pick and stop lower-tier victims for a ticket that finds no room.

    Args:
        enabled: ``admission.preempt_lower_tiers`` with admission on.
        in_flight: admitted tickets by id (shared with the controller).
        view: the pool's capacity view: nothing is stopped while it has a free sequence slot (what holds the
            ticket back is then not a slot: its prefill backlog, its KV demand, a worker it must avoid).
    """

    def __init__(self, enabled: bool, in_flight: dict[int, Ticket[Any]], view: CapacityView[Any]) -> None:
        self.enabled = enabled
        self._in_flight = in_flight
        self._view = view
        self.num_preempted: Counter[str] = Counter()  # victims by tier name (``/status``, metrics)

    def make_room(self, ticket: Ticket[Any], victims_so_far: int) -> bool:
        """Stop one running request of a lower tier than ``ticket``'s; return whether one was stopped (its ticket is
        then released: the caller tries to reserve again).

        Args:
            ticket: the request that should go next and finds no room.
            victims_so_far: victims already stopped for it in this dispatch call; at
                :data:`MAX_VICTIMS_PER_DISPATCH` nothing more is stopped (what holds it back is not slots: its KV
                demand, a worker it must avoid).
        """
        if not self.enabled or victims_so_far >= MAX_VICTIMS_PER_DISPATCH or self._view.free_sequence_slots() > 0:
            return False
        priority = ticket.tier.priority
        candidates = sorted(
            (t for t in self._in_flight.values()
             if t.tier.priority < priority and t.on_preempt is not None and t.state is TicketState.ADMITTED),
            key=lambda t: (t.tier.priority, not t.decoding, -(t.admitted_s or 0.0), -t.ticket_id),
        )
        for victim in candidates:
            if victim.on_preempt():
                self.num_preempted[victim.tier.name] += 1
                return True
        return False
