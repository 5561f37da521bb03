"""A ``redis-server`` child on a free 127.0.0.1 port: the gateways' shared state store.

rs = RedisServer(binary).start()     # answers PING; rs.url
rs.pause(); rs.resume()              # SIGSTOP / SIGCONT: a store that does not answer
rs.stop(); rs.start()                # gone, then back on the same port (empty: no persistence)
rs.close()                           # stopped, its folder removed
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time

from .ports import free_port
from .procs import start, stop


def redis_binary() -> str | None:
    """The redis-server binary on PATH (or Debian's place for it); None without one."""
    return shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin")


class RedisServer:
    """One redis-server, without persistence, in a folder of its own."""

    def __init__(self, binary: str, port: int | None = None) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="velocity-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start it and wait until it answers PING (stopped if it does not in time)."""
        # SIGKILL when this process dies: a paused server cannot act on SIGTERM.
        self.proc = start(
            [
                self.binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            death_signal=signal.SIGKILL,
        )
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
        """One command, its raw RESP answer (a look at the store)."""
        out = f"*{len(args)}\r\n".encode() + b"".join(f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall(out)
            return s.recv(65536)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 5.0) -> None:
        stop(self.proc, timeout, kill_grace=timeout)

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
