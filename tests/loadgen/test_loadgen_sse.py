"""SSE token timing: any split of the stream gives the same events."""

import orjson
import pytest

from velocity_fast.loadgen.sse import SSETokenTimer


def ev(obj):
    return b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"


STREAM = [
    ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    ev({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}),
    b": keep-alive\n\n",
    ev({"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}]}),
    ev({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}),
    ev(b"[DONE]"),
]


def test_tokens_ttft_and_gaps_with_event_times():
    t = SSETokenTimer()
    for i, piece in enumerate(STREAM):
        t.feed(piece, now=float(i))
    assert t.first_token_at == 1.0 and t.last_token_at == 3.0
    assert t.gaps == [2.0] and t.tokens == 2 and t.usage_tokens == 2
    assert t.done and t.error is None


@pytest.mark.parametrize("size", [1, 3, 7, 50])
def test_any_split_gives_the_same_result(size):
    whole = b"".join(STREAM)
    t = SSETokenTimer()
    for k in range(0, len(whole), size):
        t.feed(whole[k : k + size], now=0.0)
    assert (t.tokens, t.usage_tokens, t.done) == (2, 2, True)


def test_completions_text_and_crlf_and_error_event():
    t = SSETokenTimer()
    t.feed(b'data: {"choices":[{"index":0,"text":"a"}]}\r\n\r\n', 0.0)
    t.feed(b'data: {"error":{"message":"CUDA out of memory","code":500}}\r\n\r\ndata: [DONE]\r\n\r\n', 1.0)
    assert t.tokens == 1 and t.error == "CUDA out of memory" and t.done


def test_unknown_shape_counts_as_token():
    t = SSETokenTimer()
    t.feed(b'data: {"token":"x"}\n\ndata: {"token":"y"}\n\n', 5.0)
    assert t.tokens == 2 and t.gaps == [0.0]
