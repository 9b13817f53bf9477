"""The config reference (docs/config.md) and the commented config.toml against the Structs of shared/config.py."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from shared.config import Config, load_config
from shared.config_reference import ConfigKey, attribute_docs, config_keys, config_toml_keys, render_markdown
from sluice.config_cmd import main as config_main
from tests.shared.test_config_validation import BROKEN_AT_START

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "regenerate with: .venv/bin/sluice config --reference --output docs/config.md"


def test_docs_config_md_is_the_reference_generated_from_the_structs():
    assert (ROOT / "docs" / "config.md").read_text() == render_markdown(), REGENERATE


def test_config_toml_mentions_every_key_of_the_structs_and_no_other():
    keys = {(key.section, key.key) for key in config_keys()}
    in_file = config_toml_keys((ROOT / "config.toml").read_text())
    assert sorted(keys - in_file) == [], "keys missing from config.toml (add them, commented: # key = default)"
    assert sorted(in_file - keys) == [], "keys in config.toml that no Struct defines"


def test_every_key_has_a_meaning_in_its_struct_docstring():
    assert [key.dotted for key in config_keys() if not key.meaning] == []


def test_the_shipped_config_toml_decodes(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert load_config("config.toml", environ={}).default_tier == "standard"


def test_reference_names_sections_types_ranges_and_nested_defaults():
    by_name = {key.dotted: key for key in config_keys()}
    assert by_name["gateway.port"] == ConfigKey("gateway", "port", False, "int ≥ 1 and ≤ 65535", "8000",
                                                "where it listens.")
    assert by_name["default_tier"].default_text == '"standard"'
    assert by_name["tiers[].name"].default_text == "required"
    assert by_name["registry.redis_url"].section == "registry"
    # a nested table's defaults are those of its parent's default, not of the bare Struct
    assert by_name["kv.retention.critical.eviction_policy"].default_text == '"tier"'
    assert by_name["kv.retention.normal.max_ttl_s"].default_text == "inf"
    assert by_name["worker.backend"].type_text == '"auto" | "cpu" | "cuda" | "sim"'
    assert len(by_name) == len(config_keys())  # no key listed twice


def test_a_new_struct_field_changes_the_reference():
    class Extra(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        """Attributes:
            new_key_s: something new, seconds.
        """

        new_key_s: float = 1.5

    assert attribute_docs(Extra) == {"new_key_s": "something new, seconds."}
    keys = config_keys() + [ConfigKey("extra", "new_key_s", False, "float", "1.5", "something new, seconds.")]
    assert render_markdown(keys) != render_markdown()
    assert "| `new_key_s` | float | `1.5` | something new, seconds. |" in render_markdown(keys)


def test_config_toml_keys_reads_set_and_commented_keys_under_their_tables():
    text = '# default_tier = "vip"\n[gateway]\nport = 1\n# [registry]\n# redis_url = ""  # note\n#   free text = no\n'
    assert config_toml_keys(text) == {("", "default_tier"), ("gateway", "port"), ("registry", "redis_url")}


def test_sluice_config_check_reports_the_bad_key(tmp_path, capsys):
    bad = tmp_path / "config.toml"
    bad.write_text("[gateway]\nport = 0\n")
    assert config_main(["--check", "--config", str(bad)]) == 1
    assert "port" in capsys.readouterr().err
    assert config_main(["--check", "--config", str(ROOT / "config.toml")]) == 0
    assert Config().model.name in capsys.readouterr().out


def test_sluice_config_check_refuses_what_serve_refuses_and_names_every_pool(tmp_path, capsys):
    """A secret file that cannot be read or a short secret fail the check as they fail ``serve`` (they passed it);
    the ok line names each ``[[pools]]`` entry."""
    unreadable = tmp_path / "unreadable.toml"
    unreadable.write_text(f'[worker]\nsecret_file = "{tmp_path / "missing"}"\n')
    assert config_main(["--check", "--config", str(unreadable)]) == 1
    assert "worker.secret_file: cannot read" in capsys.readouterr().err
    short = tmp_path / "short.toml"
    short.write_text('[worker]\nsecret = "short"\n')
    assert config_main(["--check", "--config", str(short)]) == 1
    assert "at least 16 characters" in capsys.readouterr().err
    pools = tmp_path / "pools.toml"
    pools.write_text('[[pools]]\nname = "sim"\nbackend = "sim"\nmin_workers = 0\nmax_workers = 4\n\n'
                     '[[pools]]\nname = "vllm"\nmodel_name = "big"\nbackend = "openai"\nengine = "vllm"\n'
                     'upstreams = ["http://127.0.0.1:9"]\n')
    assert config_main(["--check", "--config", str(pools)]) == 0
    out = capsys.readouterr().out
    assert "sim (SmolLM2-135M-Instruct, 0-4 local worker(s), backend sim)" in out
    assert "vllm (big, 1 upstream(s), engine vllm)" in out


@pytest.mark.parametrize("text, files, message", BROKEN_AT_START)
def test_sluice_config_check_runs_the_checks_serve_runs_at_start(tmp_path, monkeypatch, capsys, text, files,
                                                                   message):
    """Duplicate keys, the keys file, an unset ``api_key_env``, a local model path that does not exist, a
    ``*_by_tier`` map naming no tier: the check fails with the line ``serve`` stops with (it said "config ok")."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DEFINITELY_NOT_SET_XYZ", raising=False)
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    (tmp_path / "config.toml").write_text(text)
    assert config_main(["--check", "--config", "config.toml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"sluice config: {message}") and err.count("\n") == 1, err


def test_sluice_config_check_passes_a_hub_model_id_and_a_set_api_key_env(tmp_path, monkeypatch, capsys):
    """What the check cannot judge without the network (a hub id) passes; a variable that is set passes."""
    monkeypatch.setenv("UPSTREAM_TOKEN_FOR_TEST", "t0ken")
    path = tmp_path / "config.toml"
    path.write_text('[model]\npath = "HuggingFaceTB/SmolLM2-135M-Instruct"\n\n[[pools]]\nname = "u"\n'
                    'backend = "openai"\nupstreams = ["http://127.0.0.1:9"]\napi_key_env = "UPSTREAM_TOKEN_FOR_TEST"\n')
    assert config_main(["--check", "--config", str(path)]) == 0
    assert "config ok" in capsys.readouterr().out
