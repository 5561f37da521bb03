"""`--workers N`: N gateway processes on one client port under a supervisor (docs/operations.md,
"Workers"; where each count lives: docs/design.md, "Where state lives"): ``WorkerSupervisor``,
and the worker's side of it, ``WorkerSide``.

The supervisor:

- reserves the client port (server/reserve.py), so that the port stays this gateway's
  while workers come and go;
- creates the state the workers share in memory (``state/shm.pyx``) before any starts,
  and removes it at exit;
- starts the workers as ``python -m velocity_fast.cli serve <the same flags>`` (spawned,
  not forked), each told in its environment its index (``VELOCITY_WORKER``), the shared
  state's file (``VELOCITY_SHARED``), the reserved port (``VELOCITY_WORKER_PORT``) and a
  pipe (``VELOCITY_WORKER_FD``) on which it writes its private admin port (127.0.0.1, a
  free port) once it serves;
- restarts a worker that dies, after giving back what it held in the shared state
  (counted: ``velocity_worker_restarts_total``, ``velocity_worker_lost_requests_total``);
  a worker that dies within a second of its start three times in a row ends the gateway;
- relays SIGHUP (reload) and SIGTERM/SIGINT (the drain) to every worker;
- answers the admin port for the whole gateway: the workers' /metrics merged, each
  family by the rule its metric declared (metrics/merge.py), and their /stats, by the
  keys the parts of /stats declare whole (gateway/stats_merge.py); /ready when every
  worker is ready.

With one worker there is no supervisor: `serve` runs the gateway as it always did.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

from ..config import Settings
from ..metrics.merge import merge_metrics
from ..server.reserve import reserve_port
from .errors import ListenError
from .stats_merge import merge_stats, take_rules

__all__ = ["WorkerSide", "WorkerSupervisor", "supervise", "worker_count", "worker_side"]

log = logging.getLogger("velocity.workers")

WORKER_ENV = "VELOCITY_WORKER"
SHARED_ENV = "VELOCITY_SHARED"
PORT_ENV = "VELOCITY_WORKER_PORT"
REPORT_ENV = "VELOCITY_WORKER_FD"
SUPERVISOR_ENV = "VELOCITY_SUPERVISOR"

FAST_DEATH_S = 1.0  # a worker that dies this soon after its start died starting
FAST_DEATHS = 3  # ... this many times in a row: the gateway gives up
DRAIN_MARGIN_S = 5.0  # past server.shutdown_grace_s, what still runs is killed
FETCH_TIMEOUT_S = 2.0  # a worker's admin port, over loopback
POLL_S = 0.1  # how often the supervisor looks for dead workers
# A worker's /metrics and /stats with this query carry how they merge: each family's rule,
# the /stats keys whose numbers are whole (Gateway.handle_admin).
WITH_RULES = {"/metrics": "/metrics?merge", "/stats": "/stats?merge"}


def worker_count(settings: Settings) -> int:
    """`workers` as a number: `auto` is one per core."""
    w = settings.workers
    return (os.cpu_count() or 1) if w == "auto" else int(w)


# -- the worker's side ----------------------------------------------------------------------------------


class WorkerSide:
    """What a worker was told by its supervisor, and its report back."""

    def __init__(self, index: int, shared: str, port: int, report_fd: int | None) -> None:
        self.index = index
        self.shared = shared
        self.port = port
        self.report_fd = report_fd
        self.state = None

    def attach(self) -> None:
        """The shared state, before the gateway starts; and this worker ends with its supervisor."""
        from velocity_fast.state.shm import SharedState, attach

        _die_with_parent()
        self.state = SharedState.open(self.shared)
        attach(self.state, self.index)

    def report(self, admin_port: int) -> None:
        """Tell the supervisor this worker serves, and where its admin port is."""
        if self.report_fd is None:
            return
        line = json.dumps({"worker": self.index, "pid": os.getpid(), "admin_port": admin_port}) + "\n"
        try:
            os.write(self.report_fd, line.encode())
        finally:
            os.close(self.report_fd)
            self.report_fd = None


def worker_side(env: dict[str, str] | None = None) -> WorkerSide | None:
    """This process's orders when a supervisor started it as a worker; None otherwise."""
    env = os.environ if env is None else env
    if WORKER_ENV not in env:
        return None
    fd = env.get(REPORT_ENV)
    return WorkerSide(int(env[WORKER_ENV]), env[SHARED_ENV], int(env[PORT_ENV]), int(fd) if fd else None)


def _die_with_parent() -> None:
    """SIGTERM this worker when its supervisor dies (killed at once, it can relay nothing):
    no orphan keeps serving on the port."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the supervisor's drain is the only stop
        return
    parent = os.environ.get(SUPERVISOR_ENV)
    if parent and os.getppid() != int(parent):  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


# -- the supervisor -----------------------------------------------------------------------------------


class _Worker:
    __slots__ = ("index", "proc", "admin_port", "started_at", "fast_deaths", "read_fd", "hup_pending")

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.admin_port: int | None = None
        self.started_at = 0.0
        self.fast_deaths = 0
        self.read_fd: int | None = None
        self.hup_pending = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def serving(self) -> bool:
        return self.admin_port is not None and self.alive


async def _fetch(port: int, path: str, headers: dict[str, str], timeout: float = FETCH_TIMEOUT_S) -> tuple[int, bytes]:
    """GET a worker's admin path over loopback: (status, body)."""

    async def go() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            head = f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            writer.write((head + "\r\n").encode())
            raw = await reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            length = None
            for h in lines[1:]:
                name, _, value = h.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            body = await (reader.readexactly(length) if length is not None else reader.read())
            return status, body
        finally:
            writer.close()

    return await asyncio.wait_for(go(), timeout)


class WorkerSupervisor:
    """N `serve` workers on one port; see the module's docstring."""

    def __init__(
        self, settings: Settings, argv: list[str], count: int, reread: Callable[[], Settings] | None = None
    ) -> None:
        from velocity_fast.gateway.identity import Identity
        from velocity_fast.metrics.registry import Registry

        self.settings = settings
        self.argv = argv
        self.count = count
        self.reread = reread
        self.identity = Identity(settings)
        self.workers = [_Worker(i) for i in range(count)]
        self.draining = False
        self.exit_code = 0
        self.port = 0
        self.admin_port = 0
        self.shared_path = f"/dev/shm/velocity-{os.getpid()}"
        self.state = None
        self._reserved: list[socket.socket] = []
        self._admin = None
        self._watch: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._all_serving: asyncio.Event | None = None
        self.registry = Registry()
        self.registry.gauge_fn(
            "velocity_workers",
            "Gateway worker processes serving now.",
            lambda: float(sum(w.serving for w in self.workers)),
        )
        self.restarts = self.registry.counter("velocity_worker_restarts_total", "Workers started again after one died.")
        self.lost = self.registry.counter(
            "velocity_worker_lost_requests_total",
            "Requests in flight on workers that died (their clients saw an error).",
        )

    # -- workers ---------------------------------------------------------------------------
    def _spawn(self, w: _Worker) -> None:
        r, wfd = os.pipe()
        env = dict(os.environ)
        env.update(
            {
                WORKER_ENV: str(w.index),
                SHARED_ENV: self.shared_path,
                PORT_ENV: str(self.port),
                REPORT_ENV: str(wfd),
                SUPERVISOR_ENV: str(os.getpid()),
            }
        )
        try:
            w.proc = subprocess.Popen(
                [sys.executable, "-m", "velocity_fast.cli", "serve", *self.argv],
                env=env,
                pass_fds=(wfd,),
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(wfd)
        w.started_at = time.monotonic()
        w.admin_port = None
        w.read_fd = r
        os.set_blocking(r, False)
        asyncio.get_running_loop().add_reader(r, self._on_report, w)
        log.info("worker %d started (pid %d)", w.index, w.proc.pid)

    def _close_report(self, w: _Worker) -> None:
        if w.read_fd is not None:
            asyncio.get_running_loop().remove_reader(w.read_fd)
            os.close(w.read_fd)
            w.read_fd = None

    def _on_report(self, w: _Worker) -> None:
        try:
            data = os.read(w.read_fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        self._close_report(w)
        if not data:
            return  # it ended before it served: the watch sees it
        try:
            w.admin_port = int(json.loads(data.decode().splitlines()[0])["admin_port"])
        except (ValueError, KeyError, IndexError):
            log.error("worker %d: a report that does not read: %r", w.index, data[:200])
            return
        if w.hup_pending and w.alive:  # a reload asked for while it started
            w.hup_pending = False
            w.proc.send_signal(signal.SIGHUP)
        if self._all_serving is not None and all(x.serving for x in self.workers):
            self._all_serving.set()

    async def _watch_workers(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            if self.draining:
                return
            for w in self.workers:
                if w.proc is None or w.proc.poll() is None:
                    continue
                self._on_death(w)
                if self.exit_code:
                    return

    def _on_death(self, w: _Worker) -> None:
        lived = time.monotonic() - w.started_at
        rc = w.proc.returncode
        self._close_report(w)
        w.admin_port = None
        held = self.state.reclaim(w.index) if self.state is not None else {}
        lost = int(held.get("inflight", 0) or 0)
        self.lost.inc(lost)
        w.fast_deaths = w.fast_deaths + 1 if lived < FAST_DEATH_S else 0
        if w.fast_deaths >= FAST_DEATHS:
            print(
                f"velocityllm: worker {w.index} exited with {rc} within {FAST_DEATH_S:g} s of its start "
                f"{FAST_DEATHS} times in a row; giving up (its output above says why)",
                file=sys.stderr,
                flush=True,
            )
            self.exit_code = 1
            w.proc = None
            self._stop.set()
            return
        log.warning(
            "worker %d (pid %d) exited with %s after %.1f s: %d request(s) in flight lost, %s given back; "
            "starting a new one",
            w.index,
            w.proc.pid,
            rc,
            lived,
            lost,
            held,
        )
        self.restarts.inc()
        self._spawn(w)

    def _signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.alive:
                try:
                    w.proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _on_hup(self) -> None:
        log.info("SIGHUP: reloading every worker")
        for w in self.workers:
            if w.serving:
                w.proc.send_signal(signal.SIGHUP)
            elif w.alive:
                w.hup_pending = True
        if self.reread is not None:  # the admin port's key follows the file, as the workers' do
            task = asyncio.get_running_loop().create_task(self._reread_identity())
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _reread_identity(self) -> None:
        from velocity_fast.gateway.identity import Identity

        from ..config import ConfigError

        try:
            settings = await asyncio.to_thread(self.reread)
        except ConfigError:
            return  # the workers log it and keep the old settings; so does the supervisor
        self.identity = Identity(settings)

    # -- lifecycle ---------------------------------------------------------------------------
    async def main(self, stop: asyncio.Event):
        """Started under run_until_signalled: returns the drain."""
        from velocity_fast.server.http_server import HTTPServer
        from velocity_fast.state.shm import SharedState

        self._stop = stop
        self._all_serving = asyncio.Event()
        s = self.settings
        try:
            try:
                self._reserved = reserve_port(s.host, s.port)
            except OSError as e:
                raise ListenError("port", s.host, s.port, e) from None
            self.port = self._reserved[0].getsockname()[1]
            self.state = SharedState.create(self.shared_path, self.count)
            self._admin = HTTPServer(self.handle_admin, name="admin")
            try:
                await self._admin.start(s.host, s.admin_port)
            except OSError as e:
                self._admin = None
                raise ListenError("admin_port", s.host, s.admin_port, e) from None
            self.admin_port = self._admin.port
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGHUP, self._on_hup)
            for w in self.workers:
                self._spawn(w)
            self._watch = loop.create_task(self._watch_workers())
            waiting = loop.create_task(self._all_serving.wait())
            stopped = loop.create_task(stop.wait())
            try:
                await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting.cancel()
                stopped.cancel()
        except BaseException:
            await self.drain()
            raise
        if self._all_serving.is_set():
            print(
                f"velocityllm: gateway http://{s.host}:{self.port} admin http://{s.host}:{self.admin_port} "
                f"policy {s.policy}, {len(s.endpoints)} endpoint(s), {self.count} workers",
                flush=True,
            )
        return self.drain

    async def drain(self) -> None:
        """SIGTERM to every worker (each drains as one gateway does), then wait for them for
        the shutdown grace and a margin; SIGKILL what is left. Then the admin port closes
        and the shared state is removed."""
        self.draining = True
        if self._watch is not None:
            self._watch.cancel()
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.server.shutdown_grace_s + DRAIN_MARGIN_S
        while any(w.alive for w in self.workers) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        for w in self.workers:
            if w.alive:
                log.warning("worker %d (pid %d) still running after the grace: killed", w.index, w.proc.pid)
                w.proc.kill()
            if w.proc is not None:
                w.proc.wait()
            self._close_report(w)
        try:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        except (RuntimeError, ValueError):
            pass
        if self._admin is not None:
            await self._admin.shutdown(1.0)
            self._admin = None
        for sock in self._reserved:
            sock.close()
        self._reserved = []
        if self.state is not None:
            self.state.close()
            self.state.unlink()
            self.state = None

    # -- the admin port -----------------------------------------------------------------------
    async def _gather(self, path: str, headers: dict[str, str]) -> list[tuple[_Worker, int, bytes] | None]:
        """Each worker's answer to ``path`` (None: not serving, or no answer in time)."""

        async def one(w: _Worker):
            if not w.serving:
                return None
            try:
                status, body = await _fetch(w.admin_port, path, headers)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
                return None
            return w, status, body

        return list(await asyncio.gather(*(one(w) for w in self.workers)))

    def _workers_stats(self) -> dict:
        return {
            "count": self.count,
            "alive": sum(w.serving for w in self.workers),
            "restarts": int(self.restarts.get()),
        }

    async def handle_admin(self, req, resp) -> None:
        path = req.path
        if path == "/health":
            return resp.send_json(200, {"status": "ok", "workers": self._workers_stats()})
        if self.identity.required:  # as Gateway.handle_admin: every path but /health
            ok, _ = self.identity.authenticate(req.headers)
            if not ok:
                return resp.send_error(401, "Missing or invalid API key.", type="AuthenticationError")
        if req.method != "GET":
            return resp.send_error(405, f"Use GET for {path}.")
        if path not in ("/metrics", "/stats", "/ready"):
            return resp.send_error(404, f"No route for {req.method} {path}.")
        # The client's key goes on to the workers, which check it as the supervisor did.
        fwd = {k: v for k in ("authorization", "x-api-key") if (v := req.headers.get(k)) is not None}
        answers = await self._gather(WITH_RULES.get(path, path), fwd)
        if path == "/metrics":
            texts = [body.decode() for a in answers if a is not None and a[1] == 200 for body in (a[2],)]
            body = merge_metrics(texts).encode() + self.registry.render()
            return resp.send(200, body, content_type="text/plain; version=0.0.4; charset=utf-8")
        if path == "/ready":
            ready_n = sum(1 for a in answers if a is not None and a[1] == 200)
            ready = ready_n == self.count and not self.draining
            healthy = 0
            for a in answers:
                if a is not None:
                    try:
                        healthy = max(healthy, int(json.loads(a[2]).get("healthy_endpoints", 0)))
                    except (ValueError, AttributeError, TypeError):
                        pass
            return resp.send_json(
                200 if ready else 503,
                {
                    "ready": ready,
                    "healthy_endpoints": healthy,
                    "draining": self.draining,
                    "workers": {**self._workers_stats(), "ready": ready_n},
                },
            )
        per_worker = []
        whole: set[str] = set()
        for a in answers:
            if a is None or a[1] != 200:
                continue
            try:
                own = json.loads(a[2])
            except ValueError:
                continue
            whole |= take_rules(own)
            per_worker.append({"worker": a[0].index, "pid": a[0].proc.pid, **own})
        merged = merge_stats([{k: v for k, v in p.items() if k not in ("worker", "pid")} for p in per_worker], whole)
        merged["workers"] = self._workers_stats()
        merged["per_worker"] = per_worker
        return resp.send_json(200, merged)


def supervise(args, settings: Settings, reread: Callable[[], Settings] | None = None) -> int:
    """Run the supervisor of ``worker_count(settings)`` workers until SIGTERM/SIGINT; the exit code."""
    from velocity_fast.server.run import run_until_signalled

    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    if argv and argv[0] == "serve":
        argv = argv[1:]
    sup = WorkerSupervisor(settings, argv, worker_count(settings), reread)
    # The workers drain within the grace; the supervisor waits for them a little longer.
    run_until_signalled(sup.main, grace=settings.server.shutdown_grace_s + DRAIN_MARGIN_S)
    return sup.exit_code
