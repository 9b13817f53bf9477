"""The decoder layer's row-wise operations (RMSNorm with the residual add, RoPE, SwiGLU), in torch or fused.

:class:`LlamaModel.forward <worker.model.LlamaModel.forward>` calls them between its matmuls and attention::

    h = norm(x, w)                 x: [num_tokens, hidden] fp32 residual stream -> h in the activations' dtype
    x, h = add_norm(x, delta, w)   x + delta, then its norm (the residual add of attention's or the MLP's output)
    q, k, v = rope_qkv(qkv, cos, sin)   qkv [num_tokens, (heads + 2 kv_heads) * head_dim]; q and k rotated
    a = swiglu(gate_up)            silu(gate) * up

:class:`TorchLayerOps` runs torch's operators. :class:`FusedLayerOps` runs Sluice's fused CPU kernels
(:mod:`worker.cpu_kernels`, ``elementwise.cpp``): one call each instead of torch's six for an RMSNorm, four for RoPE
and three for SwiGLU, which at a decode step of a few rows cost more than their arithmetic (SmolLM2-135M, one
sequence, 2-core AMD EPYC, torch profiler: the operators torch ran besides the matmuls took 5.7 ms of a 19 ms step on
a busy machine; with the fused ones, what torch still runs takes 1.5 ms of a 9.9 ms step on a quiet one).
:class:`worker.cuda_kernels.CudaLayerOps` runs the same operations as one CUDA kernel each on a GPU (bf16/fp16
activations). :func:`layer_ops` picks the fused ones where they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from worker.cuda_kernels import CudaLayerOps


class TorchLayerOps:
    """The row-wise operations in torch (any device and dtype).

    Args:
        act_dtype: the activations' dtype (matmul inputs); the residual stream and norms stay fp32.
        eps: RMSNorm's epsilon.
        num_heads, num_kv_heads, head_dim: the attention's shape.
    """

    def __init__(self, act_dtype: torch.dtype, eps: float, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.act_dtype = act_dtype
        self.eps = eps
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``x [n, hidden]`` fp32 by ``weight [hidden]`` fp32, in the activations' dtype."""
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps).to(self.act_dtype)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(x + delta, norm(x + delta))``; ``x`` may be updated in place."""
        x = x + delta
        return x, self.norm(x, weight)

    def rope_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split ``qkv`` into q ``[n, heads, d]``, k and v ``[n, kv_heads, d]``, q and k rotated by
        ``cos``/``sin [n, d // 2]`` (rotate_half)."""
        n, d = qkv.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qk = qkv[:, : q_size + kv_size].view(n, -1, d)
        x1, x2 = qk.chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        return q, k, qkv[:, q_size + kv_size :].view(n, self.num_kv_heads, d)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [n, 2 intermediate]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedLayerOps(TorchLayerOps):
    """The same operations through Sluice's fused CPU kernels: float32 activations on the CPU only.

    ``add_norm`` adds in place into ``x`` (the forward pass owns its residual stream); ``rope_qkv`` rotates q and k
    in place inside ``qkv``.
    """

    def __init__(self, kernels, eps: float, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(torch.float32, eps, num_heads, num_kv_heads, head_dim)
        self._kernels = kernels

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._kernels.rms_norm(x.contiguous(), weight, self.eps)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self._kernels.add_rms_norm_(x, delta.contiguous(), weight, self.eps)

    def rope_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, d = qkv.shape[0], self.head_dim
        self._kernels.rope_(qkv, self.num_heads + self.num_kv_heads, d, cos, sin)
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        return (qkv[:, :q_size].view(n, self.num_heads, d), qkv[:, q_size : q_size + kv_size].view(n, -1, d),
                qkv[:, q_size + kv_size :].view(n, self.num_kv_heads, d))

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._kernels.silu_mul(gate_up.contiguous())


def layer_ops(act_dtype: torch.dtype, device: torch.device, eps: float, num_heads: int, num_kv_heads: int,
              head_dim: int, hidden_size: int | None = None) -> TorchLayerOps | CudaLayerOps:
    """The fused operations where they run: Sluice's CPU kernels for float32 activations on a CPU whose kernels load
    (head_dim a multiple of 16, the hidden sizes of 8); its CUDA kernels (:mod:`worker.cuda_kernels`) for bf16 /
    fp16 activations on CUDA where CuPy sees the device (an even head_dim up to 2048, a hidden size their norms take;
    ``hidden_size`` None: ``num_heads * head_dim``); else torch's."""
    if device.type == "cuda":
        from worker import cuda_kernels

        hidden = hidden_size if hidden_size is not None else num_heads * head_dim
        if cuda_kernels.supported(act_dtype, device, head_dim, hidden):
            return cuda_kernels.CudaLayerOps(act_dtype, eps, num_heads, num_kv_heads, head_dim)
    if act_dtype == torch.float32 and device.type == "cpu" and head_dim % 16 == 0:
        from worker import cpu_kernels

        kernels = cpu_kernels.load()
        if kernels is not None:
            return FusedLayerOps(kernels, eps, num_heads, num_kv_heads, head_dim)
    return TorchLayerOps(act_dtype, eps, num_heads, num_kv_heads, head_dim)
