"""The defaults are the product: features tried as a new user runs them, at default flags,
against engines whose limits the gateway was not told.

- `velocityllm serve --sla-ms S` makes S a real SLA for requests that name none: a flood
  gets fast 429 `sla` with an honest Retry-After for what is predicted to miss, and what is
  admitted finishes within S.
- Engines started by `chargeVelocity` run the gateway's own code, not a `velocity_fast`
  folder that happens to be in the working directory.
(Priority isolation at default flags is the matrix in test_isolation_matrix.py.)
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from tests.support.fakes import free_port_block
from tests.support.gateway import gateway_process, stop_group
from tests.support.sim import http_request, sim_engine

pytestmark = [pytest.mark.e2e]

MODEL = "velocity-sim"
BIN = Path(sys.executable).parent


def chat(max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Summarise the report."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


async def timed(port: int, body: dict, headers: dict | None = None):
    t0 = time.monotonic()
    r = await http_request(port, "POST", "/v1/chat/completions", body, headers, timeout=60)
    return r, time.monotonic() - t0


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return orjson.loads(self.body)


async def flood(port: int, n: int, body: dict) -> list[tuple[Answer, float]]:
    """``n`` requests at once on connections opened beforehand, each timed from its write
    to the end of its answer (what the gateway takes, not what connecting takes)."""
    data = orjson.dumps(body)
    wire = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    ).encode() + data
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]

    async def one(reader, writer):
        t0 = time.monotonic()
        writer.write(wire)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 60)
        took = time.monotonic() - t0
        writer.close()
        return Answer(int(lines[0].split()[1]), headers, body), took

    return await asyncio.gather(*(one(r, w) for r, w in conns))


async def wait_idle(admin_port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = (await http_request(admin_port, "GET", "/stats")).json()
        if s["admission"]["counters"]["in_flight"] == 0 and s["admission"]["queued"] == 0:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("the gateway did not go idle")


async def wait_ready(admin_port: int, timeout: float = 30.0) -> None:
    """Until the gateway's readiness probe says an engine passed its health check (before
    that, requests are answered 503 no-endpoint, as a load balancer's probe would see)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await http_request(admin_port, "GET", "/ready", timeout=2)).status == 200:
                return
        except OSError:
            pass
        await asyncio.sleep(0.05)
    raise TimeoutError("the gateway did not turn ready")


@pytest.mark.timed  # 429s timed, SLAs met
@pytest.mark.timeout(180)
async def test_a_flood_against_serve_sla_ms_gets_fast_429s_and_what_is_admitted_meets_the_sla():
    """One engine of 8 sequences the gateway was not told about, `serve --sla-ms 2500`,
    then 80 concurrent chat requests of 300 tokens with no SLA of their own."""
    sla_ms = 2500
    with sim_engine("--max-num-seqs", "8", model=MODEL, time_scale=10) as eng:
        with gateway_process("serve", "--endpoint", f"e1={eng.url}={MODEL}", "--sla-ms", str(sla_ms)) as gw:
            await wait_ready(gw.admin_port)
            # A gateway that has run a while: it has seen a request finish and the engine's
            # queue (two bursts past its batch, the requests carrying long SLAs of their own).
            for _ in range(2):
                warm = await asyncio.gather(
                    *(timed(gw.port, chat(300), {"x-velocity-sla-ms": "60000"}) for _ in range(12))
                )
                assert all(r.status == 200 for r, _ in warm), [
                    (r.status, r.headers.get("x-velocity-reject-reason")) for r, _ in warm
                ]
            await wait_idle(gw.admin_port)
            service = min(t for _, t in warm)

            answers = await flood(gw.port, 80, chat(300))
            ok = [t for r, t in answers if r.status == 200]
            declined = [(r, t) for r, t in answers if r.status == 429]
            assert len(ok) + len(declined) == 80, sorted({r.status for r, _ in answers})
            within = sum(t <= sla_ms / 1000 for t in ok)
            med = statistics.median(t for _, t in declined) if declined else None
            print(
                f"\nservice {service * 1000:.0f} ms; admitted {len(ok)}, {within} within {sla_ms} ms; "
                f"declined {len(declined)}, median {med * 1000:.1f} ms"
                if declined
                else ""
            )
            # The SLA was enforced: most of the flood declined, fast, saying why and when.
            assert len(declined) >= 40, len(declined)
            # "Fast" against what the engine takes to serve one: a decline at least 10x
            # sooner than the quickest answer (a ratio, so a busy CI box does not decide it).
            assert med < service / 10, f"median 429 took {med * 1000:.1f} ms, service {service * 1000:.0f} ms"
            for r, _ in declined:
                assert r.headers["x-velocity-reject-reason"] == "sla"
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == 429
            # What was admitted keeps the promise.
            assert len(ok) >= 8 and within >= 0.9 * len(ok), (within, len(ok))

            # Retry-After is honest: under a steady load that leaves the engine room, a
            # client declined in a flood that waits the time it was told gets in.
            stop = time.monotonic() + 60

            async def steady():
                while time.monotonic() < stop:
                    r, _ = await timed(gw.port, chat(300), {"x-velocity-sla-ms": "60000"})
                    assert r.status == 200

            workers = [asyncio.create_task(steady()) for _ in range(4)]
            try:
                await asyncio.sleep(1.0)
                burst = await flood(gw.port, 40, chat(300))
                told = [int(r.headers["retry-after"]) for r, _ in burst if r.status == 429]
                assert told, "the burst was not declined in part"
                await asyncio.sleep(max(told))
                again, _ = await timed(gw.port, chat(300))
                assert again.status == 200, (again.status, again.headers.get("x-velocity-reject-reason"))
            finally:
                stop = 0
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)


@pytest.mark.timeout(90)
async def test_engines_run_the_gateways_own_code_not_a_tree_in_the_working_folder(tmp_path):
    """`pip install .` then `velocityllm chargeVelocity` from the source folder: the engines
    must not import the folder's uncompiled `velocity_fast` (a decoy stands in for it)."""
    decoy = tmp_path / "checkout"
    (decoy / "velocity_fast" / "sim").mkdir(parents=True)
    (decoy / "velocity_fast" / "__init__.py").write_text("")
    (decoy / "velocity_fast" / "sim" / "__init__.py").write_text("")
    (decoy / "velocity_fast" / "sim" / "__main__.py").write_text("import sys\nsys.exit('the decoy tree ran')\n")
    port = free_port_block(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VELOCITY_") and k != "PYTHONPATH"}
    with open(tmp_path / "log", "wb") as log:
        proc = subprocess.Popen(
            [
                str(BIN / "velocityllm"),
                "chargeVelocity",
                "--mock",
                "--engines",
                "1",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--admin-port",
                str(port + 1),
                "--engine-base-port",
                str(free_port_block(1)),
                "--engine-log-dir",
                str(tmp_path / "engines"),
            ],
            cwd=decoy,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        ready = False
        while time.monotonic() < deadline and not ready:
            assert proc.poll() is None, (tmp_path / "log").read_text()
            try:
                ready = (await http_request(port + 1, "GET", "/ready", timeout=2)).status == 200
            except OSError:
                pass
            await asyncio.sleep(0.2)
        engine_log = "".join(p.read_text() for p in (tmp_path / "engines").glob("*.log"))
        assert ready, engine_log
        assert "decoy" not in engine_log
        r = await http_request(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
        assert r.status == 200 and orjson.loads(r.body)["choices"][0]["text"]
    finally:
        stop_group(proc)
