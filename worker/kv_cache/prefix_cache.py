"""The map from chain hash to the KV block that holds that content (hashes: :mod:`shared.prefix_hash`).

A lookup compares the stored ``(parent_hash, token_ids)`` of the block with the query, so a collision of the 64-bit
block hash never serves another conversation's KV. Two different whole prefixes whose chains collide at the parent
hash *and* share the block's tokens would still match: probability about ``2**-64`` per pair.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.prefix_hash import hash_block_tokens, hash_token_blocks

__all__ = ["PrefixCache", "hash_block_tokens", "hash_token_blocks"]


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
