"""A real ``redis-server`` on a free 127.0.0.1 port for a test, stopped for sure.

    with redis_server() as rs:
        rs.url                 # redis://127.0.0.1:PORT/0
        rs.pause(); rs.resume()  # SIGSTOP / SIGCONT: a store that does not answer
        rs.stop(); rs.start()    # gone, then back on the same port (empty: no persistence)

Debian's ``redis-server`` package (.ci/run installs it) and the ``redis`` Python package.
Without them the test skips, saying so, except under CI (``CI`` set), where it fails: CI
must run these tests.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

from velocity_fast.loadgen.gateway_proc import free_port

__all__ = ["RedisServer", "redis_server", "redis_binary"]


def redis_binary() -> str:
    """The redis-server binary, or skip (fail under CI); the gateway's side needs the
    `redis` package (the `test` extra has it) as well."""
    path = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
                                            else None)
    msg = None
    if path is None:
        msg = "redis-server is not installed (apt-get install redis-server)"
    elif importlib.util.find_spec("redis") is None:
        msg = "the redis package is not installed (pip install -e '.[test]')"
    if msg:
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def _die_with_parent() -> None:
    """In the child: SIGKILL when the test process dies (a run killed by its timeout runs no
    teardown); SIGKILL, as a paused server cannot act on SIGTERM."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class RedisServer:
    def __init__(self) -> None:
        self.binary = redis_binary()
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="velocity-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.proc = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        deadline = time.monotonic() + timeout
        while not self.ping():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("redis-server did not answer PING in time")
            time.sleep(0.02)
        return self

    def ping(self, timeout: float = 0.5) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def command(self, *args: str, timeout: float = 2.0) -> bytes:
        """One command, its raw RESP answer (a test's look at the store)."""
        out = f"*{len(args)}\r\n".encode() + b"".join(f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall(out)
            return s.recv(65536)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 5.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    rs = RedisServer()
    try:
        rs.start()
        yield rs
    finally:
        rs.close()
