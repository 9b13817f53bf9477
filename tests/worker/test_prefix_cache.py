"""PrefixCache: stable chain hashes, longest verified prefix, collisions never served."""

from __future__ import annotations

import os
import subprocess
import sys

from worker.kv_cache.prefix_cache import PrefixCache, hash_block_tokens, hash_token_blocks


def test_hash_is_stable_across_processes():
    code = "from worker.kv_cache.prefix_cache import hash_block_tokens as h; print(h(h(None, [1, 2]), [3, 4]))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert int(out.stdout) == hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])
    assert 0 <= int(out.stdout) < 2**64


def test_hash_chains_over_the_parent():
    assert hash_block_tokens(None, [1, 2]) == hash_block_tokens(None, (1, 2))
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(5, [1, 2])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


def test_hash_is_blake2b_of_the_msgpack_pair_when_remembered_too():
    import hashlib

    import msgspec

    def direct(parent, tokens):
        payload = msgspec.msgpack.encode((parent, list(tokens)))
        return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")

    first = hash_block_tokens(None, [7, 8, 9])
    assert first == direct(None, [7, 8, 9])
    assert hash_block_tokens(None, [7, 8, 9]) == first  # the second ask is answered from the memo
    assert hash_block_tokens(first, range(3)) == direct(first, [0, 1, 2])


def test_hash_token_blocks_hashes_full_blocks_and_reuses_known():
    tokens = list(range(10))
    hashes = hash_token_blocks(tokens, 4)
    assert len(hashes) == 2
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    assert hash_token_blocks(tokens, 4, num_blocks=1) == hashes[:1]
    assert hash_token_blocks(tokens, 4, known_hashes=[42]) == [42, hash_block_tokens(42, [4, 5, 6, 7])]


def test_match_prefix_returns_longest_leading_run():
    cache = PrefixCache()
    tokens = list(range(12))
    hashes = hash_token_blocks(tokens, 4)
    cache.insert(hashes[0], None, tokens[0:4], block_id=7)
    cache.insert(hashes[2], hashes[1], tokens[8:12], block_id=9)  # block 1 missing: the run stops at it
    assert cache.match_prefix(tokens, hashes, 4) == [7]
    cache.insert(hashes[1], hashes[0], tokens[4:8], block_id=3)
    assert cache.match_prefix(tokens, hashes, 4) == [7, 3, 9]
    other = [0, 1, 2, 3, 99, 5, 6, 7]
    assert cache.match_prefix(other, hash_token_blocks(other, 4), 4) == [7]


def test_hash_collision_is_never_served():
    cache = PrefixCache()
    block_hash = hash_block_tokens(None, [1, 2, 3, 4])
    assert cache.insert(block_hash, None, [1, 2, 3, 4], block_id=0)
    # another conversation's block that (by a forged collision) has the same hash
    assert cache.get(block_hash, None, [9, 9, 9, 9]) is None
    assert cache.get(block_hash, 123, [1, 2, 3, 4]) is None  # same tokens after a different parent
    assert cache.get(block_hash, None, [1, 2, 3, 4]) == 0


def test_insert_keeps_first_block_and_remove_checks_the_pair():
    cache = PrefixCache()
    assert cache.insert(11, None, [1], block_id=0)
    assert not cache.insert(11, None, [1], block_id=1)  # same content elsewhere stays uncached
    cache.remove(1, 11)  # not the cached pair: ignored
    assert 11 in cache and len(cache) == 1
    cache.remove(0, 11)
    assert 11 not in cache and len(cache) == 0 and cache.block_hash_of(0) is None
