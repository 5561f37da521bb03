"""Sim engines and gateways in front of them, all children of this process: what the
isolation runs, the replica and worker tests and bench/retry_after.py measure."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field

import orjson

from .gateway import GatewayProcess
from .ports import free_port_range
from .probe import http_get
from .procs import stop_all
from .sim import SimEngine

MODEL = "velocity-sim"


@dataclass
class Fleet:
    """Sim engines (one argument list each, on top of ``sim_base``) and ``replicas``
    default-flag gateways (``serve --policy``) in front of all of them. Logs go to
    ``log_dir``, each named after the policy."""

    engine_args: list[list[str]]
    policy: str
    log_dir: str
    #: Gateways in front of the same engines (replicas, as behind a load balancer).
    replicas: int = 1
    #: Worker processes per gateway (`serve --workers`; 1: one process, no supervisor).
    workers: int = 1
    #: More `serve` flags (e.g. --sla-ms), and the sim flags every engine gets.
    gateway_args: tuple[str, ...] = ()
    sim_base: tuple[str, ...] = ()
    #: Every child, the engines first and the gateways last.
    procs: list = field(default_factory=list)
    port: int = 0
    admin_port: int = 0
    ports: list[int] = field(default_factory=list)
    admin_ports: list[int] = field(default_factory=list)
    engine_ports: list[int] = field(default_factory=list)

    def _log(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{self.policy}-{name}")

    def start(self) -> None:
        """Start every child; :meth:`wait_ready` waits for them."""
        base = free_port_range(len(self.engine_args))
        endpoints = []
        for i, extra in enumerate(self.engine_args):
            eng = SimEngine(*self.sim_base, *extra, model=MODEL, port=base + i, log=self._log(f"engine-{i}.log"))
            self.procs.append(eng.spawn().proc)
            self.engine_ports.append(base + i)
            endpoints += ["--endpoint", f"e{i}=http://127.0.0.1:{base + i}={MODEL}"]
        for r in range(self.replicas):
            gw = GatewayProcess(
                "serve",
                *endpoints,
                "--policy",
                self.policy,
                *(["--workers", str(self.workers)] if self.workers > 1 else []),
                *self.gateway_args,
                log=self._log(f"gateway-{r}.log" if r else "gateway.log"),
            )
            self.procs.append(gw.spawn().proc)
            self.ports.append(gw.port)
            self.admin_ports.append(gw.admin_port)
        self.port, self.admin_port = self.ports[0], self.admin_ports[0]

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every gateway's admin /ready says every engine is healthy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a child exited with {p.returncode} (logs in {self.log_dir})")
            ready = 0
            for admin in self.admin_ports:
                with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError, IndexError):
                    status, body = await http_get("127.0.0.1", admin, "/ready")
                    if status == 200 and orjson.loads(body)["healthy_endpoints"] == len(self.engine_args):
                        ready += 1
            if ready == len(self.admin_ports):
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"not ready after {timeout:.0f} s (logs in {self.log_dir})")

    async def stats(self) -> dict:
        """The first gateway's admin /stats ({} when it cannot be read)."""
        with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError, IndexError, orjson.JSONDecodeError):
            status, body = await http_get("127.0.0.1", self.admin_port, "/stats", timeout=2.0)
            if status == 200:
                return orjson.loads(body)
        return {}

    def stop(self) -> None:
        """SIGTERM to every child's group, the gateways first; SIGKILL after 10 s."""
        stop_all(reversed(self.procs), 10.0, whole=True)
