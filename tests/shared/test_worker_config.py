"""``shared.config.validate_worker_config``: the KV block sizes ``sluice config --check`` refuses without knowing
the model (a worker checks the rest: whether ``kv_cache_gib`` holds two blocks of it)."""

from __future__ import annotations

import msgspec
import pytest

from shared.config import (
    CUPY_BLOCK_SIZES_TOKENS,
    Config,
    ConfigError,
    validate_pool_config,
    validate_worker_config,
)
from sluice.config_cmd import main as config_main
from worker.attention.partitioned_ref import SUPPORTED_BLOCK_SIZES


def config_of(worker: dict, model: dict | None = None) -> Config:
    return msgspec.convert({"worker": worker, "model": model or {}}, Config)


def test_a_block_longer_than_the_context_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"^worker.block_size_tokens = 100000 exceeds "
                                          r"model.max_model_len_tokens = 8192: "):
        validate_pool_config(config_of({"block_size_tokens": 100000}))  # what `sluice serve` and --check run
    validate_worker_config(config_of({"block_size_tokens": 8192}))
    validate_worker_config(config_of({"block_size_tokens": 48}, {"max_model_len_tokens": 64}))  # cpu/torch: any


def test_the_cupy_backend_takes_only_the_block_sizes_its_kernel_has():
    assert CUPY_BLOCK_SIZES_TOKENS == SUPPORTED_BLOCK_SIZES
    with pytest.raises(ConfigError, match=r"block_size_tokens = 64: the cupy attention backend has kernels for "
                                          r"16 or 32 tokens only"):
        validate_worker_config(config_of({"block_size_tokens": 64, "attention_backend": "cupy"}))
    for block_size_tokens in CUPY_BLOCK_SIZES_TOKENS:
        validate_worker_config(config_of({"block_size_tokens": block_size_tokens, "attention_backend": "cupy"}))


def test_config_check_catches_the_block_size_of_the_user_trial(tmp_path, capsys):
    config_path = tmp_path / "config.toml"
    config_path.write_text("[worker]\nblock_size_tokens = 100000\n")
    assert config_main(["--check", "--config", str(config_path)]) != 0
    captured = capsys.readouterr()
    assert "worker.block_size_tokens = 100000" in captured.out + captured.err
