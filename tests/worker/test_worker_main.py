"""``worker.__main__``: what a worker reports of its KV pressure and the name its shared KV blocks go under."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from shared.config import CONFIG_ERROR_EXIT_STATUS, Config, ConfigError
from worker.__main__ import build_worker, check_num_kv_blocks, kv_model_id, main


def test_the_reported_pressure_is_the_level_the_kv_manager_applies_from_the_configured_thresholds():
    """``Capacity.pressure`` (``/status``) is the KV manager's level, from ``[pressure.*]`` with its hysteresis: a
    fixed 0.8 / 0.95 of its own said ``normal`` while the configured thresholds made retention critical."""
    pressure = msgspec.to_builtins(Config().pressure)
    for level in ("elevated", "critical"):
        pressure[level].update(enter_kv_used_fraction=0.0, leave_kv_used_fraction=0.0)
    config = msgspec.convert({"worker": {"backend": "sim"}, "pressure": pressure}, Config)
    server = build_worker(config, "w-test")
    assert server.hello.weights == "sim"  # Hello says how the weights are held (/status)
    kv_manager = server.engine.scheduler.kv
    assert server.capacity_fn().pressure == "normal"  # no step has looked at the pool yet
    kv_manager.update_pressure()  # what every engine step does first
    assert kv_manager.pressure == "critical"
    assert server.capacity_fn().pressure == "critical"


def test_kv_blocks_are_shared_only_between_workers_of_the_same_weights(tmp_path):
    """The Redis tier's key names the model, the weights it runs and which file they are: an int8 worker must not
    reload K/V an int4 worker computed, nor a worker of another file served under the same name."""
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"x" * 100)
    config = msgspec.convert({"model": {"name": "m", "path": str(gguf)}}, Config)
    int4, int8 = kv_model_id(config, "int4"), kv_model_id(config, "int8")
    assert int4 == "m:int4:model.Q4_1.gguf-" + hashlib.sha256(b"x" * 100).hexdigest()[:16] and int8 != int4
    gguf.write_bytes(b"x" * 101)  # another file under the same name and path
    assert kv_model_id(config, "int4") != int4
    other = tmp_path / "other" / "model.Q4_1.gguf"  # same name and size, other bytes
    other.parent.mkdir()
    other.write_bytes(b"y" * 100)
    other_config = msgspec.convert({"model": {"name": "m", "path": str(other)}}, Config)
    assert kv_model_id(other_config, "int4") == "m:int4:model.Q4_1.gguf-" + hashlib.sha256(b"y" * 100).hexdigest()[:16]
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"y" * 7)
    config = msgspec.convert({"model": {"name": "m", "path": str(folder)}}, Config)
    assert kv_model_id(config, "") == "m:dense:hf-7"
    synthetic = msgspec.convert({"model": {"name": "m", "synthetic": "llama-3-1b"}}, Config)
    assert kv_model_id(synthetic, "bfloat16") == "m:bfloat16:synthetic-llama-3-1b"


def test_a_kv_pool_of_fewer_than_two_blocks_names_both_keys_and_the_fix():
    """The user trial: ``block_size_tokens = 100000`` with ``kv_cache_gib = 0.5`` said only that kv_cache_gib
    holds fewer than 2 blocks, not that the block size made them that large."""
    bytes_per_block = 100000 * 36864  # SmolLM2-135M: 30 layers x K and V x 3 KV heads x 64 x 4 bytes a token
    with pytest.raises(ConfigError) as info:
        check_num_kv_blocks(0, "worker.kv_cache_gib", 0.5, 100000, bytes_per_block)
    message = str(info.value)
    assert message.startswith("worker.kv_cache_gib = 0.5 holds fewer than 2 KV blocks of worker.block_size_tokens "
                              f"= 100000 tokens ({bytes_per_block} bytes each for this model; it holds 0)"), message
    assert message.endswith("raise worker.kv_cache_gib to at least 6.87 or lower worker.block_size_tokens"), message
    check_num_kv_blocks(2, "worker.kv_cache_gib", 0.5, 16, 1024)  # two are enough


def test_the_simulator_refuses_a_pool_of_fewer_than_two_blocks_too():
    config = msgspec.convert({"worker": {"backend": "sim", "block_size_tokens": 4096},
                              "sim": {"kv_cache_gib": 0.5, "kv_bytes_per_token": 131072}}, Config)
    with pytest.raises(ConfigError, match=r"^sim.kv_cache_gib = 0.5 holds fewer than 2 KV blocks of "
                                          r"worker.block_size_tokens = 4096 tokens \(536870912 bytes each"):
        build_worker(config, "w-test")


def test_a_config_error_exits_with_status_2_and_writes_its_reason_for_the_gateway(tmp_path, capsys):
    config_path = tmp_path / "config.toml"
    config_path.write_text('[worker]\nbackend = "sim"\nblock_size_tokens = 100000\n')
    reason_path = tmp_path / "w.exit-reason"
    status = main(["--listen", f"unix:{tmp_path}/w.sock", "--config", str(config_path),
                   "--exit-reason-file", str(reason_path)])
    assert status == CONFIG_ERROR_EXIT_STATUS == 2
    reason = reason_path.read_text().strip()
    assert reason.startswith("worker.block_size_tokens = 100000 exceeds model.max_model_len_tokens = 8192"), reason
    assert capsys.readouterr().err == f"sluice worker: {reason}\n"


@pytest.mark.parametrize("argv, message", [
    (["--listen", "127.0.0.1:99999"], "--listen: port 99999 is out of range: must be 1-65535"),
    (["--listen", "nonsense"], "--listen: expected HOST:PORT or unix:PATH, got 'nonsense'"),
    (["--listen", "unix:/nonexistent/dir/x.sock"], "--listen: unix:/nonexistent/dir/x.sock: the folder "
                                                   "/nonexistent/dir does not exist"),
    (["--listen", "127.0.0.1:9100", "--advertise", "10.0.0.5:70000"], "--advertise: port 70000 is out of range"),
])
def test_a_bad_address_exits_with_status_2_in_one_line_before_the_model_loads(argv, message, monkeypatch, capsys):
    """The user trial: port 99999 was bound as 34463; ``nonsense`` loaded the model, then died with a traceback."""
    import worker.__main__ as worker_main

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load for a bad address")

    monkeypatch.setattr(worker_main, "build_worker", no_model)
    assert main([*argv, "--backend", "sim"]) == CONFIG_ERROR_EXIT_STATUS
    err = capsys.readouterr().err
    assert err.startswith(f"sluice worker: {message}") and err.count("\n") == 1, err


def test_a_port_in_use_is_one_line_and_exit_status_1_before_the_model_loads(monkeypatch, capsys):
    import socket

    import worker.__main__ as worker_main

    monkeypatch.setattr(worker_main, "build_worker", lambda *args: pytest.fail("the model must not load"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--listen", f"127.0.0.1:{port}", "--backend", "sim"]) == worker_main.LISTEN_ERROR_EXIT_STATUS
    assert capsys.readouterr().err == (f"sluice worker: --listen 127.0.0.1:{port} is already in use (another "
                                       "worker? choose another port)\n")


def test_the_command_line_reports_a_bad_listen_address_without_a_traceback(tmp_path):
    """End to end through ``sluice worker``: one line on stderr, exit status 2 (the process imports no torch)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "sluice.cli", "worker", "--listen", "127.0.0.1:99999"],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("sluice worker: --listen: port 99999 is out of range: must be 1-65535, got "
                             "'127.0.0.1:99999'\n")


def test_a_disk_cache_dir_under_a_file_exits_with_status_2_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """The user trial: ``kv.disk_cache_dir = "/etc/passwd/sub"`` ended the worker in a NotADirectoryError traceback,
    exit status 1, and the gateway restarted it for ever."""
    import worker.__main__ as worker_main

    monkeypatch.setattr(worker_main, "build_worker", lambda *args: pytest.fail("the model must not load"))
    (tmp_path / "file").write_text("")
    config_path = tmp_path / "config.toml"
    config_path.write_text(f'[worker]\nbackend = "cpu"\n[kv]\ndisk_cache_dir = "{tmp_path}/file/sub"\n')
    reason_path = tmp_path / "w.exit-reason"
    assert main(["--listen", f"unix:{tmp_path}/w.sock", "--config", str(config_path),
                 "--exit-reason-file", str(reason_path)]) == CONFIG_ERROR_EXIT_STATUS
    reason = reason_path.read_text().strip()
    assert reason.startswith(f"kv.disk_cache_dir: '{tmp_path}/file/sub': {tmp_path}/file is not a directory"), reason
    assert capsys.readouterr().err == f"sluice worker: {reason}\n"


@pytest.mark.parametrize("kv_toml, key", [
    ('disk_cache_dir = "{tmp_path}/file/sub"\nhost_cache_gib = 0', "kv.disk_cache_dir"),
    ('redis_url = "http://127.0.0.1:6379/9"\ndisk_cache_gib = 0\nhost_cache_gib = 0', "kv.redis_url"),
])
def test_an_offload_tier_the_worker_cannot_build_is_a_config_error_with_exit_status_2(kv_toml, key, tmp_path,
                                                                                       monkeypatch):
    """Past the checks before the model loads (a folder removed meanwhile, a URL redis-py refuses): the tier's
    OSError or ValueError is still the one-line config error the gateway does not restart, not a traceback. (No
    capsys: the worker's loggers, cached on first use, would keep writing to its stream once closed.)"""
    import worker.__main__ as worker_main

    monkeypatch.setattr(worker_main, "check_kv_disk_cache_dir", lambda kv: None)
    monkeypatch.setattr(worker_main, "validate_worker_config", lambda config: None)
    (tmp_path / "file").write_text("")
    config_path = tmp_path / "config.toml"
    config_path.write_text('[model]\nsynthetic = "llama-3-tiny"\n[worker]\nbackend = "cpu"\nkv_cache_gib = 0.01\n'
                           f'[kv]\n{kv_toml.format(tmp_path=tmp_path)}\n')
    reason_path = tmp_path / "w.exit-reason"
    assert main(["--listen", f"unix:{tmp_path}/w.sock", "--config", str(config_path),
                 "--exit-reason-file", str(reason_path)]) == CONFIG_ERROR_EXIT_STATUS
    reason = reason_path.read_text()
    assert reason.startswith(f"{key}: ") and reason.count("\n") == 1, reason
