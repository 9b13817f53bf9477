"""A :class:`worker.model.LlamaModel` of a real shape with random weights (``model.synthetic``), made on its device.

Weights are drawn layer by layer on the target device (a Llama-3-8B in bf16 is 16 GB: made on the GPU in about a
second, never on the host) from a seeded generator, scaled like a trained model's so that activations stay finite:
projections ``N(0, 1 / in_features)``, embeddings ``N(0, 1)``, norm weights 1. Quantized modes quantize those
weights as a checkpoint's would be (:func:`worker.model.make_linear`).
"""

from __future__ import annotations

import torch

from shared.synthetic_models import synthetic_shape
from worker.attention import make_attention_backend
from worker.model import LlamaModel, ModelSpec, _LayerWeights, activation_dtype, make_linear
from worker.quant import DenseLinear, Linear


def synthetic_spec(name: str, **overrides) -> ModelSpec:
    """Return the :class:`ModelSpec` of synthetic model ``name`` with ``overrides`` (e.g. ``num_layers=2``).

    Raises:
        ValueError: an unknown name.
    """
    return ModelSpec(**{**synthetic_shape(name), **overrides})


def build_synthetic_model(spec: ModelSpec, weights_mode: str, device: torch.device | str,
                          attention_backend: str = "auto", seed: int = 0) -> LlamaModel:
    """Build a model of ``spec`` with random weights on ``device``.

    Args:
        spec: the shape (:func:`synthetic_spec`).
        weights_mode: ``float32``, ``bfloat16``, ``float16`` (dense) or ``int8`` / ``int4`` (weight-only, bf16
            activations; on CUDA through :mod:`worker.quant_cuda`).
        device: where the weights are made and run.
        attention_backend: name for :func:`worker.attention.make_attention_backend`.
        seed: the generator's seed (same seed, same weights on the same device).

    Raises:
        ValueError: an unknown weights mode.
        ConfigError: a quantized mode whose kernels this torch build or GPU lacks (:mod:`worker.quant_cuda`).
    """
    if weights_mode not in ("float32", "bfloat16", "float16", "int8", "int4"):
        raise ValueError(f"unknown weights mode {weights_mode!r}; valid: float32, bfloat16, float16, int8, int4")
    device = torch.device(device)
    dtype = torch.float16 if weights_mode == "float16" else activation_dtype(weights_mode, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = spec.hidden_size
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim

    def linear(out_features: int, in_features: int) -> Linear:
        weight = torch.randn(out_features, in_features, generator=gen, device=device, dtype=dtype)
        weight.mul_(in_features**-0.5)
        if weights_mode in ("int8", "int4"):
            return make_linear(weight, None, weights_mode)
        return DenseLinear(weight)

    def ones() -> torch.Tensor:
        return torch.ones(hidden, dtype=dtype, device=device)

    layers = [
        _LayerWeights(input_norm=ones(), qkv=linear(q_size + 2 * kv_size, hidden), o=linear(hidden, q_size),
                      post_norm=ones(), gate_up=linear(2 * spec.intermediate_size, hidden),
                      down=linear(hidden, spec.intermediate_size))
        for _ in range(spec.num_layers)
    ]
    embed = torch.randn(spec.vocab_size, hidden, generator=gen, device=device, dtype=dtype)
    if spec.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = torch.randn(spec.vocab_size, hidden, generator=gen, device=device, dtype=dtype).mul_(hidden**-0.5)
    model = LlamaModel(spec=spec, embed=embed, layers=layers, final_norm=ones(), lm_head=DenseLinear(lm_head),
                       attention=make_attention_backend(attention_backend, device))
    model.weights_mode = weights_mode
    return model
