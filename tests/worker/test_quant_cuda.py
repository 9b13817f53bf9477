"""Weight-only int4 / int8 layers on CUDA: which GPUs and shapes they take (CPU), and their results (CUDA)."""

from __future__ import annotations

import pytest
import torch

from worker.quant import quantize_int4_groups
from worker.quant_cuda import cuda_quant_unsupported_reason


def test_int4_needs_sm80_and_tile_multiples_and_says_so():
    assert cuda_quant_unsupported_reason("int4", (9, 0), 4096, 14336) is None
    assert cuda_quant_unsupported_reason("int4", (8, 0), 14336, 4096) is None
    assert "compute capability 8.0" in cuda_quant_unsupported_reason("int4", (7, 5), 4096, 4096)
    assert "multiple of 128" in cuda_quant_unsupported_reason("int4", (9, 0), 576, 960)
    assert cuda_quant_unsupported_reason("int8", (7, 5), 576, 960) is None
    assert "not a quantized weights mode" in cuda_quant_unsupported_reason("bfloat16", (9, 0), 4096, 4096)


@pytest.mark.gpu
def test_cuda_int4_and_int8_layers_match_their_dequantized_weights():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs a CUDA GPU of compute capability 8.0+")
    from worker.quant_cuda import make_cuda_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(512, 1024, generator=gen, device="cuda") * 0.03
    x = torch.randn(5, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    q, scale, zero = quantize_int4_groups(weight)
    group = lambda t: t.repeat_interleave(32, dim=1)  # noqa: E731
    dequant4 = ((q.float() - 8) * group(scale.to(torch.bfloat16).float()) + group(zero.to(torch.bfloat16).float()))
    out4 = make_cuda_linear(weight, None, "int4").forward(x)
    torch.testing.assert_close(out4.float(), x.float() @ dequant4.t(), rtol=2e-2, atol=2e-2)
    layer8 = make_cuda_linear(weight, None, "int8")
    out8 = layer8.forward(x)
    dequant8 = layer8.q.float() * layer8.scales.float()[:, None]
    torch.testing.assert_close(out8.float(), x.float() @ dequant8.t(), rtol=2e-2, atol=2e-2)
