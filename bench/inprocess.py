"""The gateway's request path in one process, without sockets: user-space CPU per request.

Method
------
A real Gateway (default settings: dynamic admission with max-concurrency 32, routing,
metrics) with one endpoint, its client-side HttpProtocols and its engine-side
UpstreamConnections on fake transports that keep what is written. --connections clients
each send one plain POST /v1/chat/completions at a time (closed loop); every engine
request the gateway writes is answered with a fixed whole response in the next loop pass.
Everything but the kernel and uvloop's own socket code runs as in production: parsing,
admission (queueing included, since half the clients wait at the default limit), routing,
the exchange, the outbox, the responses. No system calls, no other process: the figure is
repeatable on a noisy machine, which the socket benchmark (overhead.py) is not.

Reported: microseconds of this process's CPU time (user + system) per request over
--requests requests, best of --repeat runs; --profile adds a cProfile table.

CPU time still drifts 20-40 % between runs on a shared machine. --instructions counts
instead the machine instructions per request with valgrind's callgrind, which is
deterministic: two runs (500 and 2,500 requests) under callgrind, and the difference of
their totals over the 2,000 extra requests (start-up and imports cancel out). About a
minute; needs valgrind (apt-get install valgrind).

    python -m bench.inprocess [--requests 20000] [--connections 64] [--repeat 3] [--profile]
    python -m bench.inprocess --instructions [--stream-events 32]
    python -m bench.inprocess --instructions [--tenant] [--body-kb 16 --policy smart] [--sdk-head]
    python -m bench.inprocess --smoke            # 500 requests, one run: it works, the figure is rough

--stream-events N: each engine answer is instead a vLLM-style SSE stream of N token events
and [DONE], chunked, one event per read (as bench/overhead.py's SSE phase); the figures are
per streamed request, and --instructions also prints them per event.
The client then asks `"stream": true`. --body-kb K sends bench/lib/bodies.py's K KiB chat
prompt; --tenant names one tenant (x-velocity-tenant) given a token quota too large to
bind and token fairness; --policy sets the gateway's; --sdk-head sends the head the OpenAI
Python SDK sends (17 lines) instead of three, its Bearer the API key the gateway then
requires. bench/ratchet.py counts five of these
scenarios against a committed baseline.

--trace-ratio R: tracing on (docs/tracing.md), sampling R of the requests, exporting to a
collector stand-in in another process (it answers every OTLP post 200 and keeps nothing);
the export queue holds every span and the measured time ends once all are exported, so
the figure is a traced request's whole cost in this process, its spans' encoding and
posting (the exporter's thread) included. Needs the otel extra.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from bench.lib.bodies import BODY, STREAM_BODY, chat_body
from velocity_fast.config import load_settings, parse_endpoint_flag
from velocity_fast.gateway.app import Gateway
from velocity_fast.server.connection import HttpProtocol
from velocity_fast.server.http_server import HTTPServer
from velocity_fast.server.limits import ServerLimits
from velocity_fast.upstream.connection import UpstreamConnection

ANSWER = (
    b'{"id":"chatcmpl-fixed","object":"chat.completion","created":1700000000,"model":"fixed",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"Hello!"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":10,"total_tokens":12,"completion_tokens":2}}'
)


# The other header lines the OpenAI Python SDK (1.54, over httpx) sends with a chat
# completion: the head most real clients' requests carry (17 lines, about 550 bytes),
# where wrk and the load generator send Host, Content-Type and Content-Length only.
SDK_KEY = "sk-0123456789abcdef0123456789abcdef"
SDK_LINES = (
    b"Accept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\nAccept: application/json\r\n"
    b"User-Agent: OpenAI/Python 1.54.4\r\nX-Stainless-Lang: python\r\nX-Stainless-Package-Version: 1.54.4\r\n"
    b"X-Stainless-OS: Linux\r\nX-Stainless-Arch: x64\r\nX-Stainless-Runtime: CPython\r\n"
    b"X-Stainless-Runtime-Version: 3.11.7\r\nAuthorization: Bearer " + SDK_KEY.encode() + b"\r\n"
    b"X-Stainless-Async: false\r\nx-stainless-retry-count: 0\r\nx-stainless-read-timeout: 600\r\n"
)


def request_bytes(body: bytes, tenant: str | None = None, sdk_head: bool = False) -> bytes:
    """The client's POST of ``body``, naming ``tenant`` by header when given; with
    ``sdk_head``, the head the OpenAI Python SDK sends (SDK_LINES)."""
    head = b"x-velocity-tenant: %s\r\n" % tenant.encode() if tenant else b""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n"
        + (SDK_LINES if sdk_head else b"")
        + head
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


RESPONSE = (
    b"HTTP/1.1 200 OK\r\ndate: Sun, 29 Nov 2026 22:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-length: %d\r\ncontent-type: application/json\r\n\r\n" % len(ANSWER) + ANSWER
)
# --stream-events: vLLM's streamed answer, one event per read (as bench/overhead.py's SSE phase).
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ndate: Sun, 29 Nov 2026 22:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
)
_EVENT = (
    b'data: {"id":"chatcmpl-fixed","object":"chat.completion.chunk","created":1700000000,"model":"fixed",'
    b'"choices":[{"index":0,"delta":{"content":"tok"},"logprobs":null,"finish_reason":null}]}\n\n'
)
EVENT_CHUNK = b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT)
LAST_CHUNK = b"%x\r\n%s\r\n0\r\n\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n")


class FakeTransport:
    """Keeps what is written; the harness reads it back."""

    def __init__(self, peer=("127.0.0.1", 40000)) -> None:
        self.out: list[bytes] = []
        self.closing = False
        self.peer = peer

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def writelines(self, parts) -> None:
        self.out.extend(parts)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0  # everything written is taken at once

    def close(self) -> None:
        self.closing = True

    abort = close

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_extra_info(self, name, default=None):
        return self.peer if name == "peername" else default

    def take(self) -> bytes:
        out, self.out = self.out, []
        return b"".join(out)


async def drive(
    requests: int,
    connections: int,
    stream_events: int = 0,
    body_kb: int = 0,
    policy: str | None = None,
    tenant: bool = False,
    trace_url: str | None = None,
    trace_ratio: float = 0.0,
    sdk_head: bool = False,
) -> tuple[float, int]:
    """``body_kb``: a chat prompt of that many KiB (bench/lib/bodies.py) instead of BODY;
    ``policy``: the gateway's; ``tenant``: one tenant with a token quota (too large to
    bind) and token fairness, named by x-velocity-tenant on every request; ``sdk_head``:
    each request with the OpenAI SDK's head (SDK_LINES), its Bearer the key the gateway
    requires (SDK_KEY)."""
    loop = asyncio.get_running_loop()
    flags: dict = {"endpoints": [parse_endpoint_flag("e1=http://127.0.0.1:9=fixed")]}
    if policy:
        flags["policy"] = policy
    if tenant:
        flags["tenants"] = [{"name": "t0", "tokens_per_minute": 1.0e12}]
        flags["admission"] = {"fairness": "tokens"}
    if sdk_head:
        # Keys required, as where such clients call: the SDK's Bearer is the gateway's key.
        flags["api_key"] = SDK_KEY
    if trace_ratio:
        flags["tracing"] = {"sample_ratio": trace_ratio, "otlp_endpoint": trace_url, "max_queue_size": 1_000_000}
    settings = load_settings(None, flags, env={})
    body = chat_body(body_kb) if body_kb else (STREAM_BODY if stream_events else BODY)
    request = request_bytes(body, "t0" if tenant else None, sdk_head)
    gw = Gateway(settings)
    gw.loop = loop
    ep = gw.endpoints["e1"]
    ep.healthy, ep.state = True, "healthy"
    gw.admission.on_metrics(ep)
    server = HTTPServer(gw.handle, limits=ServerLimits(), name="gateway")
    server.loop = loop
    # Engine connections: enough idle ones for every client.
    engines: list[tuple[UpstreamConnection, FakeTransport]] = []
    for _ in range(connections):
        conn = UpstreamConnection(ep.upstream, loop)
        t = FakeTransport()
        conn.connection_made(t)
        ep.upstream.adopt(conn)
        engines.append((conn, t))
    clients: list[tuple[HttpProtocol, FakeTransport]] = []
    for i in range(connections):
        proto = HttpProtocol(server)
        t = FakeTransport(("127.0.0.1", 40000 + i))
        proto.connection_made(t)
        clients.append((proto, t))

    left: dict[int, int] = {}  # engine connection -> events still to send (streams)
    got: dict[int, bytearray] = {}  # client -> what it has of a streamed answer
    sent = done = 0
    for proto, _ in clients:
        if sent < requests:
            proto.data_received(request)
            sent += 1
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    stalls = 0
    while done < requests:
        await asyncio.sleep(0)  # the outbox flushes; granted exchanges go out
        progressed = False
        for i, (conn, t) in enumerate(engines):
            if t.out:
                t.out.clear()
                if stream_events:
                    left[i] = stream_events - 1
                    conn.data_received(STREAM_HEAD + EVENT_CHUNK + (b"" if left[i] else LAST_CHUNK))
                else:
                    conn.data_received(RESPONSE)
                progressed = True
            elif left.get(i):
                left[i] -= 1
                conn.data_received(EVENT_CHUNK if left[i] else EVENT_CHUNK + LAST_CHUNK)
                progressed = True
        await asyncio.sleep(0)
        for i, (proto, t) in enumerate(clients):
            if t.out:
                data = t.take()
                progressed = True
                if stream_events:
                    buf = got.setdefault(i, bytearray())
                    buf += data
                    if not buf.endswith(b"0\r\n\r\n"):
                        continue
                    data = bytes(buf)
                    del got[i]
                if not data.startswith(b"HTTP/1.1 200 "):
                    raise RuntimeError(f"unexpected answer: {data[:200]!r}")
                done += 1
                if sent < requests:
                    proto.data_received(request)
                    sent += 1
        stalls = 0 if progressed else stalls + 1
        if stalls > 1000:
            raise RuntimeError(f"stalled after {done} answers")
    if gw.tracing is not None:  # the spans exported, in the measured time
        await gw.tracing.close(timeout=600.0)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    gw.admission.close()
    return cpu / requests * 1e6, int(requests / wall)


REPO = Path(__file__).resolve().parent.parent


def scenario_argv(
    connections: int,
    stream_events: int = 0,
    body_kb: int = 0,
    policy: str | None = None,
    tenant: bool = False,
    sdk_head: bool = False,
) -> list[str]:
    """The flags that give drive() these arguments."""
    argv = ["--connections", str(connections), "--stream-events", str(stream_events), "--body-kb", str(body_kb)]
    argv += ["--policy", policy] if policy else []
    return argv + (["--tenant"] if tenant else []) + (["--sdk-head"] if sdk_head else [])


def _collected(n: int, argv: list[str], out: str) -> int:
    vg = shutil.which("valgrind")
    if vg is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    # Run as a module from the root, as the README says, so that this checkout is imported.
    p = subprocess.run(
        [
            vg,
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-m",
            "bench.inprocess",
            "--requests",
            str(n),
            "--repeat",
            "1",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    m = re.search(r"Collected : (\d+)", p.stderr)
    if p.returncode != 0 or m is None:
        raise SystemExit(f"callgrind run failed ({p.returncode}): {p.stderr[-800:]}")
    return int(m.group(1))


def instructions(
    connections: int,
    stream_events: int = 0,
    small: int = 500,
    large: int = 2500,
    body_kb: int = 0,
    policy: str | None = None,
    tenant: bool = False,
    sdk_head: bool = False,
) -> float:
    """Machine instructions per request: callgrind totals of two runs, differenced."""
    argv = scenario_argv(connections, stream_events, body_kb, policy, tenant, sdk_head)
    with tempfile.TemporaryDirectory(prefix="velocity-callgrind-") as tmp:
        totals = [_collected(n, argv, f"{tmp}/cg.{n}") for n in (small, large)]
    return (totals[1] - totals[0]) / (large - small)


# --smoke: one short run (CI: tests/bench/); flags given still win.
SMOKE = {"requests": 500, "repeat": 1}

# A collector stand-in: answers each OTLP/HTTP post 200, keeps nothing (--trace-ratio).
_SINK = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
s = HTTPServer(("127.0.0.1", 0), H)
print(s.server_port, flush=True)
s.serve_forever()
"""


def otlp_sink() -> tuple[subprocess.Popen, str]:
    """The collector stand-in's process and its OTLP/HTTP address (stop it with stop_sink)."""
    proc = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{proc.stdout.readline().strip()}"


def stop_sink(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="then one run under cProfile, top functions")
    p.add_argument("--top", type=int, default=30)
    p.add_argument(
        "--instructions",
        action="store_true",
        help="machine instructions per request under callgrind (deterministic; needs valgrind)",
    )
    p.add_argument(
        "--stream-events",
        type=int,
        default=0,
        help="streamed answers instead: N token events (one per read), then [DONE]",
    )
    p.add_argument(
        "--body-kb",
        type=int,
        default=0,
        metavar="K",
        help="a K KiB chat prompt (bench/lib/bodies.py) instead of the small one",
    )
    p.add_argument(
        "--policy",
        default=None,
        choices=("dynamic", "static", "smart"),
        help="the gateway's policy (default: the gateway's default)",
    )
    p.add_argument(
        "--tenant",
        action="store_true",
        help="one tenant with a token quota (too large to bind) and token fairness, named on each request",
    )
    p.add_argument(
        "--sdk-head",
        action="store_true",
        help="each request with the head the OpenAI Python SDK sends (17 lines) instead of three, "
        "its Bearer the key the gateway then requires",
    )
    p.add_argument(
        "--trace-ratio",
        type=float,
        default=0.0,
        metavar="R",
        help="tracing on, sampling R of the requests, exported to a stand-in collector (needs the otel extra)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny counts (" + ", ".join(f"{k}={v}" for k, v in SMOKE.items()) + "): checks that it runs",
    )
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE)
    a = p.parse_args(argv)
    what = f"streamed request of {a.stream_events} events + [DONE]" if a.stream_events else "request"
    if a.instructions:
        per = instructions(
            a.connections, a.stream_events, body_kb=a.body_kb, policy=a.policy, tenant=a.tenant, sdk_head=a.sdk_head
        )
        print(f"{per:,.0f} instructions per {what} (callgrind, {a.connections} connections, 2,500 - 500 requests)")
        if a.stream_events:
            print(f"  {per / (a.stream_events + 1):,.0f} per event")
        return 0
    best = None
    sink, url = otlp_sink() if a.trace_ratio else (None, None)
    try:
        for _ in range(a.repeat):
            us, rps = uvloop.run(
                drive(
                    a.requests,
                    a.connections,
                    a.stream_events,
                    a.body_kb,
                    a.policy,
                    a.tenant,
                    url,
                    a.trace_ratio,
                    sdk_head=a.sdk_head,
                )
            )
            print(f"{us:.1f} us CPU per {what} ({rps} requests/s of wall time, one core, no sockets)")
            best = us if best is None else min(best, us)
    finally:
        if sink is not None:
            stop_sink(sink)
    print(f"best: {best:.1f} us per request over {a.requests} requests, {a.connections} connections")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        uvloop.run(
            drive(a.requests, a.connections, a.stream_events, a.body_kb, a.policy, a.tenant, sdk_head=a.sdk_head)
        )
        prof.disable()
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
