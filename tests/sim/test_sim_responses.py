"""SSE sinks of the sim engine against a fake Responder: chunk bytes, batching of a
step loop turn into one write, backlog while the client reads slowly, keep-alive."""

from __future__ import annotations

import asyncio
import json

from velocity_fast.server.errors import ClientDisconnected
from velocity_fast.sim.responses import RequestMeta, StreamSink, WholeSink
from velocity_fast.sim.tokens import VOCAB


class FakeResponder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.paused = False
        self.disconnected = False
        self._resume: asyncio.Future | None = None

    def write_nowait(self, data: bytes) -> bool:
        if self.disconnected:
            return False
        self.writes.append(data)
        return True

    async def write(self, data: bytes) -> None:
        if self.disconnected:
            raise ClientDisconnected()
        self.writes.append(data)
        while self.paused:
            self._resume = asyncio.get_running_loop().create_future()
            await self._resume

    def resume(self) -> None:
        self.paused = False
        if self._resume is not None and not self._resume.done():
            self._resume.set_result(None)

    def events(self) -> list[str]:
        text = b"".join(self.writes).decode()
        return [e[6:] if e.startswith("data: ") else e for e in text.split("\n\n") if e]


def meta(chat=True, include_usage=False, continuous=False) -> RequestMeta:
    return RequestMeta('chatcmpl-"q"' if chat else "cmpl-1", 1700000000, "m\\odd", chat, 7, include_usage, continuous)


def test_token_chunks_are_valid_json_with_escaped_constants():
    r = FakeResponder()
    s = StreamSink(r, meta(include_usage=True, continuous=True))
    for i, fr in enumerate([None, None, "stop"]):
        s.token(i, fr)
        s.flush()
    ev = r.events()
    assert ev[-1] == "[DONE]"
    chunks = [json.loads(e) for e in ev[:-1]]
    assert chunks[0]["id"] == 'chatcmpl-"q"' and chunks[0]["model"] == "m\\odd"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len(r.writes) == 3  # the role chunk went out with the first token
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:4]] == [VOCAB[0], VOCAB[1], VOCAB[2]]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 3]
    assert chunks[3]["choices"][0]["finish_reason"] == "stop"
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["total_tokens"] == 10
    assert s.closed


def test_one_write_per_flush():
    r = FakeResponder()
    s = StreamSink(r, meta(chat=False))
    assert s.token(1, None) is True  # became dirty: the engine remembers it once
    assert s.token(2, None) is False
    s.flush()
    assert len(r.writes) == 1 and len(r.events()) == 2
    assert s.fail(500, "InternalServerError", "boom") is True
    s.flush()
    ev = r.events()
    assert json.loads(ev[-2]) == {
        "error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}
    }
    assert ev[-1] == "[DONE]" and s.closed


async def test_slow_client_gets_everything_in_order_without_blocking_the_producer():
    r = FakeResponder()
    s = StreamSink(r, meta(chat=False))
    runner = asyncio.create_task(s.run(None))
    await asyncio.sleep(0)
    r.paused = True
    for i in range(50):  # the producer never waits
        s.token(i, None if i < 49 else "length")
        s.flush()
    await asyncio.sleep(0.01)
    assert not runner.done()
    r.resume()
    await asyncio.wait_for(runner, 2)
    texts = [json.loads(e)["choices"][0]["text"] for e in r.events()[:-1]]
    assert texts == [VOCAB[i] for i in range(50)]


async def test_keep_alive_only_while_idle():
    r = FakeResponder()
    s = StreamSink(r, meta(chat=False))
    runner = asyncio.create_task(s.run(0.01))
    await asyncio.sleep(0.05)
    assert r.events().count(": keep-alive") >= 2
    s.token(3, "length")
    s.flush()
    await asyncio.wait_for(runner, 2)
    assert r.events()[-1] == "[DONE]"


async def test_abort_ends_the_run_and_drops_pending_output():
    r = FakeResponder()
    s = StreamSink(r, meta(chat=False))
    runner = asyncio.create_task(s.run(None))
    s.token(1, None)
    s.aborted()
    s.flush()
    await asyncio.wait_for(runner, 2)
    assert r.writes == []


async def test_whole_response_body():
    done = asyncio.get_running_loop().create_future()
    w = WholeSink(meta(chat=True), done)
    for i, fr in enumerate([None, "length"]):
        w.token(i, fr)
    assert done.done()
    body = w.body("fp")
    assert body["choices"][0]["message"]["content"] == VOCAB[0] + VOCAB[1]
    assert body["usage"] == {
        "prompt_tokens": 7,
        "total_tokens": 9,
        "completion_tokens": 2,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert body["object"] == "chat.completion" and body["system_fingerprint"] == "fp"
