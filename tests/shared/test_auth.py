"""The shared secret of gateway ↔ worker connections (shared/auth.py): where it comes from, and the mutual HMAC
handshake over a real loopback socket for every pairing of secrets (same, different, missing on either side), plus a
raw peer that skips the handshake."""

from __future__ import annotations

import asyncio

import pytest

from shared.auth import (
    AuthError,
    authenticate_worker,
    gateway_proof,
    is_loopback_listen,
    load_secret,
    verify_gateway,
    worker_proof,
)
from shared.config import ConfigError, WorkerConfig
from shared.protocol import (
    MAX_HANDSHAKE_FRAME_BYTES,
    Authenticated,
    Challenge,
    Drain,
    Hello,
    ProtocolError,
    gateway_codec,
    worker_codec,
)

SECRET = b"correct horse battery staple"
OTHER = b"an entirely different secret"
HELLO = Hello(worker_id="w", model_id="m", backend="sim", device="sim", block_size_tokens=16, num_kv_blocks=10,
              kv_capacity_tokens=160, max_num_seqs=4, max_model_len_tokens=512)


def test_load_secret_from_the_key_or_a_file(tmp_path):
    assert load_secret(WorkerConfig()) is None
    assert load_secret(WorkerConfig(secret=SECRET.decode())) == SECRET
    path = tmp_path / "secret"
    path.write_text(SECRET.decode() + "\n")
    assert load_secret(WorkerConfig(secret_file=str(path))) == SECRET


@pytest.mark.parametrize(("values", "message"), [
    ({"secret": "short"}, "at least 16 characters"),
    ({"secret": SECRET.decode(), "secret_file": "/x"}, "not both"),
    ({"secret_file": "/nonexistent/sluice-secret"}, "cannot read /nonexistent/sluice-secret"),
])
def test_load_secret_errors_name_the_key_and_never_the_secret(values, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_secret(WorkerConfig(**values))
    assert SECRET.decode() not in str(info.value)


def test_empty_secret_file_is_an_error(tmp_path):
    path = tmp_path / "secret"
    path.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        load_secret(WorkerConfig(secret_file=str(path)))


@pytest.mark.parametrize(("listen", "loopback"), [
    ("unix:/tmp/w.sock", True), ("127.0.0.1:9100", True), ("localhost:9100", True), (":9100", True),
    ("[::1]:9100", True), ("0.0.0.0:9100", False), ("10.0.0.5:9100", False), ("[::]:9100", False),
    ("worker-box:9100", False),
])
def test_is_loopback_listen(listen, loopback):
    assert is_loopback_listen(listen) is loopback


def test_proofs_depend_on_role_secret_and_both_nonces():
    w, g = b"w" * 32, b"g" * 32
    proofs = {gateway_proof(SECRET, w, g), worker_proof(SECRET, g, w), gateway_proof(OTHER, w, g),
              gateway_proof(SECRET, b"x" * 32, g), gateway_proof(SECRET, w, b"x" * 32)}
    assert len(proofs) == 5 and all(len(p) == 32 for p in proofs)


async def handshake(worker_secret: bytes | None, gateway_secret: bytes | None):
    """Run the worker side (``verify_gateway`` then Hello, as worker/server.py does) and the gateway side
    (``authenticate_worker``) over a loopback TCP connection; return (worker outcome, gateway outcome): the Hello,
    None for the worker's success, or the exception."""
    worker_result: list = []

    async def serve(reader, writer):
        try:
            if worker_secret is not None:
                await verify_gateway(reader, writer, worker_codec(), worker_secret)
            writer.write(worker_codec().encode(HELLO))
            await writer.drain()
            worker_result.append(None)
        except (AuthError, ProtocolError) as exc:
            worker_result.append(exc)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        gateway_result = await authenticate_worker(reader, writer, gateway_codec(), gateway_secret)
    except (AuthError, ProtocolError, ConnectionError) as exc:
        gateway_result = exc
    writer.close()
    for _ in range(100):
        if worker_result:
            break
        await asyncio.sleep(0.01)
    server.close()
    await server.wait_closed()
    return worker_result[0] if worker_result else "pending", gateway_result


async def test_same_secret_authenticates_both_ways():
    assert await handshake(SECRET, SECRET) == (None, HELLO)


async def test_no_secret_on_either_side_is_the_plain_hello():
    assert await handshake(None, None) == (None, HELLO)


async def test_different_secrets_are_refused_by_the_worker():
    worker, gateway = await handshake(SECRET, OTHER)
    assert isinstance(worker, AuthError) and "proof of the shared secret is wrong" in str(worker)
    assert isinstance(gateway, AuthError) and "secrets differ" in str(gateway)


async def test_gateway_without_the_secret_is_refused():
    worker, gateway = await handshake(SECRET, None)
    assert isinstance(gateway, AuthError) and "this gateway has none" in str(gateway)
    assert isinstance(worker, AuthError) and "without answering the challenge" in str(worker)


async def test_worker_without_the_secret_is_refused_by_a_gateway_that_has_one():
    worker, gateway = await handshake(None, SECRET)
    assert isinstance(gateway, AuthError) and "runs without the shared secret" in str(gateway)


async def test_a_worker_that_cannot_answer_the_gateways_nonce_is_refused():
    """A fake worker replays a proof it cannot compute (no secret): the gateway refuses it after its own proof."""
    async def serve(reader, writer):
        codec = worker_codec()
        writer.write(codec.encode(Challenge(b"n" * 32)))
        await codec.read(reader)
        writer.write(codec.encode(Authenticated(b"\0" * 32)))
        writer.write(codec.encode(HELLO))
        await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    with pytest.raises(AuthError, match="proof of the shared secret is wrong"):
        await authenticate_worker(reader, writer, gateway_codec(), SECRET)
    writer.close()
    server.close()


async def test_peer_that_skips_the_handshake_is_refused_and_oversized_frames_before_it_too():
    async def run(payload: bytes) -> Exception:
        result: list = []

        async def serve(reader, writer):
            try:
                await verify_gateway(reader, writer, worker_codec(), SECRET)
            except (AuthError, ProtocolError) as exc:
                result.append(exc)
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        assert isinstance(gateway_codec().decode((await reader.readexactly(
            int.from_bytes(await reader.readexactly(4), "big")))), Challenge)
        writer.write(payload)
        await writer.drain()
        for _ in range(100):
            if result:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        return result[0]

    drain = await run(gateway_codec().encode(Drain()))
    assert isinstance(drain, AuthError) and "sent Drain before proving" in str(drain)
    huge = await run((MAX_HANDSHAKE_FRAME_BYTES + 1).to_bytes(4, "big"))
    assert isinstance(huge, ProtocolError) and "exceeds" in str(huge)

