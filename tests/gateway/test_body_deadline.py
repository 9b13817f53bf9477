"""The request body deadline and the bound on bodies received at once (gateway/http/body_deadline.py), against a
real ``sluice serve`` gateway over raw sockets (a slow or endless body is what no HTTP client library sends).

The gateway has no worker (its address is a port where nothing listens): every answer here is given before a
request reaches the pipeline.
"""

from __future__ import annotations

import json
import socket

import pytest

from tests.support.server import SluiceProcess, free_port, wait_for

pytestmark = pytest.mark.slow

BODY_READ_TIMEOUT_S = 1.0
MAX_UNFINISHED_BODIES = 2
CONFIG = f"""
[gateway]
body_read_timeout_s = {BODY_READ_TIMEOUT_S}
max_unfinished_bodies = {MAX_UNFINISHED_BODIES}
"""
READ_TIMEOUT_S = 60.0  # a socket read that waits longer means the gateway never answered


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with SluiceProcess(CONFIG, tmp_path_factory.mktemp("body_deadline"), ready="healthz",
                       args=["--worker-address", f"127.0.0.1:{free_port()}"]) as process:
        yield process


def _send_head(gateway: SluiceProcess, framing: str, body_start: bytes) -> socket.socket:
    """Open a connection and send a chat request's headers with ``framing`` and the first bytes of its body."""
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=READ_TIMEOUT_S)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"{framing}\r\n\r\n".encode() + body_start)
    return sock


def _endless_chunked(gateway: SluiceProcess) -> socket.socket:
    return _send_head(gateway, "Transfer-Encoding: chunked", b"8\r\n{\"model\"\r\n")


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], dict]:
    """Read one response (its ``Content-Length`` bytes of body), close the socket; return (status, headers
    lower-cased, JSON body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        body += _recv(sock)
    sock.close()
    return int(lines[0].split()[1]), headers, json.loads(body)


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise AssertionError("the gateway closed the connection without a whole response")
    return chunk


def _unfinished_bodies(gateway: SluiceProcess) -> float:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=READ_TIMEOUT_S) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    line = next(line for line in data.decode().splitlines() if line.startswith("sluice_unfinished_request_bodies "))
    return float(line.split()[1])


def test_a_body_that_never_ends_or_falls_short_of_its_length_gets_408_request_timeout(gateway):
    endless = _endless_chunked(gateway)
    short = _send_head(gateway, "Content-Length: 1000", b'{"model": "SmolLM2-135M-Instruct"')
    for sock in (endless, short):
        status, headers, body = _read_response(sock)  # answered while the body is still unfinished
        assert status == 408, body
        assert body["error"]["code"] == "request_timeout" and body["error"]["type"] == "invalid_request_error"
        assert "body_read_timeout_s" in body["error"]["message"]
    wait_for(lambda: _unfinished_bodies(gateway) == 0, 10, "the unfinished bodies to be let go")


def test_bodies_beyond_the_bound_get_503_server_overloaded_before_their_body_is_read(gateway):
    slow = [_endless_chunked(gateway) for _ in range(MAX_UNFINISHED_BODIES)]
    wait_for(lambda: _unfinished_bodies(gateway) == MAX_UNFINISHED_BODIES, 30, "the slow bodies to be counted")
    status, headers, body = _read_response(_endless_chunked(gateway))
    assert status == 503 and body["error"]["code"] == "server_overloaded", body
    assert headers["x-sluice-reject-reason"] == "server_overloaded" and int(headers["retry-after"]) >= 1
    for sock in slow:
        assert _read_response(sock)[0] == 408
    # a whole body is never held back by the bound: the request reaches the pipeline (no worker here: 503)
    whole = json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]}).encode()
    sock = _send_head(gateway, f"Content-Length: {len(whole)}\r\nConnection: close", whole)
    status, headers, body = _read_response(sock)
    assert status == 503 and body["error"]["code"] == "no_worker_available", body
