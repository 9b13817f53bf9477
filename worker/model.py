"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) with our forward pass over the paged KV pool.

Weights come from transformers' loaders (a GGUF file, dequantized by transformers, or a Hugging Face safetensors
folder); the forward pass is ours because it reads and writes the paged KV pool. Per layer::

    x ─ RMSNorm ─ [q|k|v] = x @ W_qkv (+ b_qkv) ─ RoPE(q, k) ─ paged attention (writes k, v) ─ @ W_o ─ + x
      ─ RMSNorm ─ [gate|up] = x @ W_gate_up ─ silu(gate) * up ─ @ W_down ─ + x

One matmul per projection for all tokens of the step (q/k/v fused, gate/up fused); the only per-sequence work is
in attention. Final norm and LM head run only on the rows whose logits are wanted. RoPE follows transformers'
``rotate_half`` convention (the GGUF loader un-permutes Q/K to it); llama3 and linear RoPE scaling supported.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from worker import cpu_kernels
from worker.attention import AttentionBackend, make_attention_backend
from worker.batch import ForwardBatch
from worker.engine import StepAbandoned
from worker.layer_ops import layer_ops
from worker.quant import (DenseLinear, InputMajorLinear, Int4Linear, Int8Linear, Linear, cpu_activation_dtype,
                          quantize_int4_groups, quantized_head)

#: ``model.weights`` values; ``auto`` is resolved by :func:`resolve_weights_mode`
WEIGHTS_MODES = ("auto", "float32", "bfloat16", "int8", "int4")

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the model, as the KV pool and the scheduler need it.

    Attributes:
        num_layers, num_heads, num_kv_heads, head_dim, hidden_size, intermediate_size, vocab_size: sizes.
        max_position_embeddings: context length the model was trained for, in tokens.
        eos_token_ids: ids that end a generation.
        rope_theta: RoPE base.
        rms_norm_eps: RMSNorm epsilon.
        tie_word_embeddings: the LM head is the embedding matrix.
        model_type: transformers' name (``llama``, ``mistral``, ``qwen2``).
        rope_scaling: transformers' rope parameters when not the default (``rope_type`` and its keys), else None.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    model_type: str
    rope_scaling: dict[str, Any] | None = field(default=None)


@dataclass
class _LayerWeights:
    """One decoder layer's weights (:class:`worker.quant.Linear`, ``out_features x in_features``)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden] (+ bias for Qwen2)
    o: Linear  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear  # [hidden, intermediate]


def activation_dtype(weights_mode: str, device: torch.device) -> torch.dtype:
    """The activations' and KV pool's dtype of a weights mode: fp32 for ``float32``, bf16 for ``bfloat16``; the
    quantized modes follow the CPU (:func:`worker.quant.cpu_activation_dtype`: bf16 only with bf16 hardware)."""
    if weights_mode in ("int4", "int8"):
        return cpu_activation_dtype()
    return torch.float32 if weights_mode == "float32" else torch.bfloat16


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, weights_mode: str) -> Linear:
    """Build a :class:`Linear` of ``weights_mode`` from float weights ``[out, in]`` (int4: min/max groups of 32;
    int8: symmetric per channel); a CUDA weight gets the CUDA layers of :mod:`worker.quant_cuda`."""
    if weights_mode in ("int4", "int8") and weight.is_cuda:
        from worker.quant_cuda import make_cuda_linear

        return make_cuda_linear(weight, bias, weights_mode)
    if weights_mode == "int4":
        q, scale, zero = quantize_int4_groups(weight)
        return Int4Linear.from_codes(q, scale, zero, bias)
    if weights_mode == "int8":
        return Int8Linear.from_float(weight, bias)
    dtype = activation_dtype(weights_mode, weight.device)
    return DenseLinear(weight.to(dtype).contiguous(), None if bias is None else bias.to(dtype))


def _rope_params(config: Any) -> tuple[float, dict[str, Any] | None]:
    """Return ``(rope_theta, scaling or None)`` from a transformers config (v4 or v5 field names)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type not in ("llama3", "linear"):
        raise ValueError(f"unsupported RoPE scaling {rope_type!r}; supported: default, linear, llama3")
    params["rope_type"] = rope_type
    return theta, params


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Return RoPE inverse frequencies ``[head_dim // 2]`` float64.

    ``llama3`` scaling follows Meta's Llama 3.1 reference (transformers' ``_compute_llama3_parameters``): long
    wavelengths divided by ``factor``, short ones kept, a smooth blend between.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def use_cuda_matmul_layouts(layers: list[_LayerWeights]) -> None:
    """Pick the matmul library and weight layouts that decode fastest on CUDA, in place: cuBLASLt as torch's
    preferred BLAS (process-wide), and the dense ``o`` and ``gate_up`` projections stored input-major
    (:class:`worker.quant.InputMajorLinear`).

    Measured on an H200, Llama-3-8B, bf16 (``bench/decode_probe.py``, ``bench/results/gpu/decode_probe.json``): the
    64-sequence decode graph took 6.29 ms with cuBLASLt against 6.53 ms with cuBLAS (down 32.4 vs 36.3 us per layer
    at 64 rows; the others within 1 us; at 256 rows the four sum to 211 vs 208 us), and the two layouts save 3.6 us
    more per layer at 64 rows.
    """
    torch.backends.cuda.preferred_blas_library("cublaslt")
    for layer in layers:
        if type(layer.o) is DenseLinear:
            layer.o = InputMajorLinear.from_dense(layer.o)
        if type(layer.gate_up) is DenseLinear:
            layer.gate_up = InputMajorLinear.from_dense(layer.gate_up)


class LlamaModel:
    """A Llama-family decoder whose attention reads and writes the paged KV pool.

    Build it with :func:`load_model` or :meth:`from_hf`.

    Attributes:
        spec: the model's shape.
        dtype: weight and KV dtype.
        device: where it runs.
        attention: the attention backend.
    """

    def __init__(
        self,
        spec: ModelSpec,
        embed: torch.Tensor,
        layers: list[_LayerWeights],
        final_norm: torch.Tensor,
        lm_head: Linear,
        attention: AttentionBackend,
    ) -> None:
        self.spec = spec
        self.embed = embed
        self.layers = layers
        if embed.device.type == "cuda":
            use_cuda_matmul_layouts(layers)
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.attention = attention
        self.dtype = embed.dtype
        self.device = embed.device
        self.weights_mode = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(embed.dtype, str(embed.dtype))
        # bf16 models keep the residual stream in fp32 (norm weights too): only matmul inputs round to bf16
        self._norms_f32 = [(layer.input_norm.float(), layer.post_norm.float()) for layer in layers]
        self._final_norm_f32 = final_norm.float()
        self.scale = spec.head_dim**-0.5
        inv_freq = rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        angles = torch.outer(torch.arange(spec.max_position_embeddings, dtype=torch.float64), inv_freq)
        # [max_positions, head_dim // 2], computed in fp64 then cast, once.
        self.rope_cos = angles.cos().to(self.dtype).to(self.device)
        self.rope_sin = angles.sin().to(self.dtype).to(self.device)
        self._ops = layer_ops(self.dtype, self.device, spec.rms_norm_eps, spec.num_heads, spec.num_kv_heads,
                              spec.head_dim, spec.hidden_size)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf(
        cls,
        hf_model: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        attention_backend: str = "torch",
        eos_token_ids: list[int] | None = None,
        weights_mode: str = "",
    ) -> LlamaModel:
        """Take the weights of a loaded transformers ``*ForCausalLM`` into our own (fused) tensors.

        Args:
            hf_model: e.g. ``AutoModelForCausalLM.from_pretrained(...)``, a Llama, Mistral or Qwen2 model.
            dtype: weight dtype of dense weights (fp32 or bf16 on the CPU; bf16/fp16 on a GPU).
            device: target device.
            attention_backend: name for :func:`worker.attention.make_attention_backend`.
            eos_token_ids: overrides the config's EOS ids.
            weights_mode: ``int4`` / ``int8`` quantize the projections on the CPU (activations in
                :func:`activation_dtype`); "" or a float mode keeps them dense in ``dtype``.

        Raises:
            ValueError: an unsupported architecture, RoPE scaling, sliding-window attention or missing weights.
        """
        config = hf_model.config
        model_type = getattr(config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}; only silu (SwiGLU)")
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
            raise ValueError(f"sliding-window attention ({window} tokens) is not supported")
        theta, scaling = _rope_params(config)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        eos = eos_token_ids
        if eos is None:
            eos = getattr(hf_model.generation_config, "eos_token_id", None) or config.eos_token_id
            eos = [eos] if isinstance(eos, int) else list(eos or [])
        spec = ModelSpec(
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.max_position_embeddings,
            eos_token_ids=eos,
            rope_theta=theta,
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            model_type=model_type,
            rope_scaling=scaling,
        )
        device = torch.device(device)
        state = hf_model.state_dict()

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise ValueError(f"checkpoint lacks weight {name!r}")
            return state[name].detach().to(device=device, dtype=dtype).contiguous()

        def cat(*names: str) -> torch.Tensor:
            return torch.cat([take(n) for n in names], dim=0).contiguous()

        quantized = weights_mode in ("int4", "int8")
        if quantized:
            dtype = activation_dtype(weights_mode, device)

        def linear(*names: str, bias_names: list[str] | None = None) -> Linear:
            weight = cat(*names)
            bias = cat(*bias_names) if bias_names else None
            if quantized:
                return make_linear(weight.float(), bias, weights_mode)
            return DenseLinear(weight, bias)

        layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            bias_names = [attn + f"{x}_proj.bias" for x in "qkv"]
            has_bias = all(n in state for n in bias_names)
            layers.append(
                _LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=linear(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight",
                               bias_names=bias_names if has_bias else None),
                    o=linear(attn + "o_proj.weight"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=linear(p + "mlp.down_proj.weight"),
                )
            )
        if any(name in state and "proj.bias" in name and "self_attn" not in name for name in state):
            raise ValueError("MLP / output projection biases are not supported")
        embed = take("model.embed_tokens.weight")
        if spec.tie_word_embeddings or "lm_head.weight" not in state:
            lm_head = embed
        else:
            lm_head = take("lm_head.weight")
        return cls(
            spec=spec,
            embed=embed,
            layers=layers,
            final_norm=take("model.norm.weight"),
            lm_head=quantized_head(lm_head, weights_mode),
            attention=make_attention_backend(attention_backend, device),
        )

    @classmethod
    def from_gguf(cls, path: str, weights_mode: str, attention_backend: str = "torch") -> LlamaModel:
        """Build the model on the CPU from a GGUF file's own bytes (:func:`worker.gguf_weights.read_gguf`).

        Args:
            path: the ``.gguf`` file.
            weights_mode: ``float32`` / ``bfloat16`` (dense, dequantized exactly then cast), ``int4`` (Q4_0/Q4_1
                codes and group scales taken as they are; other types quantized from their fp32 values, groups
                of 32) or ``int8`` (per-channel, from the fp32 values); ``auto`` follows the file
                (:func:`worker.gguf_weights.auto_weights_mode`). The embedding and the LM head stay dense in the
                activation dtype (the head runs on the sampled rows only).
            attention_backend: name for :func:`worker.attention.make_attention_backend`.

        Raises:
            ValueError: an unsupported architecture, tensor or weights mode.
        """
        from worker.gguf_weights import INT4_EXACT_TYPES, auto_weights_mode, read_gguf

        gg = read_gguf(path)
        if weights_mode == "auto":
            weights_mode = auto_weights_mode(gg.file_type)
        if weights_mode not in WEIGHTS_MODES[1:]:
            raise ValueError(f"unknown weights mode {weights_mode!r}; valid: {', '.join(WEIGHTS_MODES)}")
        c = gg.config
        spec = ModelSpec(
            num_layers=c["num_layers"], num_heads=c["num_heads"], num_kv_heads=c["num_kv_heads"],
            head_dim=c["head_dim"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            vocab_size=c["vocab_size"], max_position_embeddings=c["max_position_embeddings"],
            eos_token_ids=c["eos_token_ids"], rope_theta=c["rope_theta"], rms_norm_eps=c["rms_norm_eps"],
            tie_word_embeddings=c["tie_word_embeddings"],
            model_type="qwen2" if c["architecture"] == "qwen2" else "llama", rope_scaling=c["rope_scaling"],
        )
        dtype = activation_dtype(weights_mode, torch.device("cpu"))
        t = gg.tensors

        def vec(name: str) -> torch.Tensor:
            if name not in t:
                raise ValueError(f"GGUF file lacks weight {name!r}")
            return t[name].to_float().to(dtype).contiguous()

        def linear(*names: str, bias: bool = False) -> Linear:
            parts = [t[n] for n in names]
            bias_names = [n.replace(".weight", ".bias") for n in names]
            b = torch.cat([t[n].to_float() for n in bias_names]) if bias else None
            if weights_mode == "int4":
                codes, scales, zeros = [], [], []
                for part in parts:
                    if part.type_name in INT4_EXACT_TYPES:
                        q, scale, zero = part.codes, part.scale, part.zero
                    else:
                        q, scale, zero = quantize_int4_groups(part.to_float())
                    codes.append(q)
                    scales.append(scale)
                    zeros.append(zero)
                return Int4Linear.from_codes(torch.cat(codes), torch.cat(scales), torch.cat(zeros), b)
            return make_linear(torch.cat([part.to_float() for part in parts]), b, weights_mode)

        layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            has_bias = attn + "q_proj.bias" in t
            layers.append(
                _LayerWeights(
                    input_norm=vec(p + "input_layernorm.weight"),
                    qkv=linear(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight",
                               bias=has_bias),
                    o=linear(attn + "o_proj.weight"),
                    post_norm=vec(p + "post_attention_layernorm.weight"),
                    gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=linear(p + "mlp.down_proj.weight"),
                )
            )
        embed = vec("model.embed_tokens.weight")
        lm_head = embed if spec.tie_word_embeddings else vec("lm_head.weight")
        model = cls(spec=spec, embed=embed, layers=layers, final_norm=vec("model.norm.weight"),
                    lm_head=quantized_head(lm_head, weights_mode),
                    attention=make_attention_backend(attention_backend, "cpu"))
        model.weights_mode = weights_mode
        return model

    # ------------------------------------------------------------------ KV pool

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype | None = None) -> int:
        """Return the bytes one KV block takes across all layers (K and V) at ``dtype`` (default: the model's)."""
        element_size = torch.empty((), dtype=dtype or self.dtype).element_size()
        spec = self.spec
        return spec.num_layers * 2 * spec.num_kv_heads * block_size * spec.head_dim * element_size

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """Allocate the pool ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]`` (zeros)."""
        spec = self.spec
        shape = (spec.num_layers, 2, num_blocks, spec.num_kv_heads, block_size, spec.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor,
                should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Run one step over the paged pool: write this step's K/V, return the wanted logits.

        Args:
            batch: the step (see :class:`worker.batch.ForwardBatch`).
            kv_cache: ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]`` in the model's dtype
                and device; updated in place.
            should_stop: asked before each layer (host side, no device sync); True abandons the step.

        Returns:
            ``[num_logits, vocab_size]`` float32 logits of the rows ``batch.logits_indices``.

        Raises:
            StepAbandoned: ``should_stop`` said so; the K/V of this step's tokens is partly written, and the
                caller frees their blocks.
        """
        num_tokens = batch.input_ids.shape[0]
        ops = self._ops
        self.attention.begin_forward(batch)
        cos = self.rope_cos[batch.positions]  # [num_tokens, head_dim // 2]
        sin = self.rope_sin[batch.positions]
        x = self.embed[batch.input_ids].float()  # [num_tokens, hidden] fp32 residual stream
        h = ops.norm(x, self._norms_f32[0][0])
        for i, layer in enumerate(self.layers):
            if should_stop is not None and should_stop():
                raise StepAbandoned(f"abandoned before layer {i}")
            q, k, v = ops.rope_qkv(layer.qkv.forward(h), cos, sin)
            attn = self.attention.forward(q, k, v, kv_cache[i], batch, self.scale)
            x, h = ops.add_norm(x, layer.o.forward(attn.reshape(num_tokens, -1)), self._norms_f32[i][1])
            mlp = layer.down.forward(ops.swiglu(layer.gate_up.forward(h)))
            if i + 1 < len(self.layers):
                x, h = ops.add_norm(x, mlp, self._norms_f32[i + 1][0])
        x = x + mlp
        if batch.logits_indices.shape[0] != num_tokens:
            x = x.index_select(0, batch.logits_indices)
        return self.lm_head.forward(ops.norm(x, self._final_norm_f32)).float()


def load_hf_model(path: str, dtype: torch.dtype = torch.float32) -> Any:
    """Load a transformers ``AutoModelForCausalLM`` from a GGUF file or a checkpoint folder, on the CPU.

    Args:
        path: a ``.gguf`` file (transformers dequantizes it to fp32 once; later loads read the converted copy,
            see :mod:`shared.model_files`) or a Hugging Face folder (safetensors).
        dtype: dtype of the loaded weights of a folder (a GGUF file's are fp32).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    from shared.model_files import load_causal_lm

    return load_causal_lm(path, dtype)


def resolve_weights_mode(weights_mode: str, dtype: torch.dtype) -> str:
    """Return the weights mode that ``model.weights`` and ``model.dtype`` ask for: an explicit mode wins; ""
    follows ``dtype`` (``float32`` or ``bfloat16``); ``auto`` stays ``auto`` (resolved from a GGUF file's type)."""
    if weights_mode:
        return weights_mode
    return "bfloat16" if dtype == torch.bfloat16 else "float32"


def _model_tensors(model: LlamaModel) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Flatten ``model``'s weights for the cache: ``(tensors by name, linear kind by layer-linear name)``."""
    tensors: dict[str, torch.Tensor] = {"embed": model.embed, "final_norm": model.final_norm}
    kinds: dict[str, str] = {"lm_head": model.lm_head.kind}
    head = model.lm_head.tensors()
    if head.get("weight") is not model.embed:  # a tied dense head is the embedding itself
        tensors.update({f"lm_head.{key}": tensor.contiguous() for key, tensor in head.items()})
    for i, layer in enumerate(model.layers):
        tensors[f"layers.{i}.input_norm"] = layer.input_norm
        tensors[f"layers.{i}.post_norm"] = layer.post_norm
        for name in ("qkv", "o", "gate_up", "down"):
            linear = getattr(layer, name)
            kinds[f"layers.{i}.{name}"] = linear.kind
            for key, tensor in linear.tensors().items():
                tensors[f"layers.{i}.{name}.{key}"] = tensor.contiguous()
    return tensors, kinds


def _model_from_tensors(spec: ModelSpec, weights_mode: str, tensors: dict[str, torch.Tensor],
                        kinds: dict[str, str], attention_backend: str) -> LlamaModel:
    from worker.quant import linear_from_tensors

    layers = []
    for i in range(spec.num_layers):
        def lin(name: str, i: int = i) -> Linear:
            prefix = f"layers.{i}.{name}."
            parts = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            return linear_from_tensors(kinds[f"layers.{i}.{name}"], parts)

        layers.append(_LayerWeights(input_norm=tensors[f"layers.{i}.input_norm"], qkv=lin("qkv"), o=lin("o"),
                                    post_norm=tensors[f"layers.{i}.post_norm"], gate_up=lin("gate_up"),
                                    down=lin("down")))
    embed = tensors["embed"]
    head = {k[len("lm_head."):]: v for k, v in tensors.items() if k.startswith("lm_head.")}
    lm_head = linear_from_tensors(kinds["lm_head"], head) if head else DenseLinear(embed)
    model = LlamaModel(spec=spec, embed=embed, layers=layers, final_norm=tensors["final_norm"],
                       lm_head=lm_head,
                       attention=make_attention_backend(attention_backend, "cpu"))
    model.weights_mode = weights_mode
    return model


def load_gguf_model(path: str, weights_mode: str, attention_backend: str = "torch") -> LlamaModel:
    """Load a GGUF file for the CPU in ``weights_mode``, converted once and then read from the on-disk cache.

    The converted tensors (packed int4 codes, scales, the dense copies, norms) and the model's shape are kept in
    ``<cache root>/weights/<file stem>-<content hash>-<mode>-torch<version>/`` (see
    :func:`shared.model_files.cached_entry`): keyed by the file's content, written to a temporary folder with a
    SHA-256 of the weights file and renamed into place; an entry whose checksum does not match is rebuilt, never
    loaded. Only the most recent entries are kept.

    Raises:
        ValueError: an unsupported architecture, tensor or weights mode.
    """
    import json
    from dataclasses import asdict

    import safetensors.torch

    from shared import model_files

    built_auto: list[LlamaModel] = []

    def build(folder: str) -> None:
        model = built_auto[0] if built_auto else LlamaModel.from_gguf(path, weights_mode, attention_backend)
        tensors, kinds = _model_tensors(model)
        meta = {"spec": json.dumps(asdict(model.spec)), "kinds": json.dumps(kinds),
                "weights_mode": model.weights_mode}
        safetensors.torch.save_file(tensors, os.path.join(folder, "model.safetensors"), metadata=meta)
        built.append(model)

    built: list[LlamaModel] = []
    alias = os.path.join(model_files.cache_root(), "weights",
                         f"{os.path.basename(path)[:-5]}-{model_files.content_key(path)[:16]}-auto.json")
    if weights_mode == "auto":  # the mode auto picked for this file last time (saves reading it twice)
        try:
            with open(alias) as f:
                weights_mode = json.load(f)["weights_mode"]
        except (OSError, ValueError, KeyError):
            model = LlamaModel.from_gguf(path, "auto", attention_backend)
            weights_mode = model.weights_mode
            with contextlib.suppress(OSError):
                os.makedirs(os.path.dirname(alias), exist_ok=True)
                with open(alias + ".tmp", "w") as f:
                    json.dump({"weights_mode": weights_mode}, f)
                os.replace(alias + ".tmp", alias)
            built_auto.append(model)
    act = str(activation_dtype(weights_mode, torch.device("cpu"))).removeprefix("torch.")
    # the head is int8 only where the CPU kernels run (:func:`worker.quant.quantized_head`): part of the key
    kernels = "qgemm" if cpu_kernels.load() is not None else "dense"
    key = f"{weights_mode}-{act}-torch{torch.__version__.split('+')[0]}-{kernels}-v3"
    folder = model_files.cached_entry(path, "weights", key, build, ["model.safetensors"])
    if built:
        return built[0]
    if built_auto:  # converted for auto while a valid entry of that mode already existed
        return built_auto[0]
    if folder is None:  # the cache is unwritable: convert in memory
        return LlamaModel.from_gguf(path, weights_mode, attention_backend)
    weights_path = os.path.join(folder, "model.safetensors")
    with safetensors.safe_open(weights_path, "pt") as f:
        meta = f.metadata()
    tensors = safetensors.torch.load_file(weights_path)
    spec = ModelSpec(**json.loads(meta["spec"]))
    return _model_from_tensors(spec, meta["weights_mode"], tensors, json.loads(meta["kinds"]), attention_backend)


def load_model(
    path: str, dtype: torch.dtype, device: torch.device | str, attention_backend: str = "torch",
    weights_mode: str = "",
) -> LlamaModel:
    """Load a Llama-family model from a GGUF file or a Hugging Face folder into our forward pass.

    Args:
        path: ``.gguf`` file or checkpoint folder.
        dtype: activation and KV dtype of a dense model (fp32 or bf16 on the CPU; bf16/fp16 on a GPU).
        device: where it runs.
        attention_backend: ``auto``, ``torch`` or ``cupy``.
        weights_mode: ``model.weights`` (see :data:`WEIGHTS_MODES`); "" follows ``dtype``. On the CPU a GGUF file
            is read by :func:`load_gguf_model`; ``int4``/``int8`` of a folder quantize its weights at load.
            On a GPU the weights are dense in ``dtype``, or ``int4``/``int8`` quantized at load
            (:mod:`worker.quant_cuda`).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: an unsupported architecture (see :meth:`LlamaModel.from_hf`).
    """
    device = torch.device(device)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    mode = resolve_weights_mode(weights_mode, dtype)
    if device.type == "cpu" and str(path).endswith(".gguf"):
        return load_gguf_model(path, mode, attention_backend)
    if (device.type != "cpu" and mode not in ("int4", "int8")) or mode == "auto":
        mode = ""
    # transformers dequantizes GGUF weights to fp32; a folder loads straight in ``dtype``.
    load_dtype = torch.float32 if str(path).endswith(".gguf") or mode in ("int4", "int8") else dtype
    hf_model = load_hf_model(path, load_dtype)
    if mode in ("float32", "bfloat16"):
        dtype = getattr(torch, mode)
    model = LlamaModel.from_hf(hf_model, dtype, device, attention_backend, weights_mode=mode)
    if mode:
        model.weights_mode = mode
    del hf_model
    return model
