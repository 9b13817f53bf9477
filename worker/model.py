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

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from worker.attention import AttentionBackend, make_attention_backend
from worker.batch import ForwardBatch

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
    """One decoder layer's weights (``out_features x in_features``, as ``F.linear`` wants them)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(num_heads + 2 * num_kv_heads) * head_dim]
    o: torch.Tensor  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


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


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [num_tokens, heads, head_dim]`` by ``cos/sin [num_tokens, 1, head_dim // 2]`` (rotate_half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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
        lm_head: torch.Tensor,
        attention: AttentionBackend,
    ) -> None:
        self.spec = spec
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.attention = attention
        self.dtype = embed.dtype
        self.device = embed.device
        self.scale = spec.head_dim**-0.5
        inv_freq = rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        angles = torch.outer(torch.arange(spec.max_position_embeddings, dtype=torch.float64), inv_freq)
        # [max_positions, head_dim // 2], computed in fp64 then cast, once.
        self.rope_cos = angles.cos().to(self.dtype).to(self.device)
        self.rope_sin = angles.sin().to(self.dtype).to(self.device)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf(
        cls,
        hf_model: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        attention_backend: str = "torch",
        eos_token_ids: list[int] | None = None,
    ) -> LlamaModel:
        """Take the weights of a loaded transformers ``*ForCausalLM`` into our own (fused) tensors.

        Args:
            hf_model: e.g. ``AutoModelForCausalLM.from_pretrained(...)``, a Llama, Mistral or Qwen2 model.
            dtype: weight dtype (fp32 on the CPU; bf16/fp16 on a GPU).
            device: target device.
            attention_backend: name for :func:`worker.attention.make_attention_backend`.
            eos_token_ids: overrides the config's EOS ids.

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

        layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            bias_names = [attn + f"{x}_proj.bias" for x in "qkv"]
            has_bias = all(n in state for n in bias_names)
            layers.append(
                _LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=cat(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                    qkv_bias=cat(*bias_names) if has_bias else None,
                    o=take(attn + "o_proj.weight"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=take(p + "mlp.down_proj.weight"),
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
            lm_head=lm_head,
            attention=make_attention_backend(attention_backend, device),
        )

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

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm in fp32 as transformers' ``LlamaRMSNorm`` does it, back in the model dtype."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.spec.rms_norm_eps)
        normed = F.rms_norm(x.float(), weight.shape, None, self.spec.rms_norm_eps)
        return weight * normed.to(x.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one step over the paged pool: write this step's K/V, return the wanted logits.

        Args:
            batch: the step (see :class:`worker.batch.ForwardBatch`).
            kv_cache: ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]`` in the model's dtype
                and device; updated in place.

        Returns:
            ``[num_logits, vocab_size]`` float32 logits of the rows ``batch.logits_indices``.
        """
        spec = self.spec
        num_tokens = batch.input_ids.shape[0]
        q_size = spec.num_heads * spec.head_dim
        kv_size = spec.num_kv_heads * spec.head_dim
        self.attention.begin_forward(batch)
        cos = self.rope_cos[batch.positions].unsqueeze(1)  # [num_tokens, 1, head_dim // 2]
        sin = self.rope_sin[batch.positions].unsqueeze(1)
        x = self.embed[batch.input_ids]  # [num_tokens, hidden]
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.input_norm)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
            q = _apply_rope(q.view(num_tokens, spec.num_heads, spec.head_dim), cos, sin)
            k = _apply_rope(k.view(num_tokens, spec.num_kv_heads, spec.head_dim), cos, sin)
            v = v.view(num_tokens, spec.num_kv_heads, spec.head_dim)
            attn = self.attention.forward(q, k, v, kv_cache[i], batch, self.scale)
            x = x + F.linear(attn.reshape(num_tokens, q_size), layer.o)
            h = self._rms_norm(x, layer.post_norm)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        x = x.index_select(0, batch.logits_indices)
        return F.linear(self._rms_norm(x, self.final_norm), self.lm_head).float()


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


def load_model(
    path: str, dtype: torch.dtype, device: torch.device | str, attention_backend: str = "torch"
) -> LlamaModel:
    """Load a Llama-family model from a GGUF file or a Hugging Face folder into our forward pass.

    Args:
        path: ``.gguf`` file or checkpoint folder.
        dtype: weight and KV dtype (fp32 on the CPU).
        device: where it runs.
        attention_backend: ``auto``, ``torch`` or ``cupy``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: an unsupported architecture (see :meth:`LlamaModel.from_hf`).
    """
    # GGUF weights are dequantized to fp32 by transformers; a folder loads straight in ``dtype``.
    hf_model = load_hf_model(path, torch.float32 if str(path).endswith(".gguf") else dtype)
    model = LlamaModel.from_hf(hf_model, dtype, device, attention_backend)
    del hf_model
    return model
