"""``sluice --help``, ``--version`` and the command dispatch (sluice/cli.py)."""

from __future__ import annotations

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
