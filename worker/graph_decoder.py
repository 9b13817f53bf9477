"""Decode steps through CUDA graphs with as little host work between them as the steps allow.

:class:`GraphDecoder` drives :class:`worker.cuda_graphs.DecodeGraphs` for :class:`worker.model_runner.ModelRunner`,
step after step, three ways, the cheapest that applies::

    launched ahead   the last step launched this one before reading its own tokens: its logits are on their way
    advanced         the same sequences in the same rows as the last step, one token further: the static rows
                     advance on the device (positions + 1, the sampled ids device to device, grown table rows)
    loaded           anything else (arrivals, finishes, aborts, another bucket): the rows are written from the host

Launching ahead (vLLM's async scheduling, one step deep): after a greedy step's argmax, and before its ids are read
on the host, the step after it is launched with the same sequences one token further, its input ids the sampled
ids on the device. The ids' copy to pinned host memory is queued before that launch, so reading them waits for this
step only; while the GPU runs the next step the host reads the tokens, the engine updates the scheduler and
schedules. When the scheduler decides that same step (the same sequences, positions and block tables) its logits
are taken; otherwise it is dropped. A step is launched ahead only when every sequence's next token has its KV slot
in a block it holds already and none ends by its length, so a dropped step wrote K/V only past the valid tokens of
its own sequences' last blocks, before (on the stream) anything that reuses them.

A dropped step costs a whole step of GPU time, and a serving batch changes often (an arrival and a finish every
few steps at 64 sequences of a few hundred tokens), when hiding the host's work saves a tenth of a step at most
(H200, Llama-3-8B, 64 sequences: 0.4-0.7 ms of host work against a 6.2 ms graph). So steps are launched ahead only
after :data:`MIN_STEADY_STEPS` steps in a row that each continued the one before (launched ahead and taken, or
advanced on the device): a change at most every that many steps wastes at most 1 / (that + 1) of the GPU time.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import torch

from worker.cuda_graphs import DecodeGraphs, bucket_for
from worker.scheduler import SchedulerOutput
from worker.sequence import Sequence


MIN_STEADY_STEPS = 16  # steps in a row that continued the one before, before a step is launched ahead (docstring)


def _last_tokens(seqs: list[Sequence]) -> np.ndarray:
    """``[num_seqs]`` int64: each sequence's last token, the one its next decode step takes as input."""
    return np.fromiter([seq.output_token_ids[-1] for seq in seqs], dtype=np.int64, count=len(seqs))


class GraphStep:
    """One decode step that ran (or was launched) through a graph.

    Attributes:
        seqs: its sequences, in row order.
        tables: each sequence's block table as scheduled (``ScheduledSeq.block_ids``: the same list object while
            the table does not grow).
        positions: ``[num_seqs]`` int64, each sequence's position in that step.
        next_input_ids: ``[num_seqs]`` int64 on the model's device, the ids it sampled (greedy), or None when they
            were sampled on the host.
        logits: of a step launched ahead, its logits ``[num_seqs, vocab]`` (a view of the graph's output).
    """

    __slots__ = ("seqs", "tables", "positions", "next_input_ids", "logits")

    def __init__(self, seqs: list[Sequence], tables: list[list[int]], positions: np.ndarray) -> None:
        self.seqs = seqs
        self.tables = tables
        self.positions = positions
        self.next_input_ids: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None


class GraphDecoder:
    """Run decode steps through ``graphs`` (see the module docstring).

    One step is :meth:`forward`, then :meth:`sample_greedy` (or the caller's own sampling), then :meth:`step_done`;
    a step that does not go through the graphs calls :meth:`reset`.

    Args:
        graphs: the captured graphs (or, without CUDA, their static buffers run eagerly).
        decode_tables: ``[num_seqs, max_blocks]`` integer block tables of a decode step from its tables
            (:meth:`worker.model_runner.BatchBuilder.decode_tables`).
        min_steady_steps: steps in a row that continued the one before, before one is launched ahead
            (:data:`MIN_STEADY_STEPS`; 0 launches ahead whenever the step allows, as the tests do).
    """

    def __init__(self, graphs: DecodeGraphs, decode_tables: Callable[[list[list[int]]], np.ndarray],
                 min_steady_steps: int = MIN_STEADY_STEPS) -> None:
        self.graphs = graphs
        self._decode_tables = decode_tables
        self.min_steady_steps = min_steady_steps
        self.steady_steps = 0  # steps in a row that continued the one before
        self._last: GraphStep | None = None  # the last step that sampled: the next one may advance from it
        self._current: GraphStep | None = None  # the step between forward and step_done
        self._ahead: GraphStep | None = None  # a step launched before the scheduler decided it
        self._host_ids: torch.Tensor | None = None  # pinned: a step's sampled ids, read while the next one runs
        self._ids_copied: torch.cuda.Event | None = None

    def reset(self) -> None:
        """Forget the last step and any step launched ahead (a step ran eagerly: the static rows are stale)."""
        self._last = self._current = self._ahead = None
        self.steady_steps = 0

    def forward(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Run a decode step (``out.all_decode``); return its logits ``[num_seqs, vocab]`` float32, or None when no
        graph holds that many sequences (run it eagerly, and :meth:`reset`)."""
        ahead, self._ahead = self._ahead, None
        last, self._last = self._last, None
        self._current = None
        graphs = self.graphs
        scheduled = out.scheduled
        num_seqs = len(scheduled)
        if bucket_for(graphs.sizes, num_seqs) is None:
            self.steady_steps = 0
            return None
        seqs = [item.seq for item in scheduled]
        tables = [item.block_ids for item in scheduled]
        positions = np.fromiter([seq.num_computed_tokens for seq in seqs], dtype=np.int64, count=num_seqs)
        if ahead is not None:
            if (ahead.seqs == seqs and np.array_equal(positions, ahead.positions)
                    and all(map(operator.is_, tables, ahead.tables))):
                self._current = ahead
                self.steady_steps += 1
                return ahead.logits
            last = None  # the static rows hold the step launched ahead: rewrite them from the host
        if last is not None and last.seqs == seqs and np.array_equal(positions, last.positions + 1):
            self.steady_steps += 1
            rows = [r for r, (new, old) in enumerate(zip(tables, last.tables)) if new is not old]
            input_ids = last.next_input_ids  # sampled on the host: None, uploaded below
            if input_ids is None:
                input_ids = torch.from_numpy(_last_tokens(seqs))
            bucket = graphs.advance(num_seqs, input_ids, rows, [tables[r] for r in rows])
        else:
            self.steady_steps = 0
            bucket = graphs.load_rows(_last_tokens(seqs), positions, self._decode_tables(tables))
        self._current = GraphStep(seqs, tables, positions)
        return graphs.replay(bucket, num_seqs)

    def sample_greedy(self, logits: torch.Tensor, launch_ahead: bool) -> list[int]:
        """Return the greedy token of each row of the current step's ``logits`` (the first maximal column, as
        ``max(dim).indices``), keeping them on the device as the next step's input ids; with ``launch_ahead`` (no
        one reads these logits afterwards: no log-probabilities), launch the next step first where it may be."""
        step = self._current
        sampled_ids = logits.max(dim=-1).indices
        step.next_input_ids = sampled_ids
        if not launch_ahead or not self._may_launch_ahead(step):
            return sampled_ids.tolist()
        host_ids, copied = self._copy_ids_to_host(sampled_ids)  # queued before the next step: waits for this one
        with torch.inference_mode():
            self._ahead = self._launch_ahead(step)
        if copied is not None:
            copied.synchronize()
        return host_ids.tolist()

    def step_done(self) -> None:
        """The current step sampled (its tokens reach the scheduler): the next step may advance from it."""
        self._last, self._current = self._current, None

    def _copy_ids_to_host(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying ``ids`` (``[n]`` int64) to the host: on CUDA into a reused pinned buffer, asynchronously,
        with an event recorded after the copy (synchronize it, then read the buffer); elsewhere ``ids`` itself."""
        if ids.device.type != "cuda":
            return ids, None
        num_ids = ids.shape[0]
        if self._host_ids is None or self._host_ids.shape[0] < num_ids:
            self._host_ids = torch.empty(max(num_ids, self.graphs.sizes[-1]), dtype=torch.int64, pin_memory=True)
            self._ids_copied = torch.cuda.Event()
        host_ids = self._host_ids[:num_ids]
        host_ids.copy_(ids, non_blocking=True)
        self._ids_copied.record()
        return host_ids, self._ids_copied

    def _may_launch_ahead(self, step: GraphStep) -> bool:
        """Whether the step after ``step`` may be launched before ``step``'s tokens reach the host: the last
        ``min_steady_steps`` steps each continued the one before, each sequence's next token has its KV slot in a
        block it holds already, within the graphs' context length, and none ends by its length with ``step``'s
        token. (One that ends by a stop token or an abort makes the next step differ, and the step launched ahead
        is then dropped.)"""
        if self.steady_steps < self.min_steady_steps:
            return False
        seqs = step.seqs
        graphs = self.graphs
        slots = np.fromiter(map(len, step.tables), dtype=np.int64, count=len(seqs)) * graphs.block_size
        next_positions = step.positions + 1
        if not (bool(np.all(next_positions < slots)) and bool(np.all(next_positions + 1 < graphs.max_model_len))):
            return False
        return all(len(seq.output_token_ids) + 1 < seq.max_tokens for seq in seqs)

    def _launch_ahead(self, step: GraphStep) -> GraphStep:
        """Launch the decode step after ``step`` before ``step``'s tokens are read: the same sequences one token
        further, ``step``'s sampled ids (on the device) as input; its K/V writes and logits follow ``step``'s on
        the stream."""
        graphs = self.graphs
        num_seqs = len(step.seqs)
        bucket = graphs.advance(num_seqs, step.next_input_ids, [], [])
        ahead = GraphStep(step.seqs, step.tables, step.positions + 1)
        ahead.logits = graphs.replay(bucket, num_seqs)
        return ahead
