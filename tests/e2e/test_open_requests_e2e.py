"""What most OpenAI clients send: no max_tokens. End to end on real sockets, with the
gateway and sim engines `make run` starts (`chargeVelocity`, two sim engines serving
`velocity-sim`): the README's openai example twenty times, then a burst of 24 requests of
32 tokens. A request without max_tokens is taken for what such requests returned, and an
engine's limit is not cut for a pace no batch could give it, so the burst is admitted
whole and answered within the SLA (before, each example cut every limit by a quarter, and
the burst met 429s)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import time
from pathlib import Path
from urllib.request import urlopen

import pytest
from openai import AsyncOpenAI, RateLimitError

from tests.support.fakes import free_port_block
from tests.support.gateway import gateway_process

pytestmark = [pytest.mark.e2e, pytest.mark.timed]  # answered within the SLA, by the clock

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
SLA_S = 3.0  # chargeVelocity's default --sla-ms


def _get(url: str) -> dict:
    with urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _wait_ready(admin_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if _get(admin_url + "/ready")["healthy_endpoints"] == 2:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("the gateway did not turn ready")


async def _burst(base_url: str, n: int, max_tokens: int) -> list[tuple[object, float]]:
    # No retries: a 429 must show, not be retried away by the client.
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30)

    async def one(i: int):
        t0 = time.monotonic()
        try:
            await client.chat.completions.create(
                model="velocity-sim", max_tokens=max_tokens, messages=[{"role": "user", "content": f"burst {i}"}]
            )
            return 200, time.monotonic() - t0
        except RateLimitError as e:
            return e.status_code, time.monotonic() - t0

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


@pytest.mark.timeout(180)
def test_the_readme_example_twenty_times_then_a_burst_is_admitted_within_the_sla():
    (snippet,) = re.findall(r"```python\n(.*?)```", README, re.S)
    assert "max_tokens" not in snippet and 'model="velocity-sim"' in snippet
    with gateway_process("chargeVelocity", "--mock", "--engine-base-port", str(free_port_block(2)), timeout=60) as gp:
        _wait_ready(gp.admin_url)
        code = snippet.replace("http://localhost:8000", gp.url)
        for _ in range(20):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(code, {})
            assert "ChatCompletion(" in out.getvalue()
        before = _get(gp.admin_url + "/stats")["admission"]
        answers = asyncio.run(_burst(gp.url, 24, 32))
        after = _get(gp.admin_url + "/stats")["admission"]
    statuses = [s for s, _ in answers]
    slowest = max(t for _, t in answers)
    print(
        f"\nlimits after the examples {before['limits']}, pace cuts {before['pace_cuts']}, learned "
        f"{before['pools']['velocity-sim'].get('open_tokens', {}).get('chat')}; burst: {statuses.count(200)}/24 "
        f"admitted, slowest {slowest:.2f} s; limits after {after['limits']}"
    )
    assert statuses == [200] * 24, statuses
    assert slowest <= SLA_S, [round(t, 2) for _, t in answers]
