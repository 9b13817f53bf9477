"""What the model consumes each step: all scheduled tokens of all sequences, flattened.

::

    seq 0: positions [c0, c0+n0)   seq 1: positions [c1, c1+n1)   ...
    input_ids       = [seq0 chunk | seq1 chunk | ...]            num_tokens = n0 + n1 + ...
    query_start_loc = [0, n0, n0+n1, ...]                        seq s owns tokens [qsl[s], qsl[s+1])
    seq_lens        = [c0+n0, c1+n1, ...]                        context INCLUDING this step's tokens
    slot of token t of seq s = block_tables[s, t // block_size] * block_size + t % block_size
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One model step over the paged KV pool.

    Attributes:
        input_ids: ``[num_tokens]`` int64, device — scheduled tokens of all sequences, sequence after sequence.
        positions: ``[num_tokens]`` int64, device — absolute position of each token in its sequence.
        slot_mapping: ``[num_tokens]`` int64, device — flat slot (``block_id * block_size + offset``) where the
            token's K/V is written.
        query_start_loc: ``num_seqs + 1`` host ints — sequence ``s`` owns tokens ``[qsl[s], qsl[s+1])``.
        seq_lens: ``num_seqs`` host ints — context length of sequence ``s`` in tokens, including this step's.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32, device — block ids in sequence order, padded
            with 0.
        context_lens: ``[num_seqs]`` int32, device — equal to ``seq_lens``.
        logits_indices: ``[num_logits]`` int64, device — rows of the flattened tokens whose logits are wanted
            (the last token of each sequence that samples this step).
        max_seq_len: ``max(seq_lens)`` in tokens.
        is_decode_only: every sequence is a decode step (``all(decode_seqs)``).
        decode_seqs: ``num_seqs`` host bools — sequence ``s``'s chunk is one generated token (a decode step); a
            one-token chunk of a prompt (the rest of a prompt whose prefix was cached) is a prefill chunk, so a
            prompt token takes the same kernels whether or not its prefix was cached.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    logits_indices: torch.Tensor
    max_seq_len: int
    is_decode_only: bool
    decode_seqs: list[bool]

    @property
    def num_tokens(self) -> int:
        """Scheduled tokens in this step, all sequences together."""
        return self.query_start_loc[-1]

    @property
    def num_seqs(self) -> int:
        """Sequences in this step."""
        return len(self.seq_lens)

    @classmethod
    def build(
        cls,
        chunks: list[list[int]],
        num_computed_tokens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        sample: list[bool] | None = None,
        device: torch.device | str = "cpu",
        decode: list[bool] | None = None,
    ) -> ForwardBatch:
        """Build a batch from host lists, one entry per sequence.

        Args:
            chunks: token ids scheduled this step for each sequence (``n_s >= 1`` each).
            num_computed_tokens: tokens of each sequence already in the KV pool (the chunk starts there).
            block_tables: block ids of each sequence, covering at least ``num_computed + n_s`` tokens.
            block_size: tokens per KV block.
            sample: whether each sequence wants logits for its last token (default: all do).
            device: where the tensors go.
            decode: whether each chunk is a decode step (default: the one-token chunks are).

        Returns:
            The batch.

        Raises:
            ValueError: lists of different lengths, an empty chunk, or a block table too short for its tokens.
        """
        num_seqs = len(chunks)
        if num_seqs == 0 or not (len(num_computed_tokens) == len(block_tables) == num_seqs):
            raise ValueError("chunks, num_computed_tokens and block_tables need one entry per sequence (>= 1)")
        sample = [True] * num_seqs if sample is None else sample
        decode = [len(c) == 1 for c in chunks] if decode is None else decode
        if any(d and len(c) != 1 for d, c in zip(decode, chunks)):
            raise ValueError("a decode chunk has exactly one token")
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for chunk, start, table, wants_logits in zip(chunks, num_computed_tokens, block_tables, sample):
            end = start + len(chunk)
            if not chunk or len(table) * block_size < end:
                raise ValueError(f"empty chunk or block table of {len(table)} blocks too short for {end} tokens")
            input_ids.extend(chunk)
            positions.extend(range(start, end))
            slot_mapping.extend(table[t // block_size] * block_size + t % block_size for t in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            if wants_logits:
                logits_indices.append(len(input_ids) - 1)
        max_blocks = max(len(t) for t in block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        return cls(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            context_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
            max_seq_len=max(seq_lens),
            is_decode_only=all(decode),
            decode_seqs=list(decode),
        )
