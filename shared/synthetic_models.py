"""Model shapes served with random weights (``model.synthetic``): real layer shapes, no download, no tokenizer.

A synthetic model runs the same forward pass, KV pool and attention kernel as a real checkpoint of that shape, so
its throughput is the real model's (the weights' values do not change the work); its tokens mean nothing. The
gateway serves it with :func:`shared.model_files.synthetic_tokenizer`: token ``i`` is the word ``<i>``, so token-id
prompts through ``/v1/completions`` work and answers read as ``<17> <90211> ...``.

Shapes from the models' ``config.json`` on the Hugging Face Hub (meta-llama/Llama-3.1-8B, meta-llama/Llama-3.2-1B).
``llama-3-tiny`` keeps Llama 3's vocabulary, RoPE and grouped-query layout at a size the CPU tests run in seconds.
"""

from __future__ import annotations

from typing import Any

LLAMA3_VOCAB_SIZE = 128256
LLAMA3_EOS_TOKEN_IDS = (128001, 128008, 128009)

_LLAMA3_COMMON: dict[str, Any] = {
    "vocab_size": LLAMA3_VOCAB_SIZE,
    "max_position_embeddings": 131072,
    "eos_token_ids": list(LLAMA3_EOS_TOKEN_IDS),
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "model_type": "llama",
}

#: ``model.synthetic`` name -> the shape fields of ``worker.model.ModelSpec``
SYNTHETIC_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        **_LLAMA3_COMMON, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
        "hidden_size": 4096, "intermediate_size": 14336, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "llama-3-1b": {
        **_LLAMA3_COMMON, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8, "head_dim": 64,
        "hidden_size": 2048, "intermediate_size": 8192, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "llama-3-tiny": {
        **_LLAMA3_COMMON, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
        "hidden_size": 256, "intermediate_size": 512, "tie_word_embeddings": True, "max_position_embeddings": 8192,
        "rope_scaling": None,
    },
}

SYNTHETIC_NAMES = tuple(SYNTHETIC_SHAPES)


def synthetic_shape(name: str) -> dict[str, Any]:
    """Return a copy of the shape of synthetic model ``name``.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    if name not in SYNTHETIC_SHAPES:
        raise ValueError(f"unknown synthetic model {name!r}; valid: {', '.join(SYNTHETIC_NAMES)}")
    return dict(SYNTHETIC_SHAPES[name])


def num_parameters(name: str) -> int:
    """Return the parameter count of synthetic model ``name`` (embedding, LM head when untied, layers, norms)."""
    s = SYNTHETIC_SHAPES[name]
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    q, kv = s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    embed = s["vocab_size"] * hidden
    return s["num_layers"] * per_layer + embed * (1 if s["tie_word_embeddings"] else 2) + hidden
