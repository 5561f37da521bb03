"""A gateway in front of sim engines, from a config file with short read timeouts
(bench/lib/hostile.py's ``config_yaml``): what bench/reliability.py attacks and loads."""

from __future__ import annotations

import signal
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from velocity_fast.harness.gateway import GatewayProcess
from velocity_fast.harness.ports import free_port
from velocity_fast.harness.probe import http_status, wait_until
from velocity_fast.harness.procs import stop_all
from velocity_fast.harness.sim import SimEngine

from .hostile import MODEL, config_yaml

__all__ = ["Stack", "gateway_stack", "http_status"]


@dataclass
class Stack:
    """A running gateway process (``gw``, its output in ``log``) and its sim engines;
    ``config`` is its YAML file."""

    gw: GatewayProcess
    engines: list[SimEngine]
    config: str
    log: Path

    @property
    def port(self) -> int:
        return self.gw.port

    @property
    def admin_port(self) -> int:
        return self.gw.admin_port

    @property
    def pid(self) -> int:
        return self.gw.proc.pid

    def alive(self) -> bool:
        return self.gw.proc.poll() is None

    @property
    def log_text(self) -> str:
        """What the gateway wrote (stdout and stderr) so far."""
        return self.log.read_text(errors="replace")


@contextmanager
def gateway_stack(
    *sim_flags: str,
    engines: int = 1,
    time_scale: float = 50.0,
    log_level: str = "warning",
    extra_endpoints: list[tuple[str, str, str]] = (),
    extra_config: str = "",
) -> Iterator[Stack]:
    """``engines`` sim engines (``sim_flags`` each) and ``velocityllm serve`` in front of
    them and of ``extra_endpoints`` ((name, url, model) each), ready (admin /ready 200);
    every process stopped on exit. The config file alone sets the gateway (the caller's
    VELOCITY_* variables are left out); ``extra_config`` is YAML added to it."""
    sims: list[SimEngine] = []
    gp = None
    with tempfile.TemporaryDirectory(prefix="velocity-reliability-") as tmp:
        work = Path(tmp)
        try:
            for i in range(1, engines + 1):
                eng = SimEngine(
                    *sim_flags,
                    model=MODEL,
                    port=free_port(),
                    time_scale=time_scale,
                    log=work / f"engine-{i}.log",
                    death_signal=signal.SIGTERM,
                )
                sims.append(eng)
                eng.start(20)
            eps = [(f"e{i}", e.url, MODEL) for i, e in enumerate(sims, 1)] + list(extra_endpoints)
            config = work / "config.yaml"
            config.write_text(config_yaml(eps, extra=extra_config))
            log = work / "gateway.log"
            gp = GatewayProcess(
                "serve", "--config", str(config), "--log-level", log_level, log=log, death_signal=signal.SIGTERM
            ).spawn()
            stack = Stack(gp, sims, str(config), log)

            def ready() -> bool:
                if gp.proc.poll() is not None:
                    raise RuntimeError("the gateway exited: " + stack.log_text[-800:])
                return http_status(gp.admin_port, "/ready") == 200

            wait_until(ready, 30, "the gateway", log)
            yield stack
        finally:
            stop_all([gp and gp.proc, *(e.proc for e in reversed(sims))], 5.0, whole=True)
