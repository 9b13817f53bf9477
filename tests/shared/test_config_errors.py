"""Config errors name the file's line and, for an unknown key near a valid one, suggest it (shared/config.py)."""

from __future__ import annotations

import pytest

from shared.config import Config, ConfigError, load_config, with_overrides


def error_of(tmp_path, text: str, environ: dict[str, str] | None = None) -> str:
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc_info:
        load_config(path, environ=environ or {})
    return str(exc_info.value)


def test_unknown_key_gives_its_line_and_the_nearest_key(tmp_path):
    message = error_of(tmp_path, '[model]\nname = "x"\n\n[gateway]\nhost = "127.0.0.1"\nprot = 8000\n')
    assert message.startswith(f"{tmp_path / 'config.toml'}:6: ")
    assert "`prot`" in message and message.endswith("did you mean `port`?")


def test_unknown_table_is_suggested_too(tmp_path):
    message = error_of(tmp_path, "[gatway]\nport = 1\n")
    assert ":1: " in message and message.endswith("did you mean `gateway`?")


def test_a_key_in_the_second_array_table_points_at_its_line(tmp_path):
    message = error_of(tmp_path, '[[tiers]]\nname = "a"\n[[tiers]]\nname = "b"\nqueue_timeout = 3\n')
    assert ":5: " in message and message.endswith("did you mean `queue_timeout_s`?")


def test_a_value_out_of_range_gives_its_line_and_no_suggestion(tmp_path):
    message = error_of(tmp_path, "[gateway]\nport = 8000\n[worker]\n\nmax_num_seqs = 0\n")
    assert ":5: " in message and "max_num_seqs" in message and "did you mean" not in message


def test_a_key_nothing_is_close_to_gets_no_suggestion(tmp_path):
    assert "did you mean" not in error_of(tmp_path, "[gateway]\nzzzz = 1\n")


def test_an_environment_override_is_blamed_by_name_with_a_suggestion(tmp_path):
    message = error_of(tmp_path, "[gateway]\nport = 8000\n", {"SLUICE_GATEWAY__PROT": "1"})
    assert message.startswith("SLUICE_GATEWAY__PROT=1: ") and message.endswith("did you mean `port`?")


def test_a_value_that_is_no_choice_lists_the_valid_ones_and_the_nearest(tmp_path):
    message = error_of(tmp_path, '[[pools]]\nname = "v"\nbackend = "openai"\nengine = "vllm2"\n')
    assert ":4: Invalid enum value 'vllm2' - at `$.pools[0].engine`" in message
    assert message.endswith("; valid values are 'generic', 'llama.cpp', 'sglang', 'tgi', 'transformers', 'vllm'; "
                            "did you mean 'vllm'?"), message


def test_a_value_nothing_is_close_to_lists_the_valid_ones_only(tmp_path):
    message = error_of(tmp_path, '[worker]\nbackend = "tpu"\n')
    assert message.endswith("valid values are 'auto', 'cpu', 'cuda', 'sim'"), message


def test_an_environment_override_and_a_cli_override_list_the_valid_values_too(tmp_path):
    message = error_of(tmp_path, "", {"SLUICE_MODEL__DTYPE": "bfloat17"})
    assert message.startswith("SLUICE_MODEL__DTYPE=bfloat17: ") and message.endswith("did you mean 'bfloat16'?")
    with pytest.raises(ConfigError, match=r"valid values are 'auto', 'cpu', 'cuda', 'sim'$"):
        with_overrides(Config(), worker={"backend": "gpu"})
