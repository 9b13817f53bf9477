"""Worker addresses (shared/addresses.py): ``HOST:PORT`` with a port of 1-65535, or ``unix:PATH`` in a folder that
exists; anything else is a ConfigError naming the option."""

from __future__ import annotations

import pytest

from shared.addresses import TcpAddress, UnixAddress, parse_address
from shared.config import ConfigError


def test_tcp_and_unix_addresses_parse():
    assert parse_address("127.0.0.1:9100", "--listen") == TcpAddress("127.0.0.1", 9100)
    assert parse_address(":9100", "--listen") == TcpAddress("", 9100)  # a listener binds 127.0.0.1
    assert parse_address("[::1]:65535", "--listen") == TcpAddress("::1", 65535)
    assert parse_address("worker-1.example:1", "--listen") == TcpAddress("worker-1.example", 1)


def test_a_unix_socket_in_an_existing_folder_parses(tmp_path):
    assert parse_address(f"unix:{tmp_path}/w.sock", "--listen") == UnixAddress(f"{tmp_path}/w.sock")
    assert parse_address("unix:w.sock", "--listen") == UnixAddress("w.sock")  # the working directory


@pytest.mark.parametrize("text, message", [
    ("127.0.0.1:99999", "--listen: port 99999 is out of range: must be 1-65535"),  # was bound as 99999 - 65536
    ("127.0.0.1:0", "--listen: port 0 is out of range"),  # the worker never says which port it got
    ("nonsense", "--listen: expected HOST:PORT or unix:PATH, got 'nonsense'"),
    ("host:abc", "--listen: expected HOST:PORT or unix:PATH with a numeric port, got 'host:abc'"),
    ("host:-1", "with a numeric port"),
    ("unix:", "--listen: expected unix:PATH, got 'unix:' (no path)"),
    ("unix:/nonexistent/dir/x.sock", "--listen: unix:/nonexistent/dir/x.sock: the folder /nonexistent/dir does "
                                     "not exist"),
    ("unix:/tmp/" + "x" * 200, "a Unix socket path has at most 107 bytes"),
])
def test_a_bad_address_names_the_option_and_what_is_wrong(text, message):
    with pytest.raises(ConfigError) as info:
        parse_address(text, "--listen")
    assert message in str(info.value)
    assert str(info.value).startswith("--listen: ")
