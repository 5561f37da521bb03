"""What the proxy benchmarks send load to: the fixed upstream (bench/upstream_fixed.py,
an infinitely fast engine), the gateway (`velocityllm serve` in front of it) and nginx
(`proxy_pass` with upstream keep-alive), each a process tree whose CPU can be counted."""

from __future__ import annotations

import http.client
import os
import shutil
import subprocess
import sys
from pathlib import Path

from velocity_fast.harness.ports import free_port  # below the ephemeral range

from .bodies import BODY, MODEL, PATH
from .processes import Procs, group_pids, wait_line, wait_ready
from .procfs import cpu_ticks, runq_wait_ns

REPO = Path(__file__).resolve().parents[2]
# Children import this checkout's bench and velocity_fast, wherever they are started from.
CHILD_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;{http_extra}
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream engine {{
        server 127.0.0.1:{upstream};
        keepalive 128;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";{extra}
        }}
    }}
}}
"""


class Target:
    """A thing to send load to: its port and the pid whose process tree is the proxy."""

    def __init__(self, name: str, port: int, pid: int | None) -> None:
        self.name = name
        self.port = port
        self.pid = pid

    def cpu_ticks(self) -> tuple[int, int]:
        """(user, system) clock ticks of the proxy's processes."""
        if self.pid is None:
            return 0, 0
        ticks = [cpu_ticks(p) for p in group_pids(self.pid)]
        return sum(t[0] for t in ticks), sum(t[1] for t in ticks)

    def runq_wait_ns(self) -> int | None:
        return None if self.pid is None else runq_wait_ns(group_pids(self.pid))


def post_ok(port: int, timeout: float = 2.0) -> bool:
    """Whether one small chat request to the port is answered 200."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            c.request("POST", PATH, BODY, {"content-type": "application/json"})
            return c.getresponse().status == 200
        finally:
            c.close()
    except OSError:
        return False


def start_upstream(procs: Procs, cpu: int | None, extra: list[str] = ()) -> tuple[subprocess.Popen, int]:
    """bench/upstream_fixed.py on a free port: (its process, its port)."""
    p = procs.start(
        [sys.executable, "-m", "bench.upstream_fixed", "--port", "0", *extra],
        cpu,
        cwd=str(REPO),
        env=dict(os.environ, **CHILD_ENV),
    )
    m = wait_line(p, r"listening on 127\.0\.0\.1:(\d+)", 15, "the fixed upstream")
    return p, int(m.group(1))


def start_gateway(
    procs: Procs,
    cpu: int | None,
    upstream: int,
    policy: str,
    work: Path,
    extra: list[str],
    wrap: list[str] = (),
    ready_s: float = 20,
) -> Target:
    """`velocityllm serve` with one endpoint, the upstream, ready for requests.
    ``wrap``: a command the gateway runs under (bench/instructions.py: valgrind)."""
    port, admin = free_port(), free_port()
    log = work / "gateway.log"
    env = dict(os.environ, **CHILD_ENV)
    argv = [
        *wrap,
        sys.executable,
        "-m",
        "velocity_fast",
        "serve",
        "--endpoint",
        f"e1=http://127.0.0.1:{upstream}={MODEL}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--admin-port",
        str(admin),
        "--policy",
        policy,
        *extra,
    ]
    p = procs.start(argv, cpu, log=log, cwd=str(REPO), env=env)

    def ready() -> bool:
        if p.poll() is not None:
            raise RuntimeError("the gateway exited: " + log.read_text(errors="replace")[-800:])
        try:
            c = http.client.HTTPConnection("127.0.0.1", admin, timeout=1)
            try:
                c.request("GET", "/ready")
                return c.getresponse().status == 200 and post_ok(port)
            finally:
                c.close()
        except OSError:
            return False

    wait_ready(ready, ready_s, "the gateway", log)
    return Target("gateway", port, p.pid)


def nginx_exe() -> str | None:
    return shutil.which("nginx") or next(
        (x for x in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(x, os.X_OK)), None
    )


def nginx_version() -> str | None:
    exe = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)
    if exe is None:
        return None
    p = subprocess.run([exe, "-v"], capture_output=True, text=True)
    return (p.stderr or p.stdout).strip().replace("nginx version: ", "")


def start_nginx(
    procs: Procs,
    cpu: int | None,
    upstream: int,
    work: Path,
    stream: bool = False,
    wrap: list[str] = (),
    ready_s: float = 10,
    big_bodies: bool = False,
    name: str = "nginx",
    env: dict[str, str] | None = None,
) -> Target | None:
    """nginx in front of the upstream (None when it is not installed).
    ``wrap``: a command nginx runs under, as one process (no master: the worker is it).
    ``big_bodies``: request bodies up to 16 MiB, kept in memory (never a temp file).
    ``name``: the target's name (and its directory); ``env``: variables added to nginx's."""
    exe = nginx_exe()
    if exe is None:
        return None
    ndir = work / name
    ndir.mkdir()
    port = free_port()
    conf = ndir / "nginx.conf"
    # For streams nginx relays as the engine writes (as an SSE proxy must), not buffered.
    text = NGINX_CONF.format(
        dir=ndir,
        upstream=upstream,
        port=port,
        extra="\n            proxy_buffering off;" if stream else "",
        http_extra=("\n    client_max_body_size 16m;\n    client_body_buffer_size 16m;" if big_bodies else ""),
    )
    if os.geteuid() == 0:
        # As root nginx would switch its worker to nobody, who cannot enter our temp dir.
        text = "user root;\n" + text
    if wrap:
        text = "master_process off;\n" + text
    conf.write_text(text)
    log = ndir / "stdout.log"
    p = procs.start(
        [*wrap, exe, "-p", str(ndir), "-e", str(ndir / "error.log"), "-c", str(conf)],
        cpu,
        log=log,
        env=dict(os.environ, **env) if env else None,
    )

    def ready() -> bool:
        if p.poll() is not None:
            err = ndir / "error.log"
            raise RuntimeError("nginx exited: " + (err.read_text(errors="replace")[-800:] if err.exists() else ""))
        return post_ok(port)

    wait_ready(ready, ready_s, name, ndir / "error.log")
    return Target(name, port, p.pid)
