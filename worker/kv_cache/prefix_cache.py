"""Chained hashes of full KV blocks and the map from hash to the block that holds that content.

Block ``i`` of a sequence (tokens ``[i * block_size, (i + 1) * block_size)``) is named by a hash chained over
everything before it, so equal hashes mean equal prefixes (vLLM automatic prefix caching; SGLang RadixAttention
shares the same idea with a tree)::

    h0 = H(None, tokens[0:B])      h1 = H(h0, tokens[B:2B])      h2 = H(h1, tokens[2B:3B]) ...

``H`` is BLAKE2b with an 8-byte digest over the msgpack encoding of ``(parent_hash, token_ids)``: stable across
processes and machines (Python's ``hash`` is salted per process), so a chain hash can key blocks in Redis.
A lookup also compares the stored ``(parent_hash, token_ids)`` of the block with the query, so a collision of
the 64-bit block hash never serves another conversation's KV. Two different whole prefixes whose chains collide
at the parent hash *and* share the block's tokens would still match: probability about ``2**-64`` per pair.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

_ENCODER = msgspec.msgpack.Encoder()


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Return the 64-bit chain hash of one full block.

    Args:
        parent_hash: chain hash of the previous block, None for the first block of a sequence.
        token_ids: ``[block_size]`` token ids of this block.
    """
    payload = _ENCODER.encode((parent_hash, list(token_ids)))
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def hash_token_blocks(token_ids: Sequence[int], block_size: int, num_blocks: int | None = None,
                      known_hashes: Sequence[int] = ()) -> list[int]:
    """Return the chain hashes of the leading full blocks of ``token_ids``.

    Args:
        token_ids: ``[num_tokens]`` token ids.
        block_size: tokens per block.
        num_blocks: hash at most this many blocks (default: every full block).
        known_hashes: hashes of the first blocks already computed (reused, not recomputed).

    Returns:
        ``[min(num_blocks, num_tokens // block_size)]`` hashes.
    """
    num_full = len(token_ids) // block_size
    if num_blocks is not None:
        num_full = min(num_full, num_blocks)
    hashes = list(known_hashes[:num_full])
    parent = hashes[-1] if hashes else None
    for block_idx in range(len(hashes), num_full):
        parent = hash_block_tokens(parent, token_ids[block_idx * block_size:(block_idx + 1) * block_size])
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Map chain hash -> block id for every cached full block, with the content to verify hits.

    The cache holds metadata only; the pool's ref counts decide whether a cached block is in use or evictable.
    One hash maps to at most one block: a second block computed with the same content stays uncached.
    """

    def __init__(self) -> None:
        self._hash_to_block_id: dict[int, int] = {}
        self._block_id_to_key: dict[int, tuple[int, int | None, tuple[int, ...]]] = {}  # hash, parent, tokens

    def __len__(self) -> int:
        return len(self._hash_to_block_id)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._hash_to_block_id

    def get(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> int | None:
        """Return the block holding exactly this content, or None (miss or hash collision)."""
        block_id = self._hash_to_block_id.get(block_hash)
        if block_id is None:
            return None
        _, stored_parent, stored_tokens = self._block_id_to_key[block_id]
        if stored_parent != parent_hash or stored_tokens != tuple(token_ids):
            return None
        return block_id

    def match_prefix(self, token_ids: Sequence[int], block_hashes: Sequence[int], block_size: int) -> list[int]:
        """Return the block ids of the longest run of leading blocks that are cached with this content.

        Args:
            token_ids: ``[num_tokens]`` token ids of the sequence.
            block_hashes: chain hashes of the blocks to try, from block 0 (see :func:`hash_token_blocks`).
            block_size: tokens per block.
        """
        block_ids: list[int] = []
        parent: int | None = None
        for block_idx, block_hash in enumerate(block_hashes):
            tokens = token_ids[block_idx * block_size:(block_idx + 1) * block_size]
            block_id = self.get(block_hash, parent, tokens)
            if block_id is None:
                break
            block_ids.append(block_id)
            parent = block_hash
        return block_ids

    def insert(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int], block_id: int) -> bool:
        """Register ``block_id`` as holding this content; False (nothing changes) when the hash is taken."""
        if block_hash in self._hash_to_block_id or block_id in self._block_id_to_key:
            return False
        self._hash_to_block_id[block_hash] = block_id
        self._block_id_to_key[block_id] = (block_hash, parent_hash, tuple(token_ids))
        return True

    def remove(self, block_id: int, block_hash: int) -> None:
        """Forget an evicted block; unknown pairs are ignored."""
        key = self._block_id_to_key.get(block_id)
        if key is None or key[0] != block_hash:
            return
        del self._block_id_to_key[block_id]
        del self._hash_to_block_id[block_hash]

    def entry(self, block_id: int) -> tuple[int, int | None, tuple[int, ...]] | None:
        """Return ``(block_hash, parent_hash, token_ids)`` of a cached block, None for an uncached one."""
        return self._block_id_to_key.get(block_id)

    def block_hash_of(self, block_id: int) -> int | None:
        key = self._block_id_to_key.get(block_id)
        return None if key is None else key[0]
