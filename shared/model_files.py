"""Loading a model's tokenizer and weights with transformers, from a GGUF file or a Hugging Face folder.

A GGUF file's tokenizer is converted by transformers once (its vocabulary rebuilt: about 7 s for SmolLM2-135M on
2 CPU cores) and kept as a Hugging Face folder (``tokenizer.save_pretrained``). The worker's converted weights
(:func:`worker.model.load_gguf_model`) and transformers' fp32 dequantization (:func:`load_causal_lm`, the tests'
reference) are kept the same way. Everything lives under :func:`cache_root` (``$XDG_CACHE_HOME/sluice``, default
``~/.cache/sluice``)::

    gguf/<file stem>-<key>/tokenizer/            the tokenizer      (key: content hash + transformers version)
    gguf/<file stem>-<key>/model/                transformers' fp32 checkpoint
    weights/<file stem>-<content hash>-<mode>-torch<version>-v1/   model.safetensors + manifest.json

Keys hash the file's CONTENT (SHA-256 of its bytes, computed once per process per file), never its path: a
copied or moved file hits the same entry, a replaced one gets a new entry. An entry is written to a temporary
folder, checked, given a ``manifest.json`` of its files' sizes and SHA-256 sums, and renamed into place, so a
reader never sees half an entry; a reader verifies the manifest and rebuilds an entry that does not match (a
truncated or corrupted file) instead of loading it. Each kind keeps only its :data:`KEEP_ENTRIES` most recently
used entries. A cache that cannot be written is skipped: the load still succeeds, from the GGUF file.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
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


KEEP_ENTRIES = 4
_CONTENT_KEYS: dict[tuple[str, int, int], str] = {}


def content_key(path: str) -> str:
    """Return the SHA-256 (hex) of a file's bytes; memoized per process by (absolute path, size, mtime)."""
    st = os.stat(path)
    memo = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if memo not in _CONTENT_KEYS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        _CONTENT_KEYS[memo] = digest.hexdigest()
    return _CONTENT_KEYS[memo]


def cache_dir(gguf_path: str) -> str:
    """Return the cache folder of a GGUF file's converted tokenizer and weights (which may not exist yet)."""
    version = importlib.metadata.version("transformers")
    key = hashlib.sha256(f"{content_key(gguf_path)}|transformers={version}".encode()).hexdigest()[:32]
    return os.path.join(cache_root(), "gguf", f"{os.path.basename(gguf_path)[:-5]}-{key}")


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(folder: str, files: list[str]) -> None:
    manifest = {name: {"bytes": os.path.getsize(os.path.join(folder, name)),
                       "sha256": _file_sha256(os.path.join(folder, name))} for name in files}
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def verify_manifest(folder: str) -> bool:
    """Return whether every file of ``folder``'s ``manifest.json`` exists with its recorded size and SHA-256."""
    try:
        with open(os.path.join(folder, "manifest.json")) as f:
            manifest = json.load(f)
        return bool(manifest) and all(
            os.path.getsize(os.path.join(folder, name)) == entry["bytes"]
            and _file_sha256(os.path.join(folder, name)) == entry["sha256"]
            for name, entry in manifest.items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def prune_cache(kind_root: str, keep: int = KEEP_ENTRIES) -> None:
    """Delete all but the ``keep`` most recently used entries (folders, by mtime) under ``kind_root``, and
    temporary folders left by writers that died."""
    try:
        names = os.listdir(kind_root)
    except OSError:
        return
    entries = []
    for name in names:
        full = os.path.join(kind_root, name)
        if name.endswith(".json"):
            continue
        if name.endswith(".tmp"):
            if not os.path.exists(os.path.join("/proc", name.rsplit(".", 2)[-2])):
                shutil.rmtree(full, ignore_errors=True)
            continue
        try:
            entries.append((os.stat(full).st_mtime, full))
        except OSError:
            continue
    for _, full in sorted(entries, reverse=True)[keep:]:
        shutil.rmtree(full, ignore_errors=True)


def cached_entry(path: str, kind: str, key: str, build: Callable[[str], None], files: list[str]) -> str | None:
    """Return a verified cache folder for (``path``'s content, ``kind``, ``key``), building it when missing.

    ``build(tmp)`` writes ``files`` into a temporary folder; the manifest of their checksums is added and the
    folder renamed into place. An existing entry whose manifest does not verify is deleted and rebuilt. Returns
    the folder, or None when it could not be written (``build`` has still run).
    """
    kind_root = os.path.join(cache_root(), kind)
    stem = os.path.basename(path).rsplit(".", 1)[0]
    folder = os.path.join(kind_root, f"{stem}-{content_key(path)[:16]}-{key}")
    if os.path.isdir(folder):
        if verify_manifest(folder):
            os.utime(folder)
            return folder
        log.warning("model_cache_corrupt", path=folder)
        shutil.rmtree(folder, ignore_errors=True)

    def write(tmp: str) -> None:
        build(tmp)
        _write_manifest(tmp, files)

    written = _write_entry(folder, write, "model_cache_written")
    prune_cache(kind_root)
    return folder if written and verify_manifest(folder) else None


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
    prune_cache(os.path.join(cache_root(), "gguf"))
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


def synthetic_tokenizer(vocab_size: int, eos_token_ids: list[int]) -> Any:
    """Return a ``transformers`` fast tokenizer for a synthetic model (``shared.synthetic_models``).

    Token ``i`` is the word ``<i>`` (a word-level vocabulary of ``vocab_size`` entries, split at whitespace), so
    any token id decodes to text and that text encodes back to the same ids; the chat template joins the messages'
    contents. The first of ``eos_token_ids`` is the EOS token.
    """
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="<0>"))
    rust.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    rust.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token=f"<{eos_token_ids[0]}>", unk_token="<0>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer
