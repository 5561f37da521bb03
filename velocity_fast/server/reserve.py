"""A port held for processes that listen on it: bound with SO_REUSEPORT, never listening.

The supervisor of several gateway workers (gateway/workers.py) holds the client port so
that it stays the gateway's while workers come and go; each worker binds its own listening socket to it with
SO_REUSEPORT and the kernel spreads the connections between the listening ones.
"""

from __future__ import annotations

import socket

__all__ = ["reserve_port"]


def reserve_port(host: str, port: int) -> list[socket.socket]:
    """Bind host:port (port 0: a free one) with SO_REUSEPORT without listening: the port is
    held for the workers, and the kernel sends this socket no connection."""
    infos = socket.getaddrinfo(None if host == "" else host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    seen = set()
    try:
        for family, type_, proto, _, address in infos:
            if (family, address[:2]) in seen:
                continue
            seen.add((family, address[:2]))
            sock = socket.socket(family, type_, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:  # the port the first one got, on every address
                address = (address[0], socks[0].getsockname()[1], *address[2:])
            sock.bind(address)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks
