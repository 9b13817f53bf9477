"""Reload or recompute: the cost model behind every offload decision (DESIGN.md, KV cache → offload).

Moving a block costs ``block_bytes ÷ bandwidth(tier)`` seconds; recomputing it costs ``block_size ÷ prefill rate``
seconds. Both rates are measured on the worker's own transfers and prefill steps (an exponentially weighted mean;
the first measurement replaces the configured initial estimate), so the decision follows the hardware: on a CPU
worker a 135M model prefills ~10^3 tokens/s and any tier wins; on an H200 serving an 8B model prefill runs at
~10^4–10^5 tokens/s and a slow Redis link loses. The same model picks swap vs recompute for a preemption victim
(two host transfers, out and back, against recomputing its computed tokens), like vLLM v0's swap space.
"""

from __future__ import annotations

from collections.abc import Sequence

GB = 1e9


class CostModel:
    """Measured transfer bandwidths per tier and the measured prefill rate, and the decisions they imply.

    Args:
        bandwidth_bytes_per_s: initial estimate per tier name (``host``, ``disk``, ``redis``), bytes/s.
        prefill_tokens_per_s: initial estimate of the prefill rate, tokens/s.
        smoothing: weight of a new measurement in the moving average, 0–1.
    """

    def __init__(self, bandwidth_bytes_per_s: dict[str, float], prefill_tokens_per_s: float,
                 smoothing: float = 0.2) -> None:
        if prefill_tokens_per_s <= 0 or any(bw <= 0 for bw in bandwidth_bytes_per_s.values()):
            raise ValueError("cost model: initial bandwidths and prefill rate must be > 0")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"cost model: smoothing must be in (0, 1], got {smoothing}")
        self._bandwidth = dict(bandwidth_bytes_per_s)
        self._prefill_rate = prefill_tokens_per_s
        self._measured: set[str] = set()
        self._frozen = False
        self.smoothing = smoothing

    def freeze(self, prefill_tokens_per_s: float | None = None,
               bandwidth_bytes_per_s: dict[str, float] | None = None) -> None:
        """Pin the estimates to the given values and ignore measurements from now on (benchmarks, and tests that
        pin a decision)."""
        if prefill_tokens_per_s is not None:
            self._prefill_rate = prefill_tokens_per_s
        self._bandwidth.update(bandwidth_bytes_per_s or {})
        self._frozen = True

    # ------------------------------------------------------------------ measurements

    def _update(self, name: str, old: float, sample: float) -> float:
        if self._frozen:
            return old
        if name not in self._measured:
            self._measured.add(name)
            return sample
        return (1.0 - self.smoothing) * old + self.smoothing * sample

    def observe_transfer(self, tier: str, num_bytes: int, elapsed_s: float) -> None:
        """Record one real transfer of ``num_bytes`` between the device pool and ``tier`` that took ``elapsed_s``."""
        if num_bytes <= 0 or elapsed_s <= 0:
            return
        self._bandwidth[tier] = self._update(tier, self._bandwidth.get(tier, num_bytes / elapsed_s),
                                             num_bytes / elapsed_s)

    def observe_prefill(self, num_tokens: int, elapsed_s: float) -> None:
        """Record one model step that prefilled ``num_tokens`` tokens in ``elapsed_s`` seconds."""
        if num_tokens <= 0 or elapsed_s <= 0:
            return
        self._prefill_rate = self._update("prefill", self._prefill_rate, num_tokens / elapsed_s)

    def bandwidth_bytes_per_s(self, tier: str) -> float:
        return self._bandwidth[tier]

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._prefill_rate

    # ------------------------------------------------------------------ decisions

    def transfer_s(self, tier: str, num_bytes: int) -> float:
        """Seconds to move ``num_bytes`` between the device pool and ``tier``."""
        return num_bytes / self._bandwidth[tier]

    def recompute_s(self, num_tokens: int) -> float:
        """Seconds to prefill ``num_tokens`` tokens."""
        return num_tokens / self._prefill_rate

    def num_blocks_to_reload(self, run_tiers: Sequence[str], block_bytes: int, block_size: int) -> int:
        """Return how many leading blocks of a run found in lower tiers to reload; the rest is recomputed.

        Args:
            run_tiers: the tier holding each consecutive block of the run, ``[num_run_blocks]``.
            block_bytes: bytes of one block.
            block_size: tokens of one block.

        Returns:
            ``k`` minimising ``Σ_{i<k} transfer_s(block i) + recompute_s((n - k) · block_size)``: the reload must
            stay contiguous from the device hits, so a slow block in the middle ends the run when what follows it
            does not pay for it.
        """
        per_block_recompute_s = self.recompute_s(block_size)
        best_k, best_saving_s, saving_s = 0, 0.0, 0.0
        for k, tier in enumerate(run_tiers, start=1):
            saving_s += self.transfer_s(tier, block_bytes) - per_block_recompute_s
            if saving_s < best_saving_s:
                best_k, best_saving_s = k, saving_s
        return best_k

    def prefers_swap(self, num_blocks: int, block_bytes: int, num_computed_tokens: int) -> bool:
        """Whether swapping a preemption victim's blocks out to host RAM and back beats recomputing its tokens."""
        return 2.0 * self.transfer_s("host", num_blocks * block_bytes) < self.recompute_s(num_computed_tokens)
