"""The simulator's tokenizer facts: read from the real tokenizer once, then from a small cache file."""

from __future__ import annotations

import json

import pytest

from shared.config import Config, resolve_model_path
from worker.backends import sim


def test_tokenizer_facts_are_the_real_tokenizers_and_cached(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = resolve_model_path(Config().model)
    vocab_size, special_ids, eos_ids = sim.tokenizer_facts(path)
    tokenizer = tokenizer.hf  # the gateway's (transformers) tokenizer of the same default model, loaded once
    assert vocab_size == len(tokenizer)
    assert special_ids == sorted(set(tokenizer.all_special_ids))
    assert eos_ids == [tokenizer.eos_token_id]
    [cache_file] = (tmp_path / "sluice" / "sim").glob("*.json")
    assert json.loads(cache_file.read_text())["vocab_size"] == vocab_size

    # the second call reads the file: prove it by editing the file and seeing the edit come back
    facts = json.loads(cache_file.read_text())
    cache_file.write_text(json.dumps({**facts, "eos_ids": [12345]}))
    assert sim.tokenizer_facts(path) == (vocab_size, special_ids, [12345])
    # a corrupt cache is ignored and rewritten from the tokenizer
    cache_file.write_text("{not json")
    assert sim.tokenizer_facts(path) == (vocab_size, special_ids, eos_ids)
    assert json.loads(cache_file.read_text())["eos_ids"] == eos_ids


class FakeClock:
    """``time.monotonic`` / ``time.sleep`` for the simulator: sleeping advances the clock, nothing waits."""

    def __init__(self) -> None:
        self.now_s = 100.0
        self.slept_s: list[float] = []

    def monotonic(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.slept_s.append(seconds)
        self.now_s += seconds


def test_host_time_between_steps_overlaps_the_previous_simulated_step_up_to_its_duration(monkeypatch):
    from msgspec.structs import replace

    from shared.config import SimConfig
    from worker.scheduler import ScheduledSeq, SchedulerOutput
    from worker.sequence import Sequence

    clock = FakeClock()
    monkeypatch.setattr(sim, "time", clock)
    sim_config = replace(SimConfig(), time_scale=10.0)
    runner = sim.SimRunner(sim_config, list(range(100, 200)))
    seq = Sequence("r", list(range(512)), max_tokens=4)
    out = SchedulerOutput([ScheduledSeq(seq, 512, [0], sample=True)])
    step_s = sim.step_time_s(sim_config, 512, 512)

    runner.run(out)  # the first step: nothing before it to overlap
    assert clock.slept_s == [pytest.approx(step_s)]
    clock.now_s += 0.25 * step_s  # host work after the step (update, I/O, the next schedule)
    runner.run(out)
    assert clock.slept_s[-1] == pytest.approx(0.75 * step_s)  # the host's quarter step was hidden under the first
    assert runner.host_overlap_s == pytest.approx(0.25 * step_s)
    clock.now_s += 1.5 * step_s  # the host is slower than the GPU: one step's worth is hidden, the step is done
    runner.run(out)
    assert len(clock.slept_s) == 2 or clock.slept_s[-1] == pytest.approx(0.0, abs=1e-9)
    assert runner.host_overlap_s == pytest.approx(1.25 * step_s)
    clock.now_s += 3 * step_s  # idle: nothing is hidden
    runner.run(out)
    assert clock.slept_s[-1] == pytest.approx(step_s)
    assert runner.simulated_busy_s == pytest.approx(4 * step_s) and runner.num_steps == 4
