"""The decode step's fast paths make the same decisions as the general code they shortcut.

``Scheduler.schedule`` ends after its decode pass when the prefill pass has nothing to do, reuses the sorted running
list and the block-table copies between steps; ``BatchBuilder`` builds an ``all_decode`` step without the chunk
logic and rewrites only the block-table rows that changed; ``ModelRunner`` keeps the sampling parameters of an
unchanged batch; ``Sampler.greedy`` takes numpy's argmax on the CPU. Each is checked against the general path.
"""

from __future__ import annotations

import random

import torch

from shared.protocol import SamplingParams
from worker.kv_cache.manager import KVCacheManager
from worker.model_runner import BatchBuilder, ModelRunner
from worker.sampling import Sampler
from worker.scheduler import Scheduler, SchedulerOutput, _Step
from worker.sequence import Sequence

BS = 4


class GeneralScheduler(Scheduler):
    """The scheduler without its shortcuts: the decode pass and the prefill pass of every step, order re-sorted."""

    def schedule(self) -> SchedulerOutput:
        step = _Step(budget_tokens=self.max_num_batched_tokens)
        order = sorted(self.running, key=self._queue_key)
        self._schedule_running(step, order, decode=True)
        return self._prefill_pass(step, order)


def _token(history: list[int]) -> int:
    return 3 + hash(tuple(history)) % 50


def test_schedule_makes_the_general_decisions_through_preemptions_admissions_and_finishes():
    rng = random.Random(7)
    for trial in range(12):
        num_blocks = rng.choice([12, 24, 64])
        budget = rng.choice([3, 8, 64])
        fast = Scheduler(KVCacheManager(num_blocks, BS), 6, budget, 64)
        general = GeneralScheduler(KVCacheManager(num_blocks, BS), 6, budget, 64)
        num_fast_decode_steps = 0
        for step_idx in range(300):
            if rng.random() < 0.15:
                prompt = [rng.randrange(3, 60) for _ in range(rng.randrange(1, 20))]
                kwargs = dict(max_tokens=rng.randrange(1, 30), tier_priority=rng.randrange(2),
                              arrival_s=float(step_idx), stop_token_ids={2})
                fast.add(Sequence(f"r{step_idx}", list(prompt), **kwargs))
                general.add(Sequence(f"r{step_idx}", list(prompt), **kwargs))
            if fast.running and rng.random() < 0.02:
                victim = rng.choice(fast.running).request_id
                assert fast.abort(victim) == general.abort(victim)
            out, ref = fast.schedule(), general.schedule()
            plan = [(i.seq.request_id, i.num_new_tokens, i.block_ids, i.sample) for i in out.scheduled]
            assert plan == [(i.seq.request_id, i.num_new_tokens, i.block_ids, i.sample) for i in ref.scheduled]
            assert out.preempted_request_ids == ref.preempted_request_ids
            if out.all_decode:
                num_fast_decode_steps += 1
                assert all(i.num_new_tokens == 1 and i.sample and i.seq.output_token_ids for i in out.scheduled)
            sampled = {i.seq.request_id: _token(i.seq.all_token_ids) for i in out.scheduled if i.sample}
            events = fast.update_from_output(out, sampled)
            assert events == general.update_from_output(ref, sampled)
            assert [s.request_id for s in fast.waiting] == [s.request_id for s in general.waiting]
        assert num_fast_decode_steps > 0


def _decode_output(seqs: list[Sequence], tables: list[list[int]]) -> SchedulerOutput:
    from worker.scheduler import ScheduledSeq

    return SchedulerOutput([ScheduledSeq(seq, 1, table, True) for seq, table in zip(seqs, tables)])


def test_batch_builder_builds_a_decode_step_as_the_general_path_does_while_tables_grow():
    rng = random.Random(3)
    fast, general = BatchBuilder(BS, torch.device("cpu")), BatchBuilder(BS, torch.device("cpu"))
    seqs = [Sequence(f"s{i}", [5] * rng.randrange(1, 9), output_token_ids=[7, 8 + i]) for i in range(40)]
    tables = [list(range(100 * i, 100 * i + 4)) for i in range(40)]
    for step_idx in range(60):
        if step_idx % 17 == 5:  # the composition changes: a sequence leaves, one joins
            seqs.pop(rng.randrange(len(seqs)))
            tables.pop(0)
            seqs.append(Sequence(f"n{step_idx}", [6] * 3, output_token_ids=[9]))
            tables.append([900 + step_idx])
        for seq, table in zip(seqs, tables):
            seq.num_computed_tokens = seq.num_tokens - 1
            if len(table) * BS < seq.num_tokens:
                table.append(table[-1] + 1)  # in place: the builder must not trust a list it saw before
        tables = [list(t) if rng.random() < 0.2 else t for t in tables]
        out = _decode_output(seqs, tables)
        got = fast.build(SchedulerOutput(out.scheduled, all_decode=True))
        want = general.build(out)
        for name, value in vars(want).items():
            other = getattr(got, name)
            if isinstance(value, torch.Tensor):
                assert other.dtype == value.dtype and torch.equal(other, value), (step_idx, name)
            else:
                assert other == value, (step_idx, name)
        if step_idx % 9 == 0:  # a general build in between overwrites the reused table buffer
            fast.build(out)
        for seq in seqs:
            seq.output_token_ids.append(rng.randrange(3, 60))


def test_greedy_picks_the_first_maximum_as_torch_does_for_ties_nans_views_and_other_dtypes():
    logits = torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [2.0, 2.0, 1.0, 0.0],
                           [float("-inf")] * 4, [float("inf"), 1.0, float("inf"), 0.0]])
    cases = [logits, logits.double(), logits.half(), logits.bfloat16(), logits[:, 1:], logits.t(),
             torch.randn(7, 50), torch.round(torch.randn(30, 9)), torch.zeros(1, 5).expand(6, 5)[::2]]
    for case in cases:
        assert Sampler.greedy(case) == case.max(dim=-1).indices.tolist()
    with torch.inference_mode():
        inference = torch.randn(4, 11)
    assert Sampler.greedy(inference) == inference.max(dim=-1).indices.tolist()


class _FixedLogits:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def forward(self, batch, kv_cache, should_stop=None) -> torch.Tensor:
        return self.logits[: batch.logits_indices.shape[0]]


def test_model_runner_samples_with_the_parameters_of_the_sequences_in_the_batch_when_they_change():
    logits = torch.randn(3, 40)
    runner = ModelRunner(_FixedLogits(logits), torch.zeros(1, 2, 8, 1, BS, 1), BS, torch.device("cpu"))
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=5.0, seed=11)
    a = Sequence("a", [1, 2], greedy, seed=1, output_token_ids=[3])
    b = Sequence("b", [1, 2], greedy, seed=2, output_token_ids=[4])
    c = Sequence("c", [1, 2], hot, seed=3, output_token_ids=[5])
    for seqs in ([a, b], [a, b], [a, c], [a, c], [c, a, b], [b]):
        for seq in seqs:
            seq.num_computed_tokens = seq.num_tokens - 1
        out = _decode_output(seqs, [[0]] * len(seqs))
        want = Sampler().sample(logits[: len(seqs)], [s.sampling for s in seqs], [s.seed for s in seqs],
                                [len(s.output_token_ids) for s in seqs])
        for all_decode in (True, False):
            got = runner.run(SchedulerOutput(out.scheduled, all_decode=all_decode))
            assert got == {s.request_id: token for s, token in zip(seqs, want)}
