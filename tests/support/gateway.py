"""Run a gateway for a test, and stop it for sure.

In-process, on the test's own event loop, ports picked by the OS:

    async with running_gateway(eng1, eng2, api_key="k") as gw:
        r = await http_request(gw.port, "GET", "/v1/models", headers={"authorization": "Bearer k"})

As a subprocess (``velocityllm serve`` or ``chargeVelocity``), for exit codes, signals and
children:

    with gateway_process("serve", "--endpoint", f"e1={eng.url}=sim-model") as gp:
        urlopen(gp.url + "/health")

The subprocess is the harness's GatewayProcess: free ports (``--port``/``--admin-port``
chosen unless given), started once its banner names its port, stopped with SIGTERM, then
SIGKILL.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from velocity_fast.config import EndpointConfig, Settings, load_settings
from velocity_fast.gateway.app import Gateway
from velocity_fast.harness.gateway import GatewayProcess
from velocity_fast.harness.procs import stop

from .sim import SimEngine

__all__ = [
    "FAST_HEALTH",
    "GatewayProcess",
    "RecordingUpstream",
    "ScriptedServer",
    "gateway_process",
    "gateway_settings",
    "real_client",
    "running_gateway",
    "velocity_command",
    "wait_until",
]


def real_client(body: dict, i: int) -> dict:
    """``body`` as the ``i``-th of a stream of ordinary clients writes it: every third sends
    no ``max_tokens`` (nor ``ignore_eos``: the engine ends the reply), every other one
    vLLM's default ``"priority": 0``, the rest a ``temperature`` and a ``stop`` list. The
    loadgen's mixes do the same by share (``Mix.clients``)."""
    out = dict(body)
    if i % 3 == 0:
        out.pop("max_tokens", None)
        out.pop("ignore_eos", None)
    if i % 2 == 0:
        out["priority"] = 0
    else:
        out.update(temperature=0.7, stop=["\n\nUser:", "</s>"])
    return out


# Health checks fast enough that a test sees ejection and readmission within a second.
FAST_HEALTH = {
    "scrape_interval_ms": 50.0,
    "check_interval_ms": 100.0,
    "check_timeout_ms": 500.0,
    "eject_base_ms": 200.0,
    "eject_max_ms": 1000.0,
}


def gateway_settings(
    *engines: SimEngine | tuple[str, str, str], config_file: str | None = None, **keys: Any
) -> Settings:
    """Settings for an in-process gateway on 127.0.0.1 in front of ``engines``.

    An engine is a SimEngine (named e1, e2, ... in order, model from the engine) or a
    ``(name, url, model)`` triple. ``keys`` are settings keys (``api_key=``, ``tenants=``,
    ``server={...}``); ``health`` defaults to FAST_HEALTH. The environment is not read.
    """
    eps = []
    for i, e in enumerate(engines, 1):
        if isinstance(e, SimEngine):
            eps.append(EndpointConfig(name=f"e{i}", url=e.url, model=e.model))
        else:
            eps.append(EndpointConfig(name=e[0], url=e[1], model=e[2]))
    flags: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "admin_port": 0, "endpoints": eps}
    flags.setdefault("health", dict(FAST_HEALTH))
    flags.update(keys)
    return load_settings(config_file, flags, env={})


async def wait_until(predicate, timeout: float = 5.0, interval: float = 0.02, what: str = "condition") -> None:
    """Poll ``predicate()`` (sync or async) until true; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        ok = predicate()
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


@asynccontextmanager
async def running_gateway(
    *engines: SimEngine | tuple[str, str, str],
    healthy: int | None = None,
    settings: Settings | None = None,
    **keys: Any,
) -> AsyncIterator[Gateway]:
    """A started Gateway on 127.0.0.1 (ports 0) in front of ``engines``; stopped on exit.

    Waits until ``healthy`` endpoints (default: all of them) passed their first health check.
    """
    s = settings if settings is not None else gateway_settings(*engines, **keys)
    gw = Gateway(s)
    try:
        await gw.start("127.0.0.1", 0, 0)
        want = len(gw.endpoints) if healthy is None else healthy
        await wait_until(
            lambda: sum(e.healthy for e in gw.endpoints.values()) >= want, 10.0, what=f"{want} healthy endpoint(s)"
        )
        yield gw
    finally:
        await gw.stop(grace=1.0)


# -- subprocess ---------------------------------------------------------------------------------


def velocity_command(*args: str) -> list[str]:
    """``velocityllm ARGS`` with this interpreter."""
    return [sys.executable, "-m", "velocity_fast", *args]


def stop_group(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM a child that leads its own process group, SIGKILL the group after ``grace``
    (and anything of it still left), then reap it."""
    stop(proc, grace, whole=True, sweep=True, group=True)


@contextmanager
def gateway_process(
    command: str, *args: str, env: dict[str, str] | None = None, timeout: float = 20.0
) -> Iterator[GatewayProcess]:
    """A running ``velocityllm COMMAND ARGS`` for a ``with`` block; stopped even on failure."""
    gp = GatewayProcess(command, *args, env=env)
    try:
        gp.start(timeout)
        yield gp
    finally:
        gp.close()


# -- a tiny fixed upstream that records what it received ------------------------------------------


class ScriptedServer:
    """A test engine on 127.0.0.1 (a free port) whose answers a subclass scripts in
    ``_serve(reader, writer)``, once per connection. On exit every open connection is
    aborted and every handler cancelled, so that no test leaves one running.

        async with MyEngine() as eng:
            ...  eng.url, eng.port
    """

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self):
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            await self._serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            # The gateway closed the connection, or the server is stopping. A handler task
            # must not end cancelled: asyncio's stream server reports that as an error.
            pass
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    @staticmethod
    async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes]:
        """The next request on a connection: (method, path, headers by lower-case name, body)."""
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {}
        for ln in lines[1:]:
            if ":" in ln:
                k, v = ln.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", "0"))
        body = await reader.readexactly(n) if n else b""
        return method, path, headers, body


class RecordingUpstream(ScriptedServer):
    """A minimal engine that keeps every request it received.

    ``/health`` answers 200, ``/metrics`` an empty exposition, any POST answers ``reply``
    (200) unless its body contains one of ``reject_fields`` as a JSON key, which gets a
    400 as vLLM gives to fields it does not accept. Keep-alive as an engine does.

        async with RecordingUpstream() as up:
            ...  up.url, up.requests -> [(method, path, headers, body)]
    """

    def __init__(
        self,
        reply: bytes = b'{"id":"fixed","object":"chat.completion","choices":[]}',
        reject_fields: tuple[str, ...] = ("priority", "sla_ms"),
    ) -> None:
        super().__init__()
        self.reply = reply
        self.reject_fields = reject_fields
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import json

        while True:
            method, path, headers, body = await self.read_request(reader)
            if path == "/health":
                status, out, ct = 200, b"", "text/plain"
            elif path == "/metrics":
                status, out, ct = 200, b"vllm:num_requests_running 0\n", "text/plain"
            else:
                self.requests.append((method, path, headers, body))
                status, out, ct = 200, self.reply, "application/json"
                try:
                    obj = json.loads(body)
                except ValueError:
                    obj = None
                bad = [f for f in self.reject_fields if isinstance(obj, dict) and f in obj]
                if bad:
                    status = 400
                    out = json.dumps(
                        {
                            "error": {
                                "message": f"unknown field {bad[0]}",
                                "type": "BadRequestError",
                                "param": bad[0],
                                "code": 400,
                            }
                        }
                    ).encode()
            reason = {200: "OK", 400: "Bad Request"}[status]
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ct}\r\ncontent-length: {len(out)}\r\n\r\n".encode() + out
            )
            await writer.drain()
