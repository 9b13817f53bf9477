"""Linear layers of the model: dense, or weight-only int4 / int8 through torch's own CPU kernels.

Every projection of :class:`worker.model.LlamaModel` is a :class:`Linear`; ``forward(x, rows)`` takes the step's
activations ``[num_tokens, in_features]`` and a :class:`RowSplit` saying which rows are decode tokens (the one new
token of a sequence, a token it generated) and which are prefill tokens (a chunk of a prompt, even of one token)::

    decode rows  ──▶ weight-only quantized matmul, bf16 inputs (reads 4 or 8 bits a weight: decode is memory-bound)
    prefill rows ──▶ dense matmul over the same weights dequantized once at load, in the activations' dtype
                     (:func:`cpu_activation_dtype`: bf16 with bf16 hardware, else fp32; compute-bound)

The kernel a row takes depends only on the row's kind, never on how many other rows share the step; the quantized
kernels compute each output row independently of the others, and the prefill matmul is padded to a multiple of
``PREFILL_ROWS_MULTIPLE`` rows so that MKL rounds each row alike (``_SplitLinear._prefill``). So a request's tokens
depend neither on its neighbours in the batch nor on how its prompt was chunked or cached
(``tests/worker/test_model_quant.py``).

Kernels on a 2-core AMD EPYC with AVX-512 (avx512_bf16, avx512_vnni), torch 2.13, one thread: the four projections
of 10 SmolLM2-135M layers (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) called in a loop, random
weights, 5 repeats (a shared machine: read ratios rather than absolute times)::

    rows            1        4       16       32      128
    int4 bf16     2.0 ms   3.4 ms  14.2 ms  51.2 ms  147 ms   aten._weight_int4pack_mm_for_cpu
    dense bf16   15.7 ms   6.9 ms   8.6 ms  18.9 ms   15 ms   F.linear (oneDNN)
    int4 fp16     134 ms                                      (no vectorised path: unusable)
    int4 fp32     209 ms                                      (idem)
    int8 bf16    ~1.9x dense bf16's time at 1 row, 3.5x slower at 32   aten._weight_int8pack_mm

The same on a 2-core AMD EPYC with AVX2 only (no AVX-512, no bf16 hardware), a heavily shared machine (medians)::

    rows            1        4        8       16       32
    int4 bf16      26 ms    42 ms    76 ms   124 ms   326 ms
    int8 bf16      16 ms    32 ms    78 ms   130 ms   303 ms
    dense bf16     38 ms    87 ms   245 ms   415 ms   779 ms   (no bf16 hardware: no fast path)
    dense fp32     51 ms    77 ms    75 ms   178 ms   159 ms   (MKL)
    int4 fp32 input: 14x the bf16 input's time at 1 row

and the whole model on that CPU through the engine (one thread, the weights modes interleaved step by step in one
process, fastest of 20 steps): one stream decodes in 117 ms a step with int4 decode rows, 173 ms in fp32, and an
80-token prompt prefills in 1.3 s with fp32 prefill rows against 7.1 s in bf16. So int4 decode rows always run
``_weight_int4pack_mm_for_cpu`` with bf16 inputs, and prefill rows the dense copy in bf16 where the CPU has bf16
hardware, else in fp32 (``model.weights = "auto"`` picks int4 for a Q4 file on both). The int4 kernel computes
``w = (q - 8) * scale + zero`` per group of ``group_size`` input features with ``scale`` and ``zero`` in bf16:
GGUF's Q4_0/Q4_1 fp16 group scales (``d``) and mins (``m``) map to ``scale = d``, ``zero = m + 8 d`` exactly in fp32
and are rounded once to bf16 (relative error <= 2**-9; the fp16/fp32 kernels that would keep them exact are much
slower, above). int8 uses ``_weight_int8pack_mm`` (one scale per output channel): a GGUF Q8_0 / Q5_* / Q6_K tensor
is requantized from its exact fp32 dequantization to symmetric per-channel int8 (error <= scale / 2 per weight,
scale = row absmax / 127).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

INT4_GROUP_SIZE = 32
DECODE_ROWS_PER_CALL = 8
#: prefill matmuls run on a multiple of this many rows (zero rows appended), see :meth:`_SplitLinear.forward`
PREFILL_ROWS_MULTIPLE = 8


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX): oneDNN's bf16 matmuls are fast."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_activation_dtype() -> torch.dtype:
    """The activations' (and the KV pool's) dtype of the quantized weights modes on this CPU: bf16 where the CPU
    has bf16 hardware, else fp32 (without it a bf16 matmul is several times slower than fp32's, module docstring).
    Only the quantized kernels' inputs are rounded to bf16 then."""
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


@dataclass
class RowSplit:
    """Which rows of a step's ``[num_tokens, ...]`` activations are decode tokens.

    Attributes:
        decode_rows: ``[num_decode]`` int64 row indices, or None when every row is a decode row or none is.
        prefill_rows: ``[num_prefill]`` int64 row indices, or None under the same condition.
        all_decode: every row is a decode row.
        any_decode: at least one row is.
    """

    decode_rows: torch.Tensor | None
    prefill_rows: torch.Tensor | None
    all_decode: bool
    any_decode: bool

    @classmethod
    def from_decode_seqs(cls, query_start_loc: list[int], decode_seqs: list[bool], device: torch.device) -> RowSplit:
        """Rows of the decode steps (``ForwardBatch.decode_seqs``) are decode rows; the others are prefill rows."""
        decode = [query_start_loc[s] for s, is_decode in enumerate(decode_seqs) if is_decode]
        return cls.from_decode_rows(decode, query_start_loc[-1], device)

    @classmethod
    def from_decode_rows(cls, decode: list[int], num_rows: int, device: torch.device) -> RowSplit:
        """Rows ``decode`` (ascending) of ``num_rows`` are decode rows; the others are prefill rows."""
        if len(decode) == num_rows or not decode:
            return cls(None, None, all_decode=len(decode) == num_rows, any_decode=bool(decode))
        mask = torch.zeros(num_rows, dtype=torch.bool)
        mask[decode] = True
        decode_rows = mask.nonzero().squeeze(1).to(device)
        prefill_rows = (~mask).nonzero().squeeze(1).to(device)
        return cls(decode_rows, prefill_rows, all_decode=False, any_decode=True)

    @classmethod
    def prefill_only(cls) -> RowSplit:
        """Every row is a prefill row."""
        return cls(None, None, all_decode=False, any_decode=False)

    @classmethod
    def decode_only(cls) -> RowSplit:
        """Every row is a decode row."""
        return cls(None, None, all_decode=True, any_decode=True)


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed on ``x`` padded with zero rows to a multiple of
    ``PREFILL_ROWS_MULTIPLE`` rows, so every row's result is bit-identical however many rows share the call.

    MKL's fp32 GEMM takes other code paths for 1, 2, 3 or 5 rows (and 2 threads split rows differently), and
    oneDNN's bf16 GEMM without bf16 hardware likewise, whose sums round differently; on a multiple of 8 rows every
    row comes out bit-identical wherever it sits and however many rows share the call (checked for these models'
    shapes, 1 and 2 threads: ``tests/worker/test_model_quant.py``). So a prompt token's K/V do not depend on how its
    prompt was chunked or cached, nor a decode token on its neighbours in the batch. A matmul over weights is
    memory-bound at a few rows, so the padding costs little there.

    Args:
        x: ``[num_rows, in_features]``.
        weight: ``[out_features, in_features]``, ``x``'s dtype.
        bias: ``[out_features]`` or None.
    Returns:
        ``[num_rows, out_features]``.
    """
    num_rows = x.shape[0]
    pad = -num_rows % PREFILL_ROWS_MULTIPLE
    if not pad:
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

    def forward(self, x: torch.Tensor, rows: RowSplit) -> torch.Tensor:  # pragma: no cover - interface
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

    def forward(self, x: torch.Tensor, rows: RowSplit) -> torch.Tensor:
        return padded_linear(x, self.weight, self.bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"weight": self.weight}
        if self.bias is not None:
            out["bias"] = self.bias
        return out


class _SplitLinear(Linear):
    """Decode rows through ``self._decode`` (bf16 activations), prefill rows through the dense copy ``self.dense``
    (in the prefill dtype, :func:`prefill_dtype`); the output is in the input's dtype."""

    dense: torch.Tensor
    bias: torch.Tensor | None

    def _decode(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def _decode_as(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            return self._decode(x)
        return self._decode(x.to(torch.bfloat16)).to(x.dtype)

    def _prefill(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return padded_linear(x, self.dense, bias)

    def forward(self, x: torch.Tensor, rows: RowSplit) -> torch.Tensor:
        if rows.all_decode:
            out = self._decode_as(x)
        elif not rows.any_decode:
            return self._prefill(x, self.bias)
        else:
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
            out.index_copy_(0, rows.decode_rows, self._decode_as(x.index_select(0, rows.decode_rows)))
            out.index_copy_(0, rows.prefill_rows, self._prefill(x.index_select(0, rows.prefill_rows), None))
        return out if self.bias is None else out + self.bias


class Int4Linear(_SplitLinear):
    """Weight-only int4 with per-group scale and zero (``aten._weight_int4pack_mm_for_cpu``), see the module.

    Build it with :meth:`from_codes` (or :func:`linear_from_tensors` from the cache).

    Attributes:
        packed: the kernel's packed codes (uint8).
        scales_and_zeros: ``[in // group_size, out, 2]`` bf16.
        dense: ``[out, in]``, the same weights dequantized (prefill rows), in the activations' dtype.
        bias: ``[out]`` in the activations' dtype, or None.
        group_size: input features per group (32: GGUF's block).
    """

    kind = "int4"

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, dense: torch.Tensor,
                 bias: torch.Tensor | None, group_size: int) -> None:
        self.packed = packed
        self.scales_and_zeros = scales_and_zeros
        self.dense = dense
        self.bias = bias
        self.group_size = group_size
        self.out_features, self.in_features = dense.shape

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None,
                   group_size: int = INT4_GROUP_SIZE, dtype: torch.dtype | None = None) -> Int4Linear:
        """Pack ``w = (q - 8) * scale + zero``.

        Args:
            q: ``[out, in]`` integer codes in ``[0, 15]`` (any int dtype).
            scale, zero: ``[out, in // group_size]`` float32 (rounded to bf16 here, the kernel's dtype).
            bias: ``[out]`` or None.
            group_size: input features per group.
            dtype: the activations' dtype, of the dense copy and the bias (default: :func:`cpu_activation_dtype`).

        Raises:
            ValueError: ``in`` is not a multiple of ``group_size``.
        """
        out_features, in_features = q.shape
        if in_features % group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of the group size {group_size}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        dtype = dtype or cpu_activation_dtype()
        sz = scales_and_zeros.float()
        dense = ((q.float() - 8) * sz[..., 0].t().repeat_interleave(group_size, dim=1)
                 + sz[..., 1].t().repeat_interleave(group_size, dim=1)).to(dtype)
        return cls(packed, scales_and_zeros, dense, None if bias is None else bias.to(dtype), group_size)

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        # At most DECODE_ROWS_PER_CALL rows a call: the kernel's time per row grows past about 16 rows (2-core
        # EPYC, one thread, 10 layers: 32 rows in one call 51 ms, in calls of 8 rows 28 ms); rows are computed
        # independently, so the split does not change a bit of the result.
        if x.shape[0] <= DECODE_ROWS_PER_CALL:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)
        return torch.cat([
            torch.ops.aten._weight_int4pack_mm_for_cpu(part, self.packed, self.group_size, self.scales_and_zeros)
            for part in x.split(DECODE_ROWS_PER_CALL)
        ])

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"packed": self.packed, "scales_and_zeros": self.scales_and_zeros, "dense": self.dense,
               "group_size": torch.tensor([self.group_size])}
        if self.bias is not None:
            out["bias"] = self.bias
        return out


class Int8Linear(_SplitLinear):
    """Weight-only int8 with one scale per output channel (``aten._weight_int8pack_mm``), see the module.

    Attributes:
        q: ``[out, in]`` int8.
        scales: ``[out]`` bf16.
        dense: ``[out, in]`` dequantized copy (prefill rows) in the activations' dtype.
        bias: ``[out]`` in the activations' dtype, or None.
    """

    kind = "int8"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.q = q
        self.scales = scales
        self.dense = dense
        self.bias = bias
        self.out_features, self.in_features = q.shape

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> Int8Linear:
        """Quantize ``weight [out, in]`` (float) to symmetric per-channel int8: ``scale = absmax / 127``; the dense
        copy and the bias in ``dtype`` (default: :func:`cpu_activation_dtype`)."""
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(torch.bfloat16)
        q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        dtype = dtype or cpu_activation_dtype()
        dense = (q.float() * scales.float()[:, None]).to(dtype)
        return cls(q, scales, dense, None if bias is None else bias.to(dtype))

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"q": self.q, "scales": self.scales, "dense": self.dense}
        if self.bias is not None:
            out["bias"] = self.bias
        return out


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
        return Int4Linear(tensors["packed"], tensors["scales_and_zeros"], tensors["dense"], bias,
                          int(tensors["group_size"][0]))
    if kind == "int8":
        return Int8Linear(tensors["q"], tensors["scales"], tensors["dense"], bias)
    raise ValueError(f"unknown linear kind {kind!r}")
