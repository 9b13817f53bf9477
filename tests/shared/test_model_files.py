"""The converted-once cache of a GGUF model's tokenizer and weights (``shared.model_files``)."""

from __future__ import annotations

import os

import pytest
import torch

from shared import model_files


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def test_saved_weights_load_back_equal_with_tied_embeddings_and_no_quantization_config(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _tiny_llama()
    model.config.quantization_config = {"quant_method": "gguf"}  # what a GGUF load leaves in the config
    folder = str(tmp_path / "model")
    assert model_files.save_weights(model, folder)
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert getattr(loaded.config, "quantization_config", None) is None
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # still tied
    ids = torch.tensor([[1, 5, 9, 33]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_an_unwritable_cache_is_skipped_not_fatal(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    assert not model_files.save_weights(_tiny_llama(), str(blocker / "model"))
    assert sorted(os.listdir(tmp_path)) == ["not-a-folder"]  # no temporary folder left behind


def test_gguf_tokenizer_is_converted_once_and_the_copy_behaves_the_same(tmp_path, monkeypatch):
    from shared.config import default_model_path

    try:
        gguf = default_model_path()
    except Exception as exc:  # the model package is an install-time dependency
        pytest.skip(f"default model not installed: {exc}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = os.path.join(model_files.cache_dir(gguf), "tokenizer")
    assert folder.startswith(str(tmp_path)) and not os.path.exists(folder)
    converted = model_files.load_tokenizer(gguf)  # from the GGUF file, then written to the cache
    assert os.path.isfile(os.path.join(folder, "tokenizer.json"))
    assert not [p for p in os.listdir(os.path.dirname(folder)) if p.endswith(".tmp")]
    cached = model_files.load_tokenizer(gguf)
    assert model_files._tokenizer_probe(cached) == model_files._tokenizer_probe(converted)
    text = "def f(x):\n    return x ** 2  # 二乗 🙂"
    assert cached(text)["input_ids"] == converted(text)["input_ids"]
    assert cached.decode(cached(text)["input_ids"]) == text


def test_cache_key_changes_with_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    first = model_files.cache_dir(str(gguf))
    assert first.startswith(str(tmp_path / "cache" / "sluice" / "gguf" / "m-"))
    gguf.write_bytes(b"GGUF" + b"\0" * 17)
    assert model_files.cache_dir(str(gguf)) != first


def test_cache_key_follows_the_content_not_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, payload in ((a, b"same"), (b, b"same"), (c, b"different")):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + payload)
    assert model_files.cache_dir(str(a)) == model_files.cache_dir(str(b))
    assert model_files.cache_dir(str(a)) != model_files.cache_dir(str(c))


def _entry(tmp_path, monkeypatch, builds: list[str]):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "m.gguf"
    if not source.exists():
        source.write_bytes(b"GGUF model bytes")

    def build(folder: str) -> None:
        builds.append(folder)
        with open(os.path.join(folder, "weights.bin"), "wb") as f:
            f.write(b"\1" * 4096)

    return model_files.cached_entry(str(source), "weights", "int4-v1", build, ["weights.bin"])


def test_a_cache_entry_is_built_once_then_read(tmp_path, monkeypatch):
    builds: list[str] = []
    first = _entry(tmp_path, monkeypatch, builds)
    second = _entry(tmp_path, monkeypatch, builds)
    assert first == second and len(builds) == 1
    assert sorted(os.listdir(first)) == ["manifest.json", "weights.bin"]
    assert not [p for p in os.listdir(os.path.dirname(first)) if p.endswith(".tmp")]


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_a_corrupt_or_partial_cache_entry_is_rebuilt_not_loaded(tmp_path, monkeypatch, damage):
    builds: list[str] = []
    folder = _entry(tmp_path, monkeypatch, builds)
    weights = os.path.join(folder, "weights.bin")
    if damage == "truncate":
        with open(weights, "r+b") as f:
            f.truncate(100)
    elif damage == "flip":
        with open(weights, "r+b") as f:
            f.seek(7)
            f.write(b"\2")
    else:
        os.remove(os.path.join(folder, "manifest.json"))
    assert not model_files.verify_manifest(folder)
    again = _entry(tmp_path, monkeypatch, builds)
    assert again == folder and len(builds) == 2 and model_files.verify_manifest(again)
    assert open(weights, "rb").read() == b"\1" * 4096


def test_only_the_most_recent_cache_entries_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folders = []
    for i in range(model_files.KEEP_ENTRIES + 2):
        source = tmp_path / f"m{i}.gguf"
        source.write_bytes(f"GGUF {i}".encode())
        folder = model_files.cached_entry(str(source), "weights", "k", lambda f: open(os.path.join(f, "w"), "w").close(),
                                          ["w"])
        os.utime(folder, (1000 + i, 1000 + i))  # entry i used at time 1000 + i
        folders.append(folder)
    model_files.prune_cache(os.path.dirname(folders[0]))
    kept = sorted(os.path.join(os.path.dirname(folders[0]), n) for n in os.listdir(os.path.dirname(folders[0])))
    assert kept == sorted(folders[-model_files.KEEP_ENTRIES:])
