"""`velocityllm chargeVelocity --mock`: sim engines as children and the gateway in front,
requests served through every engine, and nothing left behind after SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path
from urllib.request import Request, urlopen

import pytest

from tests.support.fakes import free_port_block
from tests.support.gateway import gateway_process

pytestmark = pytest.mark.e2e


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, grandchildren, ...), from /proc."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                if k not in out:
                    out.add(k)
                    todo.append(k)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def post(url: str, body: dict):
    req = Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urlopen(req, timeout=10) as r:
        return r.status, dict(r.headers), json.loads(r.read())


def test_charge_mock_two_engines_serves_and_leaves_no_child():
    base = free_port_block(2)
    with gateway_process(
        "chargeVelocity",
        "--mock",
        "--engines",
        "2",
        "--engine-base-port",
        str(base),
        "--sim-args",
        "--time-scale 50",
        timeout=40,
    ) as gp:
        out = gp.stdout_text
        assert f"127.0.0.1:{base}" in out and f"127.0.0.1:{base + 1}" in out
        kids = descendants(gp.proc.pid)
        assert len(kids) >= 2, "two sim engines run as children"

        with urlopen(gp.url + "/v1/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]
        seen = set()
        deadline = time.monotonic() + 20
        for _ in range(40):
            status, headers, body = post(gp.url + "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2})
            assert status == 200 and body["choices"][0]["text"]
            seen.add(headers["x-velocity-endpoint"])
            if len(seen) == 2 or time.monotonic() > deadline:
                break
        assert len(seen) == 2, f"requests went through both engines, saw {seen}"
        with urlopen(gp.admin_url + "/ready", timeout=10) as r:
            assert r.status == 200

        gp.proc.send_signal(signal.SIGTERM)
        assert gp.wait(20) == 0
        # the children are gone (reaped or never left as orphans) and their ports are free
        deadline = time.monotonic() + 5
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [k for k in kids if alive(k)], "no child process outlives chargeVelocity"
        for port in (base, base + 1, gp.port):
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers"
