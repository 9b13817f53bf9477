"""Synthetic traces: determinism, the shape knobs doing what they say, presets and overrides, JSONL round trip."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from worker.kv_cache.cachesim import load_trace, trace_stats
from worker.kv_cache.synthetic_trace import SHAPES, TraceShape, generate, parse_shape, write_jsonl


def num_returning(requests) -> int:
    """Requests whose prompt extends an earlier prompt beyond a shared system prompt (a returning turn)."""
    seen: set[tuple[int, ...]] = set()
    count = 0
    for request in requests:
        count += any(request.block_hashes[:n] in seen for n in range(len(request.block_hashes) - 1, 0, -1))
        seen.add(request.block_hashes)
    return count


def test_the_same_shape_and_seed_give_the_same_trace_and_another_seed_another() -> None:
    shape = SHAPES["mix"]
    assert generate(shape) == generate(shape)
    assert generate(shape) != generate(replace(shape, seed=1))


def test_requests_are_sorted_by_arrival_and_every_prompt_has_a_partial_last_block() -> None:
    requests = generate(SHAPES["long_gaps"])
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert all(r.last_block_partial and r.block_hashes for r in requests)


def test_return_probability_zero_gives_one_request_per_session_and_no_reuse() -> None:
    requests = generate(TraceShape(num_sessions=100, return_probability=0.0))
    assert len(requests) == 100
    assert trace_stats(requests)["compulsory_bound_hit_rate"] == 0.0


def test_a_higher_return_probability_gives_more_returning_turns() -> None:
    low = generate(TraceShape(num_sessions=200, return_probability=0.2))
    high = generate(TraceShape(num_sessions=200, return_probability=0.8))
    assert num_returning(high) > 2 * num_returning(low) > 0


def test_a_turn_extends_the_previous_prompt_of_its_conversation_after_a_positive_gap() -> None:
    shape = TraceShape(num_sessions=1, return_probability=1.0, max_turns=5, turn_growth_blocks=(2, 2),
                       first_turn_blocks=(3, 3), gap="pareto", mean_gap_s=30.0)
    requests = generate(shape)
    assert [len(r.block_hashes) for r in requests] == [3, 5, 7, 9, 11]
    for before, after in zip(requests, requests[1:]):
        assert after.block_hashes[:len(before.block_hashes)] == before.block_hashes
        assert after.arrival_s > before.arrival_s


@pytest.mark.parametrize("gap", ["exponential", "lognormal", "pareto"])
def test_gap_distributions_have_the_stated_mean(gap: str) -> None:
    shape = TraceShape(num_sessions=400, return_probability=1.0, max_turns=6, gap=gap, mean_gap_s=50.0)
    requests = generate(shape)
    by_session: dict[int, list[float]] = {}
    for r in requests:
        by_session.setdefault(r.block_hashes[0], []).append(r.arrival_s)
    gaps = [b - a for times in by_session.values() for a, b in zip(times, times[1:])]
    mean_s = sum(gaps) / len(gaps)
    assert 35.0 < mean_s < 70.0  # 2,000 draws; Pareto (α = 1.5) converges slowly, hence the wide band


def test_system_prompts_are_shared_prefixes_and_one_shots_never_return() -> None:
    shape = TraceShape(num_sessions=200, one_shot_fraction=1.0, num_system_prompts=3, system_prompt_blocks=5)
    requests = generate(shape)
    assert len(requests) == 200
    assert len({r.block_hashes[:5] for r in requests}) == 3
    assert len({r.block_hashes[5:] for r in requests}) == 200


def test_parse_shape_takes_a_preset_with_overrides_and_names_bad_input() -> None:
    shape = parse_shape("mix:seed=4,return_probability=0.9,gap=pareto,first_turn_blocks=3-5")
    assert (shape.seed, shape.return_probability, shape.gap, shape.first_turn_blocks) == (4, 0.9, "pareto", (3, 5))
    assert parse_shape("scan") == SHAPES["scan"]
    with pytest.raises(ValueError, match="unknown synthetic shape 'zipf'; valid: long_gaps, mix, scan"):
        parse_shape("zipf")
    with pytest.raises(ValueError, match="unknown shape field 'speed'"):
        parse_shape("mix:speed=3")
    with pytest.raises(ValueError, match="return_probability must be in"):
        parse_shape("mix:return_probability=1.5")
    with pytest.raises(ValueError, match="bad value"):
        parse_shape("mix:first_turn_blocks=3")


def test_jsonl_round_trip_gives_the_same_block_references(tmp_path: Path) -> None:
    requests = generate(SHAPES["system_prompts"])
    path = tmp_path / "synthetic.jsonl"
    write_jsonl(requests, path)
    loaded = load_trace(path)
    assert [r.block_hashes for r in loaded] == [r.block_hashes for r in requests]
    assert all(r.last_block_partial for r in loaded)
