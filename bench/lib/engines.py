"""Sim engine processes for the routing benchmarks (bench/prefix.py, bench/fairness.py):
N engines on ports they pick themselves, optionally publishing KV events, one restarted
on its own port; and their prefix-cache hit counters."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from velocity_fast.loadgen.gateway_proc import die_with_parent, http_get

from .targets import REPO as ROOT

MODEL = "sim-model"
_LISTEN = re.compile(rb"listening on http://[^:\s]+:(\d+)")
_COUNTER = r"^{name}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)"


class Engines:
    """N sim engine processes on ports they pick themselves; stopped for sure."""

    def __init__(self, n: int, flags: list[str], kv_dir: str | None = None) -> None:
        self.n = n
        self.flags = flags
        self.kv_dir = kv_dir   # KV events on ipc:// sockets here (None: no events)
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []

    def kv_events(self, i: int) -> tuple[str, str] | None:
        if self.kv_dir is None:
            return None
        return f"ipc://{self.kv_dir}/e{i}.kv", f"ipc://{self.kv_dir}/e{i}.replay"

    def _spawn(self, i: int, port: int) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "velocity_fast.sim", "--host", "127.0.0.1", "--port", str(port),
               "--model", MODEL, "--seed", str(i), *self.flags]
        kv = self.kv_events(i)
        if kv is not None:
            cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": kv[0], "replay_endpoint": kv[1], "topic": "kv"})]
        # An engine gets SIGTERM if this bench dies without stopping it (killed, timed out).
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, preexec_fn=die_with_parent)

    @staticmethod
    def _port_of(p: subprocess.Popen, deadline: float) -> int:
        line = b""
        while not _LISTEN.search(line):
            if time.monotonic() > deadline or p.poll() is not None:
                raise RuntimeError("a sim engine did not start")
            line = p.stdout.readline()
        return int(_LISTEN.search(line).group(1))

    def start(self, timeout: float = 30.0) -> None:
        for i in range(self.n):
            self.procs.append(self._spawn(i, 0))
        deadline = time.monotonic() + timeout
        for p in self.procs:
            self.ports.append(self._port_of(p, deadline))

    def restart(self, i: int, timeout: float = 30.0, down_s: float = 0.0) -> None:
        """Stop engine i (SIGTERM: it finishes what it runs), leave it down ``down_s``
        seconds, and start it again on the same port and event sockets, with an empty cache."""
        p = self.procs[i]
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
        p.stdout.close()
        time.sleep(down_s)
        self.procs[i] = self._spawn(i, self.ports[i])
        self._port_of(self.procs[i], time.monotonic() + timeout)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            if p.stdout:
                p.stdout.close()


def _counter(text: str, name: str) -> float:
    pattern = re.compile(_COUNTER.format(name=re.escape(name)), re.MULTILINE)
    return sum(float(m.group(1)) for m in pattern.finditer(text))


async def engine_hits(ports: list[int]) -> tuple[float, float]:
    hits = queries = 0.0
    for port in ports:
        status, body = await http_get("127.0.0.1", port, "/metrics", timeout=5.0)
        if status != 200:
            raise RuntimeError(f"engine on {port}: /metrics answered {status}")
        text = body.decode()
        hits += _counter(text, "vllm:prefix_cache_hits_total")
        queries += _counter(text, "vllm:prefix_cache_queries_total")
    return hits, queries
