"""Cache simulator: hand-computed hit rates, Belady as an upper bound, trace loading, the CLI's outputs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from sluice.cli import main as sluice_main
from worker.kv_cache.cachesim import (
    DEFAULT_TIER_MIX,
    PrefixCacheSim,
    TraceRequest,
    compare,
    load_trace,
    simulate_belady,
    simulate_policy,
    split_by_time,
    tier_of,
    trace_stats,
)
from worker.kv_cache.eviction import make_policy, policy_names
from worker.kv_cache.synthetic_trace import SHAPES, generate

MOONCAKE = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake_fast25" / "conversation_trace.jsonl"


def write_trace(path: Path, rows: list[tuple[int, list[int]]], partial: bool = False) -> Path:
    """Write (timestamp ms, hash_ids) rows; every block is full unless ``partial``."""
    with open(path, "w", encoding="utf-8") as f:
        for timestamp_ms, hash_ids in rows:
            input_length = len(hash_ids) * 512 - (100 if partial else 0)
            f.write(json.dumps({"timestamp": timestamp_ms, "input_length": input_length, "output_length": 10,
                                "hash_ids": hash_ids}) + "\n")
    return path


TINY = [(0, [0, 1, 2, 3]), (1000, [0, 1, 2, 4]), (2000, [0, 1, 5]), (3000, [0, 1, 2, 3])]


def test_load_trace_drops_the_shared_first_block_and_the_partial_last_block(tmp_path: Path) -> None:
    rows = [(2000, [0, 1, 5]), (0, [0, 1, 2, 3]), (3000, [0, 9])]  # out of order on purpose
    requests = load_trace(write_trace(tmp_path / "t.jsonl", rows, partial=True))
    # the partial last hash is not a reference; [0, 9] keeps no full block of its own and is skipped
    assert [r.block_hashes for r in requests] == [(1, 2), (1,)]
    assert [r.arrival_s for r in requests] == [0.0, 2.0]
    assert all(r.last_block_partial for r in requests)
    kept = load_trace(tmp_path / "t.jsonl", drop_shared_first_block=False)
    assert kept[0].block_hashes == (0, 1, 2)
    full = load_trace(write_trace(tmp_path / "f.jsonl", rows))
    assert [r.block_hashes for r in full] == [(1, 2, 3), (1, 5), (9,)]
    assert not any(r.last_block_partial for r in full)
    mixed = load_trace(write_trace(tmp_path / "m.jsonl", [(0, [0, 1]), (1, [7, 8])]))
    assert [r.block_hashes for r in mixed] == [(0, 1), (7, 8)]  # no block shared by all: nothing dropped


def test_lru_hit_rate_on_a_tiny_trace_matches_the_hand_count(tmp_path: Path) -> None:
    """Capacity 4 blocks, LRU, chains released tail first.

    r1 [1 2 3]: 0 hits.                 LRU order (oldest first): 3 2 1
    r2 [1 2 4]: hits 1 2; 4 -> free.    order: 3 4 2 1
    r3 [1 5]:   hit 1; 5 evicts 3.      order: 4 2 5 1
    r4 [1 2 3]: hits 1 2; 3 evicts 4.   total 5 hits / 11 refs
    """
    requests = load_trace(write_trace(tmp_path / "t.jsonl", TINY))
    lru = simulate_policy(requests, 4, "lru")
    assert (lru.num_hit_blocks, lru.num_block_refs, lru.num_evictions) == (5, 11, 2)
    belady = simulate_belady(requests, 4)
    # MIN keeps 3 over 4 and bypasses 5 (both never used again): 6 hits, the compulsory bound (11 - 5 distinct)
    assert (belady.num_hit_blocks, belady.num_block_refs) == (6, 11)
    assert trace_stats(requests)["compulsory_bound_hit_rate"] == pytest.approx(6 / 11)


def test_hits_stop_at_the_first_miss_even_when_later_blocks_are_cached() -> None:
    sim = PrefixCacheSim(8, make_policy("lru"))
    sim.access(TraceRequest(0.0, (1, 2, 3), False))
    sim.prefix_cache.remove(sim.prefix_cache._hash_to_block_id[2], 2)  # forget the middle block only
    assert sim.access(TraceRequest(1.0, (1, 2, 3), False)) == 1  # 3 is still cached but follows a miss
    assert sim.pool.num_used_blocks == 0  # every block released after each request


def test_a_partial_last_block_takes_a_pool_block_while_running_but_is_never_cached() -> None:
    """Capacity 4, LRU. r1 [1 2] + partial: 3 blocks in use, [1 2] cached, the partial one back to the free list.

    r2 [5 6] + partial needs 3 blocks: the 2 free ones and one victim (2, the tail of [1 2]); r3 returns to [1 2]
    and hits only 1. Without the partial blocks r2 would have found 2 free blocks and r3 would hit both.
    """
    requests = [TraceRequest(0.0, (1, 2), True), TraceRequest(1.0, (5, 6), True), TraceRequest(2.0, (1, 2), False)]
    sim = PrefixCacheSim(4, make_policy("lru"))
    assert [sim.access(r) for r in requests[:2]] == [0, 0]
    assert sorted(sim.prefix_cache._hash_to_block_id) == [1, 5, 6]  # no partial block is ever cached
    assert sim.access(requests[2]) == 1 and sim.pool.num_used_blocks == 0
    result = simulate_policy(requests, 4, "lru")
    assert (result.num_hit_blocks, result.num_block_refs) == (1, 6)  # partial blocks are not references
    whole = [TraceRequest(r.arrival_s, r.block_hashes, False) for r in requests]
    assert simulate_policy(whole, 4, "lru").num_hit_blocks == 2
    assert simulate_belady(requests, 4).num_block_refs == 6  # Belady sees the same reference stream


def synthetic_requests(seed: int, num_conversations: int = 60, num_requests: int = 400) -> list[TraceRequest]:
    """Conversations that return with a growing history: a returning turn adds 1–3 blocks to its last prompt."""
    rng = random.Random(seed)
    next_hash = 1
    histories: list[list[int]] = []
    requests = []
    for i in range(num_requests):
        if histories and rng.random() < 0.6:
            history = rng.choice(histories)
        else:
            history = []
            histories.append(history)
        for _ in range(rng.randint(1, 3) if history else rng.randint(2, 8)):
            history.append(next_hash)
            next_hash += 1
        tier, priority = tier_of(history[0], DEFAULT_TIER_MIX)
        requests.append(TraceRequest(float(i), tuple(history), False, tier, priority))
        if len(histories) > num_conversations:
            histories.pop(0)
    return requests


@pytest.mark.parametrize("seed", [1, 2])
def test_belady_bounds_every_policy_on_a_synthetic_trace(seed: int) -> None:
    requests = synthetic_requests(seed)
    num_distinct = trace_stats(requests)["num_distinct_blocks"]
    for capacity_blocks in (num_distinct // 20, num_distinct // 10, num_distinct // 4):
        runs = compare(requests, [capacity_blocks], policy_names())
        belady = runs[0]["belady"]["hit_rate"]
        assert 0.0 < belady <= trace_stats(requests)["compulsory_bound_hit_rate"] + 1e-12
        for name, result in runs[0]["policies"].items():
            assert result["hit_rate"] <= belady + 1e-12, (name, capacity_blocks)


@pytest.mark.skipif(not MOONCAKE.exists(), reason="Mooncake conversation trace not present")
def test_belady_bounds_every_policy_on_a_mooncake_slice_and_lru_is_below_it() -> None:
    requests = load_trace(MOONCAKE, max_requests=1500)
    num_distinct = trace_stats(requests)["num_distinct_blocks"]
    runs = compare(requests, [num_distinct // 20, num_distinct // 10], policy_names())
    for entry in runs:
        belady = entry["belady"]["hit_rate"]
        for name, result in entry["policies"].items():
            assert result["hit_rate"] <= belady + 1e-12, (name, entry["capacity_blocks"])
        assert entry["policies"]["lru"]["fraction_of_belady"] < 0.95  # the gap the policies compete in


@pytest.mark.skipif(not MOONCAKE.exists(), reason="Mooncake conversation trace not present")
def test_chain_beats_lru_on_a_mooncake_slice_once_it_has_settled_history() -> None:
    """The first 3,000 requests (987 s): the chain policy is LRU until its first chains settle (600 s), then learns."""
    requests = load_trace(MOONCAKE, max_requests=3000)
    num_distinct = trace_stats(requests)["num_distinct_blocks"]
    for capacity_blocks in (num_distinct // 20, num_distinct // 10):
        lru = simulate_policy(requests, capacity_blocks, "lru")
        chain = simulate_policy(requests, capacity_blocks, "chain")
        assert chain.hit_rate > 1.1 * lru.hit_rate, capacity_blocks


def test_tier_mix_is_deterministic_and_close_to_its_percents() -> None:
    tiers = [tier_of(h, DEFAULT_TIER_MIX)[0] for h in range(20000)]
    assert tiers == [tier_of(h, DEFAULT_TIER_MIX)[0] for h in range(20000)]
    for name, _, percent in DEFAULT_TIER_MIX:
        assert abs(tiers.count(name) / len(tiers) - percent / 100) < 0.02


def test_cli_writes_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", TINY)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    status = sluice_main(["cachesim", str(trace), "--capacity-blocks", "4", "--capacity-blocks", "5",
                          "--policy", "lru,sluice", "--json", str(out_json), "--plot", str(out_png)])
    assert status == 0
    report = json.loads(out_json.read_text())
    assert [run["capacity_blocks"] for run in report["runs"]] == [4, 5]
    assert report["runs"][0]["policies"]["lru"]["hit_rate"] == pytest.approx(5 / 11)
    assert report["runs"][0]["belady"]["hit_rate"] == pytest.approx(6 / 11)
    assert set(report["runs"][0]["policies"]) == {"lru", "sluice"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "belady" in capsys.readouterr().out


def run_cli_expecting_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``sluice cachesim argv``; assert an argparse usage error (exit 2); return stderr."""
    with pytest.raises(SystemExit) as exc_info:
        sluice_main(["cachesim", *argv])
    assert exc_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sluice cachesim")
    return err


def test_cli_rejects_an_unknown_policy_with_the_valid_names(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", TINY)
    err = run_cli_expecting_usage_error([str(trace), "--policy", "lru", "arc"], capsys)
    assert "argument --policy: unknown eviction policy 'arc'; valid: adaptive, chain, lfu, lru, sluice, tier, ttl" in err


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--capacity-blocks", "0", "must be an integer ≥ 1, got 0"),
    ("--capacity-blocks", "-3", "must be an integer ≥ 1, got -3"),
    ("--capacity-blocks", "two", "expected an integer ≥ 1, got 'two'"),
    ("--capacity-fractions", "0", "each fraction must be in (0, 1], got 0"),
    ("--capacity-fractions", "-1", "each fraction must be in (0, 1], got -1"),
    ("--capacity-fractions", "0.1,1.5", "each fraction must be in (0, 1], got 1.5"),
    ("--capacity-fractions", "nan", "each fraction must be in (0, 1], got nan"),
    ("--capacity-fractions", ",", "expected comma-separated numbers in (0, 1], got ','"),
    ("--capacity-fractions", "half", "expected comma-separated numbers in (0, 1], got 'half'"),
    ("--max-requests", "0", "must be an integer ≥ 1, got 0"),
    ("--block-size-tokens", "0", "must be an integer ≥ 1, got 0"),
    ("--tier-mix", "x", "entry 'x': expected name:priority:percent with integers (e.g. vip:2:20)"),
    ("--tier-mix", "vip:2:20:1,free:0:80", "entry 'vip:2:20:1': expected name:priority:percent"),
    ("--tier-mix", "vip:high:20,free:0:80", "entry 'vip:high:20': expected name:priority:percent"),
    ("--tier-mix", "vip:2:120,free:0:-20", "entry 'free:0:-20': percent must be ≥ 0"),
    ("--tier-mix", "vip:2:50,vip:1:50", "tier 'vip' is given twice"),
    ("--tier-mix", "vip:2:20,free:0:20", "percents must sum to 100, got 40"),
    ("--policy", ",", "expected policy names, got ','; valid: adaptive, chain, lfu, lru, sluice, tier, ttl"),
])
def test_cli_rejects_a_bad_option_value_with_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          option: str, value: str, message: str) -> None:
    trace = write_trace(tmp_path / "t.jsonl", TINY)
    err = run_cli_expecting_usage_error([str(trace), option, value], capsys)
    assert f"error: argument {option}: {message}" in err


def test_cli_rejects_capacity_blocks_with_capacity_fractions(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", TINY)
    err = run_cli_expecting_usage_error([str(trace), "--capacity-blocks", "4", "--capacity-fractions", "0.5"], capsys)
    assert "argument --capacity-fractions: not allowed with argument --capacity-blocks" in err


def test_cli_rejects_a_trace_that_is_not_mooncake_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv_trace = tmp_path / "azure.csv"
    csv_trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    err = run_cli_expecting_usage_error([str(csv_trace)], capsys)
    assert f"argument trace: {csv_trace}:1: not JSON (Expecting value); expected a Mooncake JSONL request" in err
    bad_hashes = tmp_path / "bad.jsonl"
    bad_hashes.write_text('{"timestamp": 0, "hash_ids": "0 1 2"}\n')
    err = run_cli_expecting_usage_error([str(bad_hashes)], capsys)
    assert f"argument trace: {bad_hashes}:1: 'hash_ids' must be a list of integers" in err
    err = run_cli_expecting_usage_error([str(tmp_path / "absent.jsonl")], capsys)
    assert f"argument trace: No such file or directory: {tmp_path / 'absent.jsonl'}" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    err = run_cli_expecting_usage_error([str(empty)], capsys)
    assert f"argument trace: {empty} holds no request with a full block of 512 tokens" in err


def test_cli_rejects_an_output_path_in_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", TINY)
    err = run_cli_expecting_usage_error([str(trace), "--json", str(tmp_path / "no" / "r.json")], capsys)
    assert f"argument --json: no such directory {tmp_path / 'no'}" in err


def test_cli_takes_policies_space_and_comma_separated_once_each(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The README's ``--policy lru sluice chain`` form, mixed with commas and a repeat; duplicates run once."""
    trace = write_trace(tmp_path / "t.jsonl", TINY)
    out_json = tmp_path / "r.json"
    assert sluice_main(["cachesim", str(trace), "--policy", "lru", "sluice,chain", "--policy", "lru,tier",
                        "--capacity-blocks", "4", "--json", str(out_json)]) == 0
    assert list(json.loads(out_json.read_text())["runs"][0]["policies"]) == ["lru", "sluice", "chain", "tier"]


def test_cli_max_requests_keeps_exactly_that_many(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", TINY)
    out_json = tmp_path / "r.json"
    assert sluice_main(["cachesim", str(trace), "--max-requests", "1", "--policy", "lru", "--json",
                        str(out_json)]) == 0
    assert json.loads(out_json.read_text())["num_requests"] == 1


def test_simulations_and_loader_reject_out_of_range_arguments(tmp_path: Path) -> None:
    requests = load_trace(write_trace(tmp_path / "t.jsonl", TINY))
    with pytest.raises(ValueError, match="capacity_blocks must be ≥ 1, got 0"):
        simulate_belady(requests, 0)
    with pytest.raises(ValueError, match="capacity_blocks must be ≥ 1, got -1"):
        simulate_policy(requests, -1, "lru")
    with pytest.raises(ValueError, match=r"max_requests must be ≥ 1 \(or None for all\), got 0"):
        load_trace(tmp_path / "t.jsonl", max_requests=0)
    with pytest.raises(ValueError, match="block_size_tokens must be ≥ 1, got 0"):
        load_trace(tmp_path / "t.jsonl", block_size_tokens=0)
    assert len(load_trace(tmp_path / "t.jsonl", max_requests=1)) == 1


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_adaptive_is_within_a_point_of_the_better_of_lru_and_lfu_on_generated_shapes(shape: str) -> None:
    """The adaptive policy's no-loss property, as shares of Belady's hits at 5, 10 and 25% of the distinct blocks,
    on traffic shapes the Mooncake trace does not have (one-shot scans, short and long gaps, shared system
    prompts, a mix). Generated traces of 600 sessions: at 300, the learning period is a larger share of the trace."""
    requests = generate(SHAPES[shape])
    runs = compare(requests, [int(f * trace_stats(requests)["num_distinct_blocks"]) for f in (0.05, 0.1, 0.25)],
                   ["lru", "lfu", "adaptive"])
    for entry in runs:
        share = {name: 100 * result["fraction_of_belady"] for name, result in entry["policies"].items()}
        assert share["adaptive"] >= max(share["lru"], share["lfu"]) - 1.0, (entry["capacity_fraction"], share)


def test_cli_split_reports_both_halves_by_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [(1000 * t, [0, 1 + t % 3, 10 + t]) for t in range(10)] + [(100_000, [0, 1, 50])]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    out_json = tmp_path / "split.json"
    assert sluice_main(["cachesim", str(trace), "--split", "--capacity-blocks", "3", "--policy", "lru,adaptive",
                        "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert report["first_half"]["num_requests"] == 10  # arrivals before the midpoint, 50 s
    assert report["second_half"]["num_requests"] == 1
    assert set(report["second_half"]["runs"][0]["policies"]) == {"lru", "adaptive"}
    out = capsys.readouterr().out
    assert out.index("first half") < out.index("second half (quote this one)")


def test_split_by_time_cuts_at_the_midpoint_of_the_arrivals_not_the_count() -> None:
    requests = [TraceRequest(arrival_s=t, block_hashes=(1,), last_block_partial=False) for t in (0, 1, 2, 3, 10)]
    first, second = split_by_time(requests)
    assert [r.arrival_s for r in first] == [0, 1, 2, 3] and [r.arrival_s for r in second] == [10]
    assert split_by_time([]) == ([], [])


def test_cli_runs_on_a_synthetic_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "syn.json"
    assert sluice_main(["cachesim", "--synthetic", "scan:num_sessions=40", "--capacity-fractions", "0.25",
                        "--policy", "lru", "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert report["trace"] == "synthetic:scan:num_sessions=40"
    assert report["num_requests"] >= 40 and report["runs"][0]["policies"]["lru"]["hit_rate"] > 0
    # --max-requests cuts a generated trace as it cuts a file
    assert sluice_main(["cachesim", "--synthetic", "scan:num_sessions=40", "--capacity-fractions", "0.25",
                        "--policy", "lru", "--max-requests", "25", "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["num_requests"] == 25


def test_cli_wants_exactly_one_of_a_trace_and_synthetic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", TINY)
    assert "give a trace file or --synthetic" in run_cli_expecting_usage_error([], capsys)
    assert "give a trace file or --synthetic" in run_cli_expecting_usage_error(
        [str(trace), "--synthetic", "mix"], capsys)
    assert "unknown synthetic shape 'zipf'" in run_cli_expecting_usage_error(["--synthetic", "zipf"], capsys)
