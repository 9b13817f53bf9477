"""The shared secret of gateway ↔ worker connections end to end, with real processes over loopback (the multi-machine
setup of README "Several machines" on one box): a ``sluice serve --workers 0`` gateway and two ``sluice worker``
processes (sim backend: the roofline SIMULATOR, for speed) that register in the real Redis at 127.0.0.1:6379
(``make redis``) and prove the secret; a worker without it refused by the gateway; a gateway without it refused by the
worker, which ignores an unauthenticated ``Drain``; a non-loopback ``--listen`` without a secret refuses to start;
the local workers of a plain ``sluice serve`` challenge every peer with a secret made for the run.
"""

from __future__ import annotations

import json
import secrets
import socket
import urllib.request

from shared.protocol import Challenge, Drain, gateway_codec
from tests.support.server import SluiceProcess, free_port, get_json, wait_for

REDIS_URL = "redis://127.0.0.1:6379/0"
START_TIMEOUT_S = 180.0
MODEL = "SmolLM2-135M-Instruct"
WORKER_CONFIG = '[worker]\nbackend = "sim"\n[sim]\nkv_cache_gib = 1.0\n'


def registry_toml(prefix: str) -> str:
    return (f'[registry]\nredis_url = "{REDIS_URL}"\nkey_prefix = "{prefix}"\nheartbeat_interval_s = 0.2\n'
            'heartbeat_ttl_s = 1.0\npoll_interval_s = 0.2\n')


def gateway(config_text: str, secret: str | None, *args: str, min_ready_workers: int = 1,
            ready: str = "readyz") -> SluiceProcess:
    env = {"SLUICE_WORKER__SECRET": secret} if secret else {}
    return SluiceProcess(config_text, args=["--workers", "0", *args], env=env, ready=ready,
                         min_ready_workers=min_ready_workers, start_timeout_s=START_TIMEOUT_S)


def worker(secret: str | None, *args: str, config_text: str = WORKER_CONFIG) -> SluiceProcess:
    env = {"SLUICE_WORKER__SECRET": secret} if secret else {}
    return SluiceProcess(config_text, command="worker", ready="none", args=list(args), env=env)


def chat(base_url: str, content: str, max_tokens: int = 6) -> tuple[int, dict]:
    body = json.dumps({"model": MODEL, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": content}]}).encode()
    request = urllib.request.Request(f"{base_url}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, json.loads(response.read())


def listening(process: SluiceProcess) -> bool:
    process.check_alive()
    return bool(process.log_events("worker_listening"))


def test_gateway_and_two_workers_with_the_secret_serve_through_the_redis_registry(redis_prefix):
    secret = secrets.token_hex(32)
    worker_config = WORKER_CONFIG + registry_toml(redis_prefix)
    with worker(secret, "--registry", REDIS_URL, "--worker-id", "box-a", config_text=worker_config) as a, \
            worker(secret, "--registry", REDIS_URL, "--worker-id", "box-b", config_text=worker_config) as b, \
            gateway(registry_toml(redis_prefix), secret, min_ready_workers=2) as gw:
        codes = [chat(gw.base_url, f"question {i}")[0] for i in range(4)]
        assert codes == [200] * 4, gw.log_tail()
        status = gw.status()
        assert sorted(w["name"] for w in status["workers"]) == ["registry-box-a", "registry-box-b"]
        for w in (a, b):
            assert w.log_events("worker_listening")[0]["authenticated"] is True
            assert not w.log_events("gateway_auth_failed")
        assert not gw.log_events("worker_auth_failed")
        everything = gw.log_text() + a.log_text() + b.log_text() + json.dumps(status)
        assert secret not in everything  # never logged, never in /status


def test_worker_without_the_secret_is_refused_by_the_gateway_and_logged():
    with worker(None) as open_worker:
        wait_for(lambda: listening(open_worker), START_TIMEOUT_S, "the worker to listen")
        with gateway("", secrets.token_hex(32), "--worker-address", f"127.0.0.1:{open_worker.port}",
                     ready="healthz") as gw:
            [event] = wait_for(lambda: gw.log_events("worker_auth_failed"), 30.0, "the gateway to refuse it")
            assert "runs without the shared secret" in event["reason"]
            status, body = get_json(f"{gw.base_url}/readyz")  # no ready worker, and why
            assert status == 503 and "handshake refused: " in body["error"]["message"], body


def test_gateway_without_the_secret_is_refused_by_the_worker_which_ignores_an_unauthenticated_drain():
    secret = secrets.token_hex(32)
    with worker(secret) as locked:
        wait_for(lambda: listening(locked), START_TIMEOUT_S, "the worker to listen")
        address = f"127.0.0.1:{locked.port}"
        with gateway("", None, "--worker-address", address, ready="healthz") as gw:
            [event] = wait_for(lambda: gw.log_events("worker_auth_failed"), 30.0, "the gateway to give up")
            assert "this gateway has none" in event["reason"]
            refusals = wait_for(lambda: locked.log_events("gateway_auth_failed"), 30.0, "the worker to refuse it")
            assert "without answering the challenge" in refusals[0]["reason"]
            status, body = get_json(f"{gw.base_url}/readyz")  # no ready worker, and why
            assert status == 503 and "handshake refused: " in body["error"]["message"], body
        # a raw peer that skips the handshake: its Drain is refused and the connection closed
        with socket.create_connection(("127.0.0.1", locked.port), timeout=10) as raw:
            raw.recv(4096)  # the Challenge
            raw.sendall(gateway_codec().encode(Drain()))
            assert raw.recv(4096) == b""  # closed by the worker
        wait_for(lambda: any("sent Drain before proving" in e["reason"]
                             for e in locked.log_events("gateway_auth_failed")), 10.0, "the Drain refusal")
        with gateway("", secret, "--worker-address", address) as gw:  # the secret works; the worker is not draining
            assert chat(gw.base_url, "hello")[0] == 200


def test_non_loopback_listen_without_a_secret_refuses_to_start():
    listen = f"0.0.0.0:{free_port()}"
    with SluiceProcess(WORKER_CONFIG, command="worker", ready="none", port_arg=False, args=["--listen", listen]) as w:
        assert w.process.wait(timeout=120) == 2
        [line] = w.log_text().strip().splitlines()  # one clear line, before any model is loaded
        assert line.startswith(f"sluice worker: --listen {listen} is reachable from other machines and no shared "
                               "secret is set") and "--insecure-no-secret" in line


def test_local_workers_of_sluice_serve_get_a_per_run_secret_without_any_config():
    with SluiceProcess(WORKER_CONFIG) as gw:
        assert chat(gw.base_url, "hello")[0] == 200
        [event] = gw.log_events("worker_listening")
        assert event["authenticated"] is True
        with socket.socket(socket.AF_UNIX) as raw:  # anyone else on the machine meets a challenge first
            raw.settimeout(10)
            raw.connect(event["listen"][len("unix:"):])
            header = raw.recv(4)
            assert isinstance(gateway_codec().decode(raw.recv(int.from_bytes(header, "big"))), Challenge)
