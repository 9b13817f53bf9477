"""The map from chain hash to the KV block that holds that content (hashes: :mod:`shared.prefix_hash`).

A lookup compares the stored ``(parent_hash, token_ids)`` of the block with the query, so a collision of the 64-bit
block hash never serves another conversation's KV. Two different whole prefixes whose chains collide at the parent
hash *and* share the block's tokens would still match: probability about ``2**-64`` per pair.

Besides whole blocks, :meth:`PrefixCache.match_partial` finds the cached block after a matched chain that shares the
longest run of leading tokens with the query's next block: the KV manager copies those rows instead of recomputing
them (a prompt rarely ends on a block boundary, and its last block, full of the previous answer's tokens, never
matches whole).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from shared.prefix_hash import hash_block_tokens, hash_token_blocks

__all__ = ["PrefixCache", "hash_block_tokens", "hash_token_blocks"]


class PrefixCache:
    """Map chain hash -> block id for every cached full block, with the content to verify hits.

    The cache holds metadata only; the pool's ref counts decide whether a cached block is in use or evictable.
    One hash maps to at most one block: a second block computed with the same content stays uncached.
    """

    # candidates compared per partial lookup: bounds its cost (about 1 µs each) when thousands of chains branch
    # from one parent on the same token (conversations under one system prompt)
    MAX_PARTIAL_CANDIDATES = 64

    def __init__(self) -> None:
        self._hash_to_block_id: dict[int, int] = {}
        self._block_id_to_key: dict[int, tuple[int, int | None, tuple[int, ...]]] = {}  # hash, parent, tokens
        # (parent_hash, first token id) -> the cached blocks that follow that parent and start with that token
        self._children: dict[tuple[int | None, int], dict[int, None]] = {}

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

    def match_partial(self, parent_hash: int | None, token_ids: Sequence[int]) -> tuple[int | None, int]:
        """Find the cached block following ``parent_hash`` whose leading tokens agree longest with ``token_ids``.

        Args:
            parent_hash: chain hash of the last matched block (None: the query's first block).
            token_ids: the query's next tokens, at most a block of them (the caller caps how many may be reused).

        Returns:
            ``(block_id, num_matching_tokens)``; ``(None, 0)`` when no cached block starts with ``token_ids[0]``.
            Only the first :attr:`MAX_PARTIAL_CANDIDATES` candidates (oldest first) are compared.
        """
        if not token_ids:
            return None, 0
        children = self._children.get((parent_hash, token_ids[0]))
        if not children:
            return None, 0
        query = tuple(token_ids)
        best_block_id, best_len = None, 0
        for block_id in islice(children, self.MAX_PARTIAL_CANDIDATES):
            stored = self._block_id_to_key[block_id][2]
            num_matching = next((i for i, (a, b) in enumerate(zip(query, stored)) if a != b),
                                min(len(query), len(stored)))
            if num_matching > best_len:
                best_block_id, best_len = block_id, num_matching
                if num_matching == len(query):
                    break
        return best_block_id, best_len

    def insert(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int], block_id: int) -> bool:
        """Register ``block_id`` as holding this content; False (nothing changes) when the hash is taken."""
        if block_hash in self._hash_to_block_id or block_id in self._block_id_to_key:
            return False
        tokens = tuple(token_ids)
        self._hash_to_block_id[block_hash] = block_id
        self._block_id_to_key[block_id] = (block_hash, parent_hash, tokens)
        if tokens:
            self._children.setdefault((parent_hash, tokens[0]), {})[block_id] = None
        return True

    def remove(self, block_id: int, block_hash: int) -> None:
        """Forget an evicted block; unknown pairs are ignored."""
        key = self._block_id_to_key.get(block_id)
        if key is None or key[0] != block_hash:
            return
        del self._block_id_to_key[block_id]
        del self._hash_to_block_id[block_hash]
        _, parent_hash, tokens = key
        if tokens:
            siblings = self._children[(parent_hash, tokens[0])]
            del siblings[block_id]
            if not siblings:
                del self._children[(parent_hash, tokens[0])]

    def entry(self, block_id: int) -> tuple[int, int | None, tuple[int, ...]] | None:
        """Return ``(block_hash, parent_hash, token_ids)`` of a cached block, None for an uncached one."""
        return self._block_id_to_key.get(block_id)

    def block_hash_of(self, block_id: int) -> int | None:
        key = self._block_id_to_key.get(block_id)
        return None if key is None else key[0]
