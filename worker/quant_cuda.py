"""Weight-only int4 / int8 linear layers on CUDA, through torch's own CUDA kernels.

The CPU layers of :mod:`worker.quant` keep a dense bf16 copy for prefill rows; on a GPU that copy would cost the
memory the quantization saves, so every row here runs the quantized kernel::

    int4: aten._weight_int4pack_mm (tinygemm, bf16 activations, sm_80+): w = (q - 8) * scale + zero per group of
          32 input features, the CPU layer's formula (gpt-fast's int4 weight-only scheme); codes packed two per
          byte (high nibble = even column) and then into the kernel's tiles by aten._convert_weight_to_int4pack
    int8: aten._weight_int8pack_mm (one scale per output channel) where the torch build has its CUDA kernel, else
          the int8 weights dequantized to bf16 per call and a dense matmul (int8 memory, not int8 speed)

:func:`cuda_quant_unsupported_reason` says why a mode cannot run on a GPU (compute capability, shapes); the worker
turns that into a configuration error naming ``model.weights``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from worker.quant import INT4_GROUP_SIZE, Linear, quantize_int4_groups

INT4_INNER_K_TILES = 8
INT4_MIN_CAPABILITY = (8, 0)


def cuda_quant_unsupported_reason(weights_mode: str, capability: tuple[int, int], in_features: int,
                                  out_features: int) -> str | None:
    """Return why ``weights_mode`` cannot run a ``[out_features, in_features]`` layer on a GPU of ``capability``
    (``torch.cuda.get_device_capability()``), or None when it can."""
    if weights_mode == "int4":
        if capability < INT4_MIN_CAPABILITY:
            return (f"int4 weights run torch's tinygemm kernel, which needs compute capability "
                    f"{INT4_MIN_CAPABILITY[0]}.{INT4_MIN_CAPABILITY[1]} or newer; this GPU is "
                    f"{capability[0]}.{capability[1]}")
        tile = INT4_INNER_K_TILES * 16
        if in_features % tile or out_features % 8:
            return (f"int4 weights need in_features a multiple of {tile} and out_features of 8; a layer is "
                    f"{out_features} x {in_features}")
        return None
    if weights_mode == "int8":
        return None
    return f"{weights_mode!r} is not a quantized weights mode (int4, int8)"


class CudaInt4Linear(Linear):
    """Weight-only int4 on CUDA (``aten._weight_int4pack_mm``), every row.

    Attributes:
        packed: the kernel's tiled codes (int32, from ``_convert_weight_to_int4pack``).
        scales_and_zeros: ``[in // group_size, out, 2]`` bf16, cuda.
        bias: ``[out]`` bf16 or None.
        group_size: input features per group.
    """

    kind = "int4"

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int, out_features: int, in_features: int) -> None:
        self.packed = packed
        self.scales_and_zeros = scales_and_zeros
        self.bias = bias
        self.group_size = group_size
        self.out_features, self.in_features = out_features, in_features

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None,
                   group_size: int = INT4_GROUP_SIZE) -> CudaInt4Linear:
        """Pack ``w = (q - 8) * scale + zero`` for the CUDA kernel.

        Args:
            q: ``[out, in]`` codes in ``[0, 15]``, cuda.
            scale, zero: ``[out, in // group_size]`` float, cuda.
            bias: ``[out]`` or None.
        """
        out_features, in_features = q.shape
        codes = q.to(torch.int32)
        nibbles = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, INT4_INNER_K_TILES)
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        return cls(packed, scales_and_zeros, None if bias is None else bias.to(torch.bfloat16), group_size,
                   out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), self.packed, self.group_size,
                                                 self.scales_and_zeros)
        return out if self.bias is None else out + self.bias

    def tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError("CUDA int4 layers are built at load, not cached on disk")


@functools.cache
def _int8pack_mm_has_cuda() -> bool:
    """Whether ``aten._weight_int8pack_mm`` runs on CUDA in this torch build (probed once on a tiny layer)."""
    try:
        x = torch.ones(1, 32, dtype=torch.bfloat16, device="cuda")
        w = torch.ones(8, 32, dtype=torch.int8, device="cuda")
        torch.ops.aten._weight_int8pack_mm(x, w, torch.ones(8, dtype=torch.bfloat16, device="cuda"))
        return True
    except (NotImplementedError, RuntimeError):
        return False


class CudaInt8Linear(Linear):
    """Weight-only int8 on CUDA: symmetric per output channel (``scale = absmax / 127``), every row.

    Attributes:
        q: ``[out, in]`` int8, cuda.
        scales: ``[out]`` bf16, cuda.
        bias: ``[out]`` bf16 or None.
        kernel: ``int8pack_mm`` or ``dequant_matmul`` (see the module).
    """

    kind = "int8"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.q = q
        self.scales = scales
        self.bias = bias
        self.out_features, self.in_features = q.shape
        self.kernel = "int8pack_mm" if _int8pack_mm_has_cuda() else "dequant_matmul"

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> CudaInt8Linear:
        """Quantize ``weight [out, in]`` (float, cuda) to symmetric per-channel int8."""
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(torch.bfloat16)
        q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales, None if bias is None else bias.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self.kernel == "int8pack_mm":
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scales)
        else:
            out = F.linear(x, self.q.to(torch.bfloat16) * self.scales[:, None])
        return out if self.bias is None else out + self.bias

    def tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError("CUDA int8 layers are built at load, not cached on disk")


def make_cuda_linear(weight: torch.Tensor, bias: torch.Tensor | None, weights_mode: str) -> Linear:
    """Quantize a float ``weight [out, in]`` on CUDA to a :class:`CudaInt4Linear` (min/max groups of 32) or a
    :class:`CudaInt8Linear`.

    Raises:
        ValueError: the mode cannot run this layer on this GPU (:func:`cuda_quant_unsupported_reason`).
    """
    out_features, in_features = weight.shape
    reason = cuda_quant_unsupported_reason(weights_mode, torch.cuda.get_device_capability(weight.device),
                                           in_features, out_features)
    if reason is not None:
        raise ValueError(reason)
    if weights_mode == "int4":
        q, scale, zero = quantize_int4_groups(weight)
        return CudaInt4Linear.from_codes(q, scale, zero, bias)
    return CudaInt8Linear.from_float(weight, bias)
