"""Sim engine processes for the routing benchmarks (bench/prefix.py, bench/fairness.py):
N engines on ports they pick themselves, optionally publishing KV events, one restarted
on its own port; and their prefix-cache hit counters."""

from __future__ import annotations

import json
import re
import signal
import time

from velocity_fast.harness.probe import http_get
from velocity_fast.harness.procs import stop_all
from velocity_fast.harness.sim import SimEngine

MODEL = "sim-model"
_COUNTER = r"^{name}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)"


class Engines:
    """N sim engine processes on ports they pick themselves; stopped for sure."""

    def __init__(self, n: int, flags: list[str], kv_dir: str | None = None) -> None:
        self.n = n
        self.flags = flags
        self.kv_dir = kv_dir  # KV events on ipc:// sockets here (None: no events)
        self.engines: list[SimEngine] = []
        self.ports: list[int] = []

    def kv_events(self, i: int) -> tuple[str, str] | None:
        if self.kv_dir is None:
            return None
        return f"ipc://{self.kv_dir}/e{i}.kv", f"ipc://{self.kv_dir}/e{i}.replay"

    def _engine(self, i: int, port: int) -> SimEngine:
        flags = ["--seed", str(i), *self.flags]
        kv = self.kv_events(i)
        if kv is not None:
            flags += [
                "--kv-events-config",
                json.dumps(
                    {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": kv[0],
                        "replay_endpoint": kv[1],
                        "topic": "kv",
                    }
                ),
            ]
        # An engine gets SIGTERM if this bench dies without stopping it (killed, timed out).
        return SimEngine(*flags, model=MODEL, port=port, death_signal=signal.SIGTERM).spawn()

    def start(self, timeout: float = 30.0) -> None:
        for i in range(self.n):
            self.engines.append(self._engine(i, 0))
        deadline = time.monotonic() + timeout
        for e in self.engines:
            self.ports.append(e.wait_ready(deadline).port)

    def restart(self, i: int, timeout: float = 30.0, down_s: float = 0.0) -> None:
        """Stop engine i (SIGTERM: it finishes what it runs), leave it down ``down_s``
        seconds, and start it again on the same port and event sockets, with an empty cache."""
        self.engines[i].stop(15.0)
        time.sleep(down_s)
        self.engines[i] = self._engine(i, self.ports[i])
        self.engines[i].wait_ready(time.monotonic() + timeout)

    def stop(self) -> None:
        stop_all([e.proc for e in self.engines], 10.0)  # all at once, not one grace each
        for e in self.engines:
            e.stop()  # its stderr file


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
