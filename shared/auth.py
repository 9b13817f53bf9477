"""The shared secret of gateway ↔ worker connections: where it comes from, and its HMAC challenge–response.

Both sides prove the secret without sending it (mutual authentication, each answering the other's fresh nonce)::

    worker  ── Challenge(w) ──────────────────────────────────────▶ gateway      w, g: 32 random bytes each
    worker ◀── Authenticate(HMAC(secret, "sluice-gateway\\0" ‖ w ‖ g), g) ── gateway
    worker  ── Authenticated(HMAC(secret, "sluice-worker\\0" ‖ g ‖ w)), Hello … ─▶ gateway

HMAC-SHA256 (RFC 2104); the role labels keep one side's proof from being replayed as the other's. Proofs are compared
with :func:`hmac.compare_digest`. The secret authenticates the peers; it does not encrypt the frames (run the worker
port on a private network, or through a tunnel, where the traffic itself must stay private).

The secret is ``worker.secret`` or the file ``worker.secret_file`` (or ``SLUICE_WORKER__SECRET``), read by gateways
and workers alike; it is never logged and never in ``/status``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import secrets
from pathlib import Path

from shared.addresses import UnixAddress, parse_address
from shared.config import ConfigError, WorkerConfig
from shared.protocol import (
    MAX_HANDSHAKE_FRAME_BYTES,
    Authenticate,
    Authenticated,
    Challenge,
    FrameCodec,
    Hello,
    ProtocolError,
)

NONCE_BYTES = 32
MIN_SECRET_CHARS = 16
# Seconds a peer has to complete the handshake before the connection is closed.
HANDSHAKE_TIMEOUT_S = 10.0
_GATEWAY_LABEL = b"sluice-gateway\0"
_WORKER_LABEL = b"sluice-worker\0"


class AuthError(Exception):
    """The peer did not prove the shared secret; the message says why (never the secret itself)."""


def load_secret(worker: WorkerConfig) -> bytes | None:
    """Return the shared secret of ``worker.secret`` or ``worker.secret_file`` (UTF-8, surrounding whitespace
    stripped), or None when neither is set.

    Raises:
        ConfigError: both are set, the file cannot be read, or the secret is shorter than
            :data:`MIN_SECRET_CHARS` characters.
    """
    if worker.secret and worker.secret_file:
        raise ConfigError("worker.secret and worker.secret_file: set one of them, not both")
    if worker.secret_file:
        path = Path(worker.secret_file).expanduser()
        try:
            secret = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise ConfigError(f"worker.secret_file: cannot read {path}: {reason}") from None
        where = f"worker.secret_file ({path})"
        if not secret:
            raise ConfigError(f"{where}: the file is empty")
    else:
        secret, where = worker.secret, "worker.secret"
    if not secret:
        return None
    if len(secret) < MIN_SECRET_CHARS:
        raise ConfigError(f"{where}: the secret must have at least {MIN_SECRET_CHARS} characters "
                          "(make one with `openssl rand -hex 32`)")
    return secret.encode()


def new_secret() -> bytes:
    """Return a fresh random secret (64 hex characters, 256 bits): what a gateway gives its local workers."""
    return secrets.token_hex(32).encode()


def is_loopback_listen(listen: str) -> bool:
    """Return whether ``--listen`` (``HOST:PORT`` or ``unix:PATH``) is reachable from this machine only: a Unix
    socket, ``localhost``, an empty host (the worker then binds 127.0.0.1) or a loopback IP address.

    Raises:
        ConfigError: ``listen`` is no such address (:func:`shared.addresses.parse_address`).
    """
    address = parse_address(listen, "--listen", check_path=False)
    if isinstance(address, UnixAddress):
        return True
    host = address.host
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def gateway_proof(secret: bytes, worker_nonce: bytes, gateway_nonce: bytes) -> bytes:
    """Return the gateway's proof: HMAC-SHA256(secret, ``sluice-gateway\\0`` ‖ worker nonce ‖ gateway nonce)."""
    return hmac.new(secret, _GATEWAY_LABEL + worker_nonce + gateway_nonce, hashlib.sha256).digest()


def worker_proof(secret: bytes, gateway_nonce: bytes, worker_nonce: bytes) -> bytes:
    """Return the worker's proof: HMAC-SHA256(secret, ``sluice-worker\\0`` ‖ gateway nonce ‖ worker nonce)."""
    return hmac.new(secret, _WORKER_LABEL + gateway_nonce + worker_nonce, hashlib.sha256).digest()


async def verify_gateway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, codec: FrameCodec,
                         secret: bytes) -> None:
    """Worker side: challenge a new connection and answer its challenge; return once the gateway proved the secret.

    Raises:
        AuthError: the first frame is not a correct :class:`Authenticate`, or the connection closed first.
        ProtocolError: a malformed or oversized frame.
    """
    worker_nonce = secrets.token_bytes(NONCE_BYTES)
    writer.write(codec.encode(Challenge(worker_nonce)))
    await writer.drain()
    message = await codec.read(reader, MAX_HANDSHAKE_FRAME_BYTES)
    if message is None:
        raise AuthError("the peer closed the connection without answering the challenge (has it the secret?)")
    if not isinstance(message, Authenticate):
        raise AuthError(f"the peer sent {type(message).__name__} before proving the shared secret")
    expected = gateway_proof(secret, worker_nonce, message.nonce)
    if len(message.nonce) != NONCE_BYTES or not hmac.compare_digest(message.proof, expected):
        raise AuthError("the peer's proof of the shared secret is wrong (its secret differs)")
    writer.write(codec.encode(Authenticated(worker_proof(secret, message.nonce, worker_nonce))))
    await writer.drain()


async def authenticate_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, codec: FrameCodec,
                              secret: bytes | None) -> Hello:
    """Gateway side: read the worker's first frames, prove the secret and check the worker's proof; return its Hello.

    Without a secret the gateway accepts only a worker that has none either (its first frame is ``Hello``).

    Raises:
        AuthError: the worker asks for a secret the gateway lacks, runs without one while the gateway has one, or
            its proof is wrong or missing.
        ProtocolError: a malformed frame, or a first frame that is neither ``Hello`` nor ``Challenge``.
        ConnectionError: the worker closed the connection before its Hello.
    """
    first = await codec.read(reader, MAX_HANDSHAKE_FRAME_BYTES)
    match first:
        case None:
            raise ConnectionError("the worker closed the connection before its Hello")
        case Hello() if secret is None:
            return first
        case Hello():
            raise AuthError("the worker runs without the shared secret, and this gateway requires it "
                            "(set worker.secret or worker.secret_file on the worker too)")
        case Challenge() if secret is None:
            raise AuthError("the worker requires a shared secret and this gateway has none "
                            "(set worker.secret, worker.secret_file or SLUICE_WORKER__SECRET on the gateway)")
        case Challenge(nonce=worker_nonce):
            pass
        case _:
            raise ProtocolError(f"expected Hello or Challenge first, got {type(first).__name__}")
    gateway_nonce = secrets.token_bytes(NONCE_BYTES)
    writer.write(codec.encode(Authenticate(gateway_proof(secret, worker_nonce, gateway_nonce), gateway_nonce)))
    await writer.drain()
    answer = await codec.read(reader, MAX_HANDSHAKE_FRAME_BYTES)
    if answer is None:
        raise AuthError("the worker refused this gateway's proof and closed the connection (the secrets differ)")
    if not isinstance(answer, Authenticated) or not hmac.compare_digest(
            answer.proof, worker_proof(secret, gateway_nonce, worker_nonce)):
        raise AuthError("the worker's proof of the shared secret is wrong or missing (the secrets differ)")
    hello = await codec.read(reader, MAX_HANDSHAKE_FRAME_BYTES)
    if hello is None:
        raise ConnectionError("the worker closed the connection before its Hello")
    if not isinstance(hello, Hello):
        raise ProtocolError(f"expected Hello after authentication, got {type(hello).__name__}")
    return hello
