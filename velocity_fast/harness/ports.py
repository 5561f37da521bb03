"""Listening ports for children: drawn below the kernel's ephemeral range, never handed
out twice in a row."""

from __future__ import annotations

import collections
import random
import socket


def _port_range() -> tuple[int, int]:
    """Where to draw listening ports: the 12,000 ports below the kernel's ephemeral range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    return (max(1024, ephemeral_low - 12000), ephemeral_low)


_PORT_RANGE = _port_range()


# The ports handed out lately: two calls in a row (a gateway's port, then its admin
# port) must not get the same one before either is bound.
_handed_out: collections.deque = collections.deque(maxlen=512)


def free_port_range(count: int, attempts: int = 200) -> int:
    """A base port such that ``count`` consecutive ports on 127.0.0.1 are free now.

    Drawn below the kernel's ephemeral range (where port 0 binds and outgoing connections
    land): a port handed to a child that binds it later cannot be taken meanwhile by an
    outgoing connection, such as the gateway's own health checks of its engines.
    """
    low, high = _PORT_RANGE
    for _ in range(attempts):
        base = random.randrange(low, high - count)
        if any(port in _handed_out for port in range(base, base + count)):
            continue  # free now, but handed to a caller that may not have bound it yet
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            _handed_out.extend(range(base, base + count))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {count} free ports found")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (see free_port_range)."""
    return free_port_range(1)
