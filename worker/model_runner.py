"""Turn a scheduler decision into the model's :class:`~worker.batch.ForwardBatch`, run it, sample.

The one place where scheduler metadata (sequences, block ids) meets tensors.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable

import numpy as np
import torch

from worker.batch import ForwardBatch
from worker.cuda_graphs import DecodeGraphs
from worker.graph_decoder import GraphDecoder
from worker.sampling import Sampler, TokenLogprobs, token_logprobs
from worker.scheduler import SchedulerOutput
from worker.sequence import Sequence


class BatchBuilder:
    """Turn a scheduler decision into a :class:`ForwardBatch` from preallocated host buffers, vectorised.

    Token ``t`` of a sequence lives in slot ``block_ids[t // block_size] * block_size + t % block_size``::

        seq 0: tokens [c0, c0+n0)   seq 1: tokens [c1, c1+n1)   ...
        input_ids = [seq0 chunk | seq1 chunk | ...]    query_start_loc = [0, n0, n0+n1, ...]

    The only Python work per sequence is reading its chunk's token ids and its block table; positions, slots and
    the padded block table are computed with numpy over the whole step. Buffers grow on demand and are reused.

    Args:
        block_size: tokens per KV block.
        device: where the model runs.
    """

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self._tables = np.zeros((64, 64), dtype=np.int64)
        # the block table of each row of _tables as the last decode step wrote it (row r holds _table_rows[r],
        # then zeros); [] once anything else wrote _tables
        self._table_rows: list[list[int]] = []

    def build(self, out: SchedulerOutput) -> ForwardBatch:
        """Flatten the scheduled chunks of every sequence (at least one) into one batch.

        Returns:
            The batch; ``logits_indices`` has one row per sequence whose chunk samples a token, in scheduled
            order.
        """
        if out.all_decode:
            return self._build_decode(out)
        scheduled = out.scheduled
        num_seqs = len(scheduled)
        starts_list: list[int] = []
        counts_list: list[int] = []
        samples_list: list[bool] = []
        tables_list: list[list[int]] = []
        decode_seqs: list[bool] = []  # per sequence: one generated token (a decode step)
        input_ids: list[int] = []
        for item in scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            n = item.num_new_tokens
            starts_list.append(start)
            counts_list.append(n)
            samples_list.append(item.sample)
            tables_list.append(item.block_ids)
            prompt = seq.prompt_token_ids
            num_prompt = len(prompt)
            if start >= num_prompt:
                if n == 1:
                    input_ids.append(seq.output_token_ids[start - num_prompt])
                else:
                    input_ids.extend(seq.output_token_ids[start - num_prompt : start - num_prompt + n])
                decode_seqs.append(n == 1)
            elif start + n <= num_prompt:
                input_ids.extend(prompt[start : start + n])
                decode_seqs.append(False)
            else:
                input_ids.extend(prompt[start:])
                input_ids.extend(seq.output_token_ids[: start + n - num_prompt])
                decode_seqs.append(False)
        starts = np.array(starts_list, dtype=np.int64)
        counts = np.array(counts_list, dtype=np.int64)
        samples = np.array(samples_list, dtype=bool)
        tables = self._fill_tables(tables_list)
        ends = starts + counts
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        num_tokens = int(qsl[-1])
        if num_tokens == num_seqs:  # decode only: one token per sequence
            seq_of_token = np.arange(num_seqs)
            positions = starts
        else:
            seq_of_token = np.repeat(np.arange(num_seqs), counts)
            positions = np.arange(num_tokens) - np.repeat(qsl[:-1] - starts, counts)
        slots = tables[seq_of_token, positions // self.block_size] * self.block_size + positions % self.block_size
        logits_indices = (qsl[1:] - 1)[samples]
        device = self.device

        def as_tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values)).to(device=device, dtype=dtype, non_blocking=True)

        seq_lens = ends.tolist()
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True),
            positions=as_tensor(positions, torch.int64),
            slot_mapping=as_tensor(slots, torch.int64),
            query_start_loc=qsl.tolist(),
            seq_lens=seq_lens,
            block_tables=as_tensor(tables, torch.int32),
            context_lens=as_tensor(ends, torch.int32),
            logits_indices=as_tensor(logits_indices, torch.int64),
            max_seq_len=max(seq_lens),
            is_decode_only=all(decode_seqs),
            decode_seqs=decode_seqs,
        )

    def _build_decode(self, out: SchedulerOutput) -> ForwardBatch:
        """:meth:`build` of a step whose every chunk is one generated token (``out.all_decode``): the same batch,
        without the per-sequence chunk logic; the block tables rewrite only the rows that changed since the last
        decode step."""
        scheduled = out.scheduled
        num_seqs = len(scheduled)
        seqs = [item.seq for item in scheduled]
        input_ids = np.fromiter([seq.output_token_ids[-1] for seq in seqs], dtype=np.int64, count=num_seqs)
        starts = np.fromiter([seq.num_computed_tokens for seq in seqs], dtype=np.int64, count=num_seqs)
        tables = self.decode_tables([item.block_ids for item in scheduled])
        block_size = self.block_size
        rows = np.arange(num_seqs, dtype=np.int64)
        block_idx, offsets = np.divmod(starts, block_size)
        slots = tables[rows, block_idx] * block_size + offsets
        ends = starts + 1
        device = self.device
        seq_lens = ends.tolist()
        return ForwardBatch(
            input_ids=torch.from_numpy(input_ids).to(device, non_blocking=True),
            positions=torch.from_numpy(starts).to(device, non_blocking=True),
            slot_mapping=torch.from_numpy(slots).to(device, non_blocking=True),
            query_start_loc=list(range(num_seqs + 1)),
            seq_lens=seq_lens,
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(device, non_blocking=True),
            context_lens=torch.from_numpy(ends.astype(np.int32)).to(device, non_blocking=True),
            logits_indices=torch.from_numpy(rows).to(device, non_blocking=True),
            max_seq_len=max(seq_lens),
            is_decode_only=True,
            decode_seqs=[True] * num_seqs,
        )

    def decode_tables(self, tables_list: list[list[int]]) -> np.ndarray:
        """The block tables ``[num_seqs, max_blocks]`` int64 of a decode step, 0-padded (a view of the reused
        buffer, valid until the next call): :meth:`_fill_tables`, rewriting only the rows whose table differs from
        the one the last decode step wrote there (between two decode steps most sequences keep their table)."""
        rows = self._table_rows
        num_seqs = len(tables_list)
        if len(rows) < num_seqs or self._tables.shape[0] < num_seqs:
            return self._fill_tables(tables_list, remember=True)
        max_blocks = max(map(len, tables_list))
        if self._tables.shape[1] < max_blocks:
            return self._fill_tables(tables_list, remember=True)
        if rows[:num_seqs] != tables_list:
            changed = list(itertools.compress(range(num_seqs), map(operator.ne, rows, tables_list)))
            if 8 * len(changed) > num_seqs:  # many rows: one vectorised fill is cheaper
                return self._fill_tables(tables_list, remember=True)
            for r in changed:
                table = tables_list[r]
                row = self._tables[r]
                row[len(table):] = 0
                row[:len(table)] = table
                rows[r] = list(table)
        return self._tables[:num_seqs, :max_blocks]

    def _fill_tables(self, tables_list: list[list[int]], remember: bool = False) -> np.ndarray:
        """Return the block tables ``[num_seqs, max_blocks]`` int64 (a view of the reused buffer), 0-padded.

        With ``remember``, the whole buffer beyond the tables is zeroed and :meth:`decode_tables` may reuse the
        rows in the next decode step; without, it may not.
        """
        num_seqs = len(tables_list)
        lengths = np.fromiter(map(len, tables_list), dtype=np.int64, count=num_seqs)
        max_blocks = int(lengths.max())
        if self._tables.shape[0] < num_seqs or self._tables.shape[1] < max_blocks:
            self._tables = np.zeros((max(num_seqs, self._tables.shape[0]), max(max_blocks, self._tables.shape[1])),
                                    dtype=np.int64)
        if remember:
            self._tables.fill(0)
            self._table_rows = [list(table) for table in tables_list]  # copies: a caller may change its lists
        else:
            self._table_rows = []
        tables = self._tables[:num_seqs, :max_blocks]
        tables.fill(0)
        flat = np.fromiter(itertools.chain.from_iterable(tables_list), dtype=np.int64, count=int(lengths.sum()))
        row_starts = np.cumsum(lengths) - lengths
        rows = np.repeat(np.arange(num_seqs), lengths)
        tables[rows, np.arange(flat.shape[0]) - np.repeat(row_starts, lengths)] = flat
        return tables


def build_forward_batch(out: SchedulerOutput, block_size: int, device: torch.device) -> ForwardBatch:
    """Flatten the scheduled chunks of every sequence into one batch (see :class:`BatchBuilder`)."""
    return BatchBuilder(block_size, device).build(out)


class KVBlockIO:
    """Copy one KV block between the device pool and a flat byte buffer on the host (offload, reload, swap).

    A block is the slice ``kv_cache[:, :, block_id]``: ``[num_layers, 2, num_kv_heads, block_size, head_dim]`` of
    every layer's K and V, strided in the pool. On the host it is ``[block_bytes] uint8`` (the same elements,
    contiguous, in the pool's dtype, as bytes), so the tiers below never depend on the dtype or the model::

        pool [L, 2, N, H, B, D] ──read_block(b)──▶ host [L·2·H·B·D · itemsize] uint8 ──write_block(b)──▶ pool

    Args:
        kv_cache: the pool ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``, CPU or CUDA.
    """

    def __init__(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.dim() != 6:
            raise ValueError(f"kv_cache must be [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim], "
                             f"got shape {tuple(kv_cache.shape)}")
        num_layers, two, _, num_kv_heads, block_size, head_dim = kv_cache.shape
        self.kv_cache = kv_cache
        self.block_shape = (num_layers, two, num_kv_heads, block_size, head_dim)
        self.block_bytes = num_layers * two * num_kv_heads * block_size * head_dim * kv_cache.element_size()
        self.pin_memory = kv_cache.is_cuda
        self._staging = torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    def read_block(self, block_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy pool block ``block_id`` into ``out`` (``[block_bytes] uint8``, CPU) and return it.

        Without ``out`` the copy lands in one staging buffer, valid until the next call. Synchronous: the bytes
        are on the host when it returns.
        """
        out = self._staging if out is None else out
        out.view(self.kv_cache.dtype).view(self.block_shape).copy_(self.kv_cache[:, :, block_id])
        return out

    def read_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy pool blocks ``block_ids`` into ``[len(block_ids), block_bytes] uint8`` CPU rows, row i = block
        ``block_ids[i]``, in one copy (one kernel however many blocks). Synchronous, like :meth:`read_block`.

        Args:
            block_ids: pool block ids.
            out: ``[num_rows >= len(block_ids), block_bytes] uint8``, CPU, contiguous: the rows are its first ones
                (a buffer kept across calls spares the page faults of fresh memory); None = a new tensor.

        Returns:
            ``out[:len(block_ids)]``, or the new tensor.
        """
        if out is None:
            out = torch.empty((len(block_ids), self.block_bytes), dtype=torch.uint8, pin_memory=self.pin_memory)
        elif out.dim() != 2 or out.shape[0] < len(block_ids) or out.shape[1] != self.block_bytes \
                or out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError(f"out must be [>= {len(block_ids)}, {self.block_bytes}] uint8 contiguous, "
                             f"got {tuple(out.shape)} {out.dtype}")
        out = out[:len(block_ids)]
        if block_ids:
            rows = out.view(self.kv_cache.dtype).view(len(block_ids), *self.block_shape)
            blocks = [self.kv_cache[:, :, block_id] for block_id in block_ids]
            if self.kv_cache.is_cuda:
                rows.copy_(torch.stack(blocks, dim=0))  # gathered on the device, one transfer
            else:
                torch.stack(blocks, dim=0, out=rows)
        return out

    def copy_block_prefix(self, src_block_id: int, dst_block_id: int, num_tokens: int) -> None:
        """Copy the K/V rows of tokens ``0 .. num_tokens - 1`` of pool block ``src_block_id`` into the same rows of
        ``dst_block_id``, every layer, K and V: ``kv_cache[:, :, dst, :, :num_tokens] = kv_cache[:, :, src, :,
        :num_tokens]``, on the pool's device (partial-block prefix reuse)."""
        if not 0 < num_tokens <= self.block_shape[3]:
            raise ValueError(f"num_tokens must be in 1..{self.block_shape[3]}, got {num_tokens}")
        self.kv_cache[:, :, dst_block_id, :, :num_tokens].copy_(self.kv_cache[:, :, src_block_id, :, :num_tokens])

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """Copy ``data`` (``[block_bytes] uint8``, CPU, from :meth:`read_block`) into pool block ``block_id``."""
        if data.numel() != self.block_bytes:
            raise ValueError(f"block data has {data.numel()} bytes, a block has {self.block_bytes}")
        self.kv_cache[:, :, block_id].copy_(data.view(self.kv_cache.dtype).view(self.block_shape))


class ModelRunner:
    """Run one scheduled step on a model and sample the next token of each sequence that samples.

    Args:
        model: a :class:`worker.model.LlamaModel` (or anything with its ``forward(batch, kv_cache)``).
        kv_cache: ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]`` on the model's device.
        block_size: tokens per KV block.
        device: the model's device.
        decode_graphs: when set, decode-only steps run through it (:class:`worker.cuda_graphs.DecodeGraphs`: CUDA
            graphs per batch-size bucket); other steps run the model eagerly.

    Decode steps go through :class:`worker.graph_decoder.GraphDecoder` (:attr:`graph_decoder`) where graphs are
    given: in a steady batch a greedy step there launches the next one before reading its own tokens, so the host's
    work between steps hides behind the GPU's.
    """

    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, device: torch.device,
                 decode_graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.decode_graphs = decode_graphs
        self.sampler = Sampler()
        self.block_io = KVBlockIO(kv_cache)
        self.batch_builder = BatchBuilder(block_size, device)
        self.step_logprobs: dict[str, TokenLogprobs] = {}
        self._plan = _SamplingPlan([])
        self.graph_decoder = (GraphDecoder(decode_graphs, self.batch_builder.decode_tables)
                              if decode_graphs is not None else None)

    def run(self, out: SchedulerOutput, should_stop: Callable[[], bool] | None = None) -> dict[str, int]:
        """Execute ``out`` and return ``{request_id: sampled token id}`` for the sequences that sample.

        The sequences that asked for log-probabilities find them in :attr:`step_logprobs` until the next call.

        Args:
            out: the scheduled step.
            should_stop: passed to the model's forward (asked between layers).

        Raises:
            StepAbandoned: ``should_stop`` said so.
        """
        self.step_logprobs = {}
        decoder = self.graph_decoder
        logits = None
        if decoder is not None:
            if out.all_decode:
                with torch.inference_mode():
                    logits = decoder.forward(out)
            if logits is None:
                decoder.reset()
        from_graph = logits is not None
        if logits is None:
            batch = self.batch_builder.build(out)
            sampling = out.scheduled if out.all_decode else [item for item in out.scheduled if item.sample]
            if not sampling:
                with torch.inference_mode():
                    self.model.forward(batch, self.kv_cache, should_stop)
                return {}
            with torch.inference_mode():
                logits = self.model.forward(batch, self.kv_cache, should_stop)
        else:
            sampling = out.scheduled
        seqs = [item.seq for item in sampling]
        plan = self._plan
        if plan.seqs != seqs:  # Sequence compares by identity
            plan = self._plan = _SamplingPlan(seqs)
        if plan.all_greedy and from_graph:
            token_ids = decoder.sample_greedy(logits, launch_ahead=not plan.logprob_rows)
        elif plan.all_greedy and logits.shape[0] == len(seqs):
            token_ids = self.sampler.greedy(logits)  # what sample() returns, without its per-row checks
        else:
            output_lens = [len(seq.output_token_ids) for seq in seqs]
            token_ids = self.sampler.sample(logits, plan.params, plan.seeds, output_lens)
        rows = plan.logprob_rows
        if rows:
            picked = logits if len(rows) == len(sampling) else logits[rows]
            found = token_logprobs(picked, [token_ids[r] for r in rows], [seqs[r].sampling.top_logprobs for r in rows])
            self.step_logprobs = {seqs[r].request_id: lp for r, lp in zip(rows, found)}
        if from_graph:
            decoder.step_done()
        return dict(zip(plan.request_ids, token_ids))


class _SamplingPlan:
    """What the sampler needs of a step's sampling sequences that does not change while the same sequences, in the
    same order, sample step after step (a run of decode steps): kept by :class:`ModelRunner` across steps.

    Attributes:
        seqs: the sequences, in the order of the logits rows.
        params, seeds, request_ids: of each row.
        all_greedy: every row is greedy (``temperature == 0``).
        logprob_rows: the rows whose request asks for log-probabilities.
    """

    def __init__(self, seqs: list[Sequence]) -> None:
        self.seqs = seqs
        self.params = [seq.sampling for seq in seqs]
        self.seeds = [seq.seed for seq in seqs]
        self.request_ids = [seq.request_id for seq in seqs]
        self.all_greedy = bool(seqs) and all(p.temperature == 0 for p in self.params)
        self.logprob_rows = [r for r, p in enumerate(self.params) if p.logprobs]
