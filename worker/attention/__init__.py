"""Attention backends over the paged KV pool, chosen by name.

A backend writes the step's new K/V into their slots and attends every query token causally over its
sequence's context. The model calls :meth:`AttentionBackend.begin_forward` once per step (per-step metadata
shared by all layers), then :meth:`AttentionBackend.forward` once per layer.

Backends: ``torch`` (:mod:`worker.attention.torch_ref`, CPU and GPU), ``cpu`` (:mod:`worker.attention.cpu_paged`,
Sluice's AVX2 decode kernel, CPU only) and ``cupy`` (``worker.attention.cupy_paged``, class
``CupyAttentionBackend``, CUDA only). ``auto`` picks ``cupy`` on a CUDA device when CuPy imports, ``cpu`` on the CPU
when Sluice's CPU kernels load (:func:`worker.cpu_kernels.load`), else ``torch``.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker.batch import ForwardBatch

# name -> (module, class); imported lazily so that CuPy is only needed when asked for.
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("worker.attention.torch_ref", "TorchAttentionBackend"),
    "cpu": ("worker.attention.cpu_paged", "CpuAttentionBackend"),
    "cupy": ("worker.attention.cupy_paged", "CupyAttentionBackend"),
}


class AttentionBackend(ABC):
    """Paged attention for one model step; stateless across steps.

    Args:
        device: the model's device.
    """

    name: str = ""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def begin_forward(self, batch: ForwardBatch) -> None:  # noqa: B027 (optional hook)
        """Prepare per-step metadata shared by all layers (default: nothing)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_kv: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        """Write ``k``/``v`` into their slots, then attend each query over its sequence's context.

        Args:
            q: ``[num_tokens, num_heads, head_dim]`` (RoPE applied), the pool's dtype and device.
            k: ``[num_tokens, num_kv_heads, head_dim]`` (RoPE applied).
            v: ``[num_tokens, num_kv_heads, head_dim]``.
            layer_kv: ``[2, num_blocks, num_kv_heads, block_size, head_dim]``, this layer's K and V pools.
            batch: the step (``slot_mapping``, ``query_start_loc``, ``seq_lens``, ``block_tables``,
                ``context_lens``).
            scale: softmax scale.

        Returns:
            ``[num_tokens, num_heads, head_dim]``: the token at position ``p`` attends to positions ``<= p`` of
            its own sequence.
        """


def make_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Create the attention backend called ``name`` (``auto``, ``torch``, ``cpu`` or ``cupy``) for ``device``.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
        ImportError: ``cupy`` asked for and CuPy (or its backend module) is missing.
        RuntimeError: ``cpu`` asked for where Sluice's CPU kernels do not run.
    """
    device = torch.device(device)
    if name == "auto":
        name = "torch"
        if device.type == "cuda" and importlib.util.find_spec("cupy") is not None:
            name = "cupy"
        elif device.type == "cpu":
            from worker import cpu_kernels

            if cpu_kernels.load() is not None:
                name = "cpu"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: auto, {', '.join(sorted(_BACKENDS))}")
    module_name, class_name = _BACKENDS[name]
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    return backend_cls(device)
