"""The one-call HTTP/1.1 scanners (http/http1.pyx) against llhttp (httptools).

What a scanner takes, llhttp must take with the same meaning (method, target, headers
as the server builds them, keep-alive, body, where the message ends); everything the
scanner is not sure of it must decline (None), so that llhttp parses it or answers the
error the contract asks for.
"""

from __future__ import annotations

import httptools
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from velocity_fast.http.http1 import response_headers, scan_request, scan_response

MAX_HEAD = 64 * 1024
MAX_BODY = 1 << 20


class _Req:
    """What the server's httptools callbacks collect for each request."""

    def __init__(self) -> None:
        self.done: list[tuple] = []
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""

    def on_message_begin(self):
        self.url, self.headers, self.body = b"", [], b""

    def on_url(self, url):
        self.url += url

    def on_header(self, name, value):
        self.headers.append((name, value))

    def on_headers_complete(self):
        self.method = self.parser.get_method().decode()
        self.keep = self.parser.should_keep_alive()  # read here, as the server does

    def on_body(self, body):
        self.body += body

    def on_message_complete(self):
        self.done.append((self.method, self.url, self.headers, self.keep, self.body))


def _llhttp_request(data: bytes):
    """(method, path, query, headers, keep_alive, body) of the first request, by llhttp."""
    p = _Req()
    parser = p.parser = httptools.HttpRequestParser(p)
    parser.feed_data(data)
    assert p.done, "llhttp did not complete the request"
    method, url, raw, keep, body = p.done[0]
    headers: dict[str, str] = {}
    for name, value in raw:  # as server/connection.pyx builds them
        k = name.decode("latin-1").lower()
        v = value.decode("latin-1")
        headers[k] = headers[k] + ", " + v if k in headers else v
    q = url.find(b"?")
    path, query = (url[:q], url[q + 1 :]) if q >= 0 else (url, b"")
    return method, path.decode("latin-1"), query.decode("latin-1"), headers, keep, body


def _agree(data: bytes) -> tuple | None:
    r = scan_request(data, 0, MAX_HEAD, MAX_BODY)
    if r is not None:
        assert r[:6] == _llhttp_request(data[: r[6]])
    return r


BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
PLAIN = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
)


def test_the_plain_request_is_read_whole_with_its_headers_and_body():
    r = _agree(PLAIN)
    assert r is not None
    method, path, query, headers, keep, body, end = r
    assert (method, path, query, keep, body, end) == ("POST", "/v1/chat/completions", "", True, BODY, len(PLAIN))
    assert headers == {"host": "gw", "content-type": "application/json", "content-length": str(len(BODY))}


def test_query_repeated_headers_and_explicit_keep_alive():
    data = (
        b"GET /v1/models?a=1&b=2 HTTP/1.1\r\nX-Tag: one\r\nx-tag:two\r\nConnection: Keep-Alive\r\n"
        b"Authorization: Bearer  k  \r\n\r\n"
    )
    r = _agree(data)
    assert r is not None
    assert r[1:3] == ("/v1/models", "a=1&b=2")
    assert r[3]["x-tag"] == "one, two" and r[3]["authorization"] == "Bearer  k  "
    assert r[4] is True


def test_connection_close_is_left_to_llhttp():
    # llhttp refuses bytes sent after a Connection: close request; the server answers that.
    data = b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\nGET /health HTTP/1.1\r\n\r\n"
    assert scan_request(data, 0, MAX_HEAD, MAX_BODY) is None


def test_pipelined_requests_are_read_one_after_another():
    data = PLAIN + b"GET /health HTTP/1.1\r\n\r\n" + PLAIN[:40]
    r1 = scan_request(data, 0, MAX_HEAD, MAX_BODY)
    r2 = scan_request(data, r1[6], MAX_HEAD, MAX_BODY)
    assert r2[:2] == ("GET", "/health") and r2[5] == b""
    assert scan_request(data, r2[6], MAX_HEAD, MAX_BODY) is None  # the partial third is llhttp's


@pytest.mark.parametrize(
    "data",
    [
        PLAIN[:-1],  # body not all here
        PLAIN[:30],  # head not all here
        b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi",
        b"GET /x HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        b"GET /x HTTP/1.1\r\nConnection: keep-alive, Upgrade\r\n\r\n",
        b"GET /x HTTP/1.0\r\n\r\n",
        b"CONNECT example.com:443 HTTP/1.1\r\n\r\n",
        b"GET http://example.com/ HTTP/1.1\r\n\r\n",
        b"OPTIONS * HTTP/1.1\r\n\r\n",
        b"POST /x HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nhi",
        b"POST /x HTTP/1.1\r\nContent-Length: +2\r\n\r\nhi",
        b"POST /x HTTP/1.1\r\nContent-Length: 2 \r\n\r\nhi",
        b"GET /x HTTP/1.1\r\nBad Name: v\r\n\r\n",
        b"GET /x HTTP/1.1\r\nName : v\r\n\r\n",
        b"GET /x HTTP/1.1\r\n folded: v\r\n\r\n",
        b"GET /x HTTP/1.1\r\nName: v\x00\r\n\r\n",
        b"GET /x HTTP/1.1\r\nName: caf\xc3\xa9\r\n\r\n",
        b"GET /x HTTP/1.1\nName: v\n\n",
        b"GET /x HTTP/1.1\r\nName: v\n\r\n",
        b"get /x HTTP/1.1\r\n\r\n",
        b"GET /a b HTTP/1.1\r\n\r\n",
        b"GET  /x HTTP/1.1\r\n\r\n",
        b"\r\nGET /x HTTP/1.1\r\n\r\n",
    ],
)
def test_what_is_not_plain_is_left_to_llhttp(data):
    assert scan_request(data, 0, MAX_HEAD, MAX_BODY) is None


def test_limits_leave_the_answer_to_the_server():
    big = b"GET /x HTTP/1.1\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n"
    assert scan_request(big, 0, 4096, MAX_BODY) is None  # the server answers 431
    assert scan_request(big, 0, 8192, MAX_BODY) is not None
    assert scan_request(PLAIN, 0, MAX_HEAD, len(BODY) - 1) is None  # 413
    assert scan_request(PLAIN, 0, MAX_HEAD, len(BODY)) is not None


_tchar = st.sampled_from(list("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"))
_name = st.text(_tchar, min_size=1, max_size=12)
_value = st.binary(max_size=12).map(lambda b: bytes(c for c in b if c not in b"\r\n"))
_any_byte_line = st.binary(min_size=0, max_size=40)


@settings(max_examples=400, deadline=None)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"]),
    target=st.binary(min_size=0, max_size=20),
    headers=st.lists(st.tuples(_name, _value), max_size=6),
    body=st.binary(max_size=40),
    cl=st.sampled_from(["exact", "none", "short"]),
    tail=st.binary(max_size=8),
)
@example(method="POST", target=b"x?y", headers=[("Connection", b"keep-alive")], body=b"ab", cl="exact", tail=b"")
def test_whatever_the_scanner_takes_llhttp_takes_the_same_way(method, target, headers, body, cl, tail):
    head = b"%s /%s HTTP/1.1\r\n" % (method.encode(), target)
    for name, value in headers:
        head += name.encode() + b": " + value + b"\r\n"
    if cl == "exact":
        head += b"Content-Length: %d\r\n" % len(body)
    elif cl == "short" and body:
        head += b"Content-Length: %d\r\n" % (len(body) - 1)
    elif body:
        body = b""
    data = head + b"\r\n" + body + tail
    r = _agree(data)  # llhttp, given what the scanner took, reads the same request
    if r is None:
        # Declined: then either llhttp, too, has no whole plain request here, or the
        # request has something the scanner leaves to llhttp on purpose.
        try:
            got = _llhttp_request(head + b"\r\n" + body)
        except (httptools.HttpParserError, AssertionError):
            return
        special = any(
            n.lower() in ("transfer-encoding", "upgrade", "expect", "connection", "content-length") for n, _ in headers
        )
        odd = any(c < 0x20 and c != 9 or c >= 0x7F for _, v in headers for c in v) or any(
            c <= 0x20 or c >= 0x7F for c in target
        )
        assert special or odd or cl == "short", got


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=120))
def test_random_bytes_never_crash_the_scanner_and_what_it_takes_llhttp_takes(data):
    r = scan_request(b"GET /" + data, 0, MAX_HEAD, MAX_BODY)
    if r is not None:
        assert r[:6] == _llhttp_request((b"GET /" + data)[: r[6]])


# -- responses ----------------------------------------------------------------------


class _Resp:
    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body = b""
        self.complete = False

    def on_header(self, name, value):  # as upstream/connection.pyx keeps them
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self):  # as upstream/connection.pyx reads them
        self.status = self.parser.get_status_code()
        self.keep = self.parser.should_keep_alive()

    def on_body(self, body):
        self.body += body

    def on_message_complete(self):
        self.complete = True


def _llhttp_response(data: bytes):
    p = _Resp()
    parser = p.parser = httptools.HttpResponseParser(p)
    parser.feed_data(data)
    assert p.complete
    return p.status, p.headers, p.keep, p.body


RESP = (
    b"HTTP/1.1 200 OK\r\ndate: Sun, 29 Nov 2026 22:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-length: 2\r\ncontent-type: application/json\r\n\r\n{}"
)


def test_the_plain_response_is_read_whole():
    r = scan_response(RESP, 0)
    assert r is not None and r[4] == len(RESP)
    assert r[:4] == _llhttp_response(RESP)
    assert r[0] == 200 and r[2] is True and r[3] == b"{}"


def test_an_error_response_and_connection_close():
    data = b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 5\r\n\r\nerror"
    r = scan_response(data, 0)
    assert r[:4] == _llhttp_response(data) and r[0] == 400 and r[2] is False


@pytest.mark.parametrize(
    "data",
    [
        RESP[:-1],
        RESP[:20],
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: x\n\n",  # close-delimited
        b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1 2000 OK\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\ncontent-length: 2\n\n{}",
    ],
)
def test_responses_that_are_not_plain_are_left_to_llhttp(data):
    assert scan_response(data, 0) is None


@pytest.mark.parametrize("bad", [0x00, 0x01, 0x0B, 0x0D, 0x1F, 0x7F, 0x80, 0xFF])
def test_a_bad_byte_anywhere_in_a_long_header_value_is_llhttps_to_judge(bad):
    # Values are checked eight bytes at a time while they are plain: a bad byte in any
    # position of such a run, or in the tail after it, must still be seen.
    for at in range(20):
        value = bytearray(b"abcdefghijklmnopqrst")
        value[at] = bad
        data = b"GET / HTTP/1.1\r\nHost: t\r\nX-Long: " + bytes(value) + b"\r\n\r\n"
        assert scan_request(data, 0, MAX_HEAD, MAX_BODY) is None, (bad, at)


def _llhttp_or_none(data: bytes):
    try:
        return _llhttp_request(data)
    except (httptools.HttpParserError, AssertionError):
        return None


_TCHARS = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# Bytes a name, a value or a path may hold or not, around the ranges the scanner skips
# sixteen at a time (letters, digits, '-'; printable ASCII; a path's visible bytes).
_ODD = [
    0x00,
    0x09,
    0x0D,
    0x1F,
    0x20,
    0x21,
    0x2C,
    0x2D,
    0x2E,
    0x2F,
    0x30,
    0x39,
    0x3A,
    0x3F,
    0x40,
    0x41,
    0x5A,
    0x5B,
    0x5F,
    0x60,
    0x61,
    0x7A,
    0x7B,
    0x7E,
    0x7F,
    0x80,
    0xC3,
    0xFF,
]


@pytest.mark.parametrize("odd", _ODD)
def test_any_byte_anywhere_in_a_long_header_name_is_judged_as_llhttp_judges_it(odd):
    # Names are skipped sixteen bytes at a time while they are letters, digits and '-':
    # another byte, at any position of such a run or in what is left after it, is the
    # byte scan's to judge, as it was.
    for at in range(39):
        name = bytearray(b"X-Abcdefghijklmnopqrstuvwxyz-0123456789")  # 39 bytes
        name[at] = odd
        for tail in (b"", b"Content-Type: application/json\r\n"):
            data = b"GET / HTTP/1.1\r\nHost: t\r\n" + bytes(name) + b": v\r\n" + tail + b"\r\n"
            r = scan_request(data, 0, MAX_HEAD, MAX_BODY)
            if r is not None:
                assert r[:6] == _llhttp_request(data), (odd, at)
            if odd in _TCHARS or (odd == 0x3A and at > 0):
                assert r is not None, (odd, at)  # a name of tchars (or one cut short by ':')
            elif odd not in (0x0D,):
                assert r is None, (odd, at)


@pytest.mark.parametrize("odd", _ODD)
def test_any_byte_anywhere_in_a_long_value_or_path_is_judged_as_llhttp_judges_it(odd):
    for at in range(40):
        value = bytearray(b"abcdefghijklmnopqrstuvwxyz 0123456789ABC")
        value[at] = odd
        data = b"GET / HTTP/1.1\r\nHost: t\r\nX-Long: " + bytes(value) + b"\r\nAccept: */*\r\n\r\n"
        r = scan_request(data, 0, MAX_HEAD, MAX_BODY)
        if r is not None:
            assert r[:6] == _llhttp_request(data), (odd, at)
        if 0x20 <= odd < 0x7F or (odd == 0x09 and at > 0):
            assert r is not None, (odd, at)
        elif odd != 0x09:
            assert r is None, (odd, at)
        path = bytearray(b"/v1/chat/completions/abcdefghijklmnopqrs")
        path[at] = odd
        if at == 0:
            continue  # (not a path in origin form: llhttp's)
        data = b"GET " + bytes(path) + b" HTTP/1.1\r\nHost: t\r\n\r\n"
        r = scan_request(data, 0, MAX_HEAD, MAX_BODY)
        if r is not None:
            assert r[:6] == _llhttp_request(data), (odd, at)
        if 0x21 <= odd < 0x7F:
            assert r is not None, (odd, at)
            assert r[1:3] == _llhttp_or_none(data)[1:3]
        else:
            assert r is None, (odd, at)


def test_tabs_and_spaces_in_a_long_value_are_taken_as_llhttp_takes_them():
    for at in range(20):
        value = bytearray(b"abcdefghijklmnopqrst")
        value[at] = 0x09
        data = b"GET / HTTP/1.1\r\nHost: t\r\nX-Long: " + bytes(value) + b" \r\n\r\n"
        r = scan_request(data, 0, MAX_HEAD, MAX_BODY)
        assert r is not None and r[3]["x-long"] == (bytes(value).lstrip(b"\t") + b" ").decode()
        assert r[:6] == _llhttp_request(data)


def test_a_repeated_response_header_is_taken_and_the_last_wins_as_on_llhttps_path():
    data = (
        b"HTTP/1.1 200 OK\r\nset-cookie: a\r\nSet-Cookie: b\r\ncontent-type: text/plain\r\n"
        b"Content-Type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    )
    r = scan_response(data, 0)
    assert r is not None and r[:4] == _llhttp_response(data)
    assert r[1]["set-cookie"] == "b" and r[1]["content-type"] == "application/json"


@pytest.mark.parametrize("pos, end", [(-1, 20), (0, 10_000), (30, 20), (0, 19)])
def test_response_headers_refuses_offsets_that_are_not_a_header_block(pos, end):
    # scan_response's own offsets are always right; anything else is refused, not read past.
    with pytest.raises(ValueError):
        response_headers(RESP, pos, end)


@settings(max_examples=300, deadline=None)
@given(
    status=st.integers(100, 599),
    headers=st.lists(st.tuples(_name, _value), max_size=5),
    body=st.binary(max_size=30),
    tail=st.binary(max_size=6),
)
def test_whatever_the_response_scanner_takes_llhttp_takes_the_same_way(status, headers, body, tail):
    data = b"HTTP/1.1 %d X\r\n" % status
    for name, value in headers:
        data += name.encode() + b": " + value + b"\r\n"
    data += b"Content-Length: %d\r\n\r\n" % len(body) + body + tail
    r = scan_response(data, 0)
    if r is None:
        return
    assert r[:4] == _llhttp_response(data[: r[4]])


def test_header_names_are_lower_case_whatever_was_seen_before():
    # The scanner keeps decoded names in a small table: many names (more than it has
    # slots, so some collide), in any case, short and past the table's 32 bytes, must
    # each come back as their own lower-case text, the first time and every time after.
    names = [f"X-Name-{i}" for i in range(600)] + ["A" * 33, "b" * 64, "C" * 65, "Content-Type", "content-TYPE"]
    for _ in range(2):
        for name in names:
            req = b"GET / HTTP/1.1\r\nHost: h\r\n%s: v\r\n\r\n" % name.encode()
            r = scan_request(req, 0, MAX_HEAD, MAX_BODY)
            assert r is not None and r[3] == {"host": "h", name.lower(): "v"}, name


@pytest.mark.parametrize(
    "line, headers",
    [
        (b"x-velocity-tenant: t0", {"x-velocity-tenant": "t0"}),
        (b"X-VELOCITY-TENANT:t1 ", {"x-velocity-tenant": "t1 "}),  # any case; trailing spaces kept
        (b"X-Velocity-Tenant: a\r\nx-velocity-tenant: b", {"x-velocity-tenant": "a, b"}),
        (b"x-velocity-tenantx: y", {"x-velocity-tenantx": "y"}),
        (b"x-velocity-tenant :t", None),  # a space before the colon: declined
        (b"x\rvelocity-tenant: t", None),  # no tchar: declined
        (b"x_velocity-tenant: t", {"x_velocity-tenant": "t"}),
    ],
)
def test_the_tenant_line_read_by_words_is_the_line_read_byte_by_byte(line, headers):
    r = scan_request(b"POST / HTTP/1.1\r\n" + line + b"\r\ncontent-length: 0\r\n\r\n", 0, 8192, 8192)
    assert (r and {k: v for k, v in r[3].items() if k != "content-length"}) == headers
