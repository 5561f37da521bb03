"""The client's key where keys are required: read from the Authorization and X-Api-Key
values where the request scanner found them (no header dict), with the same verdict and
the same bound tenant as the dict gives, whatever the names' case, the spacing, a
repeated header, or a head that llhttp reads instead (split across two reads)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.gateway import running_gateway
from tests.support.sim import sim_engine

pytestmark = pytest.mark.timeout(60)

MODEL = "test-model"
BODY = b'{"model":"test-model","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
# alpha's key binds it, and alpha may ask no band above low: a request asking for high
# answers in low when its key bound alpha, in high when the global key let it in.
# beta, named by header, may ask for any band.
TENANTS = [{"name": "alpha", "api_key": "key-alpha", "max_band": "low"}, {"name": "beta"}]


@pytest.fixture(scope="module")
def engine():
    with sim_engine(model=MODEL) as e:
        yield e


async def _post(port: int, lines: bytes, split: bool = False) -> tuple[int, dict[str, str]]:
    """POST BODY with these header lines on a keep-alive connection (the scanner's path;
    ``split``: the head in two reads, llhttp's path): the status and the headers."""
    req = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + lines
        + b"x-velocity-priority: high\r\nContent-Length: %d\r\n\r\n" % len(BODY)
        + BODY
    )
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        if split:
            w.write(req[:40])
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(req[40:])
        else:
            w.write(req)
        status = int((await r.readline()).split()[1])
        headers: dict[str, str] = {}
        while (line := await r.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        await r.readexactly(int(headers.get("content-length", "0")))
        return status, headers
    finally:
        w.close()


# (header lines, status, band): the band says which key let the request in.
CASES = [
    (b"Authorization: Bearer key-alpha\r\n", 200, "low"),
    (b"authorization: bearer key-alpha\r\n", 200, "low"),
    (b"AUTHORIZATION: Bearer   key-alpha  \r\n", 200, "low"),
    (b"Authorization: Bearer secret\r\n", 200, "high"),
    (b"X-Api-Key: key-alpha\r\n", 200, "low"),
    (b"x-api-key: secret\r\n", 200, "high"),
    (b"Authorization: Basic a2V5\r\nX-API-KEY: key-alpha\r\n", 200, "low"),
    # The key's tenant wins over the header's, also once the header's tenant is known.
    (b"Authorization: Bearer secret\r\nx-velocity-tenant: beta\r\n", 200, "high"),
    (b"Authorization: Bearer key-alpha\r\nx-velocity-tenant: beta\r\n", 200, "low"),
    (b"Authorization: Bearer \r\nX-Api-Key: secret\r\n", 200, "high"),  # an empty Bearer: the other header
    (b"Authorization: bEaReR key-alpha\t\r\n", 200, "low"),  # a trailing tab is stripped too
    (b"Authorization: Bearer\r\nX-Api-Key: secret\r\n", 200, "high"),
    (b"Authorization: Bearer    \r\nX-Api-Key: key-alpha\r\n", 200, "low"),
    (b"Authorization: Bearer\tkey-alpha\r\n", 401, None),  # a tab is no space: no Bearer scheme
    (b"Authorization: Bearerx key-alpha\r\n", 401, None),
    (b"Authorization: Bear key-alpha\r\n", 401, None),
    (b"Authorization: Bearer key-alpha extra\r\n", 401, None),
    (b"Authorization: Bearer wrong\r\n", 401, None),
    (b"Authorization: key-alpha\r\n", 401, None),  # no scheme
    (b"X-Api-Key: wrong\r\nAuthorization: Bearer wrong-too\r\n", 401, None),
    (b"", 401, None),
    # Named twice, the values are joined with ", " as by the dict: no key is that.
    (b"Authorization: Bearer key-alpha\r\nAuthorization: Bearer key-alpha\r\n", 401, None),
    (b"X-Api-Key: key-alpha\r\nx-api-key: key-alpha\r\n", 401, None),
]


@pytest.mark.parametrize("split", [False, True], ids=["scanned", "llhttp"])
async def test_the_key_check_reads_the_key_headers_as_the_dict_does(engine, split):
    async with running_gateway(engine, api_key="secret", tenants=TENANTS) as gw:
        for lines, status, band in CASES:
            got, headers = await _post(gw.port, lines, split)
            assert got == status, (lines, got, headers)
            if band is not None:
                assert headers["x-velocity-band"] == band, (lines, headers)
            else:
                assert "x-velocity-band" not in headers or got == 401, (lines, headers)
