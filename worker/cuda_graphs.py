"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (``worker.cuda_graphs``).

A decode step launches a few hundred small kernels (per layer: norms, four matmuls, RoPE, the K/V write, the CuPy
attention kernel); at small batches the GPU finishes each before the host launches the next. A CUDA graph records
the whole step once and replays it with one launch. Graphs need fixed shapes and fixed addresses, so every input
lives in a static buffer sized for the largest bucket and a step of ``n`` sequences runs the graph of the smallest
bucket ``b >= n`` (vLLM's and SGLang's scheme)::

    buckets: 1, 2, 4, 8, 16, 32, 48, ... (every 16) up to max_num_seqs rounded up to 16

    static rows  [0, n)  the step's sequences: input id, position, slot, block table row, context length
                 [n, b)  padding: token 0 at position 0 written to the pad slot (the pool's spare block, never
                         allocated to a sequence), context 1 over that block, so padding reads and writes only it

A graph also derives two of its inputs itself, from the other two: each row's slot, ``block_tables[row, position //
block_size] * block_size + position % block_size``, and its context length, ``position + 1``. So the host sets only
input ids, positions and block tables: all three from host arrays (:meth:`DecodeGraphs.load_rows`), or, when a
step decodes the same sequences in the same rows as the step before, by advancing the buffers on the device
(:meth:`DecodeGraphs.advance`): positions + 1, the input ids from the last step's sampled ids (device to device),
and only the block-table rows that gained a block.

The attention plan (the split along the context) is fixed at capture for the longest context the model serves
(``max_model_len``): a shorter context leaves its trailing partitions empty. Prefill and mixed steps, and decode
steps larger than the largest bucket, run eagerly. Without CUDA (tests) :class:`DecodeGraphs` runs the padded
static batch eagerly, which exercises the same buffers and padding.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import numpy as np
import torch

from worker.batch import ForwardBatch

GRAPH_BUCKET_STEP = 16
SMALL_BUCKETS = (1, 2, 4, 8)
NUM_WARMUP_RUNS = 2


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Return the captured batch sizes for ``max_num_seqs``: 1, 2, 4, 8, then every 16 up to ``max_num_seqs``
    rounded up to a multiple of 16 (1, 2, 4 and 8 only where smaller than that)."""
    top = -(-max_num_seqs // GRAPH_BUCKET_STEP) * GRAPH_BUCKET_STEP
    return [b for b in SMALL_BUCKETS if b < top] + list(range(GRAPH_BUCKET_STEP, top + 1, GRAPH_BUCKET_STEP))


def bucket_for(sizes: list[int], num_seqs: int) -> int | None:
    """Return the smallest of ``sizes`` (ascending) that holds ``num_seqs`` sequences, or None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class CaptureReport:
    """What capturing cost: ``sizes`` captured, wall seconds, and device bytes the graphs hold (free memory before
    minus after)."""

    sizes: tuple[int, ...]
    capture_s: float
    memory_bytes: int


class DecodeGraphs:
    """Static decode buffers for the largest bucket, and (on CUDA, after :meth:`capture`) one graph per bucket.

    Args:
        model: a :class:`worker.model.LlamaModel` (``forward(batch, kv_cache) -> [rows, vocab] logits``).
        kv_cache: the pool ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``; its block
            ``pad_block_id`` is never given to a sequence.
        block_size: tokens per KV block.
        max_num_seqs: the scheduler's most running sequences (the largest bucket holds them).
        max_model_len: longest context in tokens (block table width, attention plan).
        pad_block_id: the spare block padding rows read and write.
    """

    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, max_num_seqs: int, max_model_len: int,
                 pad_block_id: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.pad_block_id = pad_block_id
        self.sizes = graph_batch_sizes(max_num_seqs)
        device = kv_cache.device
        num_rows = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((num_rows,), pad_block_id * block_size, dtype=torch.int64, device=device)
        self.block_tables = torch.full((num_rows, max_blocks), pad_block_id, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(num_rows, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(num_rows, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @property
    def captured(self) -> bool:
        """Whether graphs were captured (CUDA); else :meth:`run` runs the padded batch eagerly."""
        return bool(self._graphs)

    def static_batch(self, num_rows: int, seq_lens: list[int] | None = None) -> ForwardBatch:
        """Return the static buffers' first ``num_rows`` rows as a decode :class:`ForwardBatch`.

        ``seq_lens`` (host ints, one per row) is read only by the torch attention backend; default all 1 (the
        padding's context). ``max_seq_len`` is ``max_model_len``, so the CuPy kernel's plan is the captured one.
        """
        return ForwardBatch(
            input_ids=self.input_ids[:num_rows], positions=self.positions[:num_rows],
            slot_mapping=self.slot_mapping[:num_rows], query_start_loc=list(range(num_rows + 1)),
            seq_lens=seq_lens if seq_lens is not None else [1] * num_rows,
            block_tables=self.block_tables[:num_rows], context_lens=self.context_lens[:num_rows],
            logits_indices=self.logits_indices[:num_rows], max_seq_len=self.max_model_len, is_decode_only=True,
            decode_seqs=[True] * num_rows,
        )

    def _derive_inputs(self, bucket: int) -> None:
        """Write rows ``[0, bucket)`` of ``slot_mapping`` and ``context_lens`` from ``positions`` and
        ``block_tables`` (recorded in each graph; run before an eager step of the static batch)."""
        positions = self.positions[:bucket]
        block_idx = torch.div(positions, self.block_size, rounding_mode="floor").unsqueeze(1)
        blocks = self.block_tables[:bucket].gather(1, block_idx).squeeze(1).to(torch.int64)
        torch.add(blocks * self.block_size, positions % self.block_size, out=self.slot_mapping[:bucket])
        self.context_lens[:bucket].copy_(positions + 1)

    def load_rows(self, input_ids: np.ndarray, positions: np.ndarray, block_tables: np.ndarray) -> int | None:
        """Write a decode step of ``n`` sequences from host arrays into the static rows ``[0, n)`` and reset the
        padding rows ``[n, bucket)``.

        Args:
            input_ids: ``[n]`` int64, the token each sequence decodes.
            positions: ``[n]`` int64, its position (the tokens already in the pool).
            block_tables: ``[n, width]`` integer block ids (``width`` <= the static table's).

        Returns:
            The bucket, or None when ``n`` is larger than the largest bucket (run it eagerly).
        """
        num_seqs = input_ids.shape[0]
        bucket = bucket_for(self.sizes, num_seqs)
        if bucket is None:
            return None
        width = block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(torch.from_numpy(input_ids), non_blocking=True)
        self.positions[:num_seqs].copy_(torch.from_numpy(positions), non_blocking=True)
        tables = torch.from_numpy(np.ascontiguousarray(block_tables, dtype=np.int32))
        self.block_tables[:num_seqs, :width].copy_(tables, non_blocking=True)
        if bucket > num_seqs:  # earlier, larger steps left their rows here
            self.input_ids[num_seqs:bucket].zero_()
            self.positions[num_seqs:bucket].zero_()
            self.block_tables[num_seqs:bucket, 0].fill_(self.pad_block_id)
        return bucket

    def advance(self, num_seqs: int, input_ids: torch.Tensor, rows: list[int], row_tables: list[list[int]]) -> int:
        """Turn the static rows of the last step into the next step of the same ``num_seqs`` sequences in the same
        rows, each one token further: positions + 1, ``input_ids`` as the new tokens, and the block tables of
        ``rows`` replaced by ``row_tables`` (the rows whose table grew). Padding rows stay as they were.

        Args:
            num_seqs: sequences of the last step and of this one (rows ``[0, num_seqs)``).
            input_ids: ``[num_seqs]`` int64 on the device (the last step's sampled ids) or on the host.
            rows: the rows whose block table changed; ``row_tables`` their new tables.

        Returns:
            The bucket.
        """
        self.positions[:num_seqs].add_(1)
        self.input_ids[:num_seqs].copy_(input_ids, non_blocking=True)
        if rows:
            width = max(map(len, row_tables))
            values = np.zeros((len(rows), width), dtype=np.int32)
            for i, table in enumerate(row_tables):
                values[i, : len(table)] = table
            index = torch.tensor(rows, dtype=torch.int64).to(self.block_tables.device, non_blocking=True)
            self.block_tables[index, :width] = torch.from_numpy(values).to(self.block_tables.device,
                                                                           non_blocking=True)
        return bucket_for(self.sizes, num_seqs)

    def replay(self, bucket: int, num_seqs: int) -> torch.Tensor:
        """Run the step loaded in the static rows through the graph of ``bucket``; return the logits of rows
        ``[0, num_seqs)`` (``[num_seqs, vocab]`` float32, valid until the next call).

        Without captured graphs the padded static batch runs eagerly, with its derived context lengths as the host
        lengths the torch attention backend reads.
        """
        if bucket in self._graphs:
            self._graphs[bucket].replay()
            return self._outputs[bucket][:num_seqs]
        self._derive_inputs(bucket)
        seq_lens = self.context_lens[:bucket].tolist()
        return self.model.forward(self.static_batch(bucket, seq_lens), self.kv_cache)[:num_seqs]

    def capture(self) -> CaptureReport:
        """Capture one graph per bucket, largest first, sharing one memory pool (CUDA only).

        Each bucket first runs eagerly on a side stream (compiles the CuPy kernels, settles the allocator), then
        is recorded. Padding rows only: the pool's sequence blocks are not touched.

        Raises:
            RuntimeError: the KV pool is not on a CUDA device, or capture failed (the caller runs eagerly).
        """
        if self.kv_cache.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, the KV pool is on {self.kv_cache.device}")
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        start_s = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bucket in reversed(self.sizes):
                batch = self.static_batch(bucket)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(NUM_WARMUP_RUNS):
                        self._derive_inputs(bucket)
                        self.model.forward(batch, self.kv_cache)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._derive_inputs(bucket)
                    self._outputs[bucket] = self.model.forward(batch, self.kv_cache)
                self._graphs[bucket] = graph
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        return CaptureReport(tuple(self.sizes), time.perf_counter() - start_s, max(0, free_before - free_after))
