"""A closed connection's memory comes back at once, not at the next full collection of
the cyclic GC: under connection churn (clients that close after each request, engines that
close after a fault) dead connections would otherwise pile up by the thousand between
collections, each with its parser, transport and socket, and raise the high-water mark of
the process's memory for good. The checks run with the cyclic GC off: whatever is still
alive after the connections closed would only ever be freed by it."""

from __future__ import annotations

import asyncio
import gc
import json
from contextlib import contextmanager

import pytest

from tests.support.gateway import ScriptedServer, running_gateway, wait_until
from tests.support.server_wire import connect, echo, serving

pytestmark = pytest.mark.timeout(60)

ROUNDS = 40


def alive(type_name: str) -> int:
    return sum(type(o).__name__ == type_name for o in gc.get_objects())


@contextmanager
def cyclic_gc_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def test_closed_client_connections_are_freed_without_the_cyclic_gc():
    async with serving(echo) as srv:
        with cyclic_gc_off():
            before = alive("HttpProtocol")
            for i in range(ROUNDS):
                async with connect(srv) as c:
                    assert (await c.request("POST", f"/r{i}", b"x")).status == 200
            await wait_until(lambda: srv.connections == 0, 5.0, what="every connection closed")
            await asyncio.sleep(0.05)  # connection_lost runs from the loop's ready queue
            assert alive("HttpProtocol") - before <= 1, (before, alive("HttpProtocol"))


class ClosingEngine(ScriptedServer):
    """An engine that answers one request per connection and closes it."""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method, _, _, _ = await self.read_request(reader)
        body = (
            b""
            if method == "GET"
            else json.dumps(
                {"object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}
            ).encode()
        )
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()


async def test_engine_connections_closed_by_the_engine_are_freed_without_the_cyclic_gc():
    async with ClosingEngine() as eng, running_gateway(("e1", eng.url, "m")) as gw:
        with cyclic_gc_off():
            before = alive("UpstreamConnection")
            body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()
            for _ in range(ROUNDS):
                reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
                try:
                    writer.write(
                        b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                        b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
                    )
                    answer = await asyncio.wait_for(reader.read(), 5.0)
                finally:
                    writer.close()
                assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            await asyncio.sleep(0.05)
            # A few may be open or being opened (health checks, scrapes); not one per request.
            assert alive("UpstreamConnection") - before <= 4, (before, alive("UpstreamConnection"))
