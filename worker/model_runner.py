"""Turn a scheduler decision into the model's :class:`~worker.batch.ForwardBatch`, run it, sample.

The one place where scheduler metadata (sequences, block ids) meets tensors.
"""

from __future__ import annotations

import torch

from worker.batch import ForwardBatch
from worker.sampling import Sampler
from worker.scheduler import SchedulerOutput


def build_forward_batch(out: SchedulerOutput, block_size: int, device: torch.device) -> ForwardBatch:
    """Flatten the scheduled chunks of every sequence into one batch.

    Token ``t`` of a sequence lives in slot ``block_ids[t // block_size] * block_size + t % block_size``::

        seq 0: tokens [c0, c0+n0)   seq 1: tokens [c1, c1+n1)   ...
        input_ids = [seq0 chunk | seq1 chunk | ...]    query_start_loc = [0, n0, n0+n1, ...]

    Args:
        out: the scheduler's decision for this step (at least one scheduled sequence).
        block_size: tokens per KV block.
        device: where the model runs.

    Returns:
        The batch; ``logits_indices`` has one row per sequence whose chunk samples a token, in scheduled order.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    tables: list[list[int]] = []
    for item in out.scheduled:
        seq = item.seq
        start = seq.num_computed_tokens
        end = start + item.num_new_tokens
        token_ids = seq.all_token_ids
        input_ids.extend(token_ids[start:end])
        positions.extend(range(start, end))
        block_ids = item.block_ids
        slot_mapping.extend(block_ids[t // block_size] * block_size + t % block_size for t in range(start, end))
        query_start_loc.append(len(input_ids))
        seq_lens.append(end)
        tables.append(block_ids)
        if item.sample:
            logits_indices.append(len(input_ids) - 1)
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]

    def as_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return ForwardBatch(
        input_ids=as_tensor(input_ids, torch.int64),
        positions=as_tensor(positions, torch.int64),
        slot_mapping=as_tensor(slot_mapping, torch.int64),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=as_tensor(padded, torch.int32),
        context_lens=as_tensor(seq_lens, torch.int32),
        logits_indices=as_tensor(logits_indices, torch.int64),
        max_seq_len=max(seq_lens),
        is_decode_only=all(item.num_new_tokens == 1 for item in out.scheduled),
    )


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

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy pool blocks ``block_ids`` into a new ``[len(block_ids), block_bytes] uint8`` CPU tensor, row i =
        block ``block_ids[i]``, in one copy (one kernel however many blocks). Synchronous, like :meth:`read_block`.
        """
        out = torch.empty((len(block_ids), self.block_bytes), dtype=torch.uint8, pin_memory=self.pin_memory)
        if block_ids:
            rows = out.view(self.kv_cache.dtype).view(len(block_ids), *self.block_shape)
            blocks = [self.kv_cache[:, :, block_id] for block_id in block_ids]
            if self.kv_cache.is_cuda:
                rows.copy_(torch.stack(blocks, dim=0))  # gathered on the device, one transfer
            else:
                torch.stack(blocks, dim=0, out=rows)
        return out

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
    """

    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.block_io = KVBlockIO(kv_cache)

    def run(self, out: SchedulerOutput) -> dict[str, int]:
        """Execute ``out`` and return ``{request_id: sampled token id}`` for the sequences that sample."""
        batch = build_forward_batch(out, self.block_size, self.device)
        sampling = [item for item in out.scheduled if item.sample]
        if not sampling:
            with torch.inference_mode():
                self.model.forward(batch, self.kv_cache)
            return {}
        with torch.inference_mode():
            logits = self.model.forward(batch, self.kv_cache)
        token_ids = self.sampler.sample(
            logits,
            [item.seq.sampling for item in sampling],
            [item.seq.seed for item in sampling],
            [len(item.seq.output_token_ids) for item in sampling],
        )
        return {item.seq.request_id: token for item, token in zip(sampling, token_ids)}
