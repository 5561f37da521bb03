"""A port the gateway cannot have ends the command with one line naming the port and the
settings that choose it, not the bind's traceback; chargeVelocity says so before it starts
engines."""

from __future__ import annotations

import socket

import pytest

from tests.support.gateway import GatewayProcess

CASES = [
    ("serve", "port", ()),
    ("serve", "admin_port", ()),
    ("serve", "port", ("--workers", "2")),
    ("serve", "admin_port", ("--workers", "2")),
    ("chargeVelocity", "port", ("--mock", "--engines", "1")),
    ("chargeVelocity", "admin_port", ("--mock", "--engines", "1")),
]
FLAG = {"port": "--port", "admin_port": "--admin-port"}


@pytest.mark.parametrize("command,key,extra", CASES)
def test_a_port_in_use_is_one_line_naming_its_flag(command, key, extra):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    held = holder.getsockname()[1]
    other = "--admin-port" if key == "port" else "--port"
    args = [FLAG[key], str(held), other, "0", *extra]
    if command == "serve":
        args += ["--endpoint", "a=http://127.0.0.1:9=m"]
    gp = GatewayProcess(command, *args)
    try:
        gp.spawn()
        code = gp.wait(60)
        err = gp.stderr_text
    finally:
        gp.close()
        holder.close()
    assert code == 1, err
    assert "Traceback" not in err, err
    (line,) = [ln for ln in err.splitlines() if "cannot listen" in ln]
    assert line.startswith("velocityllm: ")
    assert f"127.0.0.1:{held}" in line and "address already in use" in line
    assert FLAG[key] in line and f"`{key}`" in line and f"VELOCITY_{key.upper()}" in line
    if command == "chargeVelocity":
        assert "engine sim-0" not in err, "engines were started for a gateway that cannot listen"
