"""``sluice --help``, ``--version`` and the command dispatch (sluice/cli.py)."""

from __future__ import annotations

import sys

import pytest

from sluice import __version__
from sluice.cli import _SUBCOMMANDS, main


def test_help_lists_every_command_with_what_it_does(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, _, summary) in _SUBCOMMANDS.items():
        assert f"  {name}" in out and summary in out
    assert "--version" in out


def test_no_command_prints_the_help_on_stderr_and_fails(capsys):
    assert main([]) == 2
    assert "commands:" in capsys.readouterr().err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"sluice {__version__}"


def test_unknown_command_names_the_valid_ones(capsys):
    assert main(["srve"]) == 2
    err = capsys.readouterr().err
    assert "'srve'" in err and "serve" in err and "sluice --help" in err


def test_serve_reports_a_config_error_found_while_the_gateway_starts_in_one_line(tmp_path, monkeypatch, capsys):
    """What only the running gateway finds (``sluice serve`` checks the rest before it binds) still ends in one
    line and exit status 2, not a traceback."""
    import types

    import gateway.__main__ as serve_main
    from shared.config import ConfigError

    def run(coro):  # stands in for uvloop.run: no event loop, so pytest's own loop and logging stay as they are
        coro.close()
        raise ConfigError("pools[u].api_key_env: the variable X is not set")

    monkeypatch.chdir(tmp_path)  # no config.toml: the defaults
    monkeypatch.delenv("SLUICE_CONFIG", raising=False)
    monkeypatch.setitem(sys.modules, "uvloop", types.SimpleNamespace(run=run))
    monkeypatch.setattr(serve_main, "configure_logging", lambda: None)
    monkeypatch.setattr(serve_main, "bind_listeners", lambda host, port, reuse_port: [])
    monkeypatch.setattr(serve_main, "return_large_blocks_to_the_os", lambda: None)  # leave pytest's malloc alone
    assert main(["serve"]) == 2
    assert capsys.readouterr().err == "sluice serve: pools[u].api_key_env: the variable X is not set\n"


def test_serve_refuses_a_worker_address_without_a_port_before_it_starts(tmp_path, monkeypatch, capsys):
    """The user trial: ``--worker-address bogus`` was accepted and /status showed it ``not connected`` forever."""
    import gateway.__main__ as serve_main

    monkeypatch.chdir(tmp_path)  # no config.toml: the defaults
    monkeypatch.delenv("SLUICE_CONFIG", raising=False)
    monkeypatch.setattr(serve_main, "configure_logging", lambda: None)
    monkeypatch.setattr(serve_main, "bind_listeners", lambda *args: pytest.fail("must not listen"))
    assert main(["serve", "--worker-address", "127.0.0.1:9100", "--worker-address", "bogus"]) == 2
    assert capsys.readouterr().err == ("sluice serve: --worker-address: expected HOST:PORT or unix:PATH, got "
                                       "'bogus'\n")
    assert main(["serve", "--worker-address", "unix:/nonexistent/w.sock"]) == 2
    assert "the folder /nonexistent does not exist" in capsys.readouterr().err


def test_config_check_refuses_output_instead_of_ignoring_it(tmp_path, capsys):
    output = tmp_path / "x.md"
    with pytest.raises(SystemExit) as info:
        main(["config", "--check", "--output", str(output)])
    assert info.value.code == 2 and not output.exists()
    assert "argument --output: only with --reference" in capsys.readouterr().err
