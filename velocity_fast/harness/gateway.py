"""A gateway (``velocityllm serve`` or ``chargeVelocity``) as a child process on free ports.

    gp = GatewayProcess("serve", "--endpoint", f"e1={url}=sim-model").start()  # banner printed
    await gp.wait_ready()        # or: admin /ready answers 200
    gp.stop()                    # SIGTERM (it drains, stops its workers and engines), SIGKILL later
    gp.close()                   # and nothing of its process group left; output files closed

``--host`` (127.0.0.1), ``--port`` and ``--admin-port`` are chosen here unless given. Its
output goes to ``log`` when given (appended), else to two files read as ``stdout_text``
and ``stderr_text``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence

import orjson

from .ports import free_port_range
from .probe import http_get
from .procs import PACKAGE_ROOT, child_env, python_child, start, stop

BANNER = re.compile(r"gateway:?\s+http://[^:\s]+:(\d+)")


class GatewayProcess:
    """``velocityllm COMMAND ARGS`` as a child leading its own process group.

    ``env`` is added to this environment less its ``VELOCITY_*`` variables (the child is
    set by its flags and files alone; ``clean=False`` keeps them). ``launcher`` replaces
    ``python -m velocity_fast`` in the command line; ``death_signal``: see procs.start."""

    def __init__(
        self,
        command: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        log: str | os.PathLike | None = None,
        clean: bool = True,
        launcher: Sequence[str] | None = None,
        death_signal: int | None = None,
    ) -> None:
        self.args = list(args)
        if "--host" not in self.args:
            self.args += ["--host", "127.0.0.1"]
        if "--port" not in self.args or "--admin-port" not in self.args:
            # Below the ephemeral range: no outgoing connection takes them before the child binds.
            base = free_port_range(2)
            if "--port" not in self.args:
                self.args += ["--port", str(base)]
            if "--admin-port" not in self.args:
                self.args += ["--admin-port", str(base + 1)]
        self.command = command
        self.env = env
        self.clean = clean
        self.argv = [*(launcher or python_child("velocity_fast")[0]), command, *self.args]
        self.log = log
        self.death_signal = death_signal
        self.proc: subprocess.Popen | None = None
        self.port = int(self.args[self.args.index("--port") + 1])
        self.admin_port = int(self.args[self.args.index("--admin-port") + 1])
        self._out = self._err = None
        if log is None:
            self._out = tempfile.TemporaryFile()
            self._err = tempfile.TemporaryFile()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @staticmethod
    def _read(f) -> str:
        f.flush()
        f.seek(0)
        return f.read().decode(errors="replace")

    @property
    def stdout_text(self) -> str:
        """What it printed so far (with ``log``: the whole log)."""
        if self._out is None:
            with open(self.log, "rb") as f:
                return f.read().decode(errors="replace")
        return self._read(self._out)

    @property
    def stderr_text(self) -> str:
        """What it wrote to stderr so far (with ``log``: the whole log)."""
        return self.stdout_text if self._err is None else self._read(self._err)

    def log_tail(self, n: int = 2000) -> str:
        """The end of its output, for error messages."""
        with contextlib.suppress(OSError):
            return self.stderr_text[-n:]
        return ""

    def spawn(self) -> GatewayProcess:
        """Start the process without waiting (for commands expected to fail)."""
        env = (
            child_env(self.env)
            if self.clean
            else {**os.environ, **python_child("velocity_fast")[1], **(self.env or {})}
        )
        if self.log is not None:
            self.proc = start(self.argv, log=self.log, env=env, cwd=PACKAGE_ROOT, death_signal=self.death_signal)
        else:
            self.proc = start(
                self.argv, stdout=self._out, stderr=self._err, env=env, cwd=PACKAGE_ROOT, death_signal=self.death_signal
            )
        return self

    def start(self, timeout: float = 20.0) -> GatewayProcess:
        """Start and wait until the banner names the gateway's port (stopped if it does not)."""
        self.spawn()
        deadline = time.monotonic() + timeout
        try:
            while not BANNER.search(self.stdout_text):
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.command} exited with {self.proc.returncode}; stderr:\n{self.stderr_text}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.command} did not print its banner in time; stderr:\n{self.stderr_text}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Return once admin ``GET /ready`` answers 200; RuntimeError if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command} exited with {self.proc.returncode}:\n" + self.log_tail())
            with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError, IndexError):
                status, _ = await http_get("127.0.0.1", self.admin_port, "/ready")
                if status == 200:
                    return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.command} not ready after {timeout:.0f} s:\n" + self.log_tail())

    async def stats(self, timeout: float = 1.0) -> dict | None:
        """The admin ``/stats`` document, or None when it cannot be read."""
        with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError, IndexError, orjson.JSONDecodeError):
            status, body = await http_get("127.0.0.1", self.admin_port, "/stats", timeout=timeout)
            if status == 200:
                obj = orjson.loads(body)
                return obj if isinstance(obj, dict) else None
        return None

    def wait(self, timeout: float = 20.0) -> int:
        """Wait for the process to exit on its own; stopped past ``timeout``."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM to the gateway (it stops its workers and engines), SIGKILL to its whole
        process group after ``timeout``; the exit code."""
        return stop(self.proc, timeout, kill_grace=timeout, group=True)

    def close(self, timeout: float = 10.0) -> None:
        """Stop, make sure nothing of its process group is left behind, close its output."""
        try:
            stop(self.proc, timeout, group=True, sweep=True)
        finally:
            for f in (self._out, self._err):
                if f is not None:
                    f.close()
