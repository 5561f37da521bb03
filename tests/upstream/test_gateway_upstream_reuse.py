"""Pooled engine connections that the engine closed while they sat idle.

An engine (or a proxy in front of it) may close a keep-alive connection at any time
between requests without saying so in the previous answer. The gateway's next request on
that connection then fails before any answer byte; it must go out again on a fresh
connection instead of reaching the client as a 502.
"""

from __future__ import annotations

import socketserver
import threading

import pytest

from tests.support.gateway import running_gateway
from tests.support.sim import http_request

pytestmark = pytest.mark.timeout(60)

MODEL = "m"
_REPLY = b'{"id":"x","object":"chat.completion","choices":[]}'


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        eng: ClosingEngine = self.server.engine  # type: ignore[attr-defined]
        answered_post = False
        while True:
            line = self.rfile.readline()
            if not line:
                return
            method = line.split(b" ", 1)[0]
            if method == b"POST" and answered_post:
                # As if this connection's idle timer fired as the request came in:
                # closed with the request unread and unanswered.
                eng.dropped += 1
                return
            length = 0
            while True:
                h = self.rfile.readline()
                if h in (b"\r\n", b""):
                    break
                k, _, v = h.partition(b":")
                if k.strip().lower() == b"content-length":
                    length = int(v)
            if length:
                self.rfile.read(length)
            body = _REPLY if method == b"POST" else b""
            if method == b"POST":
                # Counted before the answer leaves: the test reads the count as soon as
                # its answer arrives, which may be before this thread runs again.
                eng.posts += 1
                answered_post = True
            self.wfile.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: keep-alive\r\n\r\n%s" % (len(body), body)
            )
            self.wfile.flush()


class ClosingEngine(socketserver.ThreadingTCPServer):
    """Answers one POST per connection with keep-alive headers; the next POST on that
    connection finds it closed before any answer byte. Runs in threads, apart from the
    test's event loop."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.engine = self
        self.posts = 0
        self.dropped = 0
        self.port = self.server_address[1]
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "ClosingEngine":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(5)


async def test_a_pooled_connection_the_engine_dropped_is_replaced_not_a_502():
    with ClosingEngine() as eng:
        async with running_gateway(("e1", f"http://127.0.0.1:{eng.port}", MODEL)) as gw:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            for i in range(5):
                r = await http_request(gw.port, "POST", "/v1/chat/completions", body)
                assert r.status == 200, (i, r.status, r.body)
                assert r.body == _REPLY
            assert eng.posts == 5  # each request answered exactly once
            assert eng.dropped >= 3  # and the reused connections really were dropped
            assert gw.endpoints["e1"].healthy  # a dropped idle connection is no engine failure
