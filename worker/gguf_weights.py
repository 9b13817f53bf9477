"""Read a Llama-family GGUF file's shape and weights straight from its bytes (no transformers, no fp32 detour).

Quantized blocks of 32 weights along the input features (ggml's layout, rows = output features)::

    Q4_0: d fp16 | 16 bytes of nibbles      w = d * (q - 8)          -> int4 scale d, zero 0
    Q4_1: d fp16 | m fp16 | 16 bytes        w = d * q + m            -> int4 scale d, zero m + 8 d
    Q8_0: d fp16 | 32 int8                  w = d * q
    byte j of the nibbles holds element j (low nibble) and element j + 16 (high nibble).

Other types (Q5_*, Q6_K, K-quants, F16, BF16) are dequantized to fp32 with the ``gguf`` package's reference
code. llama.cpp's converter interleaves the rows of Q and K for its RoPE; :func:`read_gguf` undoes that
permutation (a permutation of whole rows, so it applies to codes and group scales alike), giving transformers'
``rotate_half`` layout that :mod:`worker.model` uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

BLOCK = 32

#: the GGUF tensor types whose codes and group scales map exactly onto the int4 kernel
INT4_EXACT_TYPES = ("Q4_0", "Q4_1")
#: GGUF types that ``model.weights = "auto"`` serves as int8
INT8_AUTO_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K")


@dataclass
class GGUFTensor:
    """One weight: its GGUF type and either exact int4 codes (Q4_0/Q4_1) or fp32 values.

    Attributes:
        type_name: GGUF type (``Q4_1``, ``F32``, ...).
        shape: ``(out_features, in_features)`` or ``(n,)``.
        codes: ``[out, in]`` uint8 codes in ``[0, 15]`` (Q4_0/Q4_1), else None.
        scale, zero: ``[out, in // 32]`` float32 (``w = (q - 8) * scale + zero``), else None.
        values: fp32 values (every other type), else None.
    """

    type_name: str
    shape: tuple[int, ...]
    codes: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def to_float(self) -> torch.Tensor:
        """Return the exact fp32 dequantization (``[out, in]`` or ``[n]``)."""
        if self.values is not None:
            return self.values
        groups = self.shape[1] // BLOCK
        q = self.codes.float().view(self.shape[0], groups, BLOCK)
        return ((q - 8) * self.scale[..., None] + self.zero[..., None]).view(self.shape)

    def permute_rows(self, perm: torch.Tensor) -> GGUFTensor:
        """Return the tensor with its rows (output features) reordered: ``new[r] = old[perm[r]]``."""
        if self.values is not None:
            return GGUFTensor(self.type_name, self.shape, values=self.values[perm])
        return GGUFTensor(self.type_name, self.shape, codes=self.codes[perm], scale=self.scale[perm],
                          zero=self.zero[perm])


def _unpack_q4(raw: np.ndarray, with_min: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpack ``raw [rows, groups * bytes_per_block]`` uint8 Q4_0/Q4_1 into codes, scale, zero (see the module)."""
    rows = raw.shape[0]
    bytes_per_block = 20 if with_min else 18
    blocks = raw.reshape(rows, -1, bytes_per_block)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if with_min:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
    else:
        m = None
        nibbles = blocks[..., 2:]
    nib = torch.from_numpy(np.ascontiguousarray(nibbles))  # [rows, groups, 16]
    codes = torch.cat([nib & 0x0F, nib >> 4], dim=-1).reshape(rows, -1)  # [rows, groups * 32]
    scale = torch.from_numpy(d)
    zero = torch.zeros_like(scale) if m is None else torch.from_numpy(m) + 8 * scale
    return codes.contiguous(), scale, zero


def _read_tensor(tensor: Any) -> GGUFTensor:
    import gguf

    type_name = tensor.tensor_type.name
    # GGUF lists dims innermost first; ours are (out, in)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    data = np.asarray(tensor.data)
    if type_name in INT4_EXACT_TYPES:
        codes, scale, zero = _unpack_q4(data.reshape(shape[0], -1), with_min=type_name == "Q4_1")
        return GGUFTensor(type_name, shape, codes=codes, scale=scale, zero=zero)
    if type_name == "F32":
        values = torch.from_numpy(data.astype(np.float32, copy=True)).reshape(shape)
    elif type_name == "F16":
        values = torch.from_numpy(data.astype(np.float32)).reshape(shape)
    elif type_name == "Q8_0":
        blocks = data.reshape(shape[0], -1, 34)
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, groups, 1]
        q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
        values = torch.from_numpy((q * d).reshape(shape))
    else:
        values = torch.from_numpy(gguf.quants.dequantize(data, tensor.tensor_type).astype(np.float32)).reshape(shape)
    return GGUFTensor(type_name, shape, values=values)


def _qk_permutation(rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K interleave (transformers' ``reverse_permute_weights``)."""
    half = rows // num_heads // 2
    return torch.arange(rows).view(num_heads, half, 2).transpose(1, 2).reshape(-1)


@dataclass
class GGUFModel:
    """A GGUF file's model: its transformers-style config values and its weights by transformers' names.

    Attributes:
        config: ``architecture``, ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``hidden_size``,
            ``intermediate_size``, ``vocab_size``, ``max_position_embeddings``, ``rope_theta``, ``rms_norm_eps``,
            ``eos_token_ids``, ``tie_word_embeddings``, ``rope_scaling``.
        tensors: ``model.layers.{i}.self_attn.q_proj.weight``-style names -> :class:`GGUFTensor`.
        file_type: the dominant quantized type of the layer weights (``Q4_1``, ``Q8_0``, ``F16``, ...).
    """

    config: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    file_type: str


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def read_gguf(path: str) -> GGUFModel:
    """Read the shape and the weights of a Llama / Mistral / Qwen2 GGUF file.

    Raises:
        ValueError: another architecture, RoPE scaling other than none/linear, or a weight we do not map.
    """
    import gguf

    reader = gguf.GGUFReader(path)

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: llama, qwen2")
    num_heads = int(field(f"{arch}.attention.head_count"))
    num_kv_heads = int(field(f"{arch}.attention.head_count_kv", num_heads))
    hidden = int(field(f"{arch}.embedding_length"))
    scaling_type = field(f"{arch}.rope.scaling.type", "none")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(field(f"{arch}.rope.scaling.factor"))}
    elif scaling_type not in ("none", None):
        raise ValueError(f"unsupported GGUF RoPE scaling {scaling_type!r}")
    tensors: dict[str, GGUFTensor] = {}
    counts: dict[str, int] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            base = _LAYER_NAMES.get(parts[2])
            if base is None:
                raise ValueError(f"unsupported GGUF tensor {t.name!r}")
            name = f"model.layers.{parts[1]}.{base}.{parts[3]}"
        else:
            name = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight"}.get(t.name)
            if name is None:
                raise ValueError(f"unsupported GGUF tensor {t.name!r}")
        tensor = _read_tensor(t)
        if arch == "llama" and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            heads = num_heads if parts[2] == "attn_q" else num_kv_heads
            tensor = tensor.permute_rows(_qk_permutation(tensor.shape[0], heads))
        tensors[name] = tensor
        if parts[0] == "blk" and len(tensor.shape) == 2:
            counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
    embed = tensors["model.embed_tokens.weight"]
    eos = field("tokenizer.ggml.eos_token_id")
    config = {
        "architecture": arch,
        "num_layers": int(field(f"{arch}.block_count")),
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": hidden // num_heads,
        "hidden_size": hidden,
        "intermediate_size": int(field(f"{arch}.feed_forward_length")),
        "vocab_size": embed.shape[0],
        "max_position_embeddings": int(field(f"{arch}.context_length")),
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        "eos_token_ids": [] if eos is None else [int(eos)],
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "rope_scaling": rope_scaling,
    }
    file_type = max(counts, key=counts.get) if counts else "F32"
    return GGUFModel(config, tensors, file_type)


def auto_weights_mode(file_type: str) -> str:
    """``model.weights = "auto"`` on the CPU: Q4_* -> ``int4``; Q5_*, Q6_K, Q8_0 -> ``int8``; else ``float32``."""
    if file_type.startswith("Q4") or file_type.startswith("IQ4"):
        return "int4"
    if file_type in INT8_AUTO_TYPES or file_type.startswith(("Q5", "Q6", "Q8")):
        return "int8"
    return "float32"
