"""Readiness probe: one small raw HTTP ``GET /health`` on loopback.

Raw asyncio rather than an HTTP client: it must run on the loop, import nothing heavy,
and treat a refused connection (vLLM still loading) as an ordinary answer.
"""

from __future__ import annotations

import asyncio
import contextlib


async def http_status(host: str, port: int, path: str = "/health", timeout: float = 2.0) -> int | None:
    """The status code of ``GET path``, or None when the engine cannot be reached in time."""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
            line = await reader.readline()
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return None
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return None
    return int(parts[1])
