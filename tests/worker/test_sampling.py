"""The sampler: greedy, temperature, top-k, top-p, and reproducibility per (seed, output position)."""

from __future__ import annotations

import pytest
import torch

from shared.protocol import SamplingParams
from worker.sampling import Sampler, token_logprobs, uniform_for, uniforms_for

GREEDY = SamplingParams(temperature=0.0)


def _logits(num_rows: int, vocab_size: int = 50, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=gen) * 3


def test_greedy_rows_are_argmax():
    logits = _logits(7)
    tokens = Sampler().sample(logits, [GREEDY] * 7, [0] * 7, [0] * 7)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_same_seed_and_position_give_same_token_whatever_the_batch():
    logits = _logits(4, vocab_size=1000)
    params = [SamplingParams(temperature=1.0), GREEDY, SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.3, top_k=40)]
    seeds = [11, 12, 13, 2**63 - 1]
    positions = [0, 5, 9, 100]
    sampler = Sampler()
    batched = sampler.sample(logits, params, seeds, positions)
    alone = [sampler.sample(logits[r : r + 1], [params[r]], [seeds[r]], [positions[r]])[0] for r in range(4)]
    reordered = sampler.sample(logits.flip(0), params[::-1], seeds[::-1], positions[::-1])[::-1]
    assert batched == alone == reordered
    assert batched == sampler.sample(logits, params, seeds, positions)  # and again: a recompute


def test_draws_differ_across_positions_and_seeds():
    draws = {uniform_for(seed, pos) for seed in range(20) for pos in range(20)}
    assert len(draws) == 400 and all(0.0 <= u < 1.0 for u in draws)
    flat = torch.zeros(1, 1000)  # uniform distribution over 1000 tokens
    tokens = [Sampler().sample(flat, [SamplingParams(temperature=1.0)], [42], [pos])[0] for pos in range(50)]
    assert len(set(tokens)) > 40


def test_empirical_distribution_follows_softmax_with_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    temperature = 0.8
    want = torch.softmax(logits[0] / temperature, dim=-1)
    num_draws = 4000
    params = [SamplingParams(temperature=temperature)] * num_draws
    tokens = Sampler().sample(logits.expand(num_draws, -1), params, list(range(num_draws)), [3] * num_draws)
    freq = torch.bincount(torch.tensor(tokens), minlength=5).double() / num_draws
    # 4 standard errors of a binomial proportion (p(1-p)/n <= 1/(4n)): 0.032
    assert (freq - want.double()).abs().max().item() < 0.032
    assert freq[4] == 0


def test_top_k_keeps_only_the_k_most_likely_tokens():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0, 2.0]])
    params = [SamplingParams(temperature=5.0, top_k=2)] * 500
    tokens = Sampler().sample(logits.expand(500, -1), params, list(range(500)), [0] * 500)
    assert set(tokens) == {1, 3}
    top1 = Sampler().sample(logits, [SamplingParams(temperature=1.0, top_k=1)], [9], [0])
    assert top1 == [1]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # mass before token 2 is 0.8 < 0.85, so tokens 0, 1, 2 are kept and token 3 is dropped.
    params = [SamplingParams(temperature=1.0, top_p=0.85)] * 2000
    tokens = Sampler().sample(logits.expand(2000, -1), params, list(range(2000)), [1] * 2000)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).double() / 2000
    assert freq[3] == 0 and freq[2] > 0
    want = torch.tensor([0.5, 0.3, 0.15]) / 0.95
    assert (freq[:3] - want.double()).abs().max().item() < 0.045  # 4 standard errors
    tiny_p = Sampler().sample(logits, [SamplingParams(temperature=1.0, top_p=0.01)], [5], [0])
    assert tiny_p == [0]


def test_mismatched_lengths_and_negative_temperature_raise():
    with pytest.raises(ValueError):
        Sampler().sample(_logits(2), [GREEDY], [0, 1], [0, 0])
    with pytest.raises(ValueError):
        Sampler().sample(_logits(1), [SamplingParams(temperature=-1.0)], [0], [0])


def test_logprobs_are_the_raw_log_softmax_whatever_the_temperature():
    logits = _logits(3, vocab_size=200)
    params = [GREEDY, SamplingParams(temperature=1.7, top_k=5, logprobs=True), SamplingParams(temperature=0.3)]
    tokens = Sampler().sample(logits, params, [1, 2, 3], [0, 0, 0])
    found = token_logprobs(logits, tokens, [0, 4, 20])
    expected = torch.log_softmax(logits, dim=-1)
    for row, (token, item) in enumerate(zip(tokens, found)):
        assert item.logprob == pytest.approx(expected[row, token].item(), abs=1e-6) and item.logprob <= 0
        top = expected[row].topk(len(item.top_token_ids))
        assert item.top_token_ids == top.indices.tolist()
        assert item.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert [len(item.top_token_ids) for item in found] == [0, 4, 20]
    assert found[0].logprob == pytest.approx(expected[0].max().item())  # greedy: the most likely token
    with pytest.raises(ValueError):
        token_logprobs(logits, tokens, [0, 0, 21])


def test_the_vectorised_draws_equal_the_scalar_draws_bit_for_bit():
    seeds = [0, 1, -5, 2**63 - 1, 2**64 - 1, 2**70 + 3, 123456789]
    positions = [0, 1, 7, 2**40, 5, 99, 2**64 + 1]
    assert uniforms_for(seeds, positions) == [uniform_for(s, p) for s, p in zip(seeds, positions)]
