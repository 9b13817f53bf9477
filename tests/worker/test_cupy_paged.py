"""What the CuPy launcher does without a GPU: it imports, reports itself unavailable, and rejects bad inputs.

The kernel itself is tested on a GPU in ``tests/gpu/test_cupy_paged.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from worker.attention import make_attention_backend
from worker.attention.cupy_paged import (
    CupyAttentionBackend,
    KernelUnavailableError,
    compile_options,
    cupy_available,
    kernel_names,
    paged_decode_attention,
)

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


def test_kernel_names_follow_the_cu_entry_points() -> None:
    assert kernel_names("bf16", 128, 16, 4) == (
        "paged_decode_bf16_d128_b16_g4",
        "paged_decode_split_bf16_d128_b16_g4",
        "paged_decode_reduce_bf16_d128",
    )
    assert compile_options("f16", 64, 32) == (
        "-DSLUICE_SELECT",
        "-DSLUICE_SELECT_f16_d64_b32",
        "-DSLUICE_SELECT_REDUCE_f16_d64",
    )


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only behaviour")
def test_unavailable_without_cuda() -> None:
    assert cupy_available() is False
    with pytest.raises(KernelUnavailableError, match="CUDA device"):
        CupyAttentionBackend(torch.device("cpu"))


def test_auto_backend_on_cpu_is_the_cpu_kernel_where_it_loads_else_torch() -> None:
    from worker import cpu_kernels

    expected = "cpu" if cpu_kernels.load() is not None else "torch"
    assert make_attention_backend("auto", "cpu").name == expected


def test_cpu_tensors_are_rejected_with_a_clear_error() -> None:
    q = torch.zeros((2, 8, 64), dtype=torch.bfloat16)
    pool = torch.zeros((4, 2, 16, 64), dtype=torch.bfloat16)
    tables = torch.zeros((2, 2), dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        paged_decode_attention(q, pool, pool, tables, lens, 0.125)
