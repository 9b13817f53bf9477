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

The attention plan (the split along the context) is fixed at capture for the longest context the model serves
(``max_model_len``): a shorter context leaves its trailing partitions empty. Prefill and mixed steps, and decode
steps larger than the largest bucket, run eagerly. Without CUDA (tests) :class:`DecodeGraphs` runs the padded
static batch eagerly, which exercises the same buffers and padding.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

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

    def load(self, batch: ForwardBatch) -> int | None:
        """Copy a decode batch into the static rows ``[0, n)`` and reset the padding rows ``[n, bucket)``.

        Returns:
            The bucket, or None when the batch is not decode-only or larger than the largest bucket (run it
            eagerly).
        """
        num_seqs = batch.num_seqs
        bucket = bucket_for(self.sizes, num_seqs) if batch.is_decode_only else None
        if bucket is None:
            return None
        width = batch.block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(batch.input_ids, non_blocking=True)
        self.positions[:num_seqs].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:num_seqs].copy_(batch.slot_mapping, non_blocking=True)
        self.context_lens[:num_seqs].copy_(batch.context_lens, non_blocking=True)
        self.block_tables[:num_seqs, :width].copy_(batch.block_tables, non_blocking=True)
        if bucket > num_seqs:  # earlier, larger steps left their rows here
            self.input_ids[num_seqs:bucket].zero_()
            self.positions[num_seqs:bucket].zero_()
            self.slot_mapping[num_seqs:bucket].fill_(self.pad_block_id * self.block_size)
            self.context_lens[num_seqs:bucket].fill_(1)
            self.block_tables[num_seqs:bucket, 0].fill_(self.pad_block_id)
        return bucket

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Run a decode step through its bucket; return the logits of ``batch.logits_indices``
        (``[num_logits, vocab]`` float32, valid until the next call), or None when the batch takes the eager path.
        """
        bucket = self.load(batch)
        if bucket is None:
            return None
        if bucket in self._graphs:
            self._graphs[bucket].replay()
            logits = self._outputs[bucket]
        else:
            seq_lens = batch.seq_lens + [1] * (bucket - batch.num_seqs)
            logits = self.model.forward(self.static_batch(bucket, seq_lens), self.kv_cache)
        if batch.logits_indices.shape[0] == batch.num_seqs:
            return logits[: batch.num_seqs]
        return logits.index_select(0, batch.logits_indices)

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
                        self.model.forward(batch, self.kv_cache)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[bucket] = self.model.forward(batch, self.kv_cache)
                self._graphs[bucket] = graph
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        return CaptureReport(tuple(self.sizes), time.perf_counter() - start_s, max(0, free_before - free_after))
