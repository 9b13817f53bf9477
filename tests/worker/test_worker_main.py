"""``worker.__main__``: what a worker reports of its KV pressure and the name its shared KV blocks go under."""

from __future__ import annotations

import hashlib

import msgspec

from shared.config import Config
from worker.__main__ import build_worker, kv_model_id


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
