"""server/reserve.py: a port held for workers, bound with SO_REUSEPORT and never listening."""

from __future__ import annotations

import socket

import pytest

from velocity_fast.server.reserve import reserve_port


def _listener(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_the_port_is_held_for_listeners_that_share_it_and_answers_nothing_itself():
    held = reserve_port("127.0.0.1", 0)
    try:
        port = held[0].getsockname()[1]
        assert port > 0
        other = socket.socket()  # a process that does not share the port cannot take it
        with other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        with pytest.raises(ConnectionRefusedError):  # no worker yet: the held socket accepts nothing
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        with _listener(port) as worker:  # a worker binds beside it and gets the connections
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                worker.settimeout(2)
                conn, _ = worker.accept()
                conn.close()
        with pytest.raises(ConnectionRefusedError):  # the worker gone, the port is still held
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        other = socket.socket()
        with other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()
