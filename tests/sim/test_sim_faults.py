"""Sim engine failures, determinism and lifecycle flags, on real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

from tests.support.sim import REPO, free_port, http_request, open_request, sim_command, sim_engine
from velocity_fast.harness.procs import child_env, start, stop

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12}


async def stream(port: int, body: dict, path: str = "/v1/chat/completions"):
    s = await open_request(port, "POST", path, {**body, "stream": True})
    try:
        if s.status != 200:
            return s.status, json.loads(await s.body())
        return s.status, [e async for e in s.events()]
    finally:
        await s.close()


def is_error_shape(obj: dict, status: int) -> bool:
    err = obj["error"]
    return (
        set(err) == {"message", "type", "param", "code"}
        and err["code"] == status
        and isinstance(err["message"], str)
        and err["type"]
    )


async def test_fail_rate_errors_before_and_during_the_stream():
    with sim_engine("--fail-rate", "1.0", "--seed", "3", time_scale=50) as eng:
        before, mid = [], []
        for i in range(16):
            status, got = await stream(eng.port, {**CHAT, "messages": [{"role": "user", "content": f"m{i}"}]})
            if status == 200:
                mid.append(got)
            else:
                before.append((status, got))
        assert before and mid
        for status, body in before:
            assert status in (500, 503) and is_error_shape(body, status)
            assert body["error"]["type"] == {500: "InternalServerError", 503: "ServiceUnavailableError"}[status]
        for events in mid:
            # role chunk, some tokens, then the error event and [DONE]
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])
            assert is_error_shape(err, 500)
            chunks = [json.loads(e) for e in events[:-2]]
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert len(chunks) >= 2 and all("error" not in c for c in chunks)
            assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
        # non-streamed requests fail with the JSON error shape
        r = await http_request(eng.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 8})
        assert r.status in (500, 503) and is_error_shape(r.json(), r.status)
        assert await _metric_line(eng.port, 'finished_reason="error"') >= len(mid)


async def _metric_line(port: int, needle: str) -> float:
    text = (await http_request(port, "GET", "/metrics")).body.decode()
    line = next(ln for ln in text.splitlines() if "vllm:request_success_total" in ln and needle in ln)
    return float(line.rsplit(" ", 1)[1])


async def test_oom_rate_errors_say_cuda_out_of_memory():
    with sim_engine("--oom-rate", "1.0", time_scale=50) as eng:
        messages = []
        for i in range(8):
            status, got = await stream(eng.port, {**CHAT, "messages": [{"role": "user", "content": f"o{i}"}]})
            if status == 200:
                assert got[-1] == "[DONE]"
                messages.append(json.loads(got[-2])["error"]["message"])
            else:
                assert status == 500 and is_error_shape(got, 500)
                messages.append(got["error"]["message"])
        r = await http_request(eng.port, "POST", "/v1/chat/completions", CHAT)
        messages.append(r.json()["error"]["message"])
        assert all("CUDA out of memory" in m for m in messages)


async def test_no_failures_without_the_flags():
    with sim_engine(time_scale=50) as eng:
        for i in range(10):
            status, events = await stream(eng.port, {**CHAT, "messages": [{"role": "user", "content": f"n{i}"}]})
            assert status == 200 and all("error" not in e for e in events)


async def _texts(port: int, prompts: list[str]) -> dict[str, str]:
    out = {}
    for p in prompts:
        r = await http_request(port, "POST", "/v1/completions", {"prompt": p, "max_tokens": 16})
        out[p] = r.json()["choices"][0]["text"]
    return out


async def test_same_seed_same_outputs_whatever_the_order():
    prompts = ["alpha", "beta", "gamma"]
    with sim_engine("--seed", "7", time_scale=50) as a:
        first = await _texts(a.port, prompts)
        again = await _texts(a.port, prompts[::-1])
        # concurrently too: arrival order and batch mates do not change the text
        conc = await asyncio.gather(*(_texts(a.port, [p]) for p in prompts))
    with sim_engine("--seed", "7", time_scale=50) as b:
        other_process = await _texts(b.port, prompts[::-1])
    with sim_engine("--seed", "8", time_scale=50) as c:
        other_seed = await _texts(c.port, prompts)
    assert first == again == other_process
    assert {k: v for d in conc for k, v in d.items()} == first
    assert len(set(first.values())) == 3
    assert all(other_seed[p] != first[p] for p in prompts)


async def test_sse_keep_alive_comments_while_idle():
    # 400 prompt tokens at 100 tok/s prefill: 4 s simulated, 0.2 s at time scale 20,
    # while keep-alives come every 0.5 s simulated (25 ms).
    with sim_engine("--sse-keep-alive-interval", "0.5", "--prefill-tps", "100", time_scale=20) as eng:
        status, events = await stream(eng.port, {"prompt": "k" * 1600, "max_tokens": 2}, "/v1/completions")
    assert status == 200
    first_data = next(i for i, e in enumerate(events) if e.startswith("{"))
    assert sum(1 for e in events[:first_data] if e == ": keep-alive") >= 2
    assert events[-1] == "[DONE]"


async def test_startup_delay_refuses_connections_until_loaded():
    port = free_port()
    cmd = sim_command("--startup-delay", "10", model="slow", port=port, time_scale=10)
    proc = start(cmd, cwd=str(REPO), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
    try:
        t0 = time.monotonic()
        await asyncio.sleep(0.3)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0  # refused while "loading"
        while time.monotonic() - t0 < 10:
            try:
                r = await http_request(port, "GET", "/health", timeout=1)
                if r.status == 200:
                    break
            except OSError:
                await asyncio.sleep(0.05)
        assert 0.9 < time.monotonic() - t0 < 8
    finally:
        stop(proc, 5.0)


def test_bad_flags_exit_2_with_a_message():
    out = subprocess.run(
        [sys.executable, "-m", "velocity_fast.sim", "--port", "0", "--num-gpu-blocks", "4", "--max-model-len", "4096"],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "--num-gpu-blocks" in out.stderr


def test_vllm_launcher_flags_are_accepted():
    with sim_engine(
        "--served-model-name",
        "served",
        "--tensor-parallel-size",
        "2",
        "--gpu-memory-utilization",
        "0.9",
        "--enable-prefix-caching",
        model="org/model",
    ) as eng:
        status, body = eng.get("/v1/models")
        (m,) = json.loads(body)["data"]
        assert status == 200 and m["id"] == "served" and m["root"] == "org/model"
