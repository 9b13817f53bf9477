"""The KV blocks a gateway has promised on one worker, with the prompt blocks that requests share counted once.

A request's KV demand is ``ceil((prompt + max_tokens) ÷ block size)`` blocks. Its leading full prompt blocks —
named by their chain hashes (``shared.prefix_hash``), the names the gateway routes by and the worker caches under —
are shared with every other request on the worker that starts with the same tokens: the worker's prefix cache
holds one copy, pinned while any of them runs. So the booking keeps two parts::

    booked blocks = Σ private blocks of the admitted requests  +  |distinct shareable prompt blocks they hold|
                    (partial last prompt block + output)           (one count per chain hash, refcounted)

A new request adds its private blocks and only those shareable blocks no admitted request holds yet: what the
worker will newly allocate for it. A shared block stays booked until the last request holding it is released,
whatever the order the requests end in. The blocks a request may share are those the worker can reuse: at most
``(prompt tokens − 1) ÷ block size`` (the worker computes the last prompt token itself, so a prompt that ends on a
block boundary allocates its last block anew).

The worker's own count of used blocks stays the check on this estimate (:attr:`WorkerClient.committed_kv_blocks`
takes the larger): requests that arrive together before their common prefix is computed each allocate it until the
first one's blocks are cached, and the worker admits them when it has room.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def shareable_hashes(block_hashes: Sequence[int], num_prompt_tokens: int, block_size_tokens: int) -> Sequence[int]:
    """Return the chain hashes of the prompt blocks a worker can reuse from another request: the leading full
    blocks that do not hold the last prompt token.

    Args:
        block_hashes: chain hashes of the prompt's full blocks (``hash_token_blocks``).
        num_prompt_tokens: prompt length in tokens.
        block_size_tokens: tokens per KV block.
    """
    return block_hashes[:max(0, num_prompt_tokens - 1) // block_size_tokens]


class KvBooking:
    """The KV blocks booked on one worker by this gateway's admitted requests (see the module docstring)."""

    def __init__(self) -> None:
        self.num_private_blocks = 0
        self._holders_by_hash: Counter[int] = Counter()

    @property
    def num_blocks(self) -> int:
        """Blocks booked: private blocks plus each held shareable block once."""
        return self.num_private_blocks + len(self._holders_by_hash)

    @property
    def num_shared_blocks(self) -> int:
        """Distinct shareable prompt blocks held by admitted requests."""
        return len(self._holders_by_hash)

    def num_held(self, hashes: Sequence[int]) -> int:
        """Return how many of ``hashes`` admitted requests hold already (booked, so not booked again)."""
        return sum(1 for block_hash in hashes if block_hash in self._holders_by_hash)

    def new_blocks(self, demand_blocks: int, hashes: Sequence[int]) -> int:
        """Return the blocks a request of ``demand_blocks`` whose shareable prompt blocks are ``hashes`` would add."""
        return demand_blocks - self.num_held(hashes)

    def book(self, demand_blocks: int, hashes: Sequence[int]) -> int:
        """Book a request: ``demand_blocks`` in all, ``hashes`` its shareable prompt blocks (≤ demand).

        Returns:
            The blocks it added to :attr:`num_blocks`.
        """
        added = self.new_blocks(demand_blocks, hashes)
        self.num_private_blocks += demand_blocks - len(hashes)
        self._holders_by_hash.update(hashes)
        return added

    def release(self, demand_blocks: int, hashes: Sequence[int]) -> None:
        """Release a request booked with the same arguments; its shared blocks stay while others hold them."""
        self.num_private_blocks -= demand_blocks - len(hashes)
        for block_hash in hashes:
            holders = self._holders_by_hash[block_hash] - 1
            if holders > 0:
                self._holders_by_hash[block_hash] = holders
            else:
                del self._holders_by_hash[block_hash]
