"""Worker addresses, ``HOST:PORT`` or ``unix:PATH`` (``sluice worker --listen`` / ``--advertise``, ``sluice serve
--worker-address``): parsed and checked once, before anything heavy starts, so a typo is one line naming the option
rather than a traceback after the model loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass

from shared.config import ConfigError

UNIX_PREFIX = "unix:"
MIN_PORT, MAX_PORT = 1, 65535
# Longest Unix socket path Linux accepts, bytes: sockaddr_un.sun_path holds 108 bytes including the trailing NUL.
MAX_UNIX_PATH_BYTES = 107


@dataclass(frozen=True)
class TcpAddress:
    """``HOST:PORT``; ``host`` is "" where the text gave none (a listener then binds 127.0.0.1), without the
    brackets of an IPv6 address."""

    host: str
    port: int


@dataclass(frozen=True)
class UnixAddress:
    """``unix:PATH``: a Unix socket at ``path``."""

    path: str


def parse_address(text: str, option: str, check_path: bool = True) -> TcpAddress | UnixAddress:
    """Parse a worker address and check what can be checked without binding or connecting.

    Args:
        text: ``HOST:PORT`` (port 1-65535; ``[::1]:9100`` for IPv6) or ``unix:PATH`` (in a folder that exists).
        option: the option it came from, for the message (``--listen``).
        check_path: check a Unix socket path's folder and length (False where the connect that follows says what
            is wrong, and is retried: a worker's socket folder may not exist yet).

    Returns:
        The :class:`TcpAddress` or :class:`UnixAddress`.

    Raises:
        ConfigError: ``<option>: ...``, naming what is wrong and the expected form.
    """
    if text.startswith(UNIX_PREFIX):
        path = text[len(UNIX_PREFIX):]
        if not path:
            raise ConfigError(f"{option}: expected unix:PATH, got {text!r} (no path)")
        folder = os.path.dirname(path) or "."
        if not check_path:
            return UnixAddress(path)
        if not os.path.isdir(folder):
            raise ConfigError(f"{option}: {text}: the folder {folder} does not exist")
        if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
            raise ConfigError(f"{option}: {text}: a Unix socket path has at most {MAX_UNIX_PATH_BYTES} bytes")
        return UnixAddress(path)
    host, colon, port_text = text.rpartition(":")
    if not colon:
        raise ConfigError(f"{option}: expected HOST:PORT or unix:PATH, got {text!r}")
    if not port_text.isdigit():
        raise ConfigError(f"{option}: expected HOST:PORT or unix:PATH with a numeric port, got {text!r}")
    port = int(port_text)
    if not MIN_PORT <= port <= MAX_PORT:
        raise ConfigError(f"{option}: port {port} is out of range: must be {MIN_PORT}-{MAX_PORT}, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return TcpAddress(host, port)
