"""A gateway in front of sim engines, from a config file with short read timeouts
(bench/lib/hostile.py's ``config_yaml``): what bench/reliability.py attacks and loads."""
from __future__ import annotations

import http.client
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from velocity_fast.loadgen.gateway_proc import free_port

from .hostile import MODEL, config_yaml
from .processes import Procs, wait_ready
from .targets import CHILD_ENV, REPO


@dataclass
class Stack:
    """A running gateway process (``gw``, its output in ``log``) and its sim engines;
    ``config`` is its YAML file."""

    gw: subprocess.Popen
    port: int
    admin_port: int
    config: str
    log: Path

    def alive(self) -> bool:
        return self.gw.poll() is None

    @property
    def log_text(self) -> str:
        """What the gateway wrote (stdout and stderr) so far."""
        return self.log.read_text(errors="replace")


def http_status(port: int, path: str) -> int:
    """The status of a GET of ``path`` on 127.0.0.1:``port`` (0: no answer within 2 s)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    try:
        c.request("GET", path)
        return c.getresponse().status
    except OSError:
        return 0
    finally:
        c.close()


@contextmanager
def gateway_stack(*sim_flags: str, engines: int = 1, time_scale: float = 50.0,
                  log_level: str = "warning") -> Iterator[Stack]:
    """``engines`` sim engines (``sim_flags`` each) and ``velocityllm serve`` in front of
    them, ready (admin /ready 200); every process stopped on exit."""
    procs = Procs()
    # Without the caller's VELOCITY_* variables: the config file alone sets the gateway.
    env = {k: v for k, v in os.environ.items() if not k.startswith("VELOCITY_")} | CHILD_ENV
    with tempfile.TemporaryDirectory(prefix="velocity-reliability-") as tmp:
        work = Path(tmp)
        try:
            eps = []
            for i in range(1, engines + 1):
                port = free_port()
                log = work / f"engine-{i}.log"
                p = procs.start([sys.executable, "-m", "velocity_fast.sim", "--host", "127.0.0.1", "--port", str(port),
                                 "--model", MODEL, "--time-scale", str(time_scale), *sim_flags], None, log=log,
                                cwd=str(REPO), env=env, stdin=subprocess.DEVNULL)
                wait_ready(lambda: p.poll() is None and http_status(port, "/health") == 200, 20, f"sim engine {i}", log)
                eps.append((f"e{i}", f"http://127.0.0.1:{port}", MODEL))
            config = work / "config.yaml"
            config.write_text(config_yaml(eps))
            port, admin = free_port(), free_port()
            log = work / "gateway.log"
            gw = procs.start([sys.executable, "-m", "velocity_fast", "serve", "--config", str(config),
                              "--log-level", log_level, "--host", "127.0.0.1", "--port", str(port),
                              "--admin-port", str(admin)], None, log=log, cwd=str(REPO), env=env,
                             stdin=subprocess.DEVNULL)
            stack = Stack(gw, port, admin, str(config), log)

            def ready() -> bool:
                if gw.poll() is not None:
                    raise RuntimeError("the gateway exited: " + stack.log_text[-800:])
                return http_status(admin, "/ready") == 200

            wait_ready(ready, 30, "the gateway", log)
            yield stack
        finally:
            procs.stop_all()
