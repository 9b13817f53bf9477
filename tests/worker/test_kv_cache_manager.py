"""KVCacheManager: exact block tables, prefix hits (never the whole prompt), tail-first release, cache metadata."""

from __future__ import annotations

import math

from worker.kv_cache.manager import KVCacheManager
from worker.sequence import Sequence, SequenceStatus

BS = 4  # tokens per block in these tests


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make_manager(num_blocks: int = 8, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, clock=kwargs.pop("clock", FakeClock()), **kwargs)


def admit(kv: KVCacheManager, seq: Sequence) -> list[int] | None:
    """Admit ``seq`` with its whole remaining prompt, as the scheduler does with an unlimited budget."""
    num_hit = kv.admit(seq, max_new_tokens=10**9)
    if num_hit is None:
        return None
    seq.num_computed_tokens = num_hit
    seq.num_cached_tokens = num_hit
    seq.status = SequenceStatus.RUNNING
    return kv.get_block_ids(seq.request_id)


def compute(kv: KVCacheManager, seq: Sequence) -> None:
    """Pretend the model computed every scheduled token (all but the next sampled one)."""
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_blocks(seq)


def check_accounting(kv: KVCacheManager) -> None:
    assert kv.num_used_blocks + kv.num_free_blocks == kv.num_total_blocks
    assert math.isclose(kv.usage, kv.num_used_blocks / kv.num_total_blocks)


def test_allocate_slots_exact_block_ids_and_growth_at_block_boundary():
    kv = make_manager(8)
    seq = Sequence("a", list(range(6)))
    assert admit(kv, seq) == [0, 1]
    compute(kv, seq)
    seq.output_token_ids.append(50)  # 7 tokens: decode token 6 fits block 1
    assert kv.allocate_slots(seq, 1) == []
    seq.num_computed_tokens = 7
    seq.output_token_ids.append(51)  # token 7 still fits block 1
    assert kv.allocate_slots(seq, 1) == []
    seq.num_computed_tokens = 8
    seq.output_token_ids.append(52)  # token 8 opens block 2
    assert kv.allocate_slots(seq, 1) == [2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert (kv.num_used_blocks, kv.num_free_blocks) == (3, 5)
    check_accounting(kv)


def test_no_memory_returns_none_and_changes_nothing():
    kv = make_manager(2)
    seq = Sequence("a", list(range(12)))
    assert admit(kv, seq) is None
    assert kv.get_block_ids("a") == [] and kv.num_free_blocks == 2


def test_second_request_hits_cached_prefix_and_never_the_whole_prompt():
    kv = make_manager(8)
    first = Sequence("a", list(range(8)))
    admit(kv, first)
    compute(kv, first)
    kv.free(first)
    assert kv.num_cached_blocks == 2
    # the same prompt again: both blocks are cached, but the last token must be computed -> back off one block
    again = Sequence("b", list(range(8)))
    assert kv.get_computed_blocks(again) == ([0], 4)
    longer = Sequence("c", list(range(8)) + [99])
    assert kv.get_computed_blocks(longer) == ([0, 1], 8)


def test_full_blocks_of_generated_tokens_are_cached():
    kv = make_manager(8)
    seq = Sequence("a", list(range(6)))
    admit(kv, seq)
    compute(kv, seq)
    for token in (60, 61):  # tokens 6, 7 fill block 1
        seq.output_token_ids.append(token)
        kv.allocate_slots(seq, 1)
        compute(kv, seq)
    seq.output_token_ids.append(62)
    kv.free(seq)
    history = Sequence("b", list(range(6)) + [60, 61, 62, 1000])
    assert kv.get_computed_blocks(history) == ([0, 1], 8)


def test_free_is_tail_first_so_lru_evicts_the_tail_before_the_head():
    kv = make_manager(5)
    seq = Sequence("a", list(range(12)))
    assert admit(kv, seq) == [0, 1, 2]
    compute(kv, seq)
    kv.free(seq)
    assert (kv.num_cached_blocks, kv.num_used_blocks) == (3, 0)
    other = Sequence("b", [7] * 16)
    assert admit(kv, other) == [3, 4, 2, 1]  # free list, then victims tail first: 2, then 1
    assert kv.num_cached_blocks == 1
    assert kv.get_computed_blocks(Sequence("c", list(range(12)))) == ([0], 4)
    check_accounting(kv)


def test_hit_blocks_that_are_evictable_count_against_free_capacity():
    kv = make_manager(4)
    first = Sequence("a", list(range(8)))
    admit(kv, first)
    compute(kv, first)
    kv.free(first)  # blocks 0, 1 cached + evictable; 2, 3 free
    too_big = Sequence("b", list(range(8)) + list(range(100, 110)))  # 2 hits + 3 new blocks > 4
    assert admit(kv, too_big) is None
    assert kv.num_cached_blocks == 2 and kv.pool.ref_count(0) == 0
    fits = Sequence("c", list(range(8)) + list(range(100, 106)))  # 2 hits + 2 new blocks
    assert admit(kv, fits) == [0, 1, 2, 3]
    assert fits.num_cached_tokens == 8
    check_accounting(kv)


def test_shared_prefix_shares_blocks_but_not_continuations():
    kv = make_manager(16)
    prefix = list(range(100, 108))  # two full blocks
    a = Sequence("a", prefix + [1, 2, 3, 4, 5])
    admit(kv, a)
    compute(kv, a)
    b = Sequence("b", prefix + [1, 2, 9, 9, 9])  # same prefix, continuation diverges inside block 2
    table_b = admit(kv, b)
    table_a = kv.get_block_ids("a")
    assert table_b[:2] == table_a[:2]
    assert set(table_b[2:]).isdisjoint(table_a)
    assert kv.pool.ref_count(table_a[0]) == 2 and kv.pool.ref_count(table_a[2]) == 1
    assert b.num_cached_tokens == 8
    check_accounting(kv)


def test_free_stamps_metadata_tier_ttl_and_chain_tail():
    clock = FakeClock()
    kv = make_manager(8, clock=clock)
    seq = Sequence("a", list(range(10)), tier="free", tier_priority=-1, cache_ttl_s=30.0)
    table = admit(kv, seq)
    compute(kv, seq)
    clock.now_s = 200.0
    kv.free(seq)
    metas = [kv.pool.meta(b) for b in table]
    assert metas[2] is None  # partial block: never cached
    assert [m.block_idx for m in metas[:2]] == [0, 1]
    assert [m.is_chain_tail for m in metas[:2]] == [False, True]
    assert all(m.tier == "free" and m.tier_priority == -1 and m.expires_at_s == 230.0 for m in metas[:2])
    assert all(m.last_access_s == 200.0 for m in metas[:2])


def test_prefix_caching_disabled_caches_nothing():
    kv = make_manager(8, enable_prefix_caching=False)
    seq = Sequence("a", list(range(8)))
    admit(kv, seq)
    compute(kv, seq)
    kv.free(seq)
    assert kv.num_cached_blocks == 0 and kv.num_free_blocks == 8
    assert kv.get_computed_blocks(Sequence("b", list(range(9)))) == ([], 0)


def test_prefix_counters_count_first_admissions_in_tokens():
    kv = make_manager(8)
    a = Sequence("a", list(range(8)))
    admit(kv, a)
    compute(kv, a)
    kv.free(a)
    b = Sequence("b", list(range(10)))
    admit(kv, b)
    assert (kv.prefix_queries_tokens, kv.prefix_hits_tokens) == (18, 8)
    assert math.isclose(kv.prefix_hit_rate, 8 / 18)
    kv.free(b)
    kv.free(b)  # idempotent
    check_accounting(kv)
    assert kv.num_used_blocks == 0


# ---------------------------------------------------------------- retention (issue 4)


def test_retention_wish_is_bounded_by_config_and_tier_and_default_applies():
    from shared.config import KVConfig

    clock = FakeClock()
    config = KVConfig(default_cache_ttl_s=50.0, max_cache_ttl_s=600.0, max_cache_ttl_s_by_tier={"free": 20.0})
    kv = make_manager(16, clock=clock, config=config)
    cases = {"wish": ("standard", 300.0, 400.0), "capped": ("standard", 9000.0, 700.0),
             "tier": ("free", 300.0, 120.0), "default": ("standard", 0.0, 150.0)}
    for request_id, (tier, ttl_s, _) in cases.items():
        seq = Sequence(request_id, [hash(request_id) % 1000 + i for i in range(4)] + [1], tier=tier,
                       cache_ttl_s=ttl_s)
        table = admit(kv, seq)
        compute(kv, seq)
        kv.free(seq)
        assert kv.pool.meta(table[0]).expires_at_s == cases[request_id][2]


def test_free_stamps_what_the_sluice_policy_classifies_by():
    kv = make_manager(16)
    first = Sequence("a", list(range(8)))
    admit(kv, first)
    compute(kv, first)
    kv.free(first)
    seq = Sequence("b", list(range(8)) + [50, 51, 52, 53, 54, 55])  # 14 prompt tokens: blocks 0, 1 hit; 3 partial
    table = admit(kv, seq)
    compute(kv, seq)
    for token in (60, 61):  # fill block 3 (prompt tokens 12, 13 + outputs 14, 15)
        seq.output_token_ids.append(token)
        kv.allocate_slots(seq, 1)
        compute(kv, seq)
    table = kv.get_block_ids("b")
    kv.free(seq)
    metas = [kv.pool.meta(b) for b in table]
    assert [m.is_partial for m in metas] == [False, False, False, True]
    assert {(m.num_request_blocks, m.num_request_cached_blocks) for m in metas} == {(4, 2)}
    assert all(m.cached_at_s == 100.0 for m in metas)


def test_pressure_switches_policy_shortens_retention_and_stops_caching_low_tiers():
    from shared.config import KVConfig

    clock = FakeClock()
    kv = make_manager(8, clock=clock, config=KVConfig(), eviction_policy="lru")
    kv.set_pressure("critical")  # default retention: tier policy, 60 s max, top tiers only, no caching below 1
    assert kv.pool.policy.name == "tier" and kv.stats.get("pressure_switches_total", level="critical") == 1
    batch = Sequence("batch", list(range(8)) + [1], tier="batch", tier_priority=0, cache_ttl_s=600.0)
    admit(kv, batch)
    compute(kv, batch)
    assert kv.num_cached_blocks == 0 and kv.pool.meta(kv.get_block_ids("batch")[0]) is None  # no-cache mode
    kv.free(batch)
    vip = Sequence("vip", list(range(20, 28)) + [1], tier="vip", tier_priority=3, cache_ttl_s=600.0)
    free_tier = Sequence("free", list(range(40, 48)) + [1], tier="free", tier_priority=1, cache_ttl_s=600.0)
    for seq in (vip, free_tier):
        admit(kv, seq)
        compute(kv, seq)
        kv.free(seq)
    assert kv.pool.meta(kv.prefix_cache.get(kv._hashes(vip, vip.all_token_ids, 1)[0], None, range(20, 24))) \
        .expires_at_s == 160.0  # 600 s × 0.25 capped at 60 s
    kv.set_pressure("normal")
    assert kv.pool.policy.name == "lru" and kv.num_cached_blocks == 4  # blocks handed back, none lost
    check_accounting(kv)


def test_used_block_fraction_drives_pressure_with_hysteresis():
    kv = make_manager(20)
    seqs = [Sequence(f"s{i}", [i * 100 + t for t in range(4)]) for i in range(20)]
    levels = []
    for seq in seqs:
        admit(kv, seq)
        levels.append(kv.update_pressure())
    assert levels[16] == "elevated" and levels[18] == "critical" and levels[15] == "normal"  # 17/20, 19/20
    for seq in seqs[:2]:
        kv.free(seq)
    assert kv.update_pressure() == "critical"  # 18/20 = 0.9: not below leave 0.9
    kv.free(seqs[2])
    assert kv.update_pressure() == "elevated"  # 17/20 < 0.9 but >= 0.75


class RecordingCopier:
    """Stands in for :meth:`worker.model_runner.KVBlockIO.copy_block_prefix`: records ``(src, dst, num_tokens)``."""

    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int]] = []

    def __call__(self, src_block_id: int, dst_block_id: int, num_tokens: int) -> None:
        self.copies.append((src_block_id, dst_block_id, num_tokens))


def answered(kv: KVCacheManager, request_id: str, prompt: list[int], answer: list[int]) -> Sequence:
    """Admit ``prompt``, decode ``answer`` token by token, then release it (its full blocks stay cached)."""
    seq = Sequence(request_id, list(prompt))
    admit(kv, seq)
    compute(kv, seq)
    for token in answer:
        seq.output_token_ids.append(token)
        assert kv.allocate_slots(seq, 1) is not None
        compute(kv, seq)
    kv.free(seq)
    return seq


def test_a_repeated_prompt_copies_the_rows_of_its_partial_last_block_and_computes_one_token():
    copier = RecordingCopier()
    kv = make_manager(8, block_copier=copier)
    # 10-token prompt + 2 answer tokens: blocks 0, 1 and 2 = (8, 9, 50, 51) are full and cached
    first = answered(kv, "a", list(range(10)), [50, 51])
    first_table_block_2 = 2
    again = Sequence("b", list(range(10)))
    table = admit(kv, again)
    assert again.num_computed_tokens == 9  # blocks 0, 1 whole, then token 8 copied; token 9 computed for logits
    assert table[:2] == [0, 1] and table[2] != first_table_block_2
    assert copier.copies == [(first_table_block_2, table[2], 1)]
    assert kv.stats.snapshot()["partial_block_hit_tokens"] == 1
    assert kv.prefix_hits_tokens == 0 + 9 and first.num_computed_tokens == 12
    check_accounting(kv)


def test_a_prompt_on_a_block_boundary_copies_all_but_its_last_token_from_the_block_it_backs_off():
    copier = RecordingCopier()
    kv = make_manager(8, block_copier=copier)
    answered(kv, "a", list(range(8)), [])
    again = Sequence("b", list(range(8)))
    table = admit(kv, again)
    assert again.num_computed_tokens == 7
    assert table[0] == 0 and copier.copies == [(1, table[1], 3)]


def test_the_longest_agreeing_cached_block_is_the_source_and_a_mismatch_at_once_copies_nothing():
    copier = RecordingCopier()
    kv = make_manager(12, block_copier=copier)
    answered(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8], [])  # block 1 = (5, 6, 7, 8)
    answered(kv, "b", [1, 2, 3, 4, 5, 6, 0, 0], [])  # block 1 = (5, 6, 0, 0): copied (5, 6) from a's block 1
    assert copier.copies == [(1, 2, 2)]
    seq = Sequence("c", [1, 2, 3, 4, 5, 6, 7, 9, 9])
    table = admit(kv, seq)
    assert seq.num_computed_tokens == 7 and copier.copies[1:] == [(1, table[1], 3)]
    other = Sequence("d", [1, 2, 3, 4, 42, 6, 7, 9, 9])
    admit(kv, other)
    assert other.num_computed_tokens == 4 and len(copier.copies) == 2


def test_the_partial_source_is_never_evicted_to_make_room_for_its_own_copy():
    copier = RecordingCopier()
    kv = make_manager(4, block_copier=copier)
    answered(kv, "a", list(range(8)), [])  # blocks 0, 1 cached, evictable
    busy = Sequence("busy", list(range(100, 108)))
    assert admit(kv, busy) == [2, 3]  # the free list is now empty
    seq = Sequence("b", list(range(8)))
    # hit block 0 + one new block: the only evictable block is block 1, the copy's source; recompute instead
    table = admit(kv, seq)
    assert table == [0, 1] and seq.num_computed_tokens == 4 and copier.copies == []
    check_accounting(kv)


def test_without_a_copier_hits_stay_whole_blocks():
    kv = make_manager(8)
    answered(kv, "a", list(range(10)), [50, 51])
    again = Sequence("b", list(range(10)))
    admit(kv, again)
    assert again.num_computed_tokens == 8


def test_a_released_requests_partly_filled_last_block_lends_its_rows_to_the_same_prompt_again():
    copier = RecordingCopier()
    kv = make_manager(8, block_copier=copier)
    first = answered(kv, "a", list(range(10)), [50])  # 11 computed tokens: block 2 holds rows of 8, 9, 50 only
    assert first.num_computed_tokens == 11 and kv.num_cached_blocks == 3
    again = Sequence("b", list(range(10)))
    table = admit(kv, again)
    assert again.num_computed_tokens == 9 and copier.copies == [(2, table[2], 1)]
    # no whole-block lookup ever matches the partly filled block
    assert kv.get_computed_blocks(Sequence("c", list(range(8)) + [8, 9, 50, 51, 52])) == ([0, 1], 8)
    check_accounting(kv)
