"""Linear layers of the model: dense (``F.linear``), or weight-only int4 / int8 through Sluice's CPU kernels.

Every projection of :class:`worker.model.LlamaModel` is a :class:`Linear`; ``forward(x)`` takes the step's
activations ``[num_tokens, in_features]``. The quantized layers keep the weights as GGUF stores them, in groups of
32 input features: int4 codes with a float32 scale and zero per group (Q4_0 / Q4_1, exactly as in the file) or
int8 codes with a scale per group (Q8_0); every row, prefill and decode alike, goes through ``q4_linear`` /
``q8_linear`` of :mod:`worker.cpu_kernels`, which quantize the activations to int8 per row and group on the fly
(llama.cpp's arithmetic on the CPU) and compute each output from its own row alone, in a fixed order. So a
request's tokens depend neither on its neighbours in the batch nor on how its prompt was chunked or cached
(``tests/worker/test_model_quant.py``). The dense layers pad their rows to a multiple of ``PREFILL_ROWS_MULTIPLE``
so that MKL rounds each row alike (:func:`padded_linear`).

Why these kernels: the four projections of 10 SmolLM2-135M layers (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536) called in a loop, random weights, median of 5, 2 threads, a quiet 2-core AMD EPYC with AVX2 only (no
AVX-512, no bf16 hardware), torch 2.13::

    rows                    1        16       64      256      512
    q4_linear (Sluice)    1.2 ms   10.7 ms  41.8 ms  171 ms   344 ms
    dense fp32 (MKL)      9.9 ms   23.1 ms  47.5 ms  149 ms   266 ms

and the LM head (49152 x 576): q8_linear 1.1 / 8.1 / 16.9 ms at 1 / 16 / 32 rows against 10.1 / 27.1 / 37.1 ms
dense. torch's own ``aten._weight_int4pack_mm_for_cpu`` needs bf16 inputs, which this CPU multiplies without
hardware: 26 ms at 1 row for these 10 layers, 326 ms at 32 on a shared machine, its time per row growing with the
rows; ``aten._weight_int8pack_mm`` likewise (16 / 303 ms). Dense MKL is faster only past about 128 rows (long
prefill chunks, 1.3x at 512 rows); one kernel for every row keeps a row's result independent of the step's shape
and the weights at 4.5 bits each in memory (no dense copy beside them). Where the kernels cannot run (no AVX2,
no compiler) the quantized layers dequantize once at load and run ``F.linear``.

Error: the weights are the file's own; each matmul input is rounded to int8 per group of 32 (at most max|x| / 254
per element) where a bf16 input would round to 2**-9 of each element; measured against the fp32 path on the
default model in ``tests/worker/test_model_quant.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker import cpu_kernels

INT4_GROUP_SIZE = 32
#: dense matmuls run on a multiple of this many rows (zero rows appended), see :func:`padded_linear`
PREFILL_ROWS_MULTIPLE = 8


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX): oneDNN's bf16 matmuls are fast."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_activation_dtype() -> torch.dtype:
    """The activations' (and the KV pool's) dtype of the quantized weights modes on this CPU: fp32 where Sluice's
    kernels run (they take and give fp32, and the fused layer operations are fp32); without them, the dense
    fallback's dtype: bf16 where the CPU multiplies bf16 in hardware, else fp32 (a bf16 matmul without it is
    several times slower than fp32's)."""
    if cpu_kernels.load() is not None:
        return torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed on ``x`` padded with zero rows to a multiple of
    ``PREFILL_ROWS_MULTIPLE`` rows, so every row's result is bit-identical however many rows share the call.

    MKL's fp32 GEMM takes other code paths for 1, 2, 3 or 5 rows (and 2 threads split rows differently), and
    oneDNN's bf16 GEMM without bf16 hardware likewise, whose sums round differently; on a multiple of 8 rows every
    row comes out bit-identical wherever it sits and however many rows share the call (checked for these models'
    shapes, 1 and 2 threads: ``tests/worker/test_model_quant.py``). So a prompt token's K/V do not depend on how its
    prompt was chunked or cached, nor a decode token on its neighbours in the batch. A matmul over weights is
    memory-bound at a few rows, so the padding costs little there. On CUDA nothing is padded: cuBLAS makes no such
    promise either way, and the pad is a kernel per call that a decode step in a CUDA graph pays for (H200, Llama-3-8B
    shapes, one row: 5-11% slower per projection, ``bench/decode_profile.py``).

    Args:
        x: ``[num_rows, in_features]``.
        weight: ``[out_features, in_features]``, ``x``'s dtype.
        bias: ``[out_features]`` or None.
    Returns:
        ``[num_rows, out_features]``.
    """
    num_rows = x.shape[0]
    pad = -num_rows % PREFILL_ROWS_MULTIPLE
    if not pad or x.is_cuda:
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, pad)), weight, bias)[:num_rows]


class Linear:
    """``y = x @ W^T (+ b)`` for ``x [num_tokens, in_features]``; ``out_features x in_features`` weights.

    Attributes:
        out_features, in_features: sizes.
        kind: ``dense``, ``int4`` or ``int8``.
    """

    kind = "dense"
    out_features: int
    in_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        """Return the tensors that rebuild this layer with :func:`linear_from_tensors` (the on-disk cache)."""
        raise NotImplementedError


class DenseLinear(Linear):
    """A dense matmul (``F.linear``) in the weight's dtype, on rows padded to a multiple of 8 (:func:`padded_linear`).

    Args:
        weight: ``[out, in]``, the activations' dtype.
        bias: ``[out]`` or None.
    """

    kind = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return padded_linear(x, self.weight, self.bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"weight": self.weight}
        if self.bias is not None:
            out["bias"] = self.bias
        return out


class InputMajorLinear(Linear):
    """A dense matmul over the weight stored input-major, ``W^T`` as ``[in, out]`` contiguous: ``x @ W^T`` is
    ``torch.mm(x, weight_t)`` (``addmm`` with a bias), with no row padding. For CUDA, where cuBLAS(Lt) picks
    faster kernels for some shapes in this layout: Llama-3-8B on an H200, cuBLASLt, 32 layers' weights (cold in L2),
    per layer at 64 rows: gate_up 58.7 us vs 61.7 us over ``[out, in]``, o 11.3 vs 11.9 us (256 rows: 108.5 vs
    113.6, 17.5 vs 18.8 us; one row: equal); qkv and down are as fast or faster ``[out, in]``
    (``bench/decode_probe.py``, ``bench/results/gpu/decode_probe.json``).

    Args:
        weight_t: ``[in, out]`` contiguous, the activations' dtype.
        bias: ``[out]`` or None.
    """

    kind = "dense"

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight_t = weight_t
        self.bias = bias
        self.in_features, self.out_features = weight_t.shape

    @classmethod
    def from_dense(cls, linear: DenseLinear) -> InputMajorLinear:
        """The same layer with its ``[out, in]`` weight copied input-major (the original is then unreferenced)."""
        return cls(linear.weight.t().contiguous(), linear.bias)

    @property
    def weight(self) -> torch.Tensor:
        """``[out, in]``: a transposed view of ``weight_t``."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    tensors = DenseLinear.tensors  # the same ``weight`` ([out, in], a view here) and ``bias``


class _QuantizedLinear(Linear):
    """Every row through Sluice's quantized kernel (float32 in and out, any activations' dtype around it); where
    the kernels do not run, through ``F.linear`` over the weights dequantized once (:func:`padded_linear`)."""

    bias: torch.Tensor | None

    def __init__(self) -> None:
        self._kernels = cpu_kernels.load()
        self._dense = None if self._kernels is not None else self.dequantized().to(cpu_activation_dtype())

    def dequantized(self) -> torch.Tensor:  # pragma: no cover - interface
        """The weights ``[out, in]`` float32."""
        raise NotImplementedError

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense is not None:
            return padded_linear(x, self._dense.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        out = self._matmul(x.float().contiguous()).to(x.dtype)
        return out if self.bias is None else out + self.bias


class Int4Linear(_QuantizedLinear):
    """Weight-only int4 in groups of 32 input features with a scale and a zero each (GGUF's Q4_0 / Q4_1 blocks),
    every row through Sluice's ``q4_linear`` (:mod:`worker.cpu_kernels`), see the module.

    Build it with :meth:`from_codes` (or :func:`linear_from_tensors` from the cache).

    Attributes:
        codes: ``[out, in // 2]`` uint8, two codes a byte in GGUF's order (:mod:`worker.cpu_kernels`).
        scale, zero: ``[out, in // 32]`` float32, ``w = (code - 8) * scale + zero``.
        bias: ``[out]`` in the activations' dtype, or None.
    """

    kind = "int4"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        self.codes = codes
        self.scale = scale
        self.zero = zero
        self.bias = bias
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * 2
        super().__init__()

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None,
                   group_size: int = INT4_GROUP_SIZE, dtype: torch.dtype | None = None) -> Int4Linear:
        """Pack ``w = (q - 8) * scale + zero``.

        Args:
            q: ``[out, in]`` integer codes in ``[0, 15]`` (any int dtype).
            scale, zero: ``[out, in // 32]`` float32, kept exact.
            bias: ``[out]`` or None.
            group_size: input features per group: 32 (the kernel's).
            dtype: the activations' dtype, of the bias (default: :func:`cpu_activation_dtype`).

        Raises:
            ValueError: ``group_size`` is not 32, or ``in`` is not a multiple of it.
        """
        out_features, in_features = q.shape
        if group_size != INT4_GROUP_SIZE or in_features % group_size:
            raise ValueError(f"int4 weights need groups of {INT4_GROUP_SIZE} input features "
                             f"(got {group_size}, in_features {in_features})")
        groups = q.to(torch.uint8).view(out_features, in_features // group_size, group_size)
        codes = (groups[..., :16] | (groups[..., 16:] << 4)).reshape(out_features, in_features // 2).contiguous()
        dtype = dtype or cpu_activation_dtype()
        return cls(codes, scale.float().contiguous(), zero.float().contiguous(),
                   None if bias is None else bias.to(dtype))

    def dequantized(self) -> torch.Tensor:
        packed = self.codes.view(self.out_features, -1, 16)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
        return ((q - 8) * self.scale[..., None] + self.zero[..., None]).view(self.out_features, self.in_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.q4_linear(x, self.codes, self.scale, self.zero)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"codes": self.codes, "scale": self.scale, "zero": self.zero}
        if self.bias is not None:
            out["bias"] = self.bias
        return out


class Int8Linear(_QuantizedLinear):
    """Weight-only int8 in groups of 32 input features with one scale each (GGUF's Q8_0 block), every row through
    Sluice's ``q8_linear`` (:mod:`worker.cpu_kernels`), see the module.

    Attributes:
        codes: ``[out, in]`` int8, ``w = code * scale``.
        scale: ``[out, in // 32]`` float32.
        bias: ``[out]`` in the activations' dtype, or None.
    """

    kind = "int8"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.codes = codes
        self.scale = scale
        self.bias = bias
        self.out_features, self.in_features = codes.shape
        super().__init__()

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> Int8Linear:
        """Quantize ``weight [out, in]`` (float) to symmetric int8 per group of 32: ``scale = absmax / 127``
        (llama.cpp's Q8_0; a Q8_0 tensor's own codes and scales come back exactly where a group's largest code
        is +-127, which llama.cpp's quantizer makes so); the bias in ``dtype`` (default:
        :func:`cpu_activation_dtype`).

        Raises:
            ValueError: ``in`` is not a multiple of 32.
        """
        out_features, in_features = weight.shape
        if in_features % INT4_GROUP_SIZE:
            raise ValueError(f"int8 weights need in_features a multiple of {INT4_GROUP_SIZE} (got {in_features})")
        w = weight.float().view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        scale = w.abs().amax(dim=-1) / 127
        inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        codes = torch.round(w * inverse[..., None]).clamp_(-127, 127).to(torch.int8)
        dtype = dtype or cpu_activation_dtype()
        return cls(codes.view(out_features, in_features).contiguous(), scale.contiguous(),
                   None if bias is None else bias.to(dtype))

    def dequantized(self) -> torch.Tensor:
        groups = self.codes.float().view(self.out_features, -1, INT4_GROUP_SIZE)
        return (groups * self.scale[..., None]).view(self.out_features, self.in_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.q8_linear(x, self.codes, self.scale)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"codes": self.codes, "scale": self.scale}
        if self.bias is not None:
            out["bias"] = self.bias
        return out


def quantized_head(weight: torch.Tensor, weights_mode: str) -> Linear:
    """The LM head ``[vocab, hidden]`` of a model in ``weights_mode``: in the quantized modes on a CPU whose kernels
    run, int8 in groups of 32 (:class:`Int8Linear`, as llama.cpp's head takes the file's Q8_0 embedding); else
    dense over ``weight`` itself."""
    if weights_mode in ("int4", "int8") and not weight.is_cuda and cpu_kernels.load() is not None:
        return Int8Linear.from_float(weight)
    return DenseLinear(weight)


def quantize_int4_groups(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``weight [out, in]`` (float) to asymmetric int4 per group (min/max): ``(q, scale, zero)`` as
    :meth:`Int4Linear.from_codes` takes them (``w ~ (q - 8) * scale + zero``, error <= scale / 2)."""
    out_features, in_features = weight.shape
    w = weight.float().view(out_features, in_features // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.view(out_features, in_features), scale, lo + 8 * scale


def linear_from_tensors(kind: str, tensors: dict[str, torch.Tensor]) -> Linear:
    """Rebuild a :class:`Linear` of ``kind`` from its :meth:`Linear.tensors` (the on-disk cache).

    Raises:
        ValueError: an unknown kind.
    """
    bias = tensors.get("bias")
    if kind == "dense":
        return DenseLinear(tensors["weight"], bias)
    if kind == "int4":
        return Int4Linear(tensors["codes"], tensors["scale"], tensors["zero"], bias)
    if kind == "int8":
        return Int8Linear(tensors["codes"], tensors["scale"], bias)
    raise ValueError(f"unknown linear kind {kind!r}")
