"""Pick the next token of each sampling sequence: greedy, temperature, top-k, top-p; reproducible per position.

Randomness is counter-based: the uniform draw of a request at output position ``i`` is
``SplitMix64(seed, i)`` (Steele et al., "Fast splittable pseudorandom number generators", OOPSLA 2014), so the
token depends only on (logits, params, seed, i). A request preempted and recomputed samples the same tokens, and
the draw does not depend on which other requests share the batch or on the device.

Sampling is inverse-CDF over the filtered distribution, sorted by descending probability::

    logits / T -> sort desc -> drop ranks >= top_k -> softmax -> drop tokens after cumulative mass top_p
              -> renormalise -> first rank whose cumulative mass exceeds u * total
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.protocol import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """Return the SplitMix64 finaliser of ``x`` (64-bit)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, output_pos: int) -> float:
    """Return the uniform draw in ``[0, 1)`` of request ``seed`` at output position ``output_pos`` (53-bit)."""
    x = _splitmix64((seed & _MASK64) ^ _splitmix64(output_pos & _MASK64))
    return (x >> 11) * (1.0 / (1 << 53))


_NUMPY_ARGMAX_DTYPES = (torch.float32, torch.float64)  # CPU logits whose greedy pick numpy computes

MAX_TOP_LOGPROBS = 20  # the most alternatives per position a request may ask for (OpenAI's chat limit)


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probabilities at one output position.

    Attributes:
        logprob: natural log of the sampled token's probability under the model's raw distribution, ``<= 0``.
        top_token_ids: the ``k`` most likely token ids, most likely first (``k`` = the request's ``top_logprobs``).
        top_logprobs: their log-probabilities, same order.
    """

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_ks: list[int]) -> list[TokenLogprobs]:
    """Return the log-probabilities of the sampled tokens and their top-k alternatives, one row each.

    The distribution is the model's raw one: ``log_softmax(logits)`` before temperature, top-k and top-p, as vLLM
    reports by default (``logprobs_mode = "raw_logprobs"``), so the numbers describe the model, not the sampler,
    and a greedy and a sampled request of the same prompt report the same values.

    Args:
        logits: ``[num_rows, vocab_size]`` float, any device.
        token_ids: the sampled token of each row.
        top_ks: alternatives wanted per row, each in ``[0, MAX_TOP_LOGPROBS]``.

    Returns:
        One :class:`TokenLogprobs` per row (one device → host copy for the whole batch).

    Raises:
        ValueError: lists whose lengths differ from the number of rows, or a ``top_k`` out of range.
    """
    num_rows = logits.shape[0]
    if not (len(token_ids) == len(top_ks) == num_rows):
        raise ValueError(f"{num_rows} logit rows but {len(token_ids)} tokens and {len(top_ks)} top-k values")
    if any(k < 0 or k > MAX_TOP_LOGPROBS for k in top_ks):
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_ks}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device)[:, None]).squeeze(1).tolist()
    max_k = max(top_ks, default=0)
    top_values: list[list[float]] = [[] for _ in range(num_rows)]
    top_ids: list[list[int]] = [[] for _ in range(num_rows)]
    if max_k > 0:
        top = logprobs.topk(max_k, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [TokenLogprobs(chosen[r], top_ids[r][:top_ks[r]], top_values[r][:top_ks[r]]) for r in range(num_rows)]


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`_splitmix64` of every element of ``x`` (uint64; numpy's array arithmetic wraps modulo 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms_for(seeds: list[int], output_positions: list[int]) -> list[float]:
    """Return :func:`uniform_for` of each ``(seed, output position)`` pair, computed for all rows at once."""
    seed_bits = np.array([seed & _MASK64 for seed in seeds], dtype=np.uint64)
    position_bits = np.array([pos & _MASK64 for pos in output_positions], dtype=np.uint64)
    x = _splitmix64_array(seed_bits ^ _splitmix64_array(position_bits))
    return ((x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))).tolist()


class Sampler:
    """Choose one token per row of logits, greedy rows vectorised, sampled rows vectorised."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int],
        output_lens: list[int],
    ) -> list[int]:
        """Sample the next token of each row.

        Args:
            logits: ``[num_seqs, vocab_size]`` float32, any device.
            params: sampling settings per row (``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p >= 1``
                are off).
            seeds: the request's seed per row (any int; taken modulo 2**64).
            output_lens: tokens the request has produced so far, i.e. the output position being sampled.

        Returns:
            One token id per row.

        Raises:
            ValueError: lists whose lengths differ from the number of rows, or a negative temperature.
        """
        num_rows = logits.shape[0]
        if not (len(params) == len(seeds) == len(output_lens) == num_rows):
            raise ValueError(
                f"{num_rows} logit rows but {len(params)} params, {len(seeds)} seeds, {len(output_lens)} lengths"
            )
        greedy_rows = [r for r, p in enumerate(params) if p.temperature == 0]
        if greedy_rows and len(greedy_rows) == num_rows:
            return self.greedy(logits)
        tokens = [0] * num_rows
        random_rows = [r for r, p in enumerate(params) if p.temperature != 0]
        if greedy_rows:
            for r, token in zip(greedy_rows, self.greedy(logits[greedy_rows])):
                tokens[r] = token
        if random_rows and not greedy_rows:  # every row samples: no subsets to gather
            return self._sample_random(logits, params, uniforms_for(seeds, output_lens))
        if random_rows:
            picked = self._sample_random(
                logits[random_rows],
                [params[r] for r in random_rows],
                uniforms_for([seeds[r] for r in random_rows], [output_lens[r] for r in random_rows]),
            )
            for r, token in zip(random_rows, picked):
                tokens[r] = token
        return tokens

    @staticmethod
    def greedy(logits: torch.Tensor) -> list[int]:
        """Return the first maximal column of each row of ``logits [num_rows, vocab_size]`` (a NaN counts as the
        maximum), one token id per row: what :meth:`sample` returns when every row is greedy.

        A CPU float32/float64 tensor goes through numpy's ``argmax`` (SIMD; about 10x faster than torch's
        ``max(dim)`` on [256, 1024] float32, one thread, torch 2.13); other dtypes and devices use
        ``max(dim).indices``, itself several times faster than torch's ``argmax`` on the CPU. Both pick the same
        index.
        """
        if (logits.device.type == "cpu" and logits.dtype in _NUMPY_ARGMAX_DTYPES and not logits.requires_grad
                and not logits.is_neg()):
            return logits.numpy().argmax(axis=-1).tolist()
        return logits.max(dim=-1).indices.tolist()

    @staticmethod
    def _sample_random(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> list[int]:
        """Sample rows ``logits [n, vocab] f32`` with their temperature/top-k/top-p and draws ``u in [0, 1)``."""
        if any(p.temperature < 0 for p in params):
            raise ValueError("temperature must be >= 0")
        device = logits.device
        vocab_size = logits.shape[1]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        scaled = logits.float() / temperature[:, None]
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        if min(top_k) < vocab_size:
            ranks = torch.arange(vocab_size, device=device)
            keep_k = ranks[None, :] < torch.tensor(top_k, device=device)[:, None]
            sorted_logits = sorted_logits.masked_fill(~keep_k, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
            mass_before = probs.cumsum(dim=-1).sub_(probs)
            # The most likely token is always kept (its mass_before is 0), also for top_p <= 0.
            drop = mass_before >= top_p[:, None]
            drop[:, 0] = False
            probs = torch.where(drop, 0.0, probs)  # masked_fill(drop, 0.0), faster on the CPU
        cumulative = probs.cumsum(dim=-1)
        target = torch.tensor(uniforms, dtype=torch.float32, device=device) * cumulative[:, -1]
        rank = torch.searchsorted(cumulative, target[:, None], right=True).clamp_(max=vocab_size - 1)
        # Kept ranks are a prefix (top-k, top-p and softmax underflow all drop a tail); float rounding can land
        # past it, so clamp to the last kept rank.
        last_kept = (probs > 0).sum(dim=-1, keepdim=True, dtype=torch.int32) - 1  # int32: a faster sum of bools
        rank = torch.minimum(rank, last_kept)
        return sorted_ids.gather(1, rank).squeeze(1).tolist()
