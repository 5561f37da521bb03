"""Asking a child whether it is ready: a one-shot GET (blocking or on the loop), a poll
until a condition holds, and the port a child prints once it listens."""

from __future__ import annotations

import asyncio
import http.client
import os
import re
import selectors
import subprocess
import time
from collections.abc import Callable


def http_status(port: int, path: str, timeout: float = 2.0) -> int:
    """The status of a GET of ``path`` on 127.0.0.1:``port`` (0: no answer in ``timeout`` s)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        return c.getresponse().status
    except OSError:
        return 0
    finally:
        c.close()


async def http_get(host: str, port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """A one-shot GET (connection: close); off the measured path, so plain streams do."""

    async def go():
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n".encode())
            data = await reader.read()
        finally:
            writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in head.lower():
            body = _dechunk(body)
        return status, body

    async with asyncio.timeout(timeout):  # not wait_for, which can drop a cancel on Python 3.11
        return await go()


def _dechunk(data: bytes) -> bytes:
    out, i = [], 0
    while True:
        j = data.find(b"\r\n", i)
        if j < 0:
            return b"".join(out)
        size = int(data[i:j].split(b";")[0] or b"0", 16)
        if size == 0:
            return b"".join(out)
        out.append(data[j + 2 : j + 2 + size])
        i = j + 2 + size + 2


def wait_until(
    check: Callable[[], bool], timeout: float, what: str, log: str | os.PathLike | None = None, interval: float = 0.1
) -> None:
    """Poll ``check()`` until true; a RuntimeError naming ``what`` (and the end of ``log``)
    after ``timeout`` s. ``check`` may raise to give up early (its child died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval)
    tail = ""
    if log is not None and os.path.exists(log):
        with open(log, "rb") as f:
            tail = f.read()[-800:].decode(errors="replace")
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s. {tail}")


def read_line(
    proc: subprocess.Popen, pattern: re.Pattern[bytes], deadline: float, what: str, why: Callable[[], str] = str
) -> re.Match[bytes]:
    """Read the child's stdout (a pipe) until a line matches ``pattern``: a child that picks
    its own port prints it once it listens. TimeoutError or RuntimeError (it exited)
    otherwise, ending with ``why()`` (its stderr, say)."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    try:
        while True:
            *lines, buf = buf.split(b"\n")
            for line in lines:
                m = pattern.search(line)
                if m:
                    return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what} did not start listening in time; {why()}")
            if not sel.select(min(left, 0.2)):
                if proc.poll() is not None:
                    raise RuntimeError(f"{what} exited with {proc.returncode}; {why()}")
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"{what} exited with {proc.wait()}; {why()}")
            buf += chunk
    finally:
        sel.close()
