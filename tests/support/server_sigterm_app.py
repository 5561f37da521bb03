"""A tiny service for the SIGTERM test of velocity_fast.server.run_until_signalled.

    python server_sigterm_app.py SHAPE CHUNKS INTERVAL GRACE

It listens on a free port of 127.0.0.1 and prints `listening PORT`. GET /stream
answers CHUNKS SSE events INTERVAL seconds apart, then `data: [DONE]`; any other
path a small JSON body. SHAPE is how `main` hands the service over: `cleanup`
(main(stop) returns a cleanup coroutine function), `servers` (main() returns a
list of servers) or `context` (main is an async context manager). On SIGTERM or
SIGINT it shuts down with GRACE seconds and prints `stopped` before exiting.
"""

from __future__ import annotations

import asyncio
import sys
from contextlib import asynccontextmanager

from velocity_fast.server.http_server import HTTPServer
from velocity_fast.server.run import run_until_signalled


def app(shape: str, chunks: int, interval: float, grace: float):
    async def handler(req, resp):
        if req.path != "/stream":
            resp.send_json(200, {"ok": True})
            return
        resp.start(200)
        for i in range(chunks):
            await resp.write(b"data: %d\n\n" % i)
            await asyncio.sleep(interval)
        await resp.write(b"data: [DONE]\n\n")
        resp.end()

    async def start() -> HTTPServer:
        srv = HTTPServer(handler, name="sigterm-test")
        await srv.start("127.0.0.1", 0)
        print(f"listening {srv.port}", flush=True)
        return srv

    if shape == "cleanup":

        async def main(stop: asyncio.Event):
            srv = await start()

            async def cleanup() -> None:
                await srv.shutdown(grace)

            return cleanup
    elif shape == "servers":

        async def main():
            return [await start()]
    elif shape == "context":

        @asynccontextmanager
        async def main():
            srv = await start()
            try:
                yield srv
            finally:
                await srv.shutdown(grace)
    else:
        raise SystemExit(f"unknown shape {shape!r}")
    return main


if __name__ == "__main__":
    shape, chunks, interval, grace = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    code = run_until_signalled(app(shape, chunks, interval, grace), grace=grace)
    print("stopped", flush=True)
    sys.exit(code)
