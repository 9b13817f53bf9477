"""The ``cpu`` attention backend: decode steps through Sluice's own CPU kernel, prefill through the torch path.

Decode attention reads every sequence's K/V in place from the pool's blocks (``paged_decode_attention`` of
:mod:`worker.cpu_kernels`, AVX2; float32 or bfloat16 pools): no gathered copy of the context, grouped-query heads
sharing each K/V row, the (sequence, KV head) pairs split among threads. Measured on a quiet 2-core AMD EPYC
(AVX2), 2 threads, SmolLM2-135M's heads (9 query, 3 KV, head_dim 64), fp32 pool, one layer, against torch's
``scaled_dot_product_attention`` over gathered pages (:func:`worker.attention.torch_ref.sdpa_decode_attention`)::

    sequences x context    1 x 200    16 x 200    32 x 250    16 x 2000
    this kernel            0.03 ms    0.27 ms     0.69 ms     3.9 ms
    torch (gather + SDPA)  0.17 ms    0.76 ms     4.7 ms      8.0 ms

Prefill chunks and the K/V writes are :class:`worker.attention.torch_ref.TorchAttentionBackend`'s.
"""

from __future__ import annotations

import torch

from worker import cpu_kernels
from worker.attention.torch_ref import TorchAttentionBackend, _StepPlan


class CpuKernelUnavailableError(RuntimeError):
    """The ``cpu`` backend was asked for where its kernel cannot run (not a CPU device, or no AVX2 / no build)."""


class CpuAttentionBackend(TorchAttentionBackend):
    """Paged attention on the CPU with Sluice's decode kernel (see the module).

    Args:
        device: the CPU.

    Raises:
        CpuKernelUnavailableError: ``device`` is not the CPU, or the kernels do not load here
            (:func:`worker.cpu_kernels.load` says why in the log).
    """

    name = "cpu"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        if self.device.type != "cpu":
            raise CpuKernelUnavailableError(f"the cpu attention backend runs on the CPU, not {self.device}")
        kernels = cpu_kernels.load()
        if kernels is None:
            raise CpuKernelUnavailableError("Sluice's CPU kernels do not run here (see cpu_kernels_unavailable in "
                                            "the log); use attention_backend = \"torch\"")
        self._kernels = kernels

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _StepPlan,
                scale: float) -> torch.Tensor:
        out = self._kernels.paged_decode_attention(q.float().contiguous(), k_cache, v_cache,
                                                   plan.decode_tables.contiguous(), plan.decode_lens.contiguous(),
                                                   scale)
        return out.to(q.dtype)
