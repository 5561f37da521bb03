"""A gateway with sim engines as a child process, for benchmarks: start, wait until
ready, sample its admin ``/stats``, stop (the whole process group, so the sim
engines it started go too)."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time

import orjson

_LAUNCH = "import sys; from velocity_fast.cli import main; sys.exit(main())"


def _port_range() -> tuple[int, int]:
    """Where to draw listening ports: the 12,000 ports below the kernel's ephemeral range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    return (max(1024, ephemeral_low - 12000), ephemeral_low)


_PORT_RANGE = _port_range()


# The ports handed out lately: two calls in a row (a gateway's port, then its admin
# port) must not get the same one before either is bound.
_handed_out: collections.deque = collections.deque(maxlen=512)


def free_port_range(count: int, attempts: int = 200) -> int:
    """A base port such that ``count`` consecutive ports on 127.0.0.1 are free now.

    Drawn below the kernel's ephemeral range (where port 0 binds and outgoing connections
    land): a port handed to a child that binds it later cannot be taken meanwhile by an
    outgoing connection, such as the gateway's own health checks of its engines.
    """
    low, high = _PORT_RANGE
    for _ in range(attempts):
        base = random.randrange(low, high - count)
        if any(port in _handed_out for port in range(base, base + count)):
            continue  # free now, but handed to a caller that may not have bound it yet
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            _handed_out.extend(range(base, base + count))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {count} free ports found")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (see free_port_range)."""
    return free_port_range(1)


async def http_get(host: str, port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """A one-shot GET (connection: close); off the measured path, so plain streams do."""
    async def go():
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n".encode())
            data = await reader.read()
        finally:
            writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in head.lower():
            body = _dechunk(body)
        return status, body

    async with asyncio.timeout(timeout):  # not wait_for, which can drop a cancel on Python 3.11
        return await go()


def _dechunk(data: bytes) -> bytes:
    out, i = [], 0
    while True:
        j = data.find(b"\r\n", i)
        if j < 0:
            return b"".join(out)
        size = int(data[i:j].split(b";")[0] or b"0", 16)
        if size == 0:
            return b"".join(out)
        out.append(data[j + 2 : j + 2 + size])
        i = j + 2 + size + 2


class GatewayProcess:
    """``velocityllm chargeVelocity --mock`` on free ports, its output in ``log_path``."""

    def __init__(self, policy: str, *, engines: int, log_path: str, extra: list[str] = (),
                 command: list[str] | None = None) -> None:
        self.policy = policy
        self.port = free_port()
        self.admin_port = free_port()
        self.log_path = log_path
        # Own engine ports and log folder, so that runs never meet each other's engines
        # (or anyone's on the default 8100+).
        argv = ["chargeVelocity", "--mock", "--engines", str(engines), "--policy", policy,
                "--host", "127.0.0.1", "--port", str(self.port), "--admin-port", str(self.admin_port),
                "--engine-base-port", str(free_port_range(engines)),
                "--engine-log-dir", os.path.splitext(log_path)[0] + "-engines", *extra]
        self.argv = [*(command or [sys.executable, "-c", _LAUNCH]), *argv]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the child in its own process group."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=die_with_parent if sys.platform == "linux" else None)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Return once admin ``GET /ready`` answers 200; raise if the child dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway ({self.policy}) exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError, IndexError):
                status, _ = await http_get("127.0.0.1", self.admin_port, "/ready")
                if status == 200:
                    return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"gateway ({self.policy}) not ready after {timeout:.0f} s:\n" + self.log_tail())

    async def stats(self) -> dict | None:
        """The admin ``/stats`` document, or None when it cannot be read."""
        with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError, IndexError,
                                 orjson.JSONDecodeError):
            status, body = await http_get("127.0.0.1", self.admin_port, "/stats", timeout=1.0)
            if status == 200:
                obj = orjson.loads(body)
                return obj if isinstance(obj, dict) else None
        return None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the gateway (it stops its engines), then the group after ``grace``."""
        p = self.proc
        if p is None or p.poll() is not None:
            self._kill_group()
            return
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        self._kill_group()

    def _kill_group(self) -> None:
        # The group is the one this object created (start_new_session), so only our
        # gateway and the engines it spawned can be in it.
        p = self.proc
        if p is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)

    def log_tail(self, n: int = 2000) -> str:
        """The end of the child's output, for error messages."""
        with contextlib.suppress(OSError):
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        return ""


def die_with_parent() -> None:
    # If the bench itself is killed (SIGKILL, a test timeout), the kernel sends the
    # gateway SIGTERM, and the gateway stops its engines: no orphans either way.
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def gauges(stats: dict) -> tuple[float | None, float | None, float | None]:
    """(sum of the endpoints' concurrency limits, total queued requests, requests in
    flight on the engines) from ``/stats``.

    The document's exact shape belongs to the gateway; this looks for the documented
    ideas (per endpoint ``limit``, per band queue depth) at the top level and under
    ``admission``, and tolerates their absence.
    """
    adm = stats.get("admission")
    if isinstance(adm, dict):
        stats = {**adm, **stats}
    limit = inflight = None
    eps = stats.get("endpoints")
    if isinstance(eps, dict):
        eps = list(eps.values())
    if isinstance(eps, list):
        limit = _sum(e.get("limit") for e in eps if isinstance(e, dict))
        inflight = _sum(e.get("inflight") for e in eps if isinstance(e, dict))
    if limit is None:
        for key in ("concurrency_limit", "limit_total", "concurrency_limits"):
            v = stats.get(key)
            if isinstance(v, (int, float)):
                limit = float(v)
            elif isinstance(v, dict):
                nums = [x for x in v.values() if isinstance(x, (int, float))]
                limit = float(sum(nums)) if nums else None
            if limit is not None:
                break
    queued = None
    for key in ("queue_depth", "queued", "queue"):
        v = stats.get(key)
        if isinstance(v, (int, float)):
            queued = float(v)
        elif isinstance(v, dict):
            nums = [x.get("depth", x.get("queued")) if isinstance(x, dict) else x for x in v.values()]
            nums = [x for x in nums if isinstance(x, (int, float))]
            queued = float(sum(nums)) if nums else None
        if queued is not None:
            break
    if queued is None and isinstance(stats.get("bands"), (dict, list)):
        bands = stats["bands"]
        bands = bands.values() if isinstance(bands, dict) else bands
        nums = [b.get("queue_depth", b.get("queued", b.get("depth"))) for b in bands if isinstance(b, dict)]
        nums = [x for x in nums if isinstance(x, (int, float))]
        queued = float(sum(nums)) if nums else None
    return limit, queued, inflight


def _sum(values) -> float | None:
    nums = [x for x in values if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return float(sum(nums)) if nums else None
