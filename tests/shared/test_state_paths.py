"""Per-deployment state: the jobs database defaults to var/ beside the config file (shared/config.py)."""

from __future__ import annotations

from shared.config import Config, load_config


def write_config(folder, text: str = "") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.toml"
    path.write_text(text)
    return str(path)


def test_each_config_folder_gets_its_own_jobs_database(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the same working directory for both
    first = load_config(write_config(tmp_path / "a"), environ={})
    second = load_config(write_config(tmp_path / "b"), environ={})
    assert first.jobs.sqlite_path == str(tmp_path.resolve() / "a" / "var" / "jobs.sqlite3")
    assert second.jobs.sqlite_path == str(tmp_path.resolve() / "b" / "var" / "jobs.sqlite3")


def test_a_relative_config_path_resolves_to_an_absolute_database(tmp_path, monkeypatch):
    write_config(tmp_path / "deploy")
    monkeypatch.chdir(tmp_path)
    assert load_config("deploy/config.toml", environ={}).jobs.sqlite_path == str(
        tmp_path.resolve() / "deploy" / "var" / "jobs.sqlite3")


def test_without_a_config_file_the_database_is_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(environ={}).jobs.sqlite_path == str(tmp_path.resolve() / "var" / "jobs.sqlite3")


def test_an_explicit_path_from_the_file_or_the_environment_is_kept(tmp_path):
    path = write_config(tmp_path, '[jobs]\nsqlite_path = "/srv/sluice/jobs.db"\n')
    assert load_config(path, environ={}).jobs.sqlite_path == "/srv/sluice/jobs.db"
    empty = write_config(tmp_path / "e")
    config = load_config(empty, environ={"SLUICE_JOBS__SQLITE_PATH": "/tmp/j.db"})
    assert config.jobs.sqlite_path == "/tmp/j.db"
    assert Config().jobs.sqlite_path == ""  # a Config built in code is not resolved: its user chooses
