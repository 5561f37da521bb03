"""A sim engine (``python -m velocity_fast.sim``) as a child process on 127.0.0.1.

    eng = SimEngine("--max-num-seqs", "4", time_scale=20).start()   # healthy, eng.port known
    eng.get("/health"); eng.metric("vllm:num_requests_running")
    eng.stop()                                                       # its exit code

By default the engine picks its own port (``--port 0``) and prints it, so that parallel
starts never race for one; its stderr is kept (``stderr_text``). With ``log`` its output
goes to that file instead, and the port must be given. ``spawn`` starts it without
waiting, ``wait_ready`` then waits (several engines start at once).
"""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Mapping

from .probe import read_line
from .procs import PACKAGE_ROOT, child_env, python_child, start, stop

LISTENING = re.compile(rb"listening on http://[^:\s]+:(\d+)")


def sim_command(*flags: str, model: str = "sim-model", port: int = 0, time_scale: float | None = None) -> list[str]:
    """The command line of a sim engine on 127.0.0.1 (also what a fake `vllm` can exec)."""
    cmd = [*python_child("velocity_fast.sim")[0], "--host", "127.0.0.1", "--port", str(port), "--model", model]
    if time_scale is not None:
        cmd += ["--time-scale", str(time_scale)]
    return cmd + [str(f) for f in flags]


class SimEngine:
    """A sim engine child; ``stop()`` (or leaving the ``with``) ends it."""

    def __init__(
        self,
        *flags: str,
        model: str = "sim-model",
        port: int = 0,
        time_scale: float | None = None,
        env: Mapping[str, str] | None = None,
        log: str | os.PathLike | None = None,
        death_signal: int | None = None,
    ) -> None:
        self.flags = flags
        self.model = model
        self.port = port
        self.time_scale = time_scale
        self.env = env
        self.log = log
        self.death_signal = death_signal
        self.proc = None
        self._stderr = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def stderr_text(self) -> str:
        """What the process wrote to stderr so far."""
        if self._stderr is None:
            return ""
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def command(self) -> list[str]:
        """The engine's command line (a subclass may start it another way)."""
        return sim_command(*self.flags, model=self.model, port=self.port, time_scale=self.time_scale)

    def spawn(self) -> SimEngine:
        """Start the process; :meth:`wait_ready` waits for it."""
        env = child_env(self.env)
        if self.log is not None:
            if not self.port:
                raise ValueError("a sim engine that logs to a file needs its port given")
            self.proc = start(self.command(), log=self.log, env=env, cwd=PACKAGE_ROOT, death_signal=self.death_signal)
        else:
            self._stderr = tempfile.TemporaryFile()
            self.proc = start(
                self.command(),
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=env,
                cwd=PACKAGE_ROOT,
                death_signal=self.death_signal,
            )
        return self

    def wait_ready(self, deadline: float) -> SimEngine:
        """Until the engine listens (its port read from its banner) and /health answers 200;
        TimeoutError past ``deadline`` (monotonic), RuntimeError if it exits first."""
        if self.log is None:
            why = lambda: f"stderr:\n{self.stderr_text}"  # noqa: E731
            self.port = int(read_line(self.proc, LISTENING, deadline, "sim engine", why).group(1))
        while True:
            try:
                if self.get("/health", timeout=1.0)[0] == 200:
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"sim engine exited with {self.proc.returncode}; stderr:\n{self.stderr_text}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"sim engine /health did not answer 200 in time; stderr:\n{self.stderr_text}")
            time.sleep(0.02)

    def start(self, timeout: float = 20.0) -> SimEngine:
        """Start the process and wait until /health answers 200 (stopped if it does not)."""
        self.spawn()
        try:
            self.wait_ready(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def get(self, path: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
        """A blocking GET; returns (status, body)."""
        return self.request("GET", path, None, headers, timeout)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 10.0,
    ) -> tuple[int, bytes]:
        """A blocking request on a fresh connection; returns (status, body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def metrics_text(self) -> str:
        """The engine's /metrics text."""
        status, body = self.get("/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return body.decode()

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value from /metrics (sum over samples matching ``labels``)."""
        total = 0.0
        found = False
        for line in self.metrics_text().splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            sample, _, lab = head.partition("{")
            if sample != name:
                continue
            if all(f'{k}="{v}"' in lab for k, v in labels.items()):
                total += float(value)
                found = True
        if not found:
            raise KeyError(f"{name}{labels} not in /metrics")
        return total

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM (it finishes what it runs), then SIGKILL after ``timeout``; the exit code."""
        try:
            return stop(self.proc, timeout, kill_grace=timeout)
        finally:
            if self._stderr is not None:
                self._stderr.close()
                self._stderr = None

    def __enter__(self) -> SimEngine:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
