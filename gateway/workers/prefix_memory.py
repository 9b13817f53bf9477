"""Which prompt blocks this gateway recently sent to a worker: the likely content of its prefix cache.

Prefix-aware routing ranks workers by how many leading blocks of a prompt (chain hashes, ``shared.prefix_hash``)
each one was sent lately. The memory is bounded and forgets the oldest first, like the worker's own LRU cache, and
is cleared when the connection drops (a new process has an empty cache).
"""

from __future__ import annotations

import collections

# Prompt-block hashes remembered per worker (about 64 K tokens of 16-token blocks per 4096 entries).
MAX_PREFIX_HASHES_PER_WORKER = 4096


class PrefixMemory:
    """The chain hashes of prompt blocks sent to one worker, most recent last.

    Args:
        max_hashes: hashes kept; the oldest are forgotten first.
    """

    def __init__(self, max_hashes: int = MAX_PREFIX_HASHES_PER_WORKER) -> None:
        self.max_hashes = max_hashes
        self._hashes: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def cached_blocks(self, block_hashes: list[int]) -> int:
        """Return how many leading blocks of ``block_hashes`` were recently sent (likely in the worker's cache)."""
        num_blocks = 0
        for block_hash in block_hashes:
            if block_hash not in self._hashes:
                break
            num_blocks += 1
        return num_blocks

    def remember(self, block_hashes: list[int]) -> None:
        """Record the prompt blocks just sent (the oldest beyond ``max_hashes`` are forgotten)."""
        for block_hash in block_hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.max_hashes:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()
