"""Loading a model's tokenizer and weights with transformers, from a GGUF file or a Hugging Face folder.

A GGUF file is converted by transformers on every load: its tokenizer is rebuilt from the GGUF vocabulary (about
7 s for SmolLM2-135M on 2 CPU cores) and its weights are dequantized (about 30 s). Both are done once per file
and kept as a Hugging Face folder (``tokenizer.save_pretrained``; fp32 weights in ``model.safetensors`` with the
``config.json`` and ``generation_config.json`` transformers wrote) under
``$XDG_CACHE_HOME/sluice/gguf/<key>/`` (default ``~/.cache``). Later loads read that folder (under a second).

The key hashes the GGUF file's absolute path, size and mtime and the transformers version, so a replaced file or
an upgraded converter makes a new entry. An entry is written to a temporary folder, checked (the weights read back
equal the dequantized ones; the tokenizer renders and encodes a probe conversation exactly as the GGUF one does)
and then renamed into place, so a reader never sees half an entry. A cache that cannot be written is skipped: the
load still succeeds, from the GGUF file.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import os
import shutil
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# a conversation whose rendering and encoding must come out the same from the GGUF tokenizer and its cached copy
PROBE_MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi in Japanese: こんにちは? And 12345 + ünïcödé, tabs\tand\nnewlines."},
    {"role": "assistant", "content": "こんにちは!"},
    {"role": "user", "content": "<|im_end|> is text here."},
]


def is_gguf(path: str) -> bool:
    """Return whether ``path`` is a GGUF file (else it is taken for a Hugging Face folder)."""
    return os.path.isfile(path) and path.endswith(".gguf")


def cache_dir(gguf_path: str) -> str:
    """Return the cache folder of a GGUF file's converted tokenizer and weights (which may not exist yet)."""
    st = os.stat(gguf_path)
    version = importlib.metadata.version("transformers")
    key = hashlib.sha256(
        f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|transformers={version}".encode()
    ).hexdigest()[:32]
    return os.path.join(cache_root(), "gguf", f"{os.path.basename(gguf_path)[:-5]}-{key}")


def cache_root() -> str:
    """Return Sluice's cache folder: ``$XDG_CACHE_HOME/sluice`` (default ``~/.cache/sluice``)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sluice")


def _write_entry(folder: str, write: Callable[[str], None], event: str) -> bool:
    """Write a cache entry: ``write(tmp)`` fills (and checks) a temporary folder, which is then renamed to
    ``folder``, so a reader never sees half an entry; a concurrent writer that got there first wins. Return whether
    it was written; a failure (``OSError``, ``ValueError`` or ``RuntimeError``) is logged and leaves nothing."""
    tmp = f"{folder}.{os.getpid()}.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        write(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info(event, path=folder)
        return True
    except (OSError, ValueError, RuntimeError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning("gguf_cache_not_written", path=folder, error=str(exc))
        return False


def _tokenizer_probe(tokenizer: Any) -> tuple:
    """What must not change when a tokenizer is saved and loaded again: vocabulary size, special ids, the chat
    template's rendering of :data:`PROBE_MESSAGES` and its encoding."""
    text = tokenizer.apply_chat_template(PROBE_MESSAGES, add_generation_prompt=True, tokenize=False)
    return (len(tokenizer), sorted(tokenizer.all_special_ids), tokenizer.eos_token_id, text,
            tokenizer(text, add_special_tokens=False)["input_ids"])


def load_tokenizer(path: str) -> Any:
    """Return the ``transformers`` tokenizer of a GGUF file (converted once, then from the cache) or an HF folder.

    Raises:
        OSError / ValueError: transformers could not load it.
    """
    from transformers import AutoTokenizer

    if not is_gguf(path):
        return AutoTokenizer.from_pretrained(path)
    folder = os.path.join(cache_dir(path), "tokenizer")
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as exc:
            log.warning("gguf_cache_unreadable", path=folder, error=str(exc))
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                              gguf_file=os.path.basename(path))

    def write(tmp: str) -> None:
        tokenizer.save_pretrained(tmp)
        if _tokenizer_probe(AutoTokenizer.from_pretrained(tmp)) != _tokenizer_probe(tokenizer):
            raise ValueError("the saved tokenizer does not render or encode like the GGUF one")

    _write_entry(folder, write, "gguf_tokenizer_cached")
    return tokenizer


def load_causal_lm(path: str, dtype: Any) -> Any:
    """Return a ``transformers`` ``AutoModelForCausalLM`` on the CPU: a GGUF file's weights dequantized to fp32
    (converted once, then read from the cache; ``dtype`` is ignored) or an HF folder's in ``dtype``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    if not is_gguf(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    folder = os.path.join(cache_dir(path), "model")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        try:
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            log.warning("gguf_cache_unreadable", path=folder, error=str(exc))
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                 gguf_file=os.path.basename(path), dtype=torch.float32)
    save_weights(model, folder)
    return model


def save_weights(model: Any, folder: str) -> bool:
    """Write ``model`` (a transformers causal LM) to ``folder`` as a plain HF checkpoint: ``model.safetensors``
    (tied weights stored once), ``config.json`` without a quantization config, ``generation_config.json``. The
    weights are read back and compared before the folder is renamed into place. Return whether it was written."""
    import safetensors.torch
    import torch

    def write(tmp: str) -> None:
        weights_path = os.path.join(tmp, "model.safetensors")
        safetensors.torch.save_model(model, weights_path)
        state = model.state_dict()
        saved = safetensors.torch.load_file(weights_path)
        if not saved or any(not torch.equal(tensor, state[name]) for name, tensor in saved.items()):
            raise ValueError("the weights read back differ from the model's")
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)

    return _write_entry(folder, write, "gguf_weights_cached")
